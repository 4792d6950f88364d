"""Where a host-bound engine's decode steps run fast or slow: one engine's passes, its threads laid out in turn.

A SmolLM2 decode step at 64 x 128 on the H200 runs in a fast mode (2.0-2.75 ms) or a slow one (3.25-4.25 ms), a
pass mostly in one, the mode seemingly set when an engine wakes for its turn (docs/perf-log.md, 2026-12-04 04:00).
The slow mode is about the fast one plus the GPU's kernels of a step, as if the engine core's host work stopped
overlapping the GPU's. This starts one engine b (breakable graphs, unsteered; async scheduling as vLLM chooses, or
off with `--sync`) and times its passes in rounds, each round one pass in each layout of its threads (`LAYOUTS`):

- shared: every thread of the frontend (this process) and of its engine core on any of `--cpus` (the bench's lanes)
- apart: the engine core's main thread (its busy loop) alone on the first CPU, its other threads (output and input
  I/O) on the second, the frontend's main thread on the third, the frontend's other threads on the rest
- together: every thread of the engine core on the first CPU, the frontend's on the second

A round takes the layouts in turn from a different one each time, so that none always follows the same one.

Each pass's wall time and decode steps (the engine core's stamps) are written to `--out` as they come. `--pause`
leaves the engine idle that long before each pass, as the bench's turns do (an engine waits 0.4-4 s while the others
of its wave time theirs).

    python -m steer.bench.modes --cpus 2-9 --out modes.json
    python -m steer.bench.modes --cpus 2-9 --sync --out modes-sync.json
"""

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from steer.bench import placement
from steer.bench.pairs import FAST_Q, STEP_GAPS
from steer.errors import ConfigError

LAYOUTS = ("shared", "apart", "together")


def layout(name: str, frontend: int, core: int, threads: Dict[int, List[int]], cpus: List[int]) -> Dict[int, List[int]]:
    """Each thread's CPUs under layout `name`; `threads` maps the frontend's and the engine core's pids to their
    threads' ids (a process's main thread's id is its pid)."""
    if name not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {name!r}")
    if len(cpus) < (4 if name == "apart" else 2):
        raise ValueError(f"--cpus: layout {name!r} needs at least {4 if name == 'apart' else 2} CPUs, got {cpus}")
    out = {}
    for pid, tids in threads.items():
        for tid in tids:
            if name == "shared":
                out[tid] = list(cpus)
            elif name == "together":
                out[tid] = [cpus[0] if pid == core else cpus[1]]
            elif pid == core:
                out[tid] = [cpus[0] if tid == core else cpus[1]]
            else:
                out[tid] = [cpus[2]] if tid == frontend else list(cpus[3:])
    return out


def engine_core(frontend: int, proc: Path = placement.PROC) -> int:
    """The frontend's child that has run longest on the CPUs: its engine core, whose busy loop never sleeps for
    long (the other children, multiprocessing's resource tracker, mostly wait)."""
    times = placement.snapshot(placement.family(frontend, proc)[1:], proc)
    if not times:
        raise RuntimeError(f"process {frontend} has no child process: is vLLM's engine core running in it "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)?")
    return max(times, key=lambda pid: times[pid][1])


def summary(passes: List[Dict]) -> Dict[str, Dict[str, float]]:
    """Per layout: its passes, their median wall, the median of their median steps, and the `FAST_Q` quantile (the
    bench's fastest steps) and the median of all their steps (ms)."""
    out = {}
    for name in dict.fromkeys(p["layout"] for p in passes):
        mine = [p for p in passes if p["layout"] == name]
        steps = [g for p in mine for g in p["steps_ms"]]
        out[name] = {"passes": len(mine), "wall_s": statistics.median(p["wall_s"] for p in mine),
                     "pass_step_ms": statistics.median(statistics.median(p["steps_ms"]) for p in mine if p["steps_ms"]),
                     "fast_step_ms": float(np.quantile(steps, FAST_Q)), "step_ms": statistics.median(steps)}
    return out


def _engine(cfg, model: str, sync: bool):
    from steer.bench import engines, workload
    from interleaver.vllm_internals import step_stamps

    m = cfg.models[model]
    os.environ.update(m.env)  # the model's own settings, as the bench's engines get them (runs.run_group)
    where = workload.model_dir(m, cfg.cache_dir)
    engines.plain_env(breakable=True)  # b's pipeline
    from vllm import LLM

    llm = LLM(model=str(where), **engines.llm_kwargs(cfg, m, where), **({"async_scheduling": False} if sync else {}))
    return llm, step_stamps(llm)


def run(cfg, model: str, requests: int, tokens: int, rounds: int, cpus: List[int], sync: bool, out: Path,
        pause_s: float = 0.05) -> Dict:
    """Time `rounds` rounds of one pass in each layout, each after `pause_s` idle; write the passes and their
    summary to `out` after each."""
    from vllm import SamplingParams

    from steer.bench import workload
    from steer.bench.runs import step_reading
    from steer.results import write_json

    placement.pin(cpus)
    llm, steps = _engine(cfg, model, sync)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts(requests, cfg.prompt_len, cfg.seed)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    frontend, core = os.getpid(), engine_core(os.getpid())
    passes = []
    for r in range(rounds):
        for name in LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]:
            placement.place(layout(name, frontend, core, {pid: placement.threads(pid) for pid in (frontend, core)},
                                   cpus))
            time.sleep(pause_s)  # the scheduler moves the threads at their next wake-up
            steps()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            passes.append({"round": r, "layout": name, "wall_s": wall,
                           "steps_ms": step_reading(steps()).get(STEP_GAPS, [])})
            report = {"model": model, "batch": [requests, tokens], "sync": sync, "cpus": cpus, "pause_s": pause_s,
                      "summary": summary(passes), "passes": passes}
            write_json(out, report)
    return report


def _checked(a: argparse.Namespace) -> List[int]:
    """The CPUs of `--cpus`; SystemExit naming the flag at fault for bad input, before any engine starts."""
    try:
        from steer.bench import workload

        workload.check_cpus("--cpus", a.cpus)
        cpus = placement.cpu_list(a.cpus)
        layout("apart", 0, 1, {}, cpus)
    except (ConfigError, ValueError) as e:
        raise SystemExit(str(e)) from None
    for flag, value, least in (("--rounds", a.rounds, 1), ("--requests", a.requests, 1), ("--tokens", a.tokens, 2)):
        if value < least:  # a pass of one token has no decode step
            raise SystemExit(f"{flag}: expected at least {least}, got {value}")
    if not a.pause >= 0.0:
        raise SystemExit(f"--pause: expected seconds >= 0, got {a.pause}")
    if not a.out.parent.is_dir():
        raise SystemExit(f"--out: {a.out.parent} is not a directory")
    return cpus


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a model of conf/bench.yaml (default smollm2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8, help="rounds of one pass in each layout (default 8)")
    p.add_argument("--cpus", default="2-9", help="a Linux CPU list, at least 4 CPUs (default 2-9)")
    p.add_argument("--sync", action="store_true", help="vLLM's async scheduling off")
    p.add_argument("--pause", type=float, default=0.05, help="seconds idle before each pass (default 0.05)")
    p.add_argument("--out", type=Path, default=Path("modes.json"))
    p.add_argument("overrides", nargs="*", help="conf/bench.yaml overrides, e.g. cache_dir=/tmp/c")
    a = p.parse_args(argv)
    cpus = _checked(a)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from steer.bench import schema

    schema.register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="bench", overrides=a.overrides))
    if a.model not in cfg.models:
        raise SystemExit(f"--model: expected one of {', '.join(cfg.models)}, got {a.model!r}")
    got = run(cfg, a.model, a.requests, a.tokens, a.rounds, cpus, a.sync, a.out, a.pause)
    for name, s in got["summary"].items():
        print(f"{name:9s} {s['passes']:3d} passes  wall {s['wall_s']:.3f} s  pass step {s['pass_step_ms']:.2f} ms  "
              f"fast step {s['fast_step_ms']:.2f} ms  step {s['step_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
