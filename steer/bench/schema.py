"""The bench's typed config: conf/bench.yaml is merged onto these dataclasses, so a typo fails at composition."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from steer.config.schema import EditKind, GgufConf, TinyConf

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
    "easysteer": "EasySteer (its vLLM 0.26.0 fork), per-request steering at its fastest admissible graph tier",
}
# The unsteered configurations run one unsteered batch that stands for every scenario. a is what a user runs
# without steer (vLLM serves Llama-family models with its V2 model runner); b is c's and f's baseline (breakable
# graphs, V1 runner); i is h's (a's compile and graphs on the V1 runner), so h over i is steering alone.
UNSTEERED = ("a", "b", "b2", "i")
# Every configuration's ratio to these is reported with its spread, so they time a pass in every round of their
# model's run: each other engine's pass of a round has theirs beside it (steer/bench/waves.py).
REFERENCES = ("a", "b")
# Other projects' steering, measured on the same prompts and edits: each runs from a Python path of its own
# (`peers.<name>.pythonpath`), so its vLLM fork never meets the vLLM steer runs on.
PEERS = ("easysteer",)

# A scenario's name with this suffix runs its edits at `epsilon` of their strength: the same stages, rows and
# kernels on the unsteered run's data (steer/bench/workload.py, `faint`).
FAINT = "@eps"
K_KINDS = (EditKind.add, EditKind.ablate, EditKind.clamp, EditKind.set, EditKind.rescale)


@dataclass
class BenchModelConf:
    # "tiny": the embedded model; "gguf": the GGUF of `gguf` converted once into the cache (SmolLM2-135M-Instruct,
    # conf/model/smollm2.yaml); "llama3_8b_shape": Llama-3-8B's config written by steer (use load_format dummy);
    # else a local model directory.
    source: str = "tiny"
    dtype: str = "bfloat16"
    load_format: str = "auto"
    # Engines of this model alive at once, the references (a, b) included: as many as fit in GPU memory side by side
    engines_at_once: int = 1
    repeats: Optional[int] = None  # timed rounds for this model's cells (null: the run's `repeats`)
    tiny: TinyConf = field(default_factory=TinyConf)
    gguf: GgufConf = field(default_factory=GgufConf)


@dataclass
class TargetConf:
    scenario: str = MISSING
    model: Optional[str] = None  # null: every model
    of: str = "c"
    over: str = "b"
    at_least: float = MISSING  # the median of of/over over the rounds both timed


@dataclass
class PeerConf:
    # The Python path the peer's engine process imports first (entries joined by ':'): for EasySteer, a directory
    # holding its vLLM (vLLM 0.26.0 with the fork's files over it) and one holding its `easysteer` package.
    # null: the peer is not installed, and a run that names it is refused before any engine starts.
    pythonpath: Optional[str] = None


@dataclass
class PeersConf:
    easysteer: PeerConf = field(default_factory=PeerConf)


@dataclass
class BenchConf:
    models: Dict[str, BenchModelConf] = field(default_factory=dict)
    run: List[str] = field(default_factory=list)  # which models, in order
    configs: List[str] = field(default_factory=lambda: list(CONFIGS))
    # add: one tap, every request adds the same vector; ablate_all: one direction ablated at every layer;
    # kN: N distinct per-request edits (kinds in turn from `k_kinds`) at one tap in one batch; add_all and kN_all:
    # the same at every layer; each also as <name>@eps: the same edits at `epsilon` of their strength, whose ratio
    # to b is the machinery alone.
    scenarios: List[str] = field(default_factory=lambda: ["add", "ablate_all", "k1", "k8", "k64"])
    # The kinds a kN scenario's N edits take in turn (EasySteer runs add and ablate: [add] for a run beside it)
    k_kinds: List[EditKind] = field(default_factory=lambda: list(K_KINDS))
    epsilon: float = 1e-6
    batches: List[List[int]] = field(default_factory=lambda: [[64, 128], [256, 256]])  # requests x new tokens
    prompt_len: int = 32
    # The warm-up: an untimed pass of the cell's batch and edits with this many new tokens (null: a whole pass).
    # The graphs are captured when an engine starts; what is left to warm is per step, so a short pass does.
    warmup_tokens: Optional[int] = 32
    repeats: int = 5  # timed rounds: each cell times one pass a round
    # A cell takes no further pass once its timed passes add up to this (an eager 8B pass can take a minute)
    max_timed_s: float = 60.0
    # "model/config/scenario/RxT" fnmatch patterns left out of this run (reported as skipped, with the pattern)
    skip: List[str] = field(default_factory=list)
    targets: List[TargetConf] = field(default_factory=list)
    # Only vLLM's start-up check (the free share of the GPU an engine must find); the KV cache is sized by
    # kv_cache_tokens, the same for every engine, so engines alive side by side cannot starve each other.
    gpu_memory_utilization: float = 0.05
    kv_cache_tokens: Optional[int] = None  # null: every request of the largest batch at full length, and a quarter
    tensor_parallel_size: int = 1  # GPUs per engine, for every configuration
    # Step sizes every graph configuration captures (null: the batches' sizes). A batch decodes in lockstep
    # (ignore_eos), so its own size is the one every timed decode step uses; fewer sizes start faster.
    capture_sizes: Optional[List[int]] = None
    max_model_len: int = 1024
    seed: int = 0
    timeout_s: int = 1800  # per engine process: to start, and then each round of its cells
    peers: PeersConf = field(default_factory=PeersConf)  # where the other projects' engines are installed
    cache_dir: str = MISSING


def register() -> None:
    ConfigStore.instance().store(name="bench_schema", node=BenchConf)


def repeats(cfg: BenchConf, m: BenchModelConf) -> int:
    """A model's timed rounds: its own where set, else the run's."""
    return cfg.repeats if m.repeats is None else m.repeats
