"""The host-speed probe (steer/bench/hostspeed.py): a real probe process, its readings set beside each pass, and
the bench's checks of `probe_cpu` before any engine starts."""

import time
from types import SimpleNamespace

import pytest

from bench_common import bench_conf
from steer.bench import hostspeed, placement, workload
from steer.errors import ConfigError

MINE = (placement.available() or [0])[0]  # a CPU this process may run on


def test_a_probe_process_times_the_work_on_its_cpu_until_stopped(tmp_path):
    out = tmp_path / "hostspeed.txt"
    t0 = time.time()
    with hostspeed.Probe(MINE, out, period_s=0.01) as p:
        deadline = time.time() + 20
        while len(hostspeed.readings(out)) < 5 and time.time() < deadline:
            time.sleep(0.05)
    assert p.proc.poll() is not None  # stopped with the block
    got = hostspeed.readings(out)
    assert len(got) >= 5 and all(d > 0 for _, d in got)
    times = [t for t, _ in got]
    assert times == sorted(times) and t0 <= times[0] and times[-1] <= time.time()


def test_readings_leave_out_lines_a_probe_cut_short(tmp_path):
    out = tmp_path / "hostspeed.txt"
    out.write_text("100.0 950.5\n100.02 1010.0\n100.04 9")
    assert hostspeed.readings(out) == [(100.0, 950.5), (100.02, 1010.0)]
    out.write_text("100.0 950.5\nnot a reading\n")
    assert hostspeed.readings(out) == [(100.0, 950.5)]
    assert hostspeed.readings(tmp_path / "none.txt") == []


def test_each_pass_gets_the_median_probe_time_within_it():
    got = [(10.0, 1000.0), (10.1, 1100.0), (10.2, 1500.0), (11.0, 2000.0), (11.1, 2200.0), (30.0, 900.0)]
    records = [{"walls_s": [0.25, 0.2, 0.5], "started_s": [10.0, 11.0, 20.0]},  # the third pass: no reading in it
               {"status": "error"}, {"walls_s": [1.0], "started_s": [40.0]}]
    hostspeed.annotate(records, got)
    assert records[0]["host_us_passes"] == [1100.0, 2100.0, None] and records[0]["host_us"] == 1600.0
    assert "host_us" not in records[1] and "host_us" not in records[2]


def test_the_work_is_the_same_work_each_time():
    assert hostspeed.work(100) > 0
    assert hostspeed.work(20 * hostspeed.WORK) > hostspeed.work(hostspeed.WORK // 20)


def test_the_probe_needs_a_cpu_no_lane_runs_on(monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [0, 1, 2, 3])
    cfg = bench_conf("probe_cpu=3", "lanes=[{runs:['*'],cpus:'1-3'}]")
    with pytest.raises(ConfigError, match=r"probe_cpu.*CPU 3 is also lanes\[0\].cpus \(1-3\)"):
        workload.check(cfg)
    with pytest.raises(ConfigError, match=r"probe_cpu.*names CPU\(s\) \[7\] that this process may not run on"):
        workload.check(bench_conf("probe_cpu=7"))
    workload.check(bench_conf("probe_cpu=0", "lanes=[{runs:['*'],cpus:'1-3'}]"))


def test_the_bench_runs_the_probe_through_its_lanes(monkeypatch, tmp_path, console):
    import steer.engine.vllm
    from steer.bench import __main__ as bench_main

    monkeypatch.setattr(steer.engine.vllm, "available", lambda: True)
    monkeypatch.setattr(bench_main, "_lane", lambda *a: time.sleep(1.0))  # the lanes' engines, timing
    monkeypatch.setattr(bench_main._Book, "report", lambda self: "")
    monkeypatch.setattr("steer.bench.workload.model_dir", lambda m, cache: SimpleNamespace())
    monkeypatch.setattr("steer.bench.workload.spec", lambda m, name, where: SimpleNamespace(layers=4))
    cfg = bench_conf("run=[tiny]", "configs=[b]", "scenarios=[add]", "batches=[[4,6]]", f"probe_cpu={MINE}")
    bench_main.run(cfg, tmp_path, console, "python -m steer.bench")
    got = hostspeed.readings(tmp_path / "hostspeed.txt")
    assert len(got) >= 3 and all(d > 0 for _, d in got)
