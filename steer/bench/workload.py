"""What every configuration runs: the model directories, the prompts, and each scenario's per-request edits.

Every configuration gets the same prompts (token ids, so no tokenizer differences) and the same edits; nothing
here starts an engine, so a bad config fails before any GPU work.
"""

import fnmatch
import json
import math
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

import torch

from steer.models import gguf as gguf_model

from steer.models import spec as model

from steer.models import tiny
from steer.bench import placement
from steer.bench.schema import CONFIGS, FAINT, UNSTEERED, BenchConf, BenchModelConf, timed_window
from steer.edits.edit import Edit, compile_edit
from steer.errors import ConfigError, refuse_repeats
from steer.config.schema import EditKind, ModelConf

# Llama-3-8B's architecture (its public config.json), for load_format=dummy: the real shape, random weights.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
_SHAPES = {"llama3_8b_shape": LLAMA3_8B}
_K = re.compile(r"k([1-9][0-9]*)$")
MAX_K = 4096
_KINDS = [EditKind.add, EditKind.ablate, EditKind.clamp, EditKind.set, EditKind.scale]


@dataclass
class Scenario:
    name: str
    layers: List[int]  # the decoder layers tapped; every request's edit runs at each of them
    edits: List[Optional[Edit]]  # per request (None: unsteered)


def check(cfg: BenchConf) -> None:
    """Fail on names that mean nothing, before any engine starts."""
    for name in ("run", "configs", "scenarios", "batches"):
        if not getattr(cfg, name):
            raise ConfigError(name, "is empty: nothing would be measured")
        refuse_repeats(name, getattr(cfg, name))
    for i, m in enumerate(cfg.run):
        if m not in cfg.models:
            raise ConfigError(f"run[{i}]", f"model {m!r} is not defined under `models` ({sorted(cfg.models)})")
    for name, m in cfg.models.items():
        if m.source not in ("tiny", "gguf", *_SHAPES) and not Path(m.source).is_dir():
            raise ConfigError(f"models.{name}.source", f"{m.source!r} is neither 'tiny', 'gguf', one of "
                                                       f"{sorted(_SHAPES)}, nor a model directory")
    _check_cells(cfg)
    for name in ("prompt_len", "repeats", "tensor_parallel_size", "trace_tokens"):
        if getattr(cfg, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_repeats < cfg.repeats:
        raise ConfigError("max_repeats", f"must be >= repeats ({cfg.repeats}), got {cfg.max_repeats}")
    if not cfg.min_timed_s >= 0:  # NaN too
        raise ConfigError("min_timed_s", f"must be >= 0, got {cfg.min_timed_s}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError("gpu_memory_utilization", f"must be a share in (0, 1], got {cfg.gpu_memory_utilization}")
    if cfg.timeout_s < 1:
        raise ConfigError("timeout_s", f"must be >= 1 (seconds), got {cfg.timeout_s}")
    longest = max(cfg.prompt_len + t for _, t in cfg.batches)
    if cfg.max_model_len < longest:
        raise ConfigError("max_model_len", f"{cfg.max_model_len} cannot hold a request of the longest batch "
                                           f"(prompt_len {cfg.prompt_len} + {longest - cfg.prompt_len} new tokens)")
    if not (math.isfinite(cfg.gpu_sample_s) and cfg.gpu_sample_s >= 0):
        raise ConfigError("gpu_sample_s", f"must be seconds >= 0 (0: not read), got {cfg.gpu_sample_s}")
    if not cfg.trace_timeout_s > 0:
        raise ConfigError("trace_timeout_s", f"must be > 0, got {cfg.trace_timeout_s}")
    if not cfg.max_timed_s > 0:
        raise ConfigError("max_timed_s", f"must be > 0 (one pass is always timed), got {cfg.max_timed_s}")
    if cfg.min_timed_s > cfg.max_timed_s:
        raise ConfigError("min_timed_s", f"must be <= max_timed_s ({cfg.max_timed_s:g}), got {cfg.min_timed_s}")
    for name, m in cfg.models.items():
        if m.dtype not in model.DTYPES:
            raise ConfigError(f"models.{name}.dtype", f"{m.dtype!r} is not one of {sorted(model.DTYPES)}")
        if m.engines_at_once < 1:
            raise ConfigError(f"models.{name}.engines_at_once", f"must be >= 1, got {m.engines_at_once}")
        _check_timed(cfg, name, m)
        _check_env(name, m)
        if m.paired is not None and m.paired not in UNSTEERED:
            raise ConfigError(f"models.{name}.paired", f"must be null or an unsteered configuration "
                                                      f"({', '.join(UNSTEERED)}), got {m.paired!r}")
    need = _largest_batch_tokens(cfg)
    if cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens < need:
        raise ConfigError("kv_cache_tokens", f"{cfg.kv_cache_tokens} tokens cannot hold the largest batch at full "
                                             f"length ({need}); requests would be preempted mid-pass")
    _check_lanes(cfg)
    _check_traces(cfg)
    for i, size in enumerate(cfg.capture_sizes or []):
        if size < 1:
            raise ConfigError(f"capture_sizes[{i}]", f"a step size must be >= 1, got {size}")
    missing = sorted({r for r, _ in cfg.batches} - set(cfg.capture_sizes or [r for r, _ in cfg.batches]))
    if missing:
        raise ConfigError("capture_sizes", f"has no graph for the batch size(s) {missing}: their decode steps would "
                                           "run eagerly")
    if cfg.warmup_tokens is not None and cfg.warmup_tokens < 1:
        raise ConfigError("warmup_tokens", f"must be >= 1 or null (a whole pass), got {cfg.warmup_tokens}")


# What the bench itself sets in an engine process, after a model's env: a lane's GPUs, a configuration's pipeline,
# the compile cache, and what steer's engine needs of vLLM (steer.engine.vllm.set_environment)
OWN_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", "VLLM_USE_BREAKABLE_CUDAGRAPH", "VLLM_USE_V2_MODEL_RUNNER",
           "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION")


def _check_timed(cfg: BenchConf, name: str, m: BenchModelConf) -> None:
    """A model's own passes, time floor and cap: null, or passes in 1..max_repeats, a floor in 0..its cap and a
    cap above 0."""
    if m.repeats is not None and not 1 <= m.repeats <= cfg.max_repeats:
        raise ConfigError(f"models.{name}.repeats", f"must be null or in 1..max_repeats ({cfg.max_repeats}), got "
                                                   f"{m.repeats}")
    if m.max_timed_s is not None and m.max_timed_s <= 0:
        raise ConfigError(f"models.{name}.max_timed_s", f"must be null or > 0 (one pass is always timed), got "
                                                       f"{m.max_timed_s}")
    least, most = timed_window(cfg, m)
    if m.min_timed_s is not None and not 0 <= m.min_timed_s <= most:
        cap = "its max_timed_s" if m.max_timed_s is not None else "max_timed_s"
        raise ConfigError(f"models.{name}.min_timed_s", f"must be null or in 0..{cap} ({most:g}), got "
                                                       f"{m.min_timed_s}")
    if least > most:  # its own cap under the run's floor
        raise ConfigError(f"models.{name}.max_timed_s", f"must be >= min_timed_s ({least:g}, the run's), got "
                                                       f"{m.max_timed_s}")


def _check_env(name: str, m: BenchModelConf) -> None:
    for key in m.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"models.{name}.env", f"{key!r} is not an environment variable's name")
        if key in OWN_ENV:
            raise ConfigError(f"models.{name}.env.{key}", f"is the bench's own to set ({', '.join(OWN_ENV)}): "
                                                          "lanes[].gpus and the configurations set these")
        if m.env[key] in ("True", "False"):  # Hydra read true/false as a boolean, and vLLM reads int("True")
            raise ConfigError(f"models.{name}.env.{key}", f"got the boolean {m.env[key]}; write 1 or 0, or quote "
                                                          "the value to keep it a string")


def _check_cells(cfg: BenchConf) -> None:
    """Configurations, scenarios, batches and targets."""
    for i, c in enumerate(cfg.configs):
        if c not in CONFIGS:
            raise ConfigError(f"configs[{i}]", f"unknown configuration {c!r}; expected one of {list(CONFIGS)}")
    for i, b in enumerate(cfg.batches):
        if len(b) != 2 or min(b) < 1:
            raise ConfigError(f"batches[{i}]", f"expected [requests, new tokens], both >= 1, got {list(b)}")
    for i, s in enumerate(cfg.scenarios):
        _check_scenario(f"scenarios[{i}]", s)
        k = _K.match(base(s))
        if k and int(k.group(1)) > MAX_K:  # each distinct edit is a vector built and registered per engine
            raise ConfigError(f"scenarios[{i}]", f"{s!r} asks for {k.group(1)} distinct edits; at most {MAX_K}")
    if not 1e-12 <= cfg.epsilon < 1:
        # A `scale` edit carries its strength as its factor minus 1 (a float64): much below this, 1 + strength
        # rounds to 1 and the edit to a no-op, which the faint edit is there not to be.
        raise ConfigError("epsilon", f"must be in [1e-12, 1), got {cfg.epsilon}")
    for i, t in enumerate(cfg.targets):
        _check_scenario(f"targets[{i}].scenario", t.scenario)  # a misspelt one would never be read: no miss
        if t.model is not None and t.model not in cfg.models:
            raise ConfigError(f"targets[{i}].model", f"model {t.model!r} is not defined under `models` "
                                                     f"({sorted(cfg.models)})")
        for key in ("of", "over"):
            if getattr(t, key) not in CONFIGS:
                raise ConfigError(f"targets[{i}].{key}", f"unknown configuration {getattr(t, key)!r}")
        if t.between not in ("medians", "fastest", "paired"):
            raise ConfigError(f"targets[{i}].between", f"expected medians, fastest or paired, got {t.between!r}")
        unpaired = [name for name in ([t.model] if t.model else cfg.run)
                    if t.between == "paired" and name in cfg.models and cfg.models[name].paired != t.over]
        if unpaired:  # its passes would have no neighbours: never decided
            raise ConfigError(f"targets[{i}].between", f"paired over {t.over}, but {unpaired[0]}'s runs are not "
                                                       f"paired over it (models.{unpaired[0]}.paired: "
                                                       f"{cfg.models[unpaired[0]].paired})")


def _check_scenario(field: str, name: str) -> None:
    if base(name) not in ("add", "ablate_all") and not _K.match(base(name)):
        raise ConfigError(field, f"unknown scenario {name!r}; expected add, ablate_all or kN (N >= 1), each also "
                                 f"with {FAINT} (its edits at `epsilon` strength)")


def skipped(cfg: BenchConf, model_name: str, config: str, scenario: str, batch) -> Optional[str]:
    """The skip pattern that leaves this cell out, or None."""
    return _matching(cfg.skip, model_name, config, scenario, batch)


def traced(cfg: BenchConf, model_name: str, config: str, scenario: str, batch) -> Optional[str]:
    """The trace pattern that names this cell, or None. An unsteered configuration's one cell stands for every
    scenario, so a pattern that names it at any of the run's scenarios (`llama3_8b/b/ablate_all/64x128`, the
    baseline beside f's ablate_all) names that cell."""
    names = [scenario, *cfg.scenarios] if scenario == "unsteered" else [scenario]
    return next(filter(None, (_matching(cfg.trace, model_name, config, s, batch) for s in names)), None)


def _check_traces(cfg: BenchConf) -> None:
    """Every trace pattern names some cell of the run (a typo would trace nothing, and say nothing)."""
    cells = [_cell(m, c, s, b) for m in cfg.run for c in cfg.configs for s in [*cfg.scenarios, "unsteered"]
             for b in cfg.batches]
    for i, pattern in enumerate(cfg.trace):
        if not any(fnmatch.fnmatchcase(cell, pattern) for cell in cells):
            example = f", e.g. {cells[0]!r}" if cells else ""
            raise ConfigError(f"trace[{i}]", f"{pattern!r} names no cell of this run: a cell is model/config/scenario/"
                                             f"RxT of run, configs, scenarios and batches{example}")


def _cell(model_name: str, config: str, scenario: str, batch) -> str:
    """A cell's name, as skip and trace patterns match it."""
    return f"{model_name}/{config}/{scenario}/{batch[0]}x{batch[1]}"


def _matching(patterns: List[str], model_name: str, config: str, scenario: str, batch) -> Optional[str]:
    cell = _cell(model_name, config, scenario, batch)
    return next((p for p in patterns if fnmatch.fnmatchcase(cell, p)), None)


def model_dir(m: BenchModelConf, cache_dir: str) -> Path:
    """A directory vLLM and nnsight can load (config, tokenizer; weights unless load_format is dummy)."""
    if m.source == "tiny":
        return tiny.ensure_tiny(cache_dir, m.tiny)
    if m.source == "gguf":
        return gguf_model.ensure(cache_dir, m.gguf)  # converted once into the cache (about a minute)
    if m.source not in _SHAPES:
        return Path(m.source)
    dest = Path(cache_dir).expanduser() / "models" / m.source
    if not (dest / "config.json").exists():
        from transformers import LlamaConfig

        # The tiny model's tokenizer: prompts are token ids below its vocabulary, valid for any shape.
        src = tiny.ensure_tiny(cache_dir, m.tiny)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, tmp / f.name)
        bos_eos = json.loads((src / "config.json").read_text())
        LlamaConfig(**_SHAPES[m.source], bos_token_id=bos_eos["bos_token_id"], eos_token_id=bos_eos["eos_token_id"],
                    torch_dtype=m.dtype).save_pretrained(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def kv_cache_bytes(cfg: BenchConf, where: Path, dtype: str) -> int:
    """The KV cache every engine of the model at `where` gets: `kv_cache_tokens` (null: the largest batch at full
    length, and a quarter more, so no configuration is ever preempted)."""
    c = json.loads((where / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    per_token = 2 * c["num_hidden_layers"] * (c.get("num_key_value_heads") or heads) * head_dim
    per_token *= torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    tokens = cfg.kv_cache_tokens or _largest_batch_tokens(cfg) * 5 // 4
    return per_token * max(tokens, cfg.max_model_len)


def lane(cfg: BenchConf, model_name: str, config: str) -> int:
    """The index of the first lane whose patterns name `model/config`, or -1."""
    return next((i for i, ln in enumerate(cfg.lanes) if any(fnmatch.fnmatchcase(f"{model_name}/{config}", p)
                                                            for p in ln.runs)), -1)


def check_cpus(field: str, cpus: Optional[str]) -> None:
    """ConfigError naming `field` where `cpus` is no Linux CPU list or names CPUs this process may not run on."""
    if cpus is None:
        return
    try:
        wanted = placement.cpu_list(cpus)
    except ValueError as e:
        raise ConfigError(field, str(e)) from None
    have = placement.available()
    if have is not None and not set(wanted) <= set(have):
        raise ConfigError(field, f"names CPU(s) {placement.as_text(set(wanted) - set(have))} that this process may "
                                 f"not run on (it may run on {placement.as_text(have)})")


def _check_lanes(cfg: BenchConf) -> None:
    if not cfg.lanes:
        raise ConfigError("lanes", "needs at least one lane, e.g. [{gpus: null, runs: ['*']}]")
    seen = {}
    for i, ln in enumerate(cfg.lanes):
        check_cpus(f"lanes[{i}].cpus", ln.cpus)
        if ln.gpus is None:
            continue
        ids = ln.gpus.split(",")
        if not all(x.strip().isdigit() for x in ids):
            raise ConfigError(f"lanes[{i}].gpus", f"expected GPU indices separated by commas (\"0\" or \"0,1\"), "
                                                  f"got {ln.gpus!r}")
        if len(ids) < cfg.tensor_parallel_size:
            raise ConfigError(f"lanes[{i}].gpus", f"{len(ids)} GPU(s) cannot hold an engine of "
                                                  f"tensor_parallel_size={cfg.tensor_parallel_size}")
        for x in ids:
            if int(x) in seen:
                raise ConfigError(f"lanes[{i}].gpus", f"GPU {int(x)} is also lane {seen[int(x)]}'s: lanes time side "
                                                      "by side, so they must not share a GPU")
            seen[int(x)] = i
    if cfg.probe_cpu is not None:
        if any(ln.cpus is None for ln in cfg.lanes):
            raise ConfigError("probe_cpu", "needs every lane to name its cpus (lanes[].cpus), so that no engine runs "
                                           "on the probe's CPU")
        check_cpus("probe_cpu", str(cfg.probe_cpu))
        used = [i for i, ln in enumerate(cfg.lanes) if cfg.probe_cpu in placement.cpu_list(ln.cpus)]
        if used:
            raise ConfigError("probe_cpu", f"CPU {cfg.probe_cpu} is also lanes[{used[0]}].cpus "
                                           f"({cfg.lanes[used[0]].cpus}): the probe needs a CPU no engine runs on")
    if len(cfg.lanes) > 1 and any(ln.gpus is None for ln in cfg.lanes):
        raise ConfigError("lanes", "with more than one lane, every lane names its gpus")
    if seen and torch.cuda.is_available() and max(seen) >= torch.cuda.device_count():
        raise ConfigError("lanes", f"names GPU {max(seen)}, but this machine has {torch.cuda.device_count()}")
    for name in cfg.run:
        for c in cfg.configs:
            if lane(cfg, name, c) < 0:
                raise ConfigError("lanes", f"no lane runs {name}/{c}; add a pattern that matches it (e.g. '*')")


def _largest_batch_tokens(cfg: BenchConf) -> int:
    """Tokens the largest batch holds at full length: every request's prompt and all its new tokens."""
    return max(r * (cfg.prompt_len + t) for r, t in cfg.batches)


def spec(m: BenchModelConf, name: str, where: Path):
    return model.spec(ModelConf(name=name, source=str(where), dtype=m.dtype), str(where.parent))


def prompts(n: int, length: int, seed: int, low: int = 2, high: int = 500) -> List[List[int]]:
    """`n` prompts of `length` token ids (ids below the tiny tokenizer's vocabulary, above its specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n, length), generator=g).tolist()


def base(name: str) -> str:
    """The scenario a name runs the edits of (`ablate_all@eps`: ablate_all's)."""
    return name.removesuffix(FAINT)


def tapped(name: str, layers: int) -> List[int]:
    """The decoder layers scenario `name` taps on a model of `layers` layers."""
    return list(range(layers)) if base(name) == "ablate_all" else [layers // 2]


def faint(e: Edit, epsilon: float) -> Edit:
    """`e` at `epsilon` of its strength: a delta `epsilon` times e's, through the same ops. Every kind is linear
    in its strength (add: the vector's scale; ablate, clamp, set: the share of the projection's move made, 1 the
    whole move; scale: the factor minus 1), and the strength is each row's weight in the tap programs, so every
    stage and every row the full edit uses is used and nonzero: the fused kernel skips only weights of exactly 0."""
    s = epsilon * e.strength
    return replace(e, scale=1.0 + s if e.kind == EditKind.scale else s)


def scenario(name: str, hidden: int, layers: int, n: int, seed: int, epsilon: float = 1e-6) -> Scenario:
    """The per-request edits of a scenario for `n` requests on a model of `layers` layers (a name ending in
    `FAINT`: its base scenario's edits at `epsilon` of their strength, requests sharing an edit as they did)."""
    scen = _full(base(name), hidden, layers, n, seed)
    if name == scen.name:
        return scen
    weak = {id(e): faint(e, epsilon) for e in scen.edits}
    return Scenario(name, scen.layers, [weak[id(e)] for e in scen.edits])


def _full(name: str, hidden: int, layers: int, n: int, seed: int) -> Scenario:
    g = torch.Generator().manual_seed(seed + 1)

    def unit() -> torch.Tensor:
        v = torch.randn(1, hidden, generator=g)
        return v / v.norm()

    taps = tapped(name, layers)
    if name == "add":
        e = compile_edit(EditKind.add, 4.0, unit())
        return Scenario(name, taps, [e] * n)
    if name == "ablate_all":
        e = compile_edit(EditKind.ablate, 1.0, unit())
        return Scenario(name, taps, [e] * n)
    k = int(_K.match(name).group(1))
    configs = []
    for j in range(k):
        kind = _KINDS[j % len(_KINDS)]
        kw = {"lo": -0.5, "hi": 0.5} if kind == EditKind.clamp else {"value": 0.25} if kind == EditKind.set else {}
        scale = 0.9 - 0.1 * j / k if kind == EditKind.scale else 1.0 + j / k
        configs.append(compile_edit(kind, scale, None if kind == EditKind.scale else unit(), **kw))
    return Scenario(name, taps, [configs[i % k] for i in range(n)])
