"""Where an engine's processes ran through a pass, and pinning a lane's engines (steer/bench/placement.py)."""

import os
import subprocess
import sys
import time

import pytest

from bench_common import bench_conf, fake_proc, first_cell, stand_in_runner
from steer.bench import placement, report

LINUX = sys.platform.startswith("linux")


def test_a_cpu_list_is_read_as_linux_writes_it():
    assert placement.cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert placement.cpu_list("5") == [5] and placement.cpu_list("2-3, 1") == [1, 2, 3]
    for bad in ("", "a", "0-", "3-1", "0;1", "-1"):
        with pytest.raises(ValueError, match="CPU list"):
            placement.cpu_list(bad)


def _cache(root, cpu, index, level, shared):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_each_cpu_is_named_by_its_l3_cache(tmp_path):
    for cpu in range(4):
        _cache(tmp_path, cpu, 0, 1, str(cpu))  # an L1 of its own
        _cache(tmp_path, cpu, 3, 3, "0-1" if cpu < 2 else "2-3")
    assert placement.llc_domains(tmp_path) == {0: 0, 1: 0, 2: 2, 3: 2}
    assert placement.llc_domains(tmp_path / "absent") == {}


def test_each_cpu_is_named_by_its_core_and_one_thread_of_each_core_is_chosen(tmp_path):
    for cpu in range(8):  # four cores of two threads: 0 and 4, 1 and 5, ...
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    assert placement.cores(tmp_path) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}
    assert placement.one_per_core([2, 3, 4, 5, 6, 7], tmp_path) == [2, 3, 4, 5]  # 6 and 7 share 2's and 3's
    assert placement.one_per_core([5, 1], tmp_path) == [1]
    assert placement.one_per_core([3, 2], tmp_path / "absent") == [2, 3]  # no topology: every CPU its own core


def test_a_process_threads_are_read_from_proc(tmp_path):
    fake_proc(tmp_path, {200: ("VLLM::EngineCore", 100, 4, 900)}, threads={200: [202, 200, 201]})
    assert placement.threads(200, tmp_path) == [200, 201, 202] and placement.threads(999, tmp_path) == []


def test_a_snapshot_holds_the_process_and_its_children(tmp_path):
    fake_proc(tmp_path, {10: ("python (engine) x", 1, 3, 50), 11: ("VLLM::EngineCore", 10, 7, 80),
                     12: ("other", 1, 0, 5), 13: ("grandchild", 11, 2, 1)})
    assert placement.family(10, tmp_path) == [10, 11]
    assert placement.snapshot([10, 11, 99], tmp_path) == {10: (3, 50), 11: (7, 80)}  # 99 has ended


def test_processes_that_worked_through_a_pass_say_whether_they_were_apart_and_moved():
    domains = {0: 0, 1: 0, 2: 2, 3: 2}
    start = {10: (0, 100), 11: (1, 100), 12: (3, 100)}
    # 100 ticks: 10 and 11 worked (50 and 90 ticks), 12 barely (5); 11 ended on the other cache
    end = {10: (0, 150), 11: (2, 190), 12: (3, 105)}
    # the busiest of them, 11 (90 ticks), ended the pass on CPU 2
    assert placement.between(start, end, 100.0, domains) == {"cpu_moved": 0.5, "cpu_apart": 1.0, "cpu_busiest": 2.0}
    together = {10: (1, 150), 11: (0, 190), 12: (3, 105)}
    assert placement.between(start, together, 100.0, domains) == {"cpu_moved": 1.0, "cpu_apart": 0.0,
                                                                  "cpu_busiest": 0.0}
    assert placement.between(start, end, 100.0, {}) == {"cpu_moved": 0.5, "cpu_busiest": 2.0}  # no caches named
    alone = {10: (0, 150), 11: (1, 101)}
    # one worked: apart from whom?
    assert placement.between(start, alone, 100.0, domains) == {"cpu_moved": 0.0, "cpu_busiest": 0.0}
    assert placement.between(start, {}, 100.0, domains) == {} and placement.between({}, end, 100.0, domains) == {}


def test_two_processes_ending_a_pass_on_one_physical_core_are_said_so():
    core = {0: 0, 1: 1, 2: 0, 3: 1}  # 0 and 2 are one core's two threads
    start = {10: (0, 0), 11: (1, 0)}
    on_siblings = placement.between(start, {10: (0, 50), 11: (2, 50)}, 100.0, {}, core)
    assert on_siblings == {"cpu_moved": 0.5, "cpu_shared_core": 1.0, "cpu_busiest": 0.0}
    assert placement.between(start, {10: (1, 50), 11: (1, 50)}, 100.0, {}, core)["cpu_shared_core"] == 1.0  # one CPU
    assert placement.between(start, {10: (0, 50), 11: (3, 50)}, 100.0, {}, core)["cpu_shared_core"] == 0.0
    assert "cpu_shared_core" not in placement.between(start, {10: (0, 50), 11: (3, 50)}, 100.0, {}, {})


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_window_reads_this_process_and_its_busy_child_as_ps_sees_them(tmp_path):
    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])  # started before the pass, as an engine core is
    time.sleep(0.3)
    with placement.Window() as w:
        t0 = os.times()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            pass
        t1 = os.times()
        seen = subprocess.run(["ps", "-o", "pid=,ppid=,time=", "-p", f"{os.getpid()},{child.pid}"],
                              capture_output=True, text=True).stdout.split()
    child.wait()
    assert w._pids[0] == os.getpid() and child.pid in w._pids  # the family, by its parent pid
    assert seen[:2] == [str(os.getpid()), str(os.getppid())] and seen[3:5] == [str(child.pid), str(os.getpid())]
    # this process's CPU time, in clock ticks, grew as the kernel's own count says it did (fields 14 and 15)
    ticks = (t1.user + t1.system - t0.user - t0.system) * placement._hz()
    assert abs(w._end[os.getpid()][1] - w._start[os.getpid()][1] - ticks) <= 3
    got = w.summary()
    assert 0.0 <= got["cpu_moved"] <= 1.0 and got.get("cpu_apart", 0.0) in (0.0, 1.0)
    assert got.get("cpu_shared_core", 0.0) in (0.0, 1.0)
    with placement.Window(proc=tmp_path / "absent") as w:  # no /proc
        pass
    assert w.summary() == {}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_pinned_process_its_threads_and_what_it_starts_run_on_the_cpus_given():
    cpu = placement.available()[-1]
    code = f"""import os, subprocess, sys, threading
from steer.bench import placement
started = threading.Event()
before = threading.Thread(target=lambda: (started.set(), threading.Event().wait(2)), daemon=True)
before.start(); started.wait()  # a thread that was running before the pin, as an engine's are
placement.pin([{cpu}])
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(before.native_id)))
subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == [f"[{cpu}] [{cpu}]", f"[{cpu}]"]


def test_an_engine_process_pins_itself_to_its_lane_s_cpus_before_its_engine_starts(engine_c, monkeypatch, tmp_path,
                                                                                  bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "lanes=[{runs:['*'],cpus:'0'}]")
    seen = []
    monkeypatch.setattr(placement, "pin", lambda cpus: seen.append(("pin", cpus)))
    engine_c(lambda cfg, m, where, group: seen.append("start") or stand_in_runner())
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert seen == [("pin", [0]), "start"] and rec["status"] == "ok"


def test_a_cell_keeps_where_its_passes_ran_and_the_report_follows_it(engine_c, monkeypatch, tmp_path, bench_model):
    cfg = bench_conf("run=[tiny]", "batches=[[4,6]]", "repeats=3", "min_timed_s=0", "configs=[c]",
                     "scenarios=[add]", "lanes=[{runs:['*'],cpus:'0-1'}]")
    monkeypatch.setattr(placement, "pin", lambda cpus: None)
    engine_c(lambda cfg, m, where, group: stand_in_runner())
    readings = iter([{"cpu_apart": 1.0, "cpu_moved": 0.5}, {"cpu_apart": 0.0, "cpu_moved": 0.0},
                     {"cpu_apart": 1.0, "cpu_moved": 1.0}])
    monkeypatch.setattr(placement.Window, "summary", lambda self: next(readings))
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert rec["cpu_apart_passes"] == [1.0, 0.0, 1.0] and rec["cpu_moved_passes"] == [0.5, 0.0, 1.0]
    rec.update(model="tiny", config="c", walls_s=[2.0, 1.0, 2.0])  # the passes apart were the slow ones
    md = report.markdown(report.cells([rec], cfg), [], cfg, {}, "now", "cmd", [rec])
    assert "the engine's processes on more than one L3 cache r = +1.00 (3 passes of 1 cells)" in md
    assert "its processes moved r = +0.87" in md and "physical core" not in md  # never read: not said
    assert "Engines pinned (their processes and threads, `lanes[].cpus`): on CPUs 0-1." in md
