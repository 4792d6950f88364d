"""Other projects' steering as configurations of the bench: EasySteer (configuration `easysteer`).

EasySteer steers inside a fork of vLLM 0.26.0 (the release's files with the fork's over them) and takes
per-request steering as `llm.generate(prompts, params, steering=[SteeringSpec, ...])`. Its engine process imports
that vLLM from `peers.easysteer.pythonpath`, ahead of the one steer runs on, and gets the settings every other
configuration gets (`engines.llm_kwargs`), plus EasySteer's declaration of the algorithms its requests use. With
only single-vector specs of its graph-family algorithms declared, EasySteer resolves its graph tier to `in_graph`
(its kernels captured into vLLM's full CUDA graphs), its fastest; the engine's log says which tier it took.

The bench's edits map onto its algorithms one for one where the math is the same: `add` (h + scale * v) is its
`direct`; `ablate` of one direction (h minus its projection) its `erase`, which removes the whole projection at any
nonzero scale. At `epsilon` (a scenario's `@eps` twin) each runs its kernels on data within epsilon of the unsteered
run's (erase then removes eps^2 / (eps^2 + 1e-8) of the projection), as EasySteer's own benchmark does at scale 0.
"""

import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from steer.bench.schema import PEERS, BenchConf
from steer.config.schema import EditKind, Tokens
from steer.errors import ConfigError

# The bench's edit kinds EasySteer runs, and the algorithm each is
ALGORITHMS = {EditKind.add: "direct", EditKind.ablate: "erase"}
# A file only EasySteer's vLLM has: a path that holds it holds the fork
FORK_MARK = Path("vllm") / "steer_vectors" / "api.py"


def entries(pythonpath: str) -> List[str]:
    return [p for p in pythonpath.split(os.pathsep) if p]


def check(cfg: BenchConf, k_scenarios: bool) -> None:
    """Refuse, before any engine starts, a run naming a peer that is not installed where its path says, or edits
    it cannot run (`k_scenarios`: the run has kN scenarios, whose edits take `k_kinds` in turn)."""
    for name in PEERS:
        if name not in cfg.configs:
            continue
        field = f"peers.{name}.pythonpath"
        path = getattr(cfg.peers, name).pythonpath
        if not path or not entries(path):
            raise ConfigError(field, f"is not set: configuration {name} runs EasySteer's vLLM fork from a Python path "
                                     "of its own (its vllm directory's parent, then its easysteer package's)")
        missing = [p for p in entries(path) if not Path(p).is_dir()]
        if missing:
            raise ConfigError(field, f"{missing[0]!r} is not a directory")
        if not any((Path(p) / FORK_MARK).is_file() for p in entries(path)):
            raise ConfigError(field, f"{path!r} holds no EasySteer vLLM (no {FORK_MARK} under any of its entries)")
        if k_scenarios:
            other = [k.value for k in cfg.k_kinds if k not in ALGORITHMS]
            if other:
                raise ConfigError("k_kinds", f"{other} have no EasySteer algorithm, and configuration {name} runs "
                                             f"every kN scenario's edits: set k_kinds to kinds of "
                                             f"{[k.value for k in ALGORITHMS]}")


def easysteer(cfg: BenchConf, settings: Callable[[], Dict], model: str, algorithms: List[str]):
    """Configuration `easysteer`'s runner (steer/bench/engines.py starts it): its engine on `model`, with vLLM's
    `settings()` (read once the fork's vLLM is the one imported) and `algorithms` declared, and a pass of a cell's
    batch with each request's edit as its own SteeringSpec."""
    if "vllm" in sys.modules:  # the vLLM steer runs on would stay the one this process uses
        raise RuntimeError("vLLM was imported in this engine process before EasySteer's path was set")
    paths = entries(cfg.peers.easysteer.pythonpath)
    sys.path[:0] = paths
    # vLLM's own subprocesses (its engine core, compile workers) import from the environment's path
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # The fork's steering modules reach the CUDA driver when imported, so an engine core forked from this process
    # would fail to initialise CUDA: vLLM starts it fresh instead
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM, SamplingParams
    from vllm.steer_vectors import ApplySpec, SteeringSpec, VectorSpec
    from vllm.steer_vectors.payloads import DirectionVector

    kwargs = settings()
    # One slot per distinct edit in flight: every request of the largest batch may carry its own
    llm = LLM(model=model, **kwargs, enable_steer_vector=True, steer_algorithms=algorithms,
              max_steer_vectors=kwargs["max_num_seqs"])
    specs: Dict[tuple, object] = {}  # (id(edit), layers) -> (edit, spec): holding the edit keeps its id unique

    def spec(edit, layers):
        key = (id(edit), tuple(layers))
        if key not in specs:
            specs[key] = (edit, SteeringSpec(vectors=[VectorSpec(
                # the payload's wire form, hashed once: EasySteer dedups slots by its digest
                data=DirectionVector({i: edit.basis[0] for i in layers}).to_wire(),
                algorithm=algorithm(edit), scale=edit.strength, layers=list(layers),
                apply=ApplySpec(**apply(edit.tokens)))]))
        return specs[key][1]

    def run(prompts, scen, tokens):
        steering = [spec(e, scen.layers) for e in scen.edits] if scen else None
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, steering=steering, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def algorithm(edit) -> str:
    """EasySteer's algorithm for one of the bench's edits (ValueError for one it has none for)."""
    if edit.kind not in ALGORITHMS or (edit.kind == EditKind.ablate and edit.basis.shape[0] != 1):
        raise ValueError(f"EasySteer has no algorithm for a {edit.kind.value} edit of {edit.basis.shape[0]} "
                         f"direction(s)")
    return ALGORITHMS[edit.kind]


def apply(tokens: Tokens) -> Dict[str, Optional[str]]:
    """EasySteer's ApplySpec fields for an edit's rows: the prompt's tokens, the generated ones, or both."""
    return {"prompt": "all" if tokens != Tokens.generated else None,
            "generation": "all" if tokens != Tokens.prompt else None}
