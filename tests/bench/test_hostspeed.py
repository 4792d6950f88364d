"""The host-speed probe (steer/bench/hostspeed.py): a real probe process, its readings set beside each pass, and
the bench's checks of `probe_cpu` before any engine starts."""

import json
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


def test_more_work_takes_longer():
    assert hostspeed.work(100) > 0
    assert hostspeed.work(20 * hostspeed.WORK) > hostspeed.work(hostspeed.WORK // 20)


def test_the_probe_needs_a_cpu_no_lane_runs_on(monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [0, 1, 2, 3])
    cfg = bench_conf("probe_cpu=3", "lanes=[{runs:['*'],cpus:'1-3'}]")
    with pytest.raises(ConfigError, match=r"probe_cpu.*CPU 3 is also lanes\[0\].cpus \(1-3\)"):
        workload.check(cfg)
    with pytest.raises(ConfigError, match=r"probe_cpu.*names CPU\(s\) 7 that this process may not run on"):
        workload.check(bench_conf("probe_cpu=7", "lanes=[{runs:['*'],cpus:'1-3'}]"))
    with pytest.raises(ConfigError, match=r"probe_cpu.*needs every lane to name its cpus"):
        workload.check(bench_conf("probe_cpu=0"))  # the default lane's engines may run anywhere
    workload.check(bench_conf("probe_cpu=0", "lanes=[{runs:['*'],cpus:'1-3'}]"))


def _bench_main(monkeypatch, lane):
    """steer.bench's run with `lane` for each lane's work and no engine, model or report."""
    import steer.engine.vllm
    from steer.bench import __main__ as bench_main

    monkeypatch.setattr(steer.engine.vllm, "available", lambda: True)
    monkeypatch.setattr(bench_main, "_lane", lane)
    monkeypatch.setattr(bench_main._Book, "report", lambda self: "")
    monkeypatch.setattr("steer.bench.workload.model_dir", lambda m, cache: SimpleNamespace())
    monkeypatch.setattr("steer.bench.workload.spec", lambda m, name, where: SimpleNamespace(layers=4))
    return bench_main


def _probe_conf():
    lane = [c for c in placement.available() if c != MINE] or [MINE]  # the probe's CPU is its own where it can be
    return bench_conf("run=[tiny]", "configs=[b]", "scenarios=[add]", "batches=[[4,6]]", f"probe_cpu={MINE}",
                      f"lanes=[{{runs:['*'],cpus:'{lane[0]}'}}]") if lane != [MINE] else None


@pytest.mark.parametrize("fails", [False, True])
def test_the_bench_runs_the_probe_through_its_lanes_and_stops_it(monkeypatch, tmp_path, console, fails):
    cfg = _probe_conf()
    if cfg is None:
        pytest.skip("one CPU: the probe needs one no lane runs on")
    seen = []

    def lane(conf, i, work, book):  # the lanes' engines, timing until the probe has read three times
        deadline = time.time() + 20
        while len(hostspeed.readings(book.probe_file)) < 3 and time.time() < deadline:
            time.sleep(0.05)
        seen.append(len(hostspeed.readings(book.probe_file)))
        if fails:
            book.failed.append(RuntimeError("an engine's lane failed"))

    monkeypatch.setattr(hostspeed.Probe, "__exit__", _remember_exit(hostspeed.Probe.__exit__, seen))
    bench_main = _bench_main(monkeypatch, lane)
    if fails:
        with pytest.raises(RuntimeError, match="lane failed"):
            bench_main.run(cfg, tmp_path, console, "python -m steer.bench")
    else:
        bench_main.run(cfg, tmp_path, console, "python -m steer.bench")
    assert seen[0] >= 3 and seen[1].poll() is not None  # it read through the lane, and was stopped after it


def _remember_exit(exit_, seen):
    def wrapped(self, *exc):
        exit_(self, *exc)
        seen.append(self.proc)
    return wrapped


def test_a_finished_engine_s_records_get_the_probe_s_time_through_each_pass(tmp_path, console):
    from steer.bench import __main__ as bench_main

    cfg = bench_conf("run=[tiny]", "configs=[b]", "scenarios=[add]", "batches=[[4,6]]")
    book = bench_main._Book(cfg, tmp_path, console, "python -m steer.bench")
    book.report = lambda: ""
    group = SimpleNamespace(model="tiny", config="b", layers=[], cells=[])
    book._out(group).write_text(json.dumps({"machine": {}, "records": [
        {"scenario": "unsteered", "requests": 4, "tokens": 6, "status": "ok", "walls_s": [0.1, 0.1],
         "started_s": [100.0, 200.0]}]}))
    book.probe_file.write_text("100.05 1200.0\n200.02 2000.0\n200.08 2200.0\n")
    book.finish(group, SimpleNamespace(exitcode=0, killed=False, ready=lambda: True))
    [rec] = book.records
    assert rec["host_us_passes"] == [1200.0, 2100.0] and rec["host_us"] == 1650.0
    from steer.bench import report
    [row] = [r for r in report.cells(book.records, cfg) if r["config"] == "b"]
    assert row["host_us"] == 1650.0


def test_a_probe_that_wrote_nothing_is_said_so(monkeypatch, tmp_path, console):
    cfg = _probe_conf()
    if cfg is None:
        pytest.skip("one CPU: the probe needs one no lane runs on")
    monkeypatch.setattr(hostspeed.Probe, "__enter__", lambda self: self)  # a probe that never started
    monkeypatch.setattr(hostspeed.Probe, "__exit__", lambda self, *exc: None)
    _bench_main(monkeypatch, lambda *a: None).run(cfg, tmp_path, console, "python -m steer.bench")
    assert (f"[bench] warning: the host-speed probe on CPU {MINE} wrote nothing to {tmp_path / 'hostspeed.txt'}; "
            "the cells' host_us stay empty") in console.file.getvalue()
