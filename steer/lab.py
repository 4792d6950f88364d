"""steer.Lab: the CLI's runs from Python, on one engine that stays loaded across calls.

A Lab composes conf/ as `python -m steer` does (Hydra's compose API, with the same overrides), and each call sets
the config fields the call names (prompts, tap, edit, extra_edits, task) on that composition, then runs it as its
task: `registry.prepare` checks it (every check the CLI makes, a ConfigError naming the field before any engine
loads) and the task's run (steer/tasks/) runs it into a run directory, which the call reads back. So a Lab call and
the command with the same config write the same files, token for token.

The engine starts on the first call that needs it (one load per Lab) and is closed by `close()` or on leaving a
`with` block. Settings that choose the engine (model, engine, device, vllm.*, hf.*) are the Lab's own.
"""

import copy
import io
import re
import shlex
import weakref
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from steer.api.edits import EditSpec, add
from steer.api.outputs import Generation, RunDir, Selection
from steer.api.vector import Vector
from steer.config import schema
from steer.errors import ConfigError, config_error_line, value_error

CONF = Path(__file__).resolve().parents[1] / "conf"


class Lab:
    """`model`: a conf/model option (`smollm2`, `tiny`, ...), as `model=` on the command line. `overrides`: any
    other command-line overrides (`gen.max_new_tokens=32`, `engine=hf`, `prompts=calm`). `config_dir`: a directory
    of your own config groups, as `--config-dir`. `quiet`: print nothing (else each call prints what the CLI
    prints: the texts and metrics table, select's grid)."""

    def __init__(self, model: Optional[str] = None, overrides: Sequence[str] = (), *,
                 config_dir: Optional[Union[str, Path]] = None, quiet: bool = False):
        if isinstance(overrides, str):
            raise ConfigError("overrides", f"expected a list of overrides, got the string {overrides!r}")
        self._overrides = ([f"model={model}"] if model else []) + [str(o) for o in overrides]
        self._config_dir = Path(config_dir).expanduser().resolve() if config_dir else None
        if self._config_dir is not None and not self._config_dir.is_dir():
            raise ConfigError("config_dir", f"{str(config_dir)!r} is not a directory")
        self.console = Console(file=io.StringIO(), force_jupyter=False) if quiet else Console(soft_wrap=True)
        self._base = self._compose(self._overrides)
        self.config = self._checked(self._base)  # the Lab's config, checked now: a bad override fails here
        self._defaults: Dict[str, Dict] = {}
        self._stack = ExitStack()
        weakref.finalize(self, self._stack.close)  # at the latest as the interpreter exits, while torch is still there
        self._engine: Optional[object] = None
        self._engine_key: Optional[str] = None
        self._hidden_size: Optional[int] = None
        self.engine_loads = 0

    # --- the calls

    def extract(self, positive: Optional[Sequence[str]] = None, negative: Optional[Sequence[str]] = None,
                layer: Optional[int] = None, *, path: Optional[str] = None, overrides: Sequence[str] = ()) -> Vector:
        """The direction at a tap (`layer`, or module `path`; else the config's tap) from two contrastive prompt
        sets (else prompts.positive / prompts.negative), as `task=extract` makes it (extract.* settings by
        `overrides`, e.g. `extract.method=pca`)."""
        values: Dict[str, object] = {"task": "extract"}
        if layer is not None or path is not None:
            values["tap"] = {"layer": layer, "path": path}
        if positive is not None:
            values["prompts.positive"] = _texts("prompts.positive", positive)
        if negative is not None:
            values["prompts.negative"] = _texts("prompts.negative", negative)
        from steer.tasks import registry

        cfg, conf = self._config(overrides, values)
        out = RunDir("steer-extract-")
        job = registry.prepare(conf, out.path)
        self._write_config(out.path, cfg)
        wrote = self._execute(job)
        return Vector.load(wrote["vector"], conf.extract.key)

    def generate(self, prompts: Union[str, Sequence[str]], edits: Union[EditSpec, Iterable[EditSpec]] = (),
                 *, overrides: Sequence[str] = ()) -> Generation:
        """Baseline and steered continuations of `prompts` with `edits` (steer.add, steer.ablate, ...; in order,
        the first is the run's `edit`, the others its `extra_edits`), with the run's metrics: a steer run."""
        values: Dict[str, object] = {"task": "steer", "prompts.steer": _texts("prompts.steer", prompts)}
        values.update(self._edit_values(_edits(edits)))
        from steer.tasks import registry

        cfg, conf = self._config(overrides, values)
        out = RunDir("steer-run-")
        job = registry.prepare(conf, out.path)
        self._write_config(out.path, cfg)
        self._execute(job)
        return Generation.read(out, _dict(cfg, resolve=True))

    def select(self, edit: Union[EditSpec, Vector, str, None] = None, layers: Optional[Sequence[int]] = None,
               scales: Optional[Sequence[float]] = None, *, prompts: Optional[Sequence[str]] = None,
               max_ppl_ratio: Optional[float] = None, overrides: Sequence[str] = ()) -> Selection:
        """task=select: `edit` (an EditSpec, or a vector to add; None: add the direction extracted at each layer)
        at every pair of `layers` x `scales` (else select.layers / select.scales), the best pair by the gain one
        probe reads toward each scale's pole, among those whose prompts pass select's per-prompt damage rules, chosen
        on part of the prompts and reported on the rest (docs/sweeps.md). The edit's own layer and scale are the
        grid's."""
        spec = edit if isinstance(edit, EditSpec) else add(edit)
        values: Dict[str, object] = {"task": "select"}
        if layers is not None:
            values["select.layers"] = list(layers)
        if scales is not None:
            values["select.scales"] = [float(x) if isinstance(x, (int, float)) else x for x in scales]
        if max_ppl_ratio is not None:
            values["select.max_ppl_ratio"] = max_ppl_ratio
        if prompts is not None:
            values["prompts.steer"] = _texts("prompts.steer", prompts)
        first = layers[0] if layers else None
        values.update(self._edit_values([EditSpec(spec.kind, spec.vector, first, None, spec.fields)]))
        if first is None:
            del values["tap"]  # the grid sets each pair's tap; the config's own stands until then
        from steer.tasks import registry, select

        cfg, conf = self._config(overrides, values)
        out = RunDir("steer-select-")
        job = registry.prepare(conf, out.path)
        self._write_config(out.path, cfg)
        engine = self._engine_for(job.cells)

        def rerun(best: Dict) -> str:  # the command a shell reruns the best pair with: the Lab's overrides, the call's
            kept = {k: v for k, v in values.items() if not k.startswith("select.")}
            edit = values["edit"]
            assert isinstance(edit, dict)
            kept.update(task="steer", tap={"layer": best["layer"], "path": None}, edit={**edit, "scale": best["scale"]})
            return self.command(kept, overrides)

        select.run(job, self.console, engine=engine, command=rerun)  # its page too, as the CLI writes it
        got = Selection.read(out)
        if got.best:
            got.command = rerun(got.best)
        return got

    def command(self, values: Mapping[str, object], overrides: Sequence[str] = ()) -> str:
        """`python -m steer` with the Lab's overrides, a call's, and `values` as overrides (dicts by their keys)."""
        args = [*self._overrides, *overrides]
        if self._config_dir:
            args = ["--config-dir", str(self._config_dir), *args]
        base = self._compose(args[2:] if self._config_dir else args)
        for key, value in _flat(values):
            if _plain(value) != _plain(OmegaConf.select(base, key, default=object())):  # a default is no override
                args.append(f"{key}={_literal(value)}")
        return "python -m steer " + " ".join(shlex.quote(a) for a in args)

    # --- the engine

    def close(self) -> None:
        """Close the engine (a later call starts another)."""
        self._stack.close()
        self._engine, self._engine_key = None, None

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _execute(self, job) -> Dict:
        """Run a prepared job on the Lab's engine; what it wrote (a failure raises)."""
        from steer.tasks import registry

        return registry.run(job, self.console, engine=self._engine_for([job]))

    def _engine_for(self, jobs: Sequence) -> object:
        """The Lab's engine, started for these jobs if none is yet (steer.runs.job.engine_for)."""
        from steer.runs.job import ENGINE_FIELDS, engine_for, engine_key

        key = engine_key(jobs[0])
        if self._engine is None:
            self._engine = self._stack.enter_context(engine_for(jobs))
            self._engine_key = key
            self.engine_loads += 1
        elif key != self._engine_key:  # _config refuses such a call first, naming the settings it changes
            raise ConfigError("overrides", f"the engine's settings ({ENGINE_FIELDS}) are the Lab's own: make another "
                                           "Lab for them")
        elif getattr(self._engine, "name", "hf") == "vllm":
            # vLLM records its graphs with the taps it starts with; the HF engine serves any tap it is given
            held = set(getattr(self._engine, "taps", {}))  # tap paths
            new = sorted({t.name for job in jobs for t in job.taps if t.path not in held})
            if new:
                raise ConfigError("tap", f"{', '.join(new)} is not among the taps this Lab's vLLM engine started "
                                         "with (those of its first call); make another Lab for it, or engine=hf")
        return self._engine

    # --- configs

    def _compose(self, overrides: Sequence[str]) -> DictConfig:
        """conf/config.yaml composed with `overrides`, as `python -m steer` composes it."""
        from hydra import compose, initialize_config_dir

        schema.register()
        extra = [f"hydra.searchpath=[file://{self._config_dir}]"] if self._config_dir else []
        try:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                return compose(config_name="config", overrides=extra + list(overrides))
        except Exception as e:
            line = config_error_line(e)
            if line is None:
                raise
            raise ConfigError("overrides", line) from e

    def _checked(self, cfg: DictConfig):
        """The config as its dataclasses, with the checks that need no model (its task's: registry.check)."""
        from steer import engine as engines
        from steer.tasks import registry

        conf = schema.to_object(cfg)
        registry.check(conf, engines.resolve(conf.engine))
        return conf

    def _config(self, overrides: Sequence[str], values: Mapping[str, object]):
        """The Lab's composition (with a call's own `overrides`), `values` set on it by dotted key: the DictConfig
        and its dataclasses. A value of the wrong type is a ConfigError naming its key."""
        if isinstance(overrides, str):
            raise ConfigError("overrides", f"expected a list of overrides, got the string {overrides!r}")
        cfg = self._compose(self._overrides + list(overrides)) if overrides else copy.deepcopy(self._base)
        for key, value in values.items():
            try:
                # a dict merges onto its typed node (every field given, so it replaces what was there)
                OmegaConf.update(cfg, key, value, merge=isinstance(value, (dict, list)))
            except OmegaConfBaseException as e:
                raise _refused(e, key) from e
        _refine_edit(cfg, overrides)
        from steer.runs.job import ENGINE_FIELDS, engine_changes

        conf = schema.to_object(cfg)
        changed = engine_changes(_engine_settings(self.config), _engine_settings(conf))
        if changed:
            raise ConfigError("overrides", f"{list(overrides)} change {', '.join(changed)}: the engine's settings "
                                           f"({ENGINE_FIELDS}) are the Lab's own, make another Lab for them")
        return cfg, conf

    def _edit_values(self, edits: List[EditSpec]) -> Dict[str, object]:
        """The config fields of `edits`: the first as `tap` and `edit`, the others as `extra_edits`."""
        if not edits:
            raise ConfigError("edits", "give at least one edit (steer.add(v, layer=12, scale=4), steer.ablate(...))")
        items = [self._edit_item(e, "" if i == 0 else f"extra_edits[{i - 1}].") for i, e in enumerate(edits)]
        return {"tap": items[0]["tap"], "edit": items[0]["edit"], "extra_edits": items[1:]}

    def _edit_item(self, e: EditSpec, prefix: str) -> Dict[str, Dict]:
        if not isinstance(e, EditSpec):
            raise ConfigError(f"{prefix}edit", f"expected an edit (steer.add, steer.ablate, steer.clamp, "
                                               f"steer.set_projection, steer.rescale), got {type(e).__name__}")
        edit = copy.deepcopy(self._kind_defaults(e.kind))
        edit.update(e.fields)
        vector = dict(edit.get("vector") or {})
        vector["path"] = self._vector_path(e.vector, f"{prefix}edit.vector")
        if isinstance(e.vector, Vector):
            vector["key"] = e.vector.key
        if "key" in e.fields:
            vector["key"] = edit.pop("key")
        edit.pop("key", None)
        edit["vector"] = vector
        tap = e.tap() if e.layer is not None or e.path is not None else _dict(self._base.tap)
        return {"tap": tap, "edit": edit}

    def _kind_defaults(self, kind: str) -> Dict:
        """conf/edit/<kind>.yaml, as `edit=<kind>` composes it."""
        if kind not in self._defaults:
            cfg = self._compose(self._overrides + [f"edit={kind}"])
            self._defaults[kind] = _dict(cfg.edit)
        return self._defaults[kind]

    def _vector_path(self, v, field: str) -> Optional[str]:
        """Where the run reads vector `v` from: a file named by path as it is; a Vector (or a tensor or array of
        its values) checked against the model, then written once into the cache (named by its values, so the
        same vector is the same file, and a sweep resumes on it)."""
        if v is None or isinstance(v, (str, Path)):
            return None if v is None else str(v)
        if not isinstance(v, Vector):
            import numpy as np
            import torch

            if not isinstance(v, (torch.Tensor, np.ndarray)):
                raise ConfigError(field, f"expected a steer.Vector, a tensor or array ([hidden] or [k, hidden]), a "
                                         f"safetensors path or None, got {type(v).__name__}")
            v = Vector(torch.as_tensor(v).detach().cpu())
        from steer.edits import vector

        vector.check(v.tensor.detach().cpu(), self._hidden(), field)  # before it becomes a file the error would name
        path = Path(self.config.cache_dir).expanduser() / "vectors" / "lab" / f"{v.digest()[:16]}.safetensors"
        v.save(path)
        return str(path)

    def _hidden(self) -> int:
        """The model's hidden size (read from its config once: a Lab's model is its own)."""
        if self._hidden_size is None:
            from steer.models.spec import spec

            self._hidden_size = spec(self.config.model, self.config.cache_dir).hidden
        return self._hidden_size

    def _write_config(self, out_dir: Path, cfg: DictConfig) -> None:
        """The run's config where Hydra writes it for a CLI run (.hydra/config.yaml)."""
        from steer import results

        (out_dir / ".hydra").mkdir(exist_ok=True)
        results.write_text(out_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))


def _flat(values: Mapping[str, object], prefix: str = ""):
    """(dotted key, value) for each leaf of `values`; an empty list of extra edits is the default, left out."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat(value, f"{name}.")
        elif not (name == "extra_edits" and value == []):
            yield name, value


def _literal(value) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_/.~][\w./~-]*", value) and value not in ("null", "true",
                                                                                                "false"):
        return value
    if isinstance(value, str):
        # Hydra's quoted strings: a backslash escapes only before a quote (and the closing one)
        return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_literal(v) for v in value) + "]"
    return str(getattr(value, "value", value))


def _refine_edit(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A call's own `edit.*` overrides refine the edit the call builds (`overrides=["edit.scale_by=resid"]` with
    lab.select or lab.steer): the edit's fields come from its kind's defaults, which would otherwise replace them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for o in OverridesParser.create().parse_overrides([x for x in overrides if x.startswith("edit.")]):
        try:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
        except OmegaConfBaseException as e:
            raise _refused(e, o.key_or_group) from e


def _refused(e: OmegaConfBaseException, key: str) -> ConfigError:
    """The error for OmegaConf refusing a value set at `key`: steer.errors.value_error's line (an old spelling's new
    one, an enum's members), else OmegaConf's first line, naming the key."""
    return value_error(e) or ConfigError(getattr(e, "full_key", None) or key, str(e).splitlines()[0])


def _dict(node: DictConfig, resolve: bool = False) -> Dict:
    """A config node as a plain dict (enums as their names)."""
    out = OmegaConf.to_container(node, resolve=resolve, enum_to_str=True)
    assert isinstance(out, dict)
    return out


def _plain(value):
    """A config value as plain data (containers as lists and dicts, enums as their names), to compare."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    return getattr(value, "value", value)


def _engine_settings(conf) -> Dict[str, object]:
    """The engine a config runs on, as the jobs of a run key it (steer.runs.job.engine_settings)."""
    from steer import engine as engines
    from steer.runs.job import engine_settings

    return engine_settings(conf, engines.resolve(conf.engine))


def _texts(field: str, texts) -> List[str]:
    """Prompts as a list of strings (one string: one prompt)."""
    items = [texts] if isinstance(texts, str) else list(texts) if isinstance(texts, (list, tuple)) else None
    if items is None or not all(isinstance(t, str) for t in items):
        raise ConfigError(field, f"expected a list of strings, got {texts!r:.80}")
    return items


def _edits(edits) -> List[EditSpec]:
    return [edits] if isinstance(edits, EditSpec) else list(edits)
