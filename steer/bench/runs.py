"""One engine configuration in one process: start it, then time every scenario and batch it serves.

Each configuration runs in a process of its own (vLLM does not free GPU memory reliably within a process, and each
sets its own vLLM environment before importing it). A process started beside others (steer/bench/waves.py) says when
its engine is ready and times nothing until it is asked for a round, so no pass is timed while another engine
compiles or captures; in a round it times one pass of every cell still short of its passes. A cell's figure is
output tokens per second of one `generate` over the whole batch (the median of at least `repeats` passes and at
least `min_timed_s` seconds of them, none begun after `max_timed_s` (a model's own where set), after a warm-up pass
of the same batch and edits); every request generates exactly its new tokens (ignore_eos) and none is detokenized (a
dummy-weight model samples ids its small tokenizer does not have), so every configuration does the same work.
Through each timed pass the GPU's SM clock and power are sampled (steer/bench/nvml.py), and the host's CPUs read
(steer/bench/cpu.py). How each configuration's engine starts and runs a pass is steer/bench/engines.py's.
"""

import faulthandler
import gc
import os
import signal
import statistics
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from interleaver import clock
from steer.bench import cpu, engines, nvml, pauses, placement, waves, workload
from steer.bench.pairs import STEP, STEP_GAPS
from steer.bench.schema import UNSTEERED, BenchConf, BenchModelConf, least_passes, timed_window
from steer.results import write_json, write_text


@dataclass
class Group:
    """What one engine process runs: a configuration, the taps it starts with, and its cells."""

    model: str
    config: str  # a..g
    layers: List[int]  # tapped decoder layers ([] for none)
    cells: List[Dict] = field(default_factory=list)  # {"scenario", "requests", "tokens"}
    trace_dir: Optional[str] = None  # vLLM's profiler output, where a cell is traced (set in the engine process)


def plan_groups(cfg: BenchConf, model_name: str, layers: int) -> List[Group]:
    """The engine processes one model needs: a, b, b2 and i once (unsteered), c, d, f, g and h once per tap set, e
    once."""
    groups: Dict[tuple, Group] = {}
    for config in cfg.configs:
        for scen in cfg.scenarios:
            taps = workload.tapped(scen, layers)
            if config in UNSTEERED:
                scen, taps = "unsteered", []
            elif config == "e":
                taps = []  # eager: every location is served, nothing to declare
            # f captures the edits its cells declare into the graphs and runs all of them every step, so each of
            # its scenarios also pays for the others at its taps (at weight 0, in the same one op per edit family):
            # a conservative figure, for 3 fewer engine starts per model, which are most of a run's time.
            key = (config, tuple(taps))
            g = groups.setdefault(key, Group(model_name, config, taps))
            for req, tok in cfg.batches:
                cell = {"scenario": scen, "requests": req, "tokens": tok}
                if cell not in g.cells:
                    g.cells.append(cell)
    return list(groups.values())


def run_group(cfg: BenchConf, m: BenchModelConf, where: str, group: Group, out: str, env: Optional[Dict] = None,
              ready=None, turns: Optional[waves.Turns] = None) -> None:
    """Child process entry: set `env` (its lane's GPUs, compiler threads), start the engine and set `ready` (an
    event; None: none), then time the group's cells in rounds, each round when `turns` asks for it (None: one
    after another): one timed pass of every cell still short of its passes, a cell's warm-up before its first.
    The finished cells' records go to `out` (JSON, atomically) as each finishes; after the last round come the
    traces of those `cfg.trace` names, and `turns` is told no more rounds are wanted."""
    try:
        _run_group(cfg, m, where, group, out, env, ready, turns)
    finally:
        # The engine shuts down when its last reference goes, and a traced runner is a cycle (run.trace calls run):
        # left to exit, this process would wait forever on vLLM's engine core, which nothing then stops, and hold
        # its lane.
        gc.collect()
        if turns is not None:
            # Should the way out hang, the scheduler kills this process after waves.EXIT_S; its threads' stacks,
            # dumped halfway there, say where it hung.
            faulthandler.dump_traceback_later(waves.EXIT_S / 2, exit=False)
            turns.answer([])


@dataclass
class _Timing:
    """One cell's passes so far, and its record once it is finished (timed, or failed)."""

    cell: Dict
    inputs: tuple  # (prompts, scenario): the same objects every pass, as a user's batch would be
    walls: List[float] = field(default_factory=list)
    starts: List[float] = field(default_factory=list)  # each timed pass's start, wall clock (steer/bench/spells.py)
    # per timed pass: its GPU's mean SM clock and power, its host's busy CPUs and steal, where this engine's
    # processes ran, its decode steps (absent: not read)
    readings: List[Dict[str, object]] = field(default_factory=list)
    host: Dict[str, Dict] = field(default_factory=dict)  # section -> summed seconds, calls, merged histogram
    record: Optional[Dict] = None


def _run_group(cfg: BenchConf, m: BenchModelConf, where: str, group: Group, out: str, env: Optional[Dict], ready,
               turns: Optional[waves.Turns]) -> None:
    os.environ.update(env or {})  # before anything touches CUDA
    os.environ.update(m.env)  # the model's own settings (models.<name>.env), before vLLM reads them
    cpus = cfg.lanes[workload.lane(cfg, group.model, group.config)].cpus
    if cpus is not None:  # before vLLM starts its engine core and threads, which inherit it
        placement.pin(placement.cpu_list(cpus))
    # Engines starting side by side must not write one torch.compile cache entry at once; a directory per
    # configuration and tap set keeps them apart and is still reused by the next run on the machine.
    os.environ["VLLM_CACHE_ROOT"] = str(Path(cfg.cache_dir).expanduser() / "bench-vllm" /
                                        f"{group.model}-{group.config}-{len(group.layers)}taps")
    traced = [c for c in group.cells if workload.traced(cfg, group.model, group.config, c["scenario"],
                                                          (c["requests"], c["tokens"]))]
    if traced and group.config in engines.TRACEABLE:
        group.trace_dir = str(Path(out).parent / "traces" / Path(out).stem.lstrip("."))
        Path(group.trace_dir).mkdir(parents=True, exist_ok=True)
    try:
        runner = engines.RUNNERS[group.config](cfg, m, Path(where), group)
    except Exception as e:  # the engine did not start: every cell says why
        err = f"engine start failed: {type(e).__name__}: {e}"
        traceback.print_exc()
        return _write(out, [{**c, "status": "error", "detail": err} for c in group.cells], {})
    if ready is not None:
        ready.set()
    spec = workload.spec(m, group.model, Path(where))
    cells = [_Timing(c, _inputs(cfg, spec, c)) for c in group.cells]
    # without NVML, or with gpu_sample_s=0, the cells go without clocks (the bench said so once, at its start)
    read = nvml.reader()[0] if cfg.gpu_sample_s > 0 else None
    machine: Dict = {}
    profiled = getattr(runner, "profile", None) is not None
    while True:
        ask = turns.wait() if turns is not None else waves.ROUND
        if ask is None:
            return  # the scheduler is gone
        for t in cells:
            if t.record is not None or not _asked(t.cell, ask):
                continue
            if not ask.close:
                _pass(cfg, group, runner, t, read, m, keep=ask.keep)
            elif t.walls:  # the pairing reference, closed: the passes it has stand (the report pairs them)
                _finish(group, t, profiled)
                t.record["paired"] = True
            else:
                t.record = {**t.cell, "status": "not run", "detail": "the pairing reference: no other engine was "
                                                                     "timed at this batch"}
            # after every finished cell, and every pass of the reference (its cells stay open to the end): a process
            # killed later keeps what it has
            if t.record is not None or ask.keep:
                machine = machine or engines.machine()
                _write(out, [t.record or {**_record(t, profiled), "paired": True} for t in cells
                             if t.record is not None or (ask.keep and t.walls)], machine)
        wanted = _wanted(cells)
        if ask.close or not wanted:
            break
        if turns is not None:
            turns.answer(wanted)
    # Traces come after every timed pass: once vLLM's profiler has run, each later step pays for its annotations.
    for t in cells:
        if t.cell in traced and hasattr(runner, "trace") and t.record and t.record["status"] == "ok":
            _trace(cfg, group, runner, t, out)
            _write(out, [t.record for t in cells if t.record is not None], machine)


def _asked(cell: Dict, ask: waves.Ask) -> bool:
    """Whether `ask` names this cell (its batch and scenario, each where given)."""
    return ((ask.batch is None or (cell["requests"], cell["tokens"]) == tuple(ask.batch)) and
            (ask.scenario is None or cell["scenario"] == ask.scenario))


def _wanted(cells: List["_Timing"]) -> List[waves.Cell]:
    """The cells still short of their passes (a pairing reference's stay open until it is closed), in order."""
    return [(t.cell["scenario"], (t.cell["requests"], t.cell["tokens"])) for t in cells if t.record is None]


def _trace(cfg: BenchConf, group: Group, runner, t: _Timing, out: str) -> None:
    """A timed cell's pass under vLLM's profiler, written beside `out`; its record names the file or the failure."""
    n, tokens = t.cell["requests"], t.cell["tokens"]
    name = f"trace-{group.model}-{group.config}-{t.cell['scenario']}-{n}x{tokens}.txt"
    try:
        with _deadline(cfg.trace_timeout_s):
            text = runner.trace(*t.inputs, min(cfg.trace_tokens, tokens))
    except Exception as e:
        traceback.print_exc()
        t.record["trace"] = f"failed: {type(e).__name__}: {e}"[:300]
    else:
        write_text(Path(out).parent / name, text)
        t.record["trace"] = name


def _pass(cfg: BenchConf, group: Group, runner, t: _Timing, read=None, m: Optional[BenchModelConf] = None,
          keep: bool = False) -> None:
    """One timed pass of a cell (after its warm-up, on its first), and its record once it has all its passes;
    `read` (None: none) reads the GPU's clock and power through the pass (nvml.reader); `m` (None: the run's
    settings) may time the model's cells for longer or shorter (`_more`); `keep`: the pairing reference's pass,
    which leaves the cell open (it is finished when the scheduler closes it)."""
    n, tokens = t.cell["requests"], t.cell["tokens"]
    profile = getattr(runner, "profile", None)  # host time: the taps' (STEER_PROFILE=1), steer's params
    try:
        if not t.walls:  # its first pass comes after a warm-up (a failed warm-up finishes the cell as an error)
            runner(*t.inputs, min(cfg.warmup_tokens or tokens, tokens))  # warm-up: same batch and edits
        if profile:
            profile()  # what ran before this pass is not the cell's
        steps = getattr(runner, "steps", None)
        if steps:
            steps()
        _sync()
        # Where the processes ran is read first and last, so the GPU and host readings do not count its reads
        gpu_window = nvml.Sampler(read, cfg.gpu_sample_s) if read else nullcontext()
        with placement.Window() as at, gpu_window as gpu, cpu.Window() as host, pauses.Window() as collected:
            t.starts.append(time.time())
            t0 = time.perf_counter()
            produced = runner(*t.inputs, tokens)
            _sync()
            t.walls.append(time.perf_counter() - t0)
        t.readings.append({**(gpu.summary() if gpu else {}), **host.summary(), **at.summary(), **collected.summary(),
                           **(step_reading(steps()) if steps else {})})
        if profile:
            for k, v in profile().items():
                acc = t.host.setdefault(k, {"seconds": 0.0, "calls": 0, "hist": {}})
                acc["seconds"] += v["seconds"]
                acc["calls"] += v["calls"]
                clock.merge(acc["hist"], v.get("hist", {}))
        if produced is not None and produced != n * tokens:
            raise RuntimeError(f"generated {produced} tokens, expected {n * tokens}")
    except Exception as e:
        traceback.print_exc()
        t.record = {**t.cell, "status": "error", "detail": f"{type(e).__name__}: {e}"[:500]}
        return
    if not keep and not _more(t.walls, cfg, m):
        _finish(group, t, profile is not None)


def _finish(group: Group, t: _Timing, profiled: bool) -> None:
    """The cell's record from its timed passes (`_record`), said on the bench's log."""
    n, tokens = t.cell["requests"], t.cell["tokens"]
    t.record = rec = _record(t, profiled)
    gpu = f", {rec['sm_mhz']:,.0f} MHz, {rec['power_w']:,.0f} W" if "sm_mhz" in rec else ""
    if "cpu_busy" in rec:
        gpu += f", {rec['cpu_busy']:.1f} CPUs busy, {rec['cpu_steal']:.1f}% stolen"
    print(f"[bench] {group.model} {group.config} {t.cell['scenario']} {n}x{tokens}: "
          f"{rec['tok_s']:,.0f} tok/s (spread {rec['spread']:.1%}{gpu})", flush=True)
    if profiled:
        print(f"[bench] host profile: {rec['host_profile']}", flush=True)


def _record(t: _Timing, profiled: bool) -> Dict:
    """A cell's record from its timed passes: the median pass, their spread, the GPU's clock and power and the
    host's busy CPUs and steal (the medians of the passes' readings, and each pass's; absent where not read), and
    where `profiled`, the host profile."""
    n, tokens = t.cell["requests"], t.cell["tokens"]
    walls = t.walls
    wall = statistics.median(walls)
    rec = {**t.cell, "status": "ok", "wall_s": wall, "tok_s": n * tokens / wall,
           "spread": (max(walls) - min(walls)) / wall, "walls_s": list(walls), "started_s": list(t.starts),
           "pid": os.getpid()}
    for key in ("sm_mhz", "power_w", "cpu_busy", "cpu_steal", *placement.READINGS, placement.BUSIEST,
                *pauses.READINGS, STEP, STEP_GAPS):
        per_pass = [g[key] for g in t.readings if key in g]
        if per_pass:
            rec[f"{key}_passes"] = per_pass
            if key not in (placement.BUSIEST, STEP_GAPS):  # a CPU's number, or a pass's steps, has no median
                rec[key] = statistics.median(per_pass)
    if profiled:
        rec["host_profile"] = {k: _profiled(v) for k, v in t.host.items()}
    return rec


def _profiled(section: Dict) -> Dict:
    """A host profile section's figures: us a call on average and, where its calls were binned, at their median
    and 90th and 99th percentiles (a mean far over the median: a few slow calls; near it: every call); a count
    alone where it has no clock."""
    if not section["seconds"]:
        return {"calls": section["calls"]}
    out = {"us_per_call": 1e6 * section["seconds"] / section["calls"], "calls": section["calls"]}
    if section["hist"]:
        out.update({name: round(clock.quantile(section["hist"], q), 1)
                    for name, q in (("p50_us", 0.5), ("p90_us", 0.9), ("p99_us", 0.99))})
    return out


def step_reading(stamps: List[float]) -> Dict[str, object]:
    """A pass's median decode step in ms (`STEP`) and each of its decode steps (`STEP_GAPS`, ms to the microsecond),
    from the engine core's stamps of its steps (the gap after the prefill's stamp is the first decode step's); {}
    with fewer than two stamps. A pass's wall time moves with the host's stalls and spells wherever they fall; its
    median step moves only with those that last half the pass."""
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return {STEP: statistics.median(gaps), STEP_GAPS: [round(g, 3) for g in gaps]} if gaps else {}


@contextmanager
def _deadline(seconds: float):
    """Raise TimeoutError in this (main) thread once `seconds` have passed: a profiler that never hands its table
    back must not hold the lane, whose engine's timed cells are already written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise TimeoutError(f"no trace after {seconds:g} s (trace_timeout_s)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _inputs(cfg: BenchConf, spec, cell: Dict):
    """A cell's prompts and scenario (None: unsteered), the same in every configuration."""
    n = cell["requests"]
    scen = None if cell["scenario"] == "unsteered" else workload.scenario(
        cell["scenario"], spec.hidden, spec.layers, n, cfg.seed, cfg.epsilon)
    return workload.prompts(n, cfg.prompt_len, cfg.seed), scen


def _more(walls: List[float], cfg: BenchConf, m: Optional[BenchModelConf] = None) -> bool:
    """Whether a cell needs another timed pass: fewer than `repeats`, or less than `min_timed_s` timed in all (up
    to `max_repeats` passes); never once `max_timed_s` are timed, always when none is. The model's `repeats`,
    `min_timed_s` and `max_timed_s` (`m`; None or null: the run's) stand in for the run's."""
    least, most = timed_window(cfg, m)
    if not walls:
        return True
    if sum(walls) >= most:
        return False
    if len(walls) < least_passes(cfg, m):
        return True
    return len(walls) < cfg.max_repeats and sum(walls) < least


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _write(out: str, records: List[Dict], machine: Dict) -> None:
    write_json(Path(out), {"records": records, "machine": machine})
