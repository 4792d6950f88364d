"""What every configuration runs: the model directories, the prompts, and each scenario's per-request edits.

Every configuration gets the same prompts (token ids, so no tokenizer differences) and the same edits; nothing
here starts an engine, so a bad config fails before any GPU work.
"""

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from steer.models import gguf as gguf_model

from steer.models import spec as model

from steer.models import tiny
from steer.bench import peers
from steer.bench.schema import CONFIGS, FAINT, K_KINDS, PEERS, REFERENCES, BenchConf, BenchModelConf
from steer.edits.condition import Condition
from steer.edits.edit import Edit, compile_edit
from interleaver.select import Positions
from steer.config import checks
from steer.errors import ConfigError, refuse_repeats
from steer.config.schema import EditKind, ModelConf

# Public architectures (their config.json), for load_format=dummy: the real shape, random weights. Llama-3-8B;
# and DeepSeek-R1-Distill-Qwen-1.5B, the Qwen2 1.5B that EasySteer's own throughput benchmark runs.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
QWEN2_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072, rope_theta=10000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=21, architectures=["Qwen2ForCausalLM"])
_SHAPES = {"llama3_8b_shape": ("llama", LLAMA3_8B), "qwen2_1p5b_shape": ("qwen2", QWEN2_1P5B)}
# add, ablate_all, add_all, kN and kN_all (N >= 1): what each request runs, one tap or (`_all`) every layer; cast
# (an add under a condition read at an earlier layer, met by half the requests) and the position selectors
# last_prompt, first_generated and window (an add on those rows alone)
_SCENARIO = re.compile(r"(?:add|add_all|ablate_all|cast|last_prompt|first_generated|window|k([1-9][0-9]*)(?:_all)?)$")
# Scenarios whose edits carry a condition or positions: run by steer's own engines alone
SELECTING = ("cast", "last_prompt", "first_generated", "window")
MAX_K = 4096


@dataclass
class Scenario:
    name: str
    layers: List[int]  # the decoder layers edited; every request's edit runs at each of them
    edits: List[Optional[Edit]]  # per request (None: unsteered)
    read: Optional[int] = None  # the layer the edits' condition reads (its path is the engine's tap there)


def check(cfg: BenchConf) -> None:
    """Fail on a config that means nothing, naming the field, before any engine starts."""
    for name in ("run", "configs", "scenarios", "batches"):
        if not getattr(cfg, name):
            raise ConfigError(name, "is empty: nothing would be measured")
        refuse_repeats(name, getattr(cfg, name))
    for i, m in enumerate(cfg.run):
        if m not in cfg.models:
            raise ConfigError(f"run[{i}]", f"model {m!r} is not defined under `models` ({sorted(cfg.models)})")
    for i, c in enumerate(cfg.configs):
        if c not in CONFIGS:
            raise ConfigError(f"configs[{i}]", f"unknown configuration {c!r}; expected one of {list(CONFIGS)}")
    for i, b in enumerate(cfg.batches):
        if len(b) != 2 or min(b) < 1:
            raise ConfigError(f"batches[{i}]", f"expected [requests, new tokens], both >= 1, got {list(b)}")
    for i, s in enumerate(cfg.scenarios):
        _check_scenario(f"scenarios[{i}]", s)
    if not cfg.k_kinds:
        raise ConfigError("k_kinds", "is empty: a kN scenario's edits need at least one kind")
    refuse_repeats("k_kinds", cfg.k_kinds)
    if not 1e-12 <= cfg.epsilon < 1:
        # A `rescale` edit carries its strength as its factor minus 1 (a float64): much below this, 1 + strength
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
    for name in ("prompt_len", "repeats", "tensor_parallel_size", "timeout_s"):
        checks.at_least(name, getattr(cfg, name), 1)
    checks.enough_gpus("tensor_parallel_size", cfg.tensor_parallel_size)
    if cfg.warmup_tokens is not None and cfg.warmup_tokens < 1:
        raise ConfigError("warmup_tokens", f"must be >= 1 or null (a whole pass), got {cfg.warmup_tokens}")
    if not cfg.max_timed_s > 0:  # NaN too
        raise ConfigError("max_timed_s", f"must be > 0 (one pass is always timed), got {cfg.max_timed_s}")
    checks.memory_share("gpu_memory_utilization", cfg.gpu_memory_utilization)
    longest = max(cfg.prompt_len + t for _, t in cfg.batches)
    if cfg.max_model_len < longest:
        raise ConfigError("max_model_len", f"{cfg.max_model_len} cannot hold a request of the longest batch "
                                           f"(prompt_len {cfg.prompt_len} + {longest - cfg.prompt_len} new tokens)")
    need = _largest_batch_tokens(cfg)
    if cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens < need:
        raise ConfigError("kv_cache_tokens", f"{cfg.kv_cache_tokens} tokens cannot hold the largest batch at full "
                                             f"length ({need}); requests would be preempted mid-pass")
    for i, size in enumerate(cfg.capture_sizes or []):
        if size < 1:
            raise ConfigError(f"capture_sizes[{i}]", f"a step size must be >= 1, got {size}")
    missing = sorted({r for r, _ in cfg.batches} - set(cfg.capture_sizes or [r for r, _ in cfg.batches]))
    if missing:
        raise ConfigError("capture_sizes", f"has no graph for the batch size(s) {missing}: their decode steps would "
                                           "run eagerly")
    refs = [c for c in cfg.configs if c in REFERENCES]
    alive = len(refs) + (len(refs) < len(cfg.configs))  # the references stay up beside one engine at least
    selecting = [s for s in cfg.scenarios if base(s) in SELECTING]
    others = [c for c in cfg.configs if c in ("d", "e") or c in PEERS]
    if selecting and others:
        raise ConfigError("scenarios", f"{selecting[0]!r} carries a condition or positions, which only steer's "
                                       f"engines run; leave it out or drop configuration {others[0]!r}")
    peers.check(cfg, any(_SCENARIO.match(base(s)).group(1) for s in cfg.scenarios))
    for name, m in cfg.models.items():
        if m.source not in ("tiny", "gguf", *_SHAPES) and not Path(m.source).is_dir():
            raise ConfigError(f"models.{name}.source", f"{m.source!r} is neither 'tiny', 'gguf', one of "
                                                       f"{sorted(_SHAPES)}, nor a model directory")
        model.check_dtype(f"models.{name}.dtype", m.dtype)
        if m.engines_at_once < alive:
            raise ConfigError(f"models.{name}.engines_at_once", f"must be >= {alive}: the references "
                                                                f"({', '.join(refs) or 'none'}) stay up beside one "
                                                                f"engine at least, got {m.engines_at_once}")
        if m.repeats is not None and m.repeats < 1:
            raise ConfigError(f"models.{name}.repeats", f"must be null or >= 1, got {m.repeats}")


def _check_scenario(field: str, name: str) -> None:
    k = _SCENARIO.match(base(name))
    if not k:
        raise ConfigError(field, f"unknown scenario {name!r}; expected add, add_all, ablate_all, kN or kN_all "
                                 f"(N >= 1), cast, last_prompt, first_generated or window, each also with {FAINT} "
                                 "(its edits at `epsilon` strength)")
    if k.group(1) and int(k.group(1)) > MAX_K:  # each distinct edit is a vector built and registered per engine
        raise ConfigError(field, f"{name!r} asks for {k.group(1)} distinct edits; at most {MAX_K}")


def skipped(cfg: BenchConf, model_name: str, config: str, scenario: str, batch) -> Optional[str]:
    """The skip pattern that leaves this cell (model/config/scenario/RxT) out, or None."""
    cell = f"{model_name}/{config}/{scenario}/{batch[0]}x{batch[1]}"
    return next((p for p in cfg.skip if fnmatch.fnmatchcase(cell, p)), None)


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
        from transformers import AutoConfig

        # The tiny model's tokenizer: prompts are token ids below its vocabulary, valid for any shape.
        src = tiny.ensure_tiny(cache_dir, m.tiny)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, tmp / f.name)
        bos_eos = json.loads((src / "config.json").read_text())
        kind, shape = _SHAPES[m.source]
        AutoConfig.for_model(kind, **shape, bos_token_id=bos_eos["bos_token_id"], eos_token_id=bos_eos["eos_token_id"],
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
    """The decoder layers scenario `name` taps on a model of `layers` layers: every one for a name ending `_all`;
    for cast, the condition's (a quarter of the way) and the edit's (three eighths: 8 and 12 of 32); else the middle
    one."""
    if base(name).endswith("_all"):
        return list(range(layers))
    return [layers // 4, layers * 3 // 8] if base(name) == "cast" else [layers // 2]


def faint(e: Edit, epsilon: float) -> Edit:
    """`e` at `epsilon` of its strength: a delta `epsilon` times e's, through the same ops. Every kind is linear
    in its strength (add: the vector's scale; ablate, clamp, set: the share of the projection's move made, 1 the
    whole move; rescale: the factor minus 1), and the strength is each row's weight in the tap programs, so every
    stage and every row the full edit uses is used and nonzero: the fused kernel skips only weights of exactly 0."""
    return replace(e, strength=epsilon * e.strength)


def scenario(name: str, hidden: int, layers: int, n: int, seed: int, epsilon: float = 1e-6,
             kinds: Sequence[EditKind] = K_KINDS) -> Scenario:
    """The per-request edits of a scenario for `n` requests on a model of `layers` layers, a kN scenario's N edits
    taking `kinds` in turn (a name ending in `FAINT`: its base scenario's edits at `epsilon` of their strength,
    requests sharing an edit as they did)."""
    scen = _full(base(name), hidden, layers, n, seed, kinds)
    if name == scen.name:
        return scen
    weak = {id(e): faint(e, epsilon) for e in scen.edits}
    return Scenario(name, scen.layers, [weak[id(e)] for e in scen.edits], scen.read)


def _full(name: str, hidden: int, layers: int, n: int, seed: int, kinds: Sequence[EditKind]) -> Scenario:
    g = torch.Generator().manual_seed(seed + 1)

    def unit() -> torch.Tensor:
        v = torch.randn(1, hidden, generator=g)
        return v / v.norm()

    taps = tapped(name, layers)
    if name in ("add", "add_all"):
        e = compile_edit(EditKind.add, 4.0, unit())
        return Scenario(name, taps, [e] * n)
    if name == "ablate_all":
        e = compile_edit(EditKind.ablate, 1.0, unit())
        return Scenario(name, taps, [e] * n)
    if name == "cast":  # cosine against any direction is above -1 and never above 1: half meet, half do not
        v = unit()[0]
        met, unmet = (compile_edit(EditKind.add, 4.0, v[None], when=Condition("", v, "mean", "cosine", "above", t))
                      for t in (-1.0, 1.0))
        return Scenario(name, taps[1:], [met if i % 2 == 0 else unmet for i in range(n)], taps[0])
    if name in SELECTING:
        where = {"last_prompt": Positions("last_prompt", count=1), "first_generated": Positions("first_generated",
                 count=16), "window": Positions("window", start=0, end=63)}[name]
        return Scenario(name, taps, [compile_edit(EditKind.add, 4.0, unit(), positions=where)] * n)
    k = int(_SCENARIO.match(name).group(1))
    configs = []
    for j in range(k):
        kind = kinds[j % len(kinds)]
        kw = {"lo": -0.5, "hi": 0.5} if kind == EditKind.clamp else {"value": 0.25} if kind == EditKind.set else {}
        scale = 0.9 - 0.1 * j / k if kind == EditKind.rescale else 1.0 + j / k
        configs.append(compile_edit(kind, scale, None if kind == EditKind.rescale else unit(), **kw))
    return Scenario(name, taps, [configs[i % k] for i in range(n)])
