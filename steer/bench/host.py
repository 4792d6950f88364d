"""`python -m steer.bench.host`: the taps' own host work per step, measured on this machine's CPU.

A replayed step runs no Python except the taps: the tap worker's row mapping (`fill_step`, once per step) and
each tap's program (`replay`, once per tap per step). On a small model these are what separates steer from
unsteered vLLM (the bench's host profile, STEER_PROFILE=1, measures them inside vLLM). This runs the same
worker code against a stand-in runner (CPU tensors, so `replay` includes the CPU doing the math; hidden is
kept small so that is dispatch, not arithmetic) and prints microseconds per call.
"""

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from interleaver.bank import EditBank, RequestEdits
from interleaver.host_worker import HostWorker
from interleaver.vllm_internals import tap_location
from steer.bench.workload import scenario
from steer.engine.vllm import stage_edit

_TAP = "layers.0"


class _Layer(torch.nn.Module):
    def forward(self, x):
        return x, x  # (hidden, residual), as vLLM's Llama layers hand them on


class _Runner:
    """Just what the tap worker reads of vLLM's GPUModelRunner, for `n` requests."""

    def __init__(self, n: int, hidden: int):
        self.device, self.requests, self.max_num_tokens = "cpu", {}, n
        self.model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Layer()])})
        self.query_start_loc = SimpleNamespace(np=np.zeros(n + 1, dtype=np.int32))
        self.input_batch = SimpleNamespace(num_reqs=n, req_ids=[f"r{i}" for i in range(n)],
                                           num_computed_tokens_cpu=np.zeros(n, dtype=np.int64))
        self.x = torch.randn(n, hidden)

    def get_model(self):
        return self.model

    def add(self, rid: str, steer: str) -> None:
        """Request `rid`, 32 prompt tokens, asking for `steer` (RequestEdits.to_args)."""
        self.requests[rid] = SimpleNamespace(num_prompt_tokens=32, sampling_params=SimpleNamespace(
            extra_args={"steer": steer}))

    def _prepare_inputs(self, scheduler_output):
        return None

    def execute_model(self, scheduler_output):
        return None


def measure(n: int, scen_name: str, hidden: int = 64, steps: int = 200, cold_mb: int = 0) -> dict:
    """Microseconds of fill_step in the step `n` requests steered by `scen_name` join (32 prompt rows each), then
    per decode step of fill_step and of one tap's replay, and per serving step (one request leaves, a new one
    takes its row: `churn_us`, and `churn_ways`, how fill_step went on those steps). `cold_mb`: read that many MB
    of other memory before each step, as an engine's step runs its taps' code once between much else (0: the
    same code back to back, hot)."""
    if cold_mb < 0:
        raise ValueError(f"cold_mb: {cold_mb} MB of other memory to read; expected 0 or more")
    other = np.ones(cold_mb << 17) if cold_mb else None  # float64: 1 MB is 2 ** 17 of them

    def chill() -> None:  # evict the caches before a timed step, where they are to be cold
        if other is not None:
            other.sum()

    runner = _Runner(n, hidden)
    worker = HostWorker(runner, [(_TAP, True)])
    bank, loc = EditBank(), tap_location(_TAP)
    edits = scenario(scen_name, hidden, 1, n, 0).edits
    per_request = [RequestEdits(bank.register(loc, [stage_edit(e)])) for e in edits]  # one stage per distinct edit
    worker.steer_set_stages([(s.id, s.location, s.index, s.edit) for s in bank.stages])
    for i, rid in enumerate(runner.input_batch.req_ids):
        runner.add(rid, per_request[i].to_args())
    # The step they join in: each request's 32 prompt rows, its edits looked up and every row's weights built
    runner.query_start_loc.np[:] = np.arange(n + 1) * 32
    chill()
    t0 = time.perf_counter()
    worker.fill_step(32 * n)
    join = time.perf_counter() - t0
    runner.query_start_loc.np[:] = np.arange(n + 1)
    il = worker.interleaver
    fill = replay = 0.0
    for step in range(steps):
        runner.input_batch.num_computed_tokens_cpu[:] = 32 + step
        chill()
        t0 = time.perf_counter()
        worker.fill_step(n)
        t1 = time.perf_counter()
        il.replay(loc, (runner.x.clone(), runner.x))
        t2 = time.perf_counter()
        fill, replay = fill + t1 - t0, replay + t2 - t1
    # Serving's steps: one request leaves and a new one takes its row, its 32 prompt rows beside the others' one
    ids, computed = runner.input_batch.req_ids, runner.input_batch.num_computed_tokens_cpu
    churn, ways, counts = 0.0, {}, np.ones(n, dtype=np.int64)
    for step in range(steps):
        k, new = step % n, f"j{step}"
        runner.add(new, per_request[k].to_args())
        gone, ids[k] = ids[k], new
        del runner.requests[gone]
        counts[:] = 1
        counts[k] = 32
        runner.query_start_loc.np[1:] = np.cumsum(counts)
        computed += 1
        computed[k] = 0
        chill()
        t0 = time.perf_counter()
        way = worker.fill_step(int(counts.sum()), finished=[gone])
        churn += time.perf_counter() - t0
        ways[way] = ways.get(way, 0) + 1
        computed[k] = 31
    return {"requests": n, "scenario": scen_name, "cold_mb": cold_mb, "join_us": 1e6 * join,
            "fill_step_us": 1e6 * fill / steps, "replay_us": 1e6 * replay / steps, "churn_us": 1e6 * churn / steps,
            "churn_ways": ways}


def _megabytes(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: expected 0 or more MB")
    return n


def _llc_mb(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int:
    """This CPU's last-level cache in MB, rounded up, from sysfs ("32768K"); 0 where it is not there."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return 0
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return -(-int(text.rstrip("KM")) * scale // (1 << 20))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    p.add_argument("--scenarios", nargs="+", default=["add", "k8", "k64"])
    p.add_argument("--cold-mb", type=_megabytes, default=None,
                   help="also time each step after reading this many MB of other memory (0: back to back only; "
                        "default: twice the last-level cache up to 128, 64 where its size is not known)")
    a = p.parse_args(argv)
    if a.cold_mb is None:
        a.cold_mb = min(2 * _llc_mb(), 128) or 64
    torch.set_num_threads(1)
    print(f"{'requests':>8} {'scenario':>8} {'caches':>6} {'join step us':>13} {'fill_step us':>13} {'replay us':>10} "
          f"{'churn step us':>14}")
    for n in a.requests:
        for s in a.scenarios:
            for cold in sorted({0, a.cold_mb}):
                r = measure(n, s, cold_mb=cold)
                print(f"{n:>8} {s:>8} {'cold' if cold else 'hot':>6} {r['join_us']:>13.1f} {r['fill_step_us']:>13.1f} "
                      f"{r['replay_us']:>10.1f} {r['churn_us']:>14.1f}")


if __name__ == "__main__":
    main()
