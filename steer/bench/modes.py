"""Where a host-bound engine's decode steps run fast or slow: one engine's passes, its threads laid out in turn.

A SmolLM2 decode step at 64 x 128 on the H200 runs in a fast mode (2.0-2.75 ms) or a slow one (3.25-4.25 ms), a
pass mostly in one, the mode seemingly set when an engine wakes for its turn (docs/perf-log.md, 2026-12-04 04:00).
The slow mode is about the fast one plus the GPU's kernels of a step, as if the engine core's host work stopped
overlapping the GPU's. This starts one engine b (breakable graphs, unsteered; async scheduling as vLLM chooses, or
off with `--sync`) and times its passes in rounds, each round one pass in each condition: a layout of its threads
(`LAYOUTS`, those of `--layouts`), an idle time before the pass (those of `--pauses`; the bench's turns leave an
engine idle 0.4-4 s while the others of its wave time theirs) and, with `--nvml`, the GPU's clock and power read
through the pass or not (the bench reads them, every `gpu_sample_s`, from the timed process: steer/bench/nvml.py).
The layouts:

- shared: every thread of the frontend (this process) and of its engine core on any of `--cpus` (the bench's lanes)
- apart: the engine core's main thread (its busy loop) alone on the first CPU, its other threads (output and input
  I/O) on the second, the frontend's main thread on the third, the frontend's other threads on the rest
- together: every thread of the engine core on the first CPU, the frontend's on the second

A round takes the conditions in turn from a different one each time, so that none always follows the same one.
Each pass's wall time and decode steps (the engine core's stamps) are written to `--out` as they come.

    python -m steer.bench.modes --cpus 2-9 --out modes.json
    python -m steer.bench.modes --cpus 2-9 --sync --out modes-sync.json
    python -m steer.bench.modes --cpus 2-9 --layouts shared --pauses 0.05,3 --nvml --out modes-idle.json
"""

import argparse
import itertools
import math
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from steer.bench import nvml, placement
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


def conditions(layouts: List[str], pauses: List[float], nvml_too: bool) -> List[Dict]:
    """Every condition a round times a pass in: each layout, after each pause, without and (`nvml_too`) with the
    GPU read through the pass; each named, e.g. "shared 3s nvml"."""
    out = []
    for name, pause, read in itertools.product(layouts, pauses, (False, True) if nvml_too else (False,)):
        out.append({"name": f"{name} {pause:g}s" + (" nvml" if read else ""), "layout": name, "pause_s": pause,
                    "nvml": read})
    return out


def summary(passes: List[Dict]) -> Dict[str, Dict]:
    """Per condition: its passes, their median wall, the median of their median steps and each of those (ascending),
    and the `FAST_Q` quantile (the bench's fastest steps) and the median of all their steps (ms)."""
    out = {}
    for name in dict.fromkeys(p["condition"] for p in passes):
        mine = [p for p in passes if p["condition"] == name]
        steps = [g for p in mine for g in p["steps_ms"]]
        each = sorted(statistics.median(p["steps_ms"]) for p in mine if p["steps_ms"])
        out[name] = {"passes": len(mine), "wall_s": statistics.median(p["wall_s"] for p in mine),
                     "pass_step_ms": statistics.median(each), "pass_steps_ms": [round(x, 3) for x in each],
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
        conds: List[Dict], read=None) -> Dict:
    """Time `rounds` rounds of one pass in each of `conds` (`conditions`), `read` (nvml.reader) sampling the GPU
    through those that ask for it; write the passes and their summary to `out` after each."""
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
        for c in conds[r % len(conds):] + conds[:r % len(conds)]:
            placement.place(layout(c["layout"], frontend, core,
                                   {pid: placement.threads(pid) for pid in (frontend, core)}, cpus))
            time.sleep(c["pause_s"])  # the scheduler moves the threads at their next wake-up
            steps()
            with nvml.Sampler(read, cfg.gpu_sample_s) if c["nvml"] and read else nullcontext() as gpu:
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
            passes.append({"round": r, "condition": c["name"], "wall_s": wall,
                           "steps_ms": step_reading(steps()).get(STEP_GAPS, []), **(gpu.summary() if gpu else {})})
            report = {"model": model, "batch": [requests, tokens], "sync": sync, "cpus": cpus, "conditions": conds,
                      "summary": summary(passes), "passes": passes}
            write_json(out, report)
    return report


def _numbers(flag: str, text: str) -> List[float]:
    """A comma-separated list of numbers; SystemExit naming `flag` otherwise."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def _checked(a: argparse.Namespace) -> Tuple[List[int], List[Dict]]:
    """The CPUs of `--cpus` and the conditions; SystemExit naming the flag at fault for bad input, before any engine
    starts."""
    layouts = a.layouts.split(",")
    try:
        from steer.bench import workload

        workload.check_cpus("--cpus", a.cpus)
        cpus = placement.cpu_list(a.cpus)
    except (ConfigError, ValueError) as e:
        raise SystemExit(str(e)) from None
    for name in sorted(layouts, key=lambda n: n != "apart"):  # the one needing the most CPUs says so
        try:
            layout(name, 0, 1, {}, cpus)
        except ValueError as e:
            raise SystemExit(f"--layouts: {e}" if name not in LAYOUTS else str(e)) from None
    for flag, value, least in (("--rounds", a.rounds, 1), ("--requests", a.requests, 1), ("--tokens", a.tokens, 2)):
        if value < least:  # a pass of one token has no decode step
            raise SystemExit(f"{flag}: expected at least {least}, got {value}")
    pauses = _numbers("--pauses", a.pauses)
    if not all(math.isfinite(x) and x >= 0.0 for x in pauses):
        raise SystemExit(f"--pauses: expected seconds >= 0, got {a.pauses}")
    for flag, values in (("--layouts", layouts), ("--pauses", pauses)):
        if len(set(values)) < len(values):  # two conditions of one name would be summed as one
            raise SystemExit(f"{flag}: expected each value once, got {getattr(a, flag[2:])}")
    if not a.out.parent.is_dir():
        raise SystemExit(f"--out: {a.out.parent} is not a directory")
    return cpus, conditions(layouts, pauses, a.nvml)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a model of conf/bench.yaml (default smollm2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8, help="rounds of one pass in each condition (default 8)")
    p.add_argument("--cpus", default="2-9", help="a Linux CPU list, at least 4 CPUs for `apart` (default 2-9)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)} (default all)")
    p.add_argument("--pauses", default="0.05", help="seconds idle before a pass, each a condition (default 0.05)")
    p.add_argument("--nvml", action="store_true", help="each condition also with the GPU read through the pass")
    p.add_argument("--sync", action="store_true", help="vLLM's async scheduling off")
    p.add_argument("--out", type=Path, default=Path("modes.json"))
    p.add_argument("overrides", nargs="*", help="conf/bench.yaml overrides, e.g. cache_dir=/tmp/c")
    a = p.parse_args(argv)
    cpus, conds = _checked(a)
    read, why = nvml.reader() if a.nvml else (None, "")
    if a.nvml and read is None:
        raise SystemExit(f"--nvml: the GPU's clock and power cannot be read ({why})")
    from hydra import compose, initialize_config_dir

    from steer.bench import schema
    from steer.config.schema import to_object

    schema.register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        try:
            cfg = to_object(compose(config_name="bench", overrides=a.overrides))
        except ConfigError as e:
            raise SystemExit(f"error {e}") from None
    if a.model not in cfg.models:
        raise SystemExit(f"--model: expected one of {', '.join(cfg.models)}, got {a.model!r}")
    if a.nvml and not (math.isfinite(cfg.gpu_sample_s) and cfg.gpu_sample_s > 0):
        raise SystemExit(f"--nvml: reads the GPU every gpu_sample_s seconds, which must be > 0, got {cfg.gpu_sample_s}")
    got = run(cfg, a.model, a.requests, a.tokens, a.rounds, cpus, a.sync, a.out, conds, read)
    for name, s in got["summary"].items():
        print(f"{name:18s} {s['passes']:3d} passes  wall {s['wall_s']:.3f} s  pass step {s['pass_step_ms']:.2f} ms  "
              f"fast step {s['fast_step_ms']:.2f} ms  step {s['step_ms']:.2f} ms  passes' steps "
              f"{' '.join(f'{x:.2f}' for x in s['pass_steps_ms'])}", flush=True)


if __name__ == "__main__":
    main()
