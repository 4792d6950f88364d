"""One engine's passes in conditions taken in turn (steer/bench/modes.py): the layouts, the conditions, the engine
core's process and threads, the summary, and bad input said before an engine starts."""

import pytest

from bench_common import fake_proc
from steer.bench import modes, nvml, placement

CPUS = [2, 3, 4, 5, 6]
THREADS = {100: [100, 101, 102], 200: [200, 201, 202]}  # the frontend 100, its engine core 200


def test_shared_lets_every_thread_run_on_every_cpu():
    got = modes.layout("shared", 100, 200, THREADS, CPUS)
    assert set(got) == {100, 101, 102, 200, 201, 202} and all(c == CPUS for c in got.values())


def test_apart_gives_the_busy_loop_a_cpu_of_its_own():
    got = modes.layout("apart", 100, 200, THREADS, CPUS)
    assert got[200] == [2] and got[201] == got[202] == [3]  # the engine core's busy loop, then its I/O threads
    assert got[100] == [4] and got[101] == got[102] == [5, 6]  # the frontend's main thread, then the rest
    assert all(got[t] != [2] for t in got if t != 200)


def test_together_puts_the_engine_core_on_one_cpu():
    got = modes.layout("together", 100, 200, THREADS, CPUS)
    assert {got[t][0] for t in THREADS[200]} == {2} and {got[t][0] for t in THREADS[100]} == {3}


@pytest.mark.parametrize("name,cpus,match", [("apart", [2, 3, 4], "at least 4 CPUs"),
                                             ("together", [2], "at least 2 CPUs"), ("spread", CPUS, "one of")])
def test_a_layout_says_what_it_needs(name, cpus, match):
    with pytest.raises(ValueError, match=match):
        modes.layout(name, 100, 200, THREADS, cpus)


def test_the_engine_core_is_the_busiest_child(tmp_path):
    fake_proc(tmp_path, {100: ("python", 1, 2, 500), 150: ("resource_tracker", 100, 3, 2),
                         200: ("VLLM::EngineCore", 100, 4, 900), 300: ("other", 1, 5, 5000)})
    assert modes.engine_core(100, tmp_path) == 200


def test_no_child_means_no_engine_core_process(tmp_path):
    fake_proc(tmp_path, {100: ("python", 1, 2, 500)})
    with pytest.raises(RuntimeError, match="no child process"):
        modes.engine_core(100, tmp_path)


def test_the_summary_is_per_condition_in_order_of_first_pass():
    passes = [{"condition": "shared 0.05s", "wall_s": 0.5, "steps_ms": [2.0] * 10 + [4.0] * 10},
              {"condition": "apart 0.05s", "wall_s": 0.3, "steps_ms": [2.0] * 20},
              {"condition": "shared 0.05s", "wall_s": 0.7, "steps_ms": [4.0] * 20}]
    got = modes.summary(passes)
    assert list(got) == ["shared 0.05s", "apart 0.05s"]
    assert got["shared 0.05s"] == {"passes": 2, "wall_s": pytest.approx(0.6), "pass_step_ms": pytest.approx(3.5),
                                   "pass_steps_ms": [3.0, 4.0], "fast_step_ms": 2.0,
                                   "step_ms": 4.0}  # 10% quantile of 10 + 30 steps
    assert got["apart 0.05s"]["step_ms"] == 2.0 and got["apart 0.05s"]["passes"] == 1


def test_conditions_are_every_layout_pause_and_reading():
    got = modes.conditions(["shared", "apart"], [0.05, 3.0], nvml_too=True)
    assert [c["name"] for c in got] == ["shared 0.05s", "shared 0.05s nvml", "shared 3s", "shared 3s nvml",
                                        "apart 0.05s", "apart 0.05s nvml", "apart 3s", "apart 3s nvml"]
    assert got[3] == {"name": "shared 3s nvml", "layout": "shared", "pause_s": 3.0, "nvml": True}
    assert [c["nvml"] for c in modes.conditions(["shared"], [0.05], nvml_too=False)] == [False]


MINE = str((placement.available() or [0])[0])  # a CPU this process may run on


@pytest.mark.parametrize("args,match", [
    (["--cpus", MINE], "--cpus: layout 'apart' needs at least 4 CPUs"), (["--cpus", "2-"], "--cpus: .*CPU list"),
    (["--cpus", "4000"], "--cpus: names CPU.* that this process may not run on"),
    (["--cpus", "100000"], "--cpus: names CPU 100000 .*; Linux numbers CPUs below 8192"),
    (["--rounds", "0"], "--rounds: expected at least 1"), (["--tokens", "1"], "--tokens: expected at least 2"),
    (["--requests", "0"], "--requests: expected at least 1"), (["--out", "/nonexistent/dir/m.json"], "--out: ")])
def test_bad_input_is_refused_naming_the_flag_before_an_engine_starts(args, match, monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [int(MINE)] + list(range(200, 208)))
    with pytest.raises(SystemExit, match=match):
        modes.main(args + ([] if "--cpus" in args else ["--cpus", "200-207"]))


def test_an_unknown_model_is_refused_before_an_engine_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: list(range(200, 208)))
    with pytest.raises(SystemExit, match="--model: expected one of"):
        modes.main(["--model", "nope", "--cpus", "200-207", f"cache_dir={tmp_path}"])


@pytest.mark.parametrize("args,match", [(["--pauses", "0.05,-1"], "--pauses: expected seconds >= 0"),
                                        (["--pauses", "nan"], "--pauses: expected seconds >= 0"),
                                        (["--pauses", "inf"], "--pauses: expected seconds >= 0"),
                                        (["--pauses", "3s"], "--pauses: expected comma-separated numbers"),
                                        (["--pauses", "3,3.0"], "--pauses: expected each value once"),
                                        (["--layouts", "shared,shared"], "--layouts: expected each value once"),
                                        (["--layouts", "shared,spread"], "--layouts: layout: expected one of")])
def test_bad_conditions_are_refused_before_an_engine_starts(args, match, monkeypatch):
    # conditions that could not run, or two of one name that the summary would merge
    monkeypatch.setattr(placement, "available", lambda: list(range(200, 208)))
    with pytest.raises(SystemExit, match=match):
        modes.main(args + ["--cpus", "200-207"])


def test_nvml_asked_for_but_not_readable_is_refused_before_an_engine_starts(monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: list(range(200, 208)))
    monkeypatch.setattr(nvml, "reader", lambda: (None, "no driver here"))
    with pytest.raises(SystemExit, match=r"--nvml: the GPU's clock and power cannot be read \(no driver here\)"):
        modes.main(["--nvml", "--cpus", "200-207"])


@pytest.mark.parametrize("period", ["0", "-1"])
def test_nvml_needs_a_sampling_period_before_an_engine_starts(period, monkeypatch, tmp_path):
    monkeypatch.setattr(placement, "available", lambda: list(range(200, 208)))
    monkeypatch.setattr(nvml, "reader", lambda: (lambda: (1980.0, 160.0), ""))
    with pytest.raises(SystemExit, match=f"--nvml: reads the GPU every gpu_sample_s seconds, which must be > 0, "
                                         f"got {float(period)}"):
        modes.main(["--nvml", "--cpus", "200-207", f"gpu_sample_s={period}", f"cache_dir={tmp_path}"])
