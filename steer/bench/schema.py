"""The bench's typed config: conf/bench.yaml is merged onto these dataclasses, so a typo fails at composition."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from steer.config.schema import GgufConf, TinyConf

CONFIGS = {
    "a": "vLLM default (torch.compile + CUDA graphs), unsteered",
    "b": "vLLM breakable CUDA graphs, unsteered",
    "b2": "b again in an engine process of its own, unsteered: the A/A control (b2/b is the run's own noise)",
    "c": "steer: replay callables at the taps",
    "d": "nnsight 0.8.1 taps, edit as a trace (tracer.all, in place)",
    "e": "vLLM eager, edit through nnsight",
    "f": "steer, edits captured into the graph (no eager break)",
    "g": "steer, each tap's edits a CUDA graph of their own at the break (vllm.tap_graphs)",
    "h": "steer, edits compiled into vLLM's own torch.compile'd graphs (vllm.compiled_edits; a's pipeline)",
    "i": "vLLM default (torch.compile + CUDA graphs) on the V1 model runner steer's worker hooks, unsteered",
    "j": "steer, f with each tap's edits run inside the next layer's residual add and RMSNorm (vllm.fold_norm)",
}
# The unsteered configurations: they run one unsteered batch that stands for every scenario. a is what a user runs
# without steer (vLLM 0.26 serves Llama-family models with its V2 model runner); b is c's and f's baseline (breakable
# graphs, V1 runner); i is h's (a's compile and graphs on the V1 runner), so h over i is steering alone. b2 is b in
# a second engine process, the run's A/A control (steer/bench/targets.py).
UNSTEERED = ("a", "b", "b2", "i")

# A scenario's name with this suffix runs its edits at `epsilon` of their strength: the same stages, rows and
# kernels, and data that stays the unsteered run's (steer/bench/workload.py, `faint`).
FAINT = "@eps"


@dataclass
class BenchModelConf:
    # "tiny": the embedded model; "gguf": the GGUF of `gguf` converted once into the cache (SmolLM2-135M-Instruct,
    # conf/model/smollm2.yaml); "llama3_8b_shape": Llama-3-8B's config written by steer (use load_format dummy);
    # else a local model directory.
    source: str = "tiny"
    dtype: str = "bfloat16"
    load_format: str = "auto"
    # Engines of this model started at once (each then waits, holding its GPU memory, to be timed alone): as many
    # as fit in GPU and host memory side by side.
    engines_at_once: int = 1
    # The run's repeats for this model's cells (null: the run's): between fastest passes, each cell needs as many
    # draws at its larger batch, whose passes take 4 times as long, as the time floor gives the smaller one
    repeats: Optional[int] = None
    # The run's min_timed_s for this model's cells (null: the run's): a host-bound model's passes spread so
    # widely that its fastest pass needs many more passes to show up
    min_timed_s: Optional[float] = None
    # The run's max_timed_s for this model's cells (null: the run's): a host-bound model's slow spells last about as
    # long as a pass of its larger batch, so a pass wholly between them needs many passes to turn up
    max_timed_s: Optional[float] = None
    # An unsteered configuration (b) that times a pass of each batch before and after every other engine's, where
    # its wave holds it (null: plain rounds): each steered pass sits between two of its passes, and the report
    # sets the one against the others (steer/bench/pairs.py), which a host's spells move together
    paired: Optional[str] = None
    # Environment variables every engine process of this model sets before vLLM starts, e.g.
    # +models.smollm2.env.VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core in the process that times it
    env: Dict[str, str] = field(default_factory=dict)
    tiny: TinyConf = field(default_factory=TinyConf)
    gguf: GgufConf = field(default_factory=GgufConf)


@dataclass
class LaneConf:
    # CUDA_VISIBLE_DEVICES for this lane's engines, e.g. "1" or "0,1" (null: whatever the run was given)
    gpus: Optional[str] = None
    # "model/config" fnmatch patterns of the engines this lane runs; an engine goes to the first lane that names it
    runs: List[str] = field(default_factory=lambda: ["*"])
    # CPUs this lane's engine processes (and the engine cores and threads they start) run on, a Linux CPU list
    # such as "0-3" (null: any); steer/bench/placement.py says why one would
    cpus: Optional[str] = None


@dataclass
class TargetConf:
    scenario: str = MISSING
    model: Optional[str] = None  # null: every model
    of: str = "c"
    over: str = "b"
    at_least: float = MISSING
    # Which ratio decides: between the cells' medians, their fastest passes (for a host-bound model, whose passes
    # spread widely whatever steers them), or paired passes (a paired run's `over`, steer/bench/pairs.py)
    between: str = "medians"


@dataclass
class BenchConf:
    models: Dict[str, BenchModelConf] = field(default_factory=dict)
    run: List[str] = field(default_factory=list)  # which models, in order
    configs: List[str] = field(default_factory=lambda: list(CONFIGS))
    # add: one tap, every request adds the same vector; ablate_all: one direction ablated at every layer;
    # kN: N distinct per-request edits (kinds in turn: add, ablate, clamp, set, scale) at one tap in one batch;
    # each also as <name>@eps: the same edits at `epsilon` of their strength (every stage, row and kernel of the
    # full edit, the unsteered run's data), whose ratio to b is the machinery's cost alone.
    scenarios: List[str] = field(default_factory=lambda: ["add", "ablate_all", "k1", "k8", "k64"])
    epsilon: float = 1e-6
    batches: List[List[int]] = field(default_factory=lambda: [[64, 128], [256, 256]])  # requests x new tokens
    prompt_len: int = 32
    # The warm-up: an untimed pass of the cell's batch and edits with this many new tokens (null: a whole pass).
    # The graphs are captured when an engine starts; what is left to warm is per step, so a short pass does.
    warmup_tokens: Optional[int] = 32
    repeats: int = 3  # at least this many timed passes per cell; the report gives their median and spread
    # ... and more, until the timed passes add up to this many seconds (a tiny-model pass is a fraction of a
    # second, and one hiccup moves a short median), at most max_repeats
    min_timed_s: float = 4.0
    max_repeats: int = 30
    # No further pass once the timed ones add up to this (an eager 8B pass can take a minute); one pass at least
    max_timed_s: float = 15.0
    # "model/config/scenario/RxT" fnmatch patterns left out of this run (reported as not run, with the pattern)
    skip: List[str] = field(default_factory=list)
    # Cells (the same patterns) that, after their timed passes, run one more pass of trace_tokens new tokens under
    # vLLM's torch profiler; its table of kernels by device time lands in the run dir as trace-<cell>.txt (the
    # configurations that run vLLM directly: a, b, c, f, g, h, i). An unsteered configuration's one cell is named
    # `unsteered`, and a pattern naming it at any scenario of the run names it too (b/ablate_all: f's baseline).
    trace: List[str] = field(default_factory=list)
    trace_tokens: int = 16
    # Seconds between readings of the GPU's SM clock and power through a timed pass (steer/bench/nvml.py; 0: none)
    gpu_sample_s: float = 0.02
    # A CPU no lane's engines run on, for a probe of the host's own speed through the run (steer/bench/hostspeed.py;
    # null: none); each timed pass then records the probe's median time within it (host_us)
    probe_cpu: Optional[int] = None
    trace_timeout_s: float = 300.0  # a trace not back by then is given up (the cell's figure stands)
    targets: List[TargetConf] = field(default_factory=list)
    # Only vLLM's start-up check (the free share of the GPU an engine must find); the KV cache is sized by
    # kv_cache_tokens, the same for every engine, so engines starting side by side cannot starve each other.
    gpu_memory_utilization: float = 0.05
    kv_cache_tokens: Optional[int] = None  # null: every request of the largest batch at full length, and a quarter
    tensor_parallel_size: int = 1  # GPUs per engine, for every configuration
    # Step sizes every graph configuration captures (null: the batches' sizes). A batch decodes in lockstep
    # (ignore_eos), so its own size is the one every timed decode step uses; fewer sizes start faster.
    capture_sizes: Optional[List[int]] = None
    max_model_len: int = 1024
    seed: int = 0
    # Lanes run side by side, each on GPUs of its own: a lane starts its engines in waves and times them one at a
    # time, as one GPU does, while the other lanes do the same on theirs. One lane (the default) times nothing side
    # by side; more lanes trade that for time (engines of different lanes share the host's cores).
    lanes: List[LaneConf] = field(default_factory=lambda: [LaneConf()])
    timeout_s: int = 1800  # per engine process: to start, and then each round of its cells
    cache_dir: str = MISSING


def register() -> None:
    ConfigStore.instance().store(name="bench_schema", node=BenchConf)


def least_passes(cfg: BenchConf, m: Optional[BenchModelConf] = None) -> int:
    """A model's `repeats`: its own where set, else the run's."""
    return cfg.repeats if m is None or m.repeats is None else m.repeats


def timed_window(cfg: BenchConf, m: Optional[BenchModelConf] = None) -> Tuple[float, float]:
    """A model's (min_timed_s, max_timed_s): its own where set, else the run's."""
    own = (None, None) if m is None else (m.min_timed_s, m.max_timed_s)
    return (cfg.min_timed_s if own[0] is None else own[0], cfg.max_timed_s if own[1] is None else own[1])
