"""The host micro-benchmark runs the tap worker's own code (interleaver's HostWorker) on a stand-in runner."""

import pytest

from steer.bench import host


@pytest.mark.parametrize("scen", ["add", "k8"])
def test_the_host_bench_times_the_join_step_the_workers_row_mapping_and_a_taps_program(scen):
    r = host.measure(8, scen, hidden=16, steps=3)
    assert (r["requests"], r["scenario"]) == (8, scen)
    assert r["join_us"] > 0 and r["fill_step_us"] > 0 and r["replay_us"] > 0
