"""One engine configuration in one process: start it, then time its cells a round at a time.

Each configuration runs in a process of its own (vLLM does not free GPU memory reliably within a process, and each
sets its own vLLM environment before importing it). The process says when its engine is ready and times nothing
until the scheduler (steer/bench/waves.py) asks for a round: then it times one pass of each cell still short of
its passes (a reference, asked to keep, of every cell), a cell's warm-up before its first. A pass is one
`generate` of the whole batch, every request exactly its new tokens (ignore_eos) and none detokenized (a
dummy-weight model samples ids its small tokenizer does not have), so every configuration does the same work. A
cell's record keeps each pass's wall time and round, which the report sets against the references' passes of the
same round. How each configuration starts its engine and runs a pass is steer/bench/engines.py's.
"""

import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from steer.bench import engines, waves, workload
from steer.bench.schema import PEERS, UNSTEERED, BenchConf, BenchModelConf, repeats
from steer.results import write_json


@dataclass
class Group:
    """What one engine process runs: a configuration, the taps it starts with, and its cells."""

    model: str
    config: str
    layers: List[int]  # tapped decoder layers ([] for none)
    cells: List[Dict] = field(default_factory=list)  # {"scenario", "requests", "tokens"}


def plan_groups(cfg: BenchConf, model_name: str, layers: int) -> List[Group]:
    """The engine processes one model needs: each unsteered configuration once, e and each peer once (they serve
    every location), the others once per tap set."""
    groups: Dict[tuple, Group] = {}
    for config in cfg.configs:
        for scen in cfg.scenarios:
            taps = workload.tapped(scen, layers)
            if config in UNSTEERED:
                scen, taps = "unsteered", []
            elif config == "e" or config in PEERS:  # eager, or a peer's own steering: any layer at any step
                taps = []
            # f captures the edits its cells declare into the graphs and runs all of them every step, so each of
            # its scenarios also pays for the others at its taps (at weight 0, in the same one op per edit family):
            # a conservative figure, for fewer engine starts, which are most of a run's time.
            g = groups.setdefault((config, tuple(taps)), Group(model_name, config, taps))
            for req, tok in cfg.batches:
                cell = {"scenario": scen, "requests": req, "tokens": tok}
                if cell not in g.cells:
                    g.cells.append(cell)
    return list(groups.values())


@dataclass
class _Timing:
    """One cell's passes so far."""

    cell: Dict
    inputs: tuple  # (prompts, scenario): the same objects every pass, as a user's batch would be
    walls: List[float] = field(default_factory=list)
    rounds: List[int] = field(default_factory=list)  # the round of each timed pass
    host: Dict[str, List[float]] = field(default_factory=dict)  # host profile section -> [seconds, calls]
    error: Optional[str] = None


def run_group(cfg: BenchConf, m: BenchModelConf, where: str, group: Group, out: str, env: Optional[Dict] = None,
              ready=None, turns: Optional[waves.Turns] = None) -> None:
    """Child process entry: set `env`, start the engine and set `ready` (an event; None: none), then time the
    group's cells a round at a time, each round when `turns` asks for it (None: rounds one after another until
    every cell has its passes). The records go to `out` (JSON, atomically) after every round, so a process killed
    later keeps what it timed; `turns` is told once no more rounds are wanted."""
    try:
        _run_group(cfg, m, where, group, out, env, ready, turns)
    finally:
        if turns is not None:
            turns.answer(False)


def _run_group(cfg, m, where, group, out, env, ready, turns) -> None:
    os.environ.update(env or {})  # before anything touches CUDA
    # Engines starting side by side must not write one torch.compile cache entry at once; a directory per
    # configuration and tap set keeps them apart and is still reused by the next run on the machine.
    os.environ["VLLM_CACHE_ROOT"] = str(Path(cfg.cache_dir).expanduser() / "bench-vllm" /
                                        f"{group.model}-{group.config}-{len(group.layers)}taps")
    try:
        runner = engines.RUNNERS[group.config](cfg, m, Path(where), group)
    except Exception as e:  # the engine did not start: every cell says why
        traceback.print_exc()
        err = f"engine start failed: {type(e).__name__}: {e}"
        return write_json(Path(out), {"records": [{**c, "status": "error", "detail": err} for c in group.cells],
                                      "machine": {}})
    if ready is not None:
        ready.set()
    spec = workload.spec(m, group.model, Path(where))
    cells = [_Timing(c, _inputs(cfg, spec, c)) for c in group.cells]
    machine, n = {}, 0  # n: the round's number where no scheduler gives one
    while True:
        n += 1
        ask = turns.wait() if turns is not None else waves.Ask(n)
        if ask is None or ask.close:
            break
        for t in cells:
            if t.error is None and (ask.keep or _more(cfg, m, t)):
                _pass(cfg, runner, t, ask.round)
        machine = machine or engines.machine()
        write_json(Path(out), {"records": [_record(t) for t in cells if t.walls or t.error], "machine": machine})
        wanted = any(t.error is None and _more(cfg, m, t) for t in cells)
        if not (wanted or ask.keep):  # finished (a reference is finished when closed): `finally` says so
            break
        if turns is not None:
            turns.answer(wanted)
    for t in cells:
        rec = _record(t)
        said = f"{rec['tok_s']:,.0f} tok/s, {len(t.walls)} passes" if rec["status"] == "ok" else rec["detail"]
        print(f"[bench] {group.model} {group.config} {t.cell['scenario']} {t.cell['requests']}x"
              f"{t.cell['tokens']}: {said}", flush=True)


def _inputs(cfg: BenchConf, spec, cell: Dict):
    """A cell's prompts and scenario (None: unsteered), the same in every configuration."""
    n = cell["requests"]
    scen = None if cell["scenario"] == "unsteered" else workload.scenario(
        cell["scenario"], spec.hidden, spec.layers, n, cfg.seed, cfg.epsilon, cfg.k_kinds)
    return workload.prompts(n, cfg.prompt_len, cfg.seed), scen


def _more(cfg: BenchConf, m: BenchModelConf, t: _Timing) -> bool:
    """Whether a cell is short of its passes: fewer than the model's repeats, and under max_timed_s timed."""
    return len(t.walls) < repeats(cfg, m) and sum(t.walls) < cfg.max_timed_s


def _pass(cfg: BenchConf, runner, t: _Timing, round_: int) -> None:
    """One timed pass of a cell in round `round_`, after its warm-up on its first; a failure ends the cell."""
    n, tokens = t.cell["requests"], t.cell["tokens"]
    profile = getattr(runner, "profile", None)
    try:
        if not t.walls:
            runner(*t.inputs, min(cfg.warmup_tokens or tokens, tokens))  # warm-up: same batch and edits
        if profile:
            profile()  # what ran before this pass is not the cell's
        _sync()
        t0 = time.perf_counter()
        produced = runner(*t.inputs, tokens)
        _sync()
        wall = time.perf_counter() - t0
        if produced is not None and produced != n * tokens:
            raise RuntimeError(f"generated {produced} tokens, expected {n * tokens}")
    except Exception as e:
        traceback.print_exc()
        t.error = f"{type(e).__name__}: {e}"[:500]
        return
    t.walls.append(wall)
    t.rounds.append(round_)
    for k, v in (profile() if profile else {}).items():
        acc = t.host.setdefault(k, [0.0, 0])
        acc[0] += v["seconds"]
        acc[1] += v["calls"]


def _record(t: _Timing) -> Dict:
    """A cell's record: its median pass's throughput, every pass's wall time and round, and where the engine was
    profiled (STEER_PROFILE=1), the taps' host time a call per section."""
    if t.error is not None:
        return {**t.cell, "status": "error", "detail": t.error}
    wall = statistics.median(t.walls)
    rec = {**t.cell, "status": "ok", "tok_s": t.cell["requests"] * t.cell["tokens"] / wall, "wall_s": wall,
           "walls_s": list(t.walls), "rounds": list(t.rounds)}
    if t.host:
        rec["host_profile"] = {k: {"calls": c, **({"us_per_call": 1e6 * s / c} if s and c else {})}
                               for k, (s, c) in t.host.items()}
    return rec


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
