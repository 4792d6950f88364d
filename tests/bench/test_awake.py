"""Spinners that keep the lanes' CPUs from halting (steer/bench/awake.py): real processes, their CPU and policy, and
the bench's check of `awake` before any engine starts."""

import os
import time

import pytest

from bench_common import bench_conf
from steer.bench import awake, placement, report, workload
from steer.errors import ConfigError

MINE = (placement.available() or [0])[0]  # a CPU this process may run on


def test_a_spinner_runs_at_idle_priority_on_its_cpu_and_stops_with_the_block():
    with awake.Spinners([MINE]) as s:
        [p] = s.procs
        deadline = time.time() + 20  # the child sets its CPU and policy once its interpreter is up
        while time.time() < deadline and os.sched_getscheduler(p.pid) != os.SCHED_IDLE:
            time.sleep(0.05)
        assert os.sched_getscheduler(p.pid) == os.SCHED_IDLE and os.sched_getaffinity(p.pid) == {MINE}
        assert p.poll() is None
    assert p.poll() is not None


def test_awake_needs_every_lane_to_name_its_cpus():
    with pytest.raises(ConfigError, match=r"awake.*every lane names its cpus"):
        workload.check(bench_conf("awake=true"))
    workload.check(bench_conf("awake=true", f"lanes=[{{runs:['*'],cpus:'{MINE}'}}]"))


def test_the_report_says_the_cpus_were_kept_awake():
    cfg = bench_conf("awake=true", f"lanes=[{{runs:['*'],cpus:'{MINE}'}}]")
    md = report.markdown(report.cells([], cfg), [], cfg, {}, "now", "python -m steer.bench awake=true")
    assert f"on CPUs {MINE}. Those CPUs kept awake (`awake`: a SCHED_IDLE spinner on each, so none halts)." in md
