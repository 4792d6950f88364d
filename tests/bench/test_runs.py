"""Which engines a bench starts, and how one engine process times its cells (a stand-in engine, on CPU)."""

import faulthandler
import json
import os
import threading
from contextlib import contextmanager
from multiprocessing import Pipe

import pytest

from bench_common import COMMAND, bench_conf, ended, first_cell, one_tap, records, stand_in_runner
from steer.bench import engines, report, runs, schema, waves
from test_timeline import synthetic_trace


def test_groups_start_each_engine_once():
    cfg = bench_conf("configs=[a,b,b2,c,d,e]")
    groups = {(g.config, tuple(g.layers)): g for g in runs.plan_groups(cfg, "tiny", 4)}
    assert set(groups) == {("a", ()), ("b", ()), ("b2", ()), ("c", (2,)), ("c", (0, 1, 2, 3)), ("d", (2,)),
                           ("d", (0, 1, 2, 3)), ("e", ())}
    assert [c["scenario"] for c in groups[("a", ())].cells] == ["unsteered", "unsteered"]
    assert groups[("b2", ())].cells == groups[("b", ())].cells  # the control: b's work, an engine of its own
    # a faint twin runs on its scenario's engine: the same taps, the same stages
    assert {c["scenario"] for c in groups[("c", (2,))].cells} == {"add", "k1", "k8", "k64", "add@eps"}
    assert {c["scenario"] for c in groups[("c", (0, 1, 2, 3))].cells} == {"ablate_all", "ablate_all@eps"}
    assert len(groups[("e", ())].cells) == 7 * 2
    graphed = {(g.config, tuple(g.layers)) for g in runs.plan_groups(bench_conf("configs=[g]"), "tiny", 4)}
    assert graphed == {("g", (2,)), ("g", (0, 1, 2, 3))}  # tap graphs: engines as c's


def test_the_control_starts_b_s_pipeline(monkeypatch):
    seen = {}
    monkeypatch.setattr(engines, "_plain", lambda cfg, m, w, group, **how: seen.setdefault(group, how))
    for config in ("b", "b2", "a"):
        engines.RUNNERS[config](None, None, None, config)
    assert seen["b2"] == seen["b"] == {"breakable": True} != seen["a"]
    assert set(engines.RUNNERS) == set(schema.CONFIGS)  # every configuration the bench accepts can start


@pytest.fixture
def stand_in(engine_c):
    """c's engines record every pass (requests, scenario, tokens); k8's passes fail."""
    calls = []

    def run(prompts, scen, tokens):
        calls.append((len(prompts), scen.name if scen else None, tokens))
        if scen and scen.name == "k8":
            raise RuntimeError("boom")
        return len(prompts) * tokens

    engine_c(lambda cfg, m, where, group: run, {"gpu": "stand-in"})
    return calls


def run_group(cfg, where, group, out):
    """One engine process's work, in this process: `group`'s cells on the tiny model at `where`, into `out`."""
    runs.run_group(cfg, cfg.models["tiny"], where, group, str(out))
    return records(out)


def test_a_group_warms_up_times_and_records_each_cell(stand_in, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=0", "scenarios=[add,ablate_all,k1,k8,k64]")
    runs.run_group(cfg, cfg.models["tiny"], bench_model, one_tap(cfg), str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    by = {r["scenario"]: r for r in got["records"]}
    assert by["add"]["status"] == "ok" and by["add"]["tok_s"] == pytest.approx(24 / by["add"]["wall_s"])
    assert by["k8"]["status"] == "error" and "boom" in by["k8"]["detail"]
    # Round 1: each cell's warm-up (a whole pass) and first timed pass (k8 fails in its warm-up); round 2: the
    # second timed pass of those still short of theirs.
    assert [s for _, s, _ in stand_in] == ["add", "add", "k1", "k1", "k8", "k64", "k64", "add", "k1", "k64"]
    assert all(n == 4 and tokens == 6 for n, _, tokens in stand_in)
    assert len(by["add"]["walls_s"]) == 2 and by["add"]["spread"] >= 0
    assert got["machine"] == {"gpu": "stand-in"}


def test_a_traced_cell_runs_one_more_pass_under_the_profiler_and_keeps_its_table(engine_c, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "trace=[tiny/c/k1/*]", "trace_tokens=3")
    seen, dirs = [], []

    def start(cfg, m, where, group):
        dirs.append(group.trace_dir)

        def run(prompts, scen, tokens):
            seen.append((scen.name, tokens))
            return len(prompts) * tokens

        return engines.traceable(run, _Profiled(seen, group.trace_dir), group.trace_dir)

    engine_c(start)
    group = one_tap(cfg)
    group.cells = group.cells[:2][::-1]  # k1, then add
    recs = run_group(cfg, bench_model, group, tmp_path / ".tiny-c-1taps.json")
    assert dirs == [str(tmp_path / "traces" / "tiny-c-1taps")]
    # warm-up and one timed pass each, and only then the traced pass of trace_tokens, between start and stop
    assert seen == [("k1", 6), ("k1", 6), ("add", 6), ("add", 6), "start", ("k1", 3), "stop"]
    assert recs[0]["trace"] == "trace-tiny-c-k1-4x6.txt" and "trace" not in recs[1]
    table = (tmp_path / "trace-tiny-c-k1-4x6.txt").read_text()
    assert table.startswith("kernel table 1\ntimeline: 2 decode steps of 4 requests") and "worker.1" in table


def test_only_configurations_with_an_llm_of_their_own_are_traced(stand_in, tmp_path, bench_model, monkeypatch):
    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "trace=[*]")
    seen = []
    monkeypatch.setitem(engines.RUNNERS, "d", lambda cfg, m, w, group: seen.append(group.trace_dir) or
                        (lambda prompts, scen, tokens: None))
    group = one_tap(bench_conf("configs=[d]"), "d")
    group.cells = group.cells[:1]
    run_group(cfg, bench_model, group, tmp_path / "out.json")
    assert seen == [None] and not list(tmp_path.glob("trace-*"))


def test_a_trace_that_never_comes_back_is_given_up(engine_c, tmp_path, bench_model):
    import time as clock

    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "trace=[*]", "trace_timeout_s=0.2")

    def start(cfg, m, where, group):
        run = stand_in_runner()
        run.trace = lambda prompts, scen, tokens: clock.sleep(30)  # a profiler stuck in its stop
        return run

    engine_c(start)
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    t0 = clock.monotonic()
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    assert clock.monotonic() - t0 < 10 and rec["status"] == "ok"
    assert rec["trace"].startswith("failed: TimeoutError: no trace after 0.2 s")


class _Profiled:
    """An LLM's profiler calls, as the stand-in sees them: stop writes rank 0's table, as vLLM's does."""

    def __init__(self, passes, trace_dir):
        self.passes, self.dir = passes, trace_dir

    def start_profile(self):
        self.passes.append("start")

    def stop_profile(self):
        self.passes.append("stop")
        from pathlib import Path

        Path(self.dir).mkdir(parents=True, exist_ok=True)
        (Path(self.dir) / "profiler_out_0.txt").write_text(f"kernel table {self.passes.count('stop')}")
        (Path(self.dir) / "worker.1.pt.trace.json").write_text(json.dumps({"traceEvents": synthetic_trace()}))


def test_a_traced_engine_is_let_go_when_its_cells_are_done(engine_c, tmp_path, bench_model):
    # vLLM stops its engine core when the LLM's last reference goes; a process that still holds one on its way
    # out waits for that engine core forever. A traced runner is a reference cycle, which counting never frees.
    import gc
    import weakref

    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "trace=[*]")
    llms = []

    def start(cfg, m, where, group):
        llm = _Profiled([], group.trace_dir)
        llms.append(weakref.ref(llm))
        return engines.traceable(stand_in_runner(), llm, group.trace_dir)

    engine_c(start)
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    gc.disable()  # only run_group's own collection may free it
    try:
        [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
        assert len(llms) == 1 and llms[0]() is None
    finally:
        gc.enable()
    assert rec["trace"].startswith("trace-")


def _add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch) -> dict:
    """The `add` cell's record, every pass taking one tick, 0.125 s, of a fake clock."""
    clock = iter(range(1000))
    monkeypatch.setattr(runs.time, "perf_counter", lambda: next(clock) * 0.125)
    group = one_tap(cfg)
    group.cells = [c for c in group.cells if c["scenario"] == "add"]
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    return rec


def test_short_passes_are_repeated_until_the_time_floor(stand_in, tmp_path, bench_model, monkeypatch):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=1.0", "max_repeats=7")
    rec = _add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch)
    assert rec["walls_s"] == [0.125] * 7  # 1 s would take 8 passes: max_repeats stops it at 7
    assert len(stand_in) == 1 + 7  # and one warm-up pass


@pytest.mark.parametrize("walls,more", [([], True), ([9.0], True), ([0.1, 0.1], True), ([3.0, 3.0], False),
                                        ([0.1] * 5, False), ([25.0], False), ([12.0], False)])
def test_more_passes_until_repeats_and_seconds(walls, more):
    cfg = bench_conf("repeats=2", "min_timed_s=1.0", "max_repeats=5", "max_timed_s=12")
    assert runs._more(walls, cfg) is more


def test_a_model_may_time_its_cells_longer_than_the_run(stand_in, tmp_path, bench_model, monkeypatch):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=0.25", "models.tiny.min_timed_s=0.75")
    rec = _add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch)
    assert rec["walls_s"] == [0.125] * 6  # the model's 0.75 s, not the run's 0.25 (2 passes)
    assert runs._more([0.125] * 2, cfg) is False and runs._more([0.125] * 2, cfg, cfg.models["tiny"]) is True


def test_a_model_may_time_past_the_runs_cap():
    cfg = bench_conf("repeats=2", "min_timed_s=1.0", "max_timed_s=4", "max_repeats=30", "models.tiny.min_timed_s=9",
                     "models.tiny.max_timed_s=10")
    tiny = cfg.models["tiny"]
    assert runs._more([3.0, 3.0], cfg) is False and runs._more([3.0, 3.0], cfg, tiny) is True  # 6 s: past 4, not 9
    assert runs._more([3.0, 3.0, 2.5], cfg, tiny) is True  # 8.5 s: under its own floor still
    assert runs._more([9.5], cfg, tiny) is True and runs._more([10.0], cfg, tiny) is False


def test_a_model_may_take_more_passes_than_the_run():
    # SmolLM2's larger batch: a pass takes seconds, so its time floor alone would leave a handful of draws
    cfg = bench_conf("repeats=3", "min_timed_s=4", "max_timed_s=40", "max_repeats=30", "models.tiny.repeats=10")
    tiny = cfg.models["tiny"]
    assert runs._more([2.5] * 3, cfg) is False and runs._more([2.5] * 3, cfg, tiny) is True
    assert runs._more([2.5] * 9, cfg, tiny) is True and runs._more([2.5] * 10, cfg, tiny) is False
    assert runs._more([0.25] * 10, cfg, tiny) is True  # 2.5 s: the floor still wants more
    assert runs._more([5.0] * 8, cfg, tiny) is False  # the cap still stops it


@contextmanager
def beside_a_scheduler(cfg, group, where, out):
    """`group`'s engine process as the scheduler starts it beside others (run_group in a thread, on `where`,
    recording into `out`), once it is ready: the scheduler's end of its pipe, and the thread."""
    ready, (scheduler, child_end) = threading.Event(), Pipe()
    child = threading.Thread(target=runs.run_group, args=(cfg, cfg.models["tiny"], where, group, str(out), None,
                                                          ready, waves.Turns(child_end)))
    child.start()
    try:
        assert ready.wait(30)
        yield scheduler, child
    finally:
        faulthandler.cancel_dump_traceback_later()  # armed for a process on its way out; this one goes on
        child.join(30)


def test_a_process_started_beside_others_times_a_round_only_when_asked(stand_in, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=0")
    group = one_tap(cfg)
    group.cells = group.cells[:2]  # add, k1
    with beside_a_scheduler(cfg, group, bench_model, tmp_path / "out.json") as (scheduler, child):
        child.join(0.2)
        assert child.is_alive() and stand_in == [] and not scheduler.poll()  # started, waiting: no pass run
        scheduler.send(waves.ROUND)
        assert scheduler.recv() == [["add", [4, 6]], ["k1", [4, 6]]]  # each cell has had one of its two passes
        assert [s for _, s, _ in stand_in] == ["add", "add", "k1", "k1"]
        child.join(0.2)
        assert child.is_alive() and len(stand_in) == 4
        scheduler.send(waves.ROUND)
        assert scheduler.recv() == []  # finished
        assert [s for _, s, _ in stand_in[4:]] == ["add", "k1"]
        assert [(r["scenario"], r["status"], len(r["walls_s"])) for r in records(tmp_path / "out.json")] == [
            ("add", "ok", 2), ("k1", "ok", 2)]


def test_a_paired_rounds_engine_times_only_the_batch_asked_and_the_reference_until_closed(stand_in, tmp_path,
                                                                                          bench_model):
    cfg = bench_conf("batches=[[4,6],[8,6]]", "repeats=1", "min_timed_s=0")
    group = one_tap(cfg)
    group.cells = [c for c in group.cells if c["scenario"] == "add" or c["requests"] == 8][:3]  # add, add, k1 at 8
    with beside_a_scheduler(cfg, group, bench_model, tmp_path / "out.json") as (scheduler, _):
        for i in range(3):  # as the reference: past its one pass (repeats=1), still open
            scheduler.send(waves.Ask((4, 6), keep=True))
            assert scheduler.recv() == [["add", [4, 6]], ["add", [8, 6]], ["k1", [8, 6]]]
            # what it has so far is written after every pass: should the process die, those passes stand
            assert [(r["requests"], len(r["walls_s"]), r["paired"]) for r in records(tmp_path / "out.json")] == [
                (4, i + 1, True)]
        assert [n for n, _, _ in stand_in] == [4] * 4  # a warm-up and three timed passes, all of 4 requests
        scheduler.send(waves.Ask((8, 6), "add"))  # a plain pass of that cell alone: its one pass finishes it
        assert scheduler.recv() == [["add", [4, 6]], ["k1", [8, 6]]]
        scheduler.send(waves.Ask(close=True))
        assert scheduler.recv() == []
        got = {(r["scenario"], r["requests"]): r for r in records(tmp_path / "out.json")}
        assert len(got["add", 4]["walls_s"]) == 3 and got["add", 4]["paired"] is True
        assert len(got["add", 8]["walls_s"]) == 1 and "paired" not in got["add", 8]
        assert got["k1", 8]["status"] == "not run" and "no other engine" in got["k1", 8]["detail"]  # never asked


def test_every_engine_gets_the_same_kv_cache_and_the_batches_graph_sizes(cache_dir, bench_model):
    from steer.bench import workload

    cfg = bench_conf("batches=[[64,128],[256,256]]")
    where = workload.model_dir(cfg.models["llama3_8b"], cache_dir)
    v = engines.vllm_conf(cfg, cfg.models["llama3_8b"], where, tap_graphs=True)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB a token; 256 x (32 + 256) x 5/4 tokens
    assert v.kv_cache_memory_bytes == 128 * 1024 * (256 * 288 * 5 // 4)
    assert v.cudagraph_capture_sizes == [64, 256] and v.max_cudagraph_capture_size == 256 and v.tap_graphs


def test_an_engine_that_fails_to_start_marks_its_cells(monkeypatch, tmp_path):
    cfg = bench_conf("batches=[[4,6]]")

    def broken(*a):
        raise RuntimeError("no GPU here")

    monkeypatch.setitem(engines.RUNNERS, "a", broken)
    [rec] = run_group(cfg, "/nowhere", runs.plan_groups(cfg, "tiny", 4)[0], tmp_path / "out.json")
    assert rec["status"] == "error" and "no GPU here" in rec["detail"]


def test_in_graph_configuration_starts_one_engine_per_tap_set():
    cfg = bench_conf("configs=[b,f]", "batches=[[64,128],[256,256]]")
    f = [g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "f"]
    assert [(tuple(g.layers), {c["scenario"] for c in g.cells}) for g in f] == [
        ((2,), {"add", "k1", "k8", "k64", "add@eps"}), ((0, 1, 2, 3), {"ablate_all", "ablate_all@eps"})]
    assert [len(g.cells) for g in f] == [10, 4]


def test_declared_plans_name_every_edit_of_the_group(bench_model):
    from pathlib import Path

    from steer.bench import workload
    from steer.edits.plan import Plan

    cfg = bench_conf("configs=[f]", "batches=[[16,4]]")
    group = one_tap(cfg, "f")
    spec = workload.spec(cfg.models["tiny"], "tiny", Path(bench_model))
    seen = []
    plans = engines.declared(cfg, spec, group, lambda e, at: seen.append((e, tuple(at))) or Plan())
    # add, k1, k8, k64, add@eps for 16 requests each: 1 + 1 + 8 + 16 + 1 distinct edits, all at the one tap
    assert len(plans) == 5 * 16 and len({id(e) for e, _ in seen}) == 27 and {at for _, at in seen} == {(2,)}
    faint = [e for e, _ in seen[-16:]]
    assert faint[0].scale == pytest.approx(4e-6) and all(e is faint[0] for e in faint)


def test_a_process_stopped_mid_group_keeps_the_cells_it_timed(engine_c, new_book, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "min_timed_s=0", "scenarios=[add,ablate_all,k1,k8,k64]")

    def run(prompts, scen, tokens):
        if scen.name == "k1":
            raise KeyboardInterrupt  # stands in for the process being killed: nothing after this runs
        return len(prompts) * tokens

    engine_c(lambda cfg, m, where, group: run, {"gpu": "stand-in"})
    group = one_tap(cfg)
    assert [c["scenario"] for c in group.cells] == ["add", "k1", "k8", "k64"]
    book = new_book(cfg)
    with pytest.raises(KeyboardInterrupt):
        run_group(cfg, bench_model, group, book._out(group))
    book.finish(group, ended())
    assert [(r["scenario"], r["status"]) for r in book.records] == [
        ("add", "ok"), ("k1", "error"), ("k8", "error"), ("k64", "error")]
    assert "ended with code -9 before this cell had its passes" in book.records[1]["detail"]
    assert book.machine == {"gpu": "stand-in"} and (tmp_path / "bench.md").exists()


def test_cells_finished_out_of_order_are_kept_and_only_the_rest_marked(new_book):
    # In rounds, a cell of few passes (256 x 256) finishes before one of many (64 x 128) of the same engine.
    from steer.results import write_json

    cfg = bench_conf("batches=[[4,6],[8,6]]")
    group = one_tap(cfg)
    book = new_book(cfg)
    late = group.cells[3]
    write_json(book._out(group), {"records": [{**late, "status": "ok", "wall_s": 1.0, "tok_s": 48.0, "spread": 0.0,
                                               "walls_s": [1.0]}], "machine": {}})
    book.finish(group, ended())
    by = {(r["scenario"], r["requests"]): r["status"] for r in book.records}
    assert len(by) == len(group.cells) and by.pop((late["scenario"], late["requests"])) == "ok"
    assert set(by.values()) == {"error"}


@pytest.mark.parametrize("ready, when", [(True, "when its lane moved on"), (False, "when its start timed out")])
def test_a_killed_engine_is_said_so_in_the_log(new_book, console, ready, when):
    cfg = bench_conf("batches=[[4,6]]")
    group = next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "b")
    book = new_book(cfg)
    book.finish(group, ended(killed=True, ready=ready))
    said = f"[bench] tiny b: engine process still running {when}; killed with its process group"
    assert said in console.file.getvalue()
    assert [r["status"] for r in book.records] == ["error"]


def _stand_in_group(*args):
    """run_group in a child process, its engine a stand-in (vLLM is not there)."""
    engines.RUNNERS["c"] = lambda cfg, m, where, group: stand_in_runner()
    engines.machine = lambda: {"gpu": "stand-in"}
    runs.run_group(*args)


def test_engine_processes_take_their_rounds_and_end_on_their_own(new_book, bench_model):
    import multiprocessing

    cfg = bench_conf("batches=[[4,6]]", "repeats=3", "min_timed_s=0")
    groups = [g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "c"]
    book = new_book(cfg)
    ctx, engines = multiprocessing.get_context("spawn"), []

    def start(g):
        engines.append(waves.Process(ctx, _stand_in_group, (cfg, cfg.models["tiny"], bench_model, g,
                                                            str(book._out(g)), {})))
        return engines[-1]

    waves.run(groups, 2, start, book.finish, timeout_s=120, poll_s=0.05, exit_s=30)
    assert len(engines) == 2 and not any(e.killed for e in engines) and {e.exitcode for e in engines} == {0}
    # add, k1, k8, k64, add@eps; ablate_all, ablate_all@eps
    assert len(book.records) == 7 and {r["status"] for r in book.records} == {"ok"}
    assert {len(r["walls_s"]) for r in book.records} == {3}


def test_lanes_run_side_by_side_each_on_its_own_gpus(monkeypatch, tmp_path, cache_dir, bench_model, console):
    import steer.engine.vllm
    from steer.bench import __main__ as bench_main

    cfg = bench_conf("run=[tiny]", "configs=[a,b,c,d]", "scenarios=[add]", "batches=[[4,6]]",
                     'lanes=[{gpus:"0",runs:["*/[abc]"]},{gpus:"1",runs:["*/d"]}]', cache_dir=cache_dir)
    both = threading.Barrier(2, timeout=30)  # passed only if the two lanes time at the same moment
    seen = []

    class Engine:
        def __init__(self, group, env):
            self.group, self.env = group, env

        def ready(self):
            return True

        alive = ready

        def round(self, timeout):
            if self.group.config in ("c", "d"):  # the last engine of each lane
                both.wait()
            seen.append((self.group.config, self.env["CUDA_VISIBLE_DEVICES"], threading.current_thread().name))
            return False

        def join(self, timeout):
            pass

        def kill(self):
            pass

    monkeypatch.setattr(steer.engine.vllm, "available", lambda: True)
    monkeypatch.setattr(bench_main._Book, "start", lambda self, g, m, w, env: Engine(g, env))
    monkeypatch.setattr(bench_main._Book, "finish", lambda self, g, e: None)
    bench_main.run(cfg, tmp_path, console, COMMAND)
    assert sorted(seen) == [("a", "0", "lane0"), ("b", "0", "lane0"), ("c", "0", "lane0"), ("d", "1", "lane1")]


def test_an_engine_process_sets_its_models_environment_before_its_engine_starts(engine_c, monkeypatch, tmp_path,
                                                                               bench_model):
    cfg = bench_conf("run=[tiny]", "batches=[[4,6]]", "repeats=1", "min_timed_s=0",
                     "+models.tiny.env.STEER_BENCH_TEST_ENV=0")
    monkeypatch.setenv("STEER_BENCH_TEST_ENV", "1")  # and monkeypatch puts it back after
    seen = []
    engine_c(lambda cfg, m, where, group: seen.append(os.environ["STEER_BENCH_TEST_ENV"]) or stand_in_runner())
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert seen == ["0"] and rec["status"] == "ok"
    md = report.markdown(report.cells([], cfg), [], cfg, {}, "now", "cmd")
    assert "Engine processes' own environment (`models.<name>.env`): tiny's with " \
           "STEER_BENCH_TEST_ENV=0." in md


def test_a_pass_records_its_median_decode_step_from_the_engine_cores_stamps(engine_c, tmp_path, bench_model):
    # The engine core stamps each step: a warm-up pass's stamps are dropped; each timed pass of 6 tokens makes a
    # prefill and 5 decode steps, 10 ms each but one that a 200 ms stall holds: the median step stays 10 ms while
    # the stall lands in the pass's wall
    stamps, t = [], [100.0]

    def run(prompts, scen, tokens):
        for gap in [0.0, 0.01, 0.01, 0.2, 0.01, 0.01][:tokens]:
            t[0] += gap
            stamps.append(t[0])
        return len(prompts) * tokens

    run.steps = lambda: [stamps.pop(0) for _ in range(len(stamps))]
    engine_c(lambda cfg, m, where, group: run, {"gpu": "stand-in"})
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "min_timed_s=0", "warmup_tokens=3")
    group = one_tap(cfg)
    group.cells = [c for c in group.cells if c["scenario"] == "add"]
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    assert rec["step_ms_passes"] == pytest.approx([10.0, 10.0]) and rec["step_ms"] == pytest.approx(10.0)
    assert rec["step_gaps_ms_passes"] == [[10.0, 10.0, 200.0, 10.0, 10.0]] * 2 and "step_gaps_ms" not in rec


@pytest.mark.parametrize("stamps,median,gaps", [([], None, None), ([1.0], None, None), ([1.0, 1.004], 4.0, [4.0]),
                                                 ([0.0, 0.003, 0.006, 0.1], 3.0, [3.0, 3.0, 94.0])])
def test_a_pass_step_is_the_median_gap_between_stamps(stamps, median, gaps):
    got = runs.step_reading(stamps)
    if median is None:
        assert got == {}
    else:
        assert got["step_ms"] == pytest.approx(median) and got["step_gaps_ms"] == pytest.approx(gaps)
