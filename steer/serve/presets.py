"""Presets: named lists of {tap, edit} pairs (conf/preset/<name>.yaml, and those of `serve.preset_dir` beside them),
checked and compiled when the server starts.

`read` and `check` run before any engine loads, with the CLI's own checks (steer.edits.plan, steer.edits.vector): a bad
preset stops the start with a ConfigError naming it and the field, e.g. `preset joy: edits[0].edit.vector.path: ...`.
`compile_all` then compiles every preset as `python -m steer` compiles the same edits (a null vector path is the
default direction at the tap, steer.runs.extract.cached_default with the config's prompts), so a preset served is the
CLI run with those edits, and `compose` stacks presets for one request.
"""

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from steer.config.preset import edits_for
from steer.edits import vector
from steer.edits.condition import Condition
from steer.edits.edit import Edit, compile_edit
from steer.errors import ConfigError, value_error
from steer.models.spec import ModelSpec
from steer.edits import formats
from steer.edits.plan import Plan, compile_entries, needs_default_vector
from steer.config.schema import EditConf, EditKind, TapEditConf, Tokens
from steer.serve.schema import PresetConf, ServeOptions
from steer.edits.tap import Tap

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # no commas: a request composes presets as "a,b"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class Preset:
    name: str
    conf: PresetConf
    items: List[Tuple[Tap, Edit]]  # every edit in config order, as compiled (a request drops its no-ops)
    listed: List[dict]  # per edit: what GET /v1/steer/presets shows of it (its config's scale, its vector file)
    reads: List[Tap] = field(default_factory=list)  # the taps its edits' conditions read the prompt at


def directories(opts: ServeOptions) -> List[Path]:
    """Where presets are read from: the built-in conf/preset/, then `serve.preset_dir` where set (its presets add
    to the built-in ones)."""
    out = [CONF_DIR / "preset"]
    if opts.preset_dir:
        extra = Path(opts.preset_dir).expanduser()
        if not extra.is_dir():
            raise ConfigError("serve.preset_dir", f"{str(extra)!r} is not a directory")
        if extra.resolve() != out[0].resolve():
            out.append(extra)
    return out


def available(opts: ServeOptions) -> Dict[str, Path]:
    """Every preset file of the preset directories by name; a name two files define is an error naming both."""
    found: Dict[str, Path] = {}
    for where in directories(opts):
        for p in sorted(where.glob("*.yaml")) if where.is_dir() else []:
            if p.stem in found:
                raise ConfigError("serve.preset_dir", f"preset {p.stem!r} is defined twice: {found[p.stem]} and {p}; "
                                                      "rename one")
            found[p.stem] = p
    return found


def read(opts: ServeOptions, model: Optional[str] = None) -> Dict[str, PresetConf]:
    """The presets `serve.presets` names (all of them if null), parsed onto PresetConf; a preset with edits of its
    own for `model` (its `models` entry for that model.name) gets those."""
    found = available(opts)
    where = " and ".join(repr(str(d)) for d in directories(opts))
    names = list(found) if opts.presets is None else list(opts.presets)
    if opts.presets is not None and not names:
        raise ConfigError("serve.presets", "is empty; name at least one preset, or null for all of them")
    if not names:
        raise ConfigError("serve.preset_dir", f"no presets (*.yaml) in {where}")
    out = {}
    for name in names:
        if name not in found:
            raise ConfigError("serve.presets", f"no preset {name!r} in {where}; presets there: {sorted(found)}")
        if not NAME.match(name):
            raise ConfigError(f"preset {name}", "a preset's name (its file name) may hold only letters, digits, "
                                                "'_', '-' and '.'")
        conf = _parse(name, found[name])
        conf.edits = edits_for(conf, model, name)
        out[name] = conf
    return out


def _parse(name: str, path: Path) -> PresetConf:
    """A preset file merged onto PresetConf, each edit onto TapEditConf, so an error names `edits[i].<key>`."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    where = "edits"  # the part being parsed, for the error's field name
    try:
        raw = OmegaConf.load(path)
        if not isinstance(raw, DictConfig):
            raise ConfigError(f"preset {name}", f"must be a mapping with `edits` ({path})")
        models = raw.get("models", None) or {}
        if not isinstance(models, (DictConfig, dict)):
            raise ConfigError(f"preset {name}: models", f"must map model names to edit lists ({path})")
        lists = {"edits": raw.get("edits", []), **{f"models.{m}": v for m, v in models.items()}}
        where = ""
        top = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PresetConf),
                                                  {k: v for k, v in raw.items() if k not in ("edits", "models")}))
        parsed = {}
        for part, edits in lists.items():
            if not isinstance(edits, (ListConfig, list)):
                raise ConfigError(f"preset {name}: {part}", f"must be a list of {{tap, edit}} pairs ({path})")
            parsed[part] = []
            for i, item in enumerate(edits):
                where = f"{part}[{i}]."
                if not isinstance(item, (DictConfig, dict)):  # OmegaConf's merge raises a plain ValueError
                    raise ConfigError(f"preset {name}: {part}[{i}]", f"must be a {{tap, edit}} mapping, got "
                                                                   f"{item!r} ({path})")
                parsed[part].append(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TapEditConf), item)))
    except (OmegaConfBaseException, YAMLError) as e:
        key = getattr(e, "full_key", None)
        refused = value_error(e)  # a value outside a choice, or an old spelling: the message says which
        first = str(refused)[len(refused.field) + 2:] if refused else " ".join(str(e).split("\n")[0].split())
        field = f"preset {name}: {where}{key}" if key else f"preset {name}"
        raise ConfigError(field, f"{first} ({path})") from e
    top.edits = parsed.pop("edits")
    top.models = {part.split(".", 1)[1]: items for part, items in parsed.items()}
    return top


def check(confs: Dict[str, PresetConf], spec: ModelSpec) -> None:
    """Everything that can be checked before an engine loads: taps, vector files, keys, shapes, values, kinds."""
    for name, conf in confs.items():
        _compile(name, conf, spec, None)


def needs_default(confs: Dict[str, PresetConf]) -> bool:
    return any(needs_default_vector(te.edit) for conf in confs.values() for te in conf.edits)


def compile_all(confs: Dict[str, PresetConf], spec: ModelSpec,
                default_vector: Optional[Callable[[Tap], torch.Tensor]], cache_dir: str) -> Dict[str, Preset]:
    """Every preset compiled, default directions asked of `default_vector` (as the CLI does)."""
    out = {}
    for name, conf in confs.items():
        reads: Dict[str, Tap] = {}
        items = _compile(name, conf, spec, default_vector, reads)
        out[name] = Preset(name, conf, [(tap, e) for _, tap, e in items],
                           [_listed(te.edit, e, tap, cache_dir) for te, tap, e in items], list(reads.values()))
    return out


def _compile(name: str, conf: PresetConf, spec: ModelSpec, default_vector,
             reads: Optional[Dict[str, Tap]] = None) -> List[Tuple[TapEditConf, Tap, Edit]]:
    """The preset's (edit config, tap, compiled edit) triples in config order, by the CLI's own steer.edits.plan (one
    entry at a time, which is what `build` does for a run's tap/edit and extra_edits); an entry with
    `vector.layers` gives one per layer. `reads` gains the taps its conditions read."""
    out = []
    for i, te in enumerate(conf.edits):
        try:
            plan = compile_entries([(f"edits[{i}].", te.tap, te.edit)], spec, default_vector)
        except ConfigError as e:
            raise ConfigError(f"preset {name}: {e.field}", str(e)[len(e.field) + 2:]) from e
        out += [(te, plan.taps[path], e) for path, edits in plan.edits.items() for e in edits]
        if reads is not None:
            reads.update(plan.condition_taps)
    return out


def scaled(e: Edit, k: float) -> Edit:
    """`e` with its strength multiplied by `k` (for `rescale`, the stream's factor about its centre goes from
    1 + s to 1 + k * s)."""
    return e if k == 1.0 else replace(e, strength=e.strength * k)


def compose(presets: Dict[str, Preset], names: Sequence[str], scale: float = 1.0, inline: Sequence = (),
            inline_taps: Optional[Dict[int, Tap]] = None, when=None) -> Optional[Plan]:
    """The plan of presets applied in order (at each tap, the first preset's edits, then the next's), every
    strength times `scale`, then the request's own vectors (steer.serve.protocol.InlineVector, added at
    `inline_taps[layer]` in order, under the request's condition `when`, an InlineWhen, where it sends one),
    without edits that change nothing; None if none is left (an unsteered request)."""
    plan = Plan()
    for n in names:
        for tap, e in presets[n].items:
            plan.add(tap, scaled(e, scale))
    cond = None
    if when is not None:
        read = inline_taps[when.layer]
        cond = Condition(read.path, torch.from_numpy(when.values()), when.reduce, when.score, when.compare,
                         when.threshold)
        plan.condition_taps.setdefault(read.path, read)
    for i, v in enumerate(inline):
        vec = torch.from_numpy(v.values())[None]
        plan.add(inline_taps[v.layer], compile_edit(EditKind.add, v.strength, vec, tokens=Tokens(v.tokens),
                                                    field=f"steer_vector[{i}]", when=cond))
    active = plan.active()
    return active if active.edits else None


def listing(presets: Dict[str, Preset]) -> List[dict]:
    """What GET /v1/steer/presets answers: each preset's taps and edits, with its vector files' metadata."""
    out = []
    for p in presets.values():
        out.append({"name": p.name, "description": p.conf.description,
                    "taps": list(dict.fromkeys(tap.name for tap, _ in p.items)), "edits": p.listed})
    return out


def _listed(conf: EditConf, e: Edit, tap: Tap, cache_dir: str) -> dict:
    """One edit as the listing shows it: the scale as its config gives it (a rescale edit's strength is scale - 1,
    which would not always give the same float back)."""
    return {"tap": tap.name, "path": tap.path, "kind": e.kind.value, "scale": float(conf.scale),
            "tokens": e.tokens.value, "lo": e.lo, "hi": e.hi, "value": e.value,
            "vector": _vector(conf, e, tap, cache_dir)}


def _vector(conf: EditConf, e: Edit, tap: Tap, cache_dir: str) -> Optional[dict]:
    if conf.vector.path is not None:
        path = Path(conf.vector.path).expanduser()
        meta = vector.metadata(path) if formats.kind(path) == "safetensors" else {}  # other tools' files: none
        return {"path": str(path), "key": conf.vector.key, "default": False, "metadata": meta}
    if not needs_default_vector(conf):
        return None
    found = _cached_file(cache_dir, tap, e.basis)
    return {"path": str(found) if found else None, "key": "direction", "default": True,
            "metadata": vector.metadata(found) if found else {}}


def _cached_file(cache_dir: str, tap: Tap, v: Optional[torch.Tensor]) -> Optional[Path]:
    """The cached default-direction file at `tap` holding `v` (up to its norm: an ablate keeps the unit direction)."""
    if v is None:
        return None
    folder = Path(cache_dir).expanduser() / "vectors"
    target = v[0].float() / v[0].float().norm()
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            if vector.metadata(f).get("tap") != tap.name:
                continue
            d = vector.load(f, "direction", v.shape[-1], "default vector")[0]
        except Exception:  # another file of the cache, unreadable or of another shape: not this one
            continue
        if torch.allclose(d / d.norm(), target, atol=1e-6):
            return f
    return None
