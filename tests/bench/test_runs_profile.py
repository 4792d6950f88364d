"""A profiled engine's host time in a cell's record (steer/bench/runs.py): each pass's sections summed, their
calls' histograms merged, and the figures a reader compares (mean, median, 90th and 99th percentiles)."""

import json

import pytest

from bench_common import bench_conf, one_tap
from interleaver import clock
from steer.bench import runs


def test_a_cells_host_profile_adds_its_passes_and_reads_their_calls_quantiles(engine_c, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=0", "scenarios=[add]")
    taken = []

    def start(cfg, m, where, group):
        def run(prompts, scen, tokens):
            return len(prompts) * tokens

        def profile():  # after each of the two timed passes, its own calls; before each, what must not count
            calls = {1: [4e-6] * 6 + [50e-6] * 3 + [900e-6], 3: [4e-6] * 10}.get(len(taken), [1.0])
            taken.append(calls)
            return {"fill_step": {"seconds": sum(calls), "calls": len(calls), "hist": clock.bins(calls)},
                    "edits_fused": {"seconds": 0.0, "calls": 3}}

        run.profile = profile
        return run

    engine_c(start)
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    runs.run_group(cfg, cfg.models["tiny"], bench_model, group, str(tmp_path / "out.json"))
    [rec] = json.loads((tmp_path / "out.json").read_text())["records"]
    prof = rec["host_profile"]
    assert prof["edits_fused"] == {"calls": 6}  # a count, not a clock: the two timed passes'
    f = prof["fill_step"]
    assert f["calls"] == 20 and f["us_per_call"] == pytest.approx((16 * 4 + 3 * 50 + 900) / 20)
    # the two passes' calls merged: 16 quick, three at 50 us, one at 900 (each read as its bin's middle)
    middle = {us: round(clock.quantile(clock.bins([us * 1e-6]), 0.5), 1) for us in (4, 50, 900)}
    assert (f["p50_us"], f["p90_us"], f["p99_us"]) == (middle[4], middle[50], middle[900])
