"""Which engines a bench starts, and how one engine process times its cells (a stand-in engine, on CPU)."""

import json
import threading
from contextlib import contextmanager
from multiprocessing import Pipe

import pytest

from bench_common import bench_conf, ended, one_tap, records, stand_in_runner
from steer.bench import engines, runs, schema, waves


def test_groups_start_each_engine_once():
    cfg = bench_conf("configs=[a,b,b2,c,d,e]")
    groups = {(g.config, tuple(g.layers)): g for g in runs.plan_groups(cfg, "tiny", 4)}
    assert set(groups) == {("a", ()), ("b", ()), ("b2", ()), ("c", (2,)), ("c", (0, 1, 2, 3)), ("d", (2,)),
                           ("d", (0, 1, 2, 3)), ("e", ())}
    assert [c["scenario"] for c in groups[("a", ())].cells] == ["unsteered", "unsteered"]
    assert groups[("b2", ())].cells == groups[("b", ())].cells  # the control: b's work, an engine of its own
    # a faint twin runs on its scenario's engine: the same taps, the same stages
    assert {c["scenario"] for c in groups[("c", (2,))].cells} == {"add", "k1", "k8", "k64", "k256", "add@eps"}
    assert {c["scenario"] for c in groups[("c", (0, 1, 2, 3))].cells} == {"ablate_all", "ablate_all@eps"}
    assert len(groups[("e", ())].cells) == 8 * 2


def test_a_peer_starts_one_engine_for_every_scenario():
    # EasySteer steers any layer at any step, as e does: one engine, every scenario's cells
    cfg = bench_conf("configs=[a,h,easysteer]", "scenarios=[add,add_all,k8,k8_all]", "batches=[[256,128]]")
    groups = {(g.config, tuple(g.layers)): g for g in runs.plan_groups(cfg, "tiny", 4)}
    assert set(groups) == {("a", ()), ("h", (2,)), ("h", (0, 1, 2, 3)), ("easysteer", ())}
    assert [c["scenario"] for c in groups[("easysteer", ())].cells] == ["add", "add_all", "k8", "k8_all"]


def test_in_graph_configuration_starts_one_engine_per_tap_set():
    cfg = bench_conf("configs=[b,f]", "batches=[[64,128],[256,256]]")
    f = [g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "f"]
    assert [(tuple(g.layers), {c["scenario"] for c in g.cells}) for g in f] == [
        ((2,), {"add", "k1", "k8", "k64", "k256", "add@eps"}), ((0, 1, 2, 3), {"ablate_all", "ablate_all@eps"})]
    assert [len(g.cells) for g in f] == [12, 4]


def test_the_control_starts_b_s_pipeline(monkeypatch):
    seen = {}
    monkeypatch.setattr(engines, "_plain", lambda cfg, m, w, group, **how: seen.setdefault(group, how))
    for config in ("b", "b2", "a", "i"):
        engines.RUNNERS[config](None, None, None, config)
    assert seen["b2"] == seen["b"] == {"breakable": True} != seen["a"] == {"breakable": False}
    assert seen["i"] == {"breakable": False, "v1": True}
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


def test_a_group_warms_up_times_and_records_each_cell_a_round_at_a_time(stand_in, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "warmup_tokens=3", "scenarios=[add,ablate_all,k1,k8,k64]")
    runs.run_group(cfg, cfg.models["tiny"], bench_model, one_tap(cfg), str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    by = {r["scenario"]: r for r in got["records"]}
    assert by["add"]["status"] == "ok" and by["add"]["tok_s"] == pytest.approx(24 / by["add"]["wall_s"])
    assert by["k8"]["status"] == "error" and "boom" in by["k8"]["detail"]
    # Round 1: each cell's warm-up (3 tokens) and first timed pass (k8 fails in its warm-up); round 2: the
    # second timed pass of the others
    assert [(s, t) for _, s, t in stand_in] == [("add", 3), ("add", 6), ("k1", 3), ("k1", 6), ("k8", 3), ("k64", 3),
                                                ("k64", 6), ("add", 6), ("k1", 6), ("k64", 6)]
    assert len(by["add"]["walls_s"]) == 2 and by["add"]["rounds"] == [1, 2]
    assert got["machine"] == {"gpu": "stand-in"}


def _add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch) -> dict:
    """The `add` cell's record, every pass taking one tick, 0.125 s, of a fake clock."""
    clock = iter(range(1000))
    monkeypatch.setattr(runs.time, "perf_counter", lambda: next(clock) * 0.125)
    group = one_tap(cfg)
    group.cells = [c for c in group.cells if c["scenario"] == "add"]
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    return rec


def test_a_cell_takes_no_pass_past_max_timed_s(stand_in, tmp_path, bench_model, monkeypatch):
    cfg = bench_conf("batches=[[4,6]]", "repeats=10", "max_timed_s=0.5")
    rec = _add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch)
    assert rec["walls_s"] == [0.125] * 4 and rec["rounds"] == [1, 2, 3, 4]  # 0.5 s reached after 4 passes


def test_a_model_may_take_more_rounds_than_the_run(stand_in, tmp_path, bench_model, monkeypatch):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "models.tiny.repeats=6")
    assert len(_add_on_a_fake_clock(cfg, bench_model, tmp_path, monkeypatch)["walls_s"]) == 6


def test_a_profiled_engine_s_host_time_is_summed_over_the_timed_passes(engine_c, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "scenarios=[add]")
    taken = []

    def start(cfg, m, where, group):
        run = stand_in_runner()

        def profile():  # before each timed pass what must not count; after each, its own calls
            taken.append(None)
            return {"fill_step": {"seconds": 1.0 if len(taken) % 2 else 20e-6, "calls": 5 if len(taken) % 2 else 2},
                    "edits_fused": {"seconds": 0.0, "calls": 3}}

        run.profile = profile
        return run

    engine_c(start)
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    assert rec["host_profile"]["edits_fused"] == {"calls": 6}  # a count, not a clock
    assert rec["host_profile"]["fill_step"] == {"calls": 4, "us_per_call": pytest.approx(10.0)}


def test_a_pass_that_produces_too_few_tokens_fails_its_cell(engine_c, tmp_path, bench_model):
    engine_c(lambda cfg, m, where, group: lambda prompts, scen, tokens: len(prompts) * tokens - 1)
    cfg = bench_conf("batches=[[4,6]]", "repeats=1", "scenarios=[add]")
    group = one_tap(cfg)
    [rec] = run_group(cfg, bench_model, group, tmp_path / "out.json")
    assert rec["status"] == "error" and "generated 23 tokens, expected 24" in rec["detail"]


@contextmanager
def beside_a_scheduler(cfg, group, where, out):
    """`group`'s engine process as the scheduler starts it (run_group in a thread, on `where`, recording into
    `out`), once it is ready: the scheduler's end of its pipe, and the thread."""
    ready, (scheduler, child_end) = threading.Event(), Pipe()
    child = threading.Thread(target=runs.run_group, args=(cfg, cfg.models["tiny"], where, group, str(out), None,
                                                          ready, waves.Turns(child_end)))
    child.start()
    try:
        assert ready.wait(30)
        yield scheduler, child
    finally:
        child.join(30)


def test_a_process_times_a_round_only_when_asked(stand_in, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2")
    group = one_tap(cfg)
    group.cells = group.cells[:2]  # add, k1
    with beside_a_scheduler(cfg, group, bench_model, tmp_path / "out.json") as (scheduler, child):
        child.join(0.2)
        assert child.is_alive() and stand_in == [] and not scheduler.poll()  # started, waiting: no pass run
        scheduler.send(waves.Ask(7))
        assert scheduler.recv() is True  # each cell has had one of its two passes
        assert [s for _, s, _ in stand_in] == ["add", "add", "k1", "k1"]
        scheduler.send(waves.Ask(9))
        assert scheduler.recv() is False  # finished: the process ends
        child.join(30)
        assert not child.is_alive() and not scheduler.poll()
        assert [(r["scenario"], r["rounds"]) for r in records(tmp_path / "out.json")] == [("add", [7, 9]),
                                                                                         ("k1", [7, 9])]


def test_a_reference_times_every_round_it_is_asked_to_keep_until_closed(stand_in, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=1")
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    with beside_a_scheduler(cfg, group, bench_model, tmp_path / "out.json") as (scheduler, _):
        for n in (1, 2, 3):
            scheduler.send(waves.Ask(n, keep=True))
            assert scheduler.recv() is False  # past its one pass, still timing
            # what it has is written after every round: should the process die, those passes stand
            assert records(tmp_path / "out.json")[0]["rounds"] == list(range(1, n + 1))
        scheduler.send(waves.Ask(close=True))
        assert scheduler.recv() is False
    assert len(stand_in) == 1 + 3  # a warm-up and three timed passes


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
    assert rec["status"] == "error" and "engine start failed: RuntimeError: no GPU here" in rec["detail"]


def test_declared_plans_name_every_edit_of_the_group(bench_model):
    from pathlib import Path

    from steer.bench import workload
    from steer.edits.plan import Plan

    cfg = bench_conf("configs=[f]", "batches=[[16,4]]", "scenarios=[add,k1,k8,k64,add@eps]")
    group = one_tap(cfg, "f")
    spec = workload.spec(cfg.models["tiny"], "tiny", Path(bench_model))
    seen = []
    plans = engines.declared(cfg, spec, group, lambda e, at, read=None: seen.append((e, tuple(at))) or Plan())
    # add, k1, k8, k64, add@eps for 16 requests each: 1 + 1 + 8 + 16 + 1 distinct edits, all at the one tap
    assert len(plans) == 5 * 16 and len({id(e) for e, _ in seen}) == 27 and {at for _, at in seen} == {(2,)}
    faint = [e for e, _ in seen[-16:]]
    assert faint[0].strength == pytest.approx(4e-6) and all(e is faint[0] for e in faint)


def test_a_process_stopped_mid_group_keeps_the_cells_it_timed(engine_c, new_book, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=2", "scenarios=[add,ablate_all,k1,k8,k64]")
    passes = []

    def run(prompts, scen, tokens):
        passes.append(scen.name)
        if len(passes) > 8:  # round 2: stands in for the process being killed; nothing after this runs
            raise KeyboardInterrupt
        return len(prompts) * tokens

    engine_c(lambda cfg, m, where, group: run, {"gpu": "stand-in"})
    group = one_tap(cfg)
    assert [c["scenario"] for c in group.cells] == ["add", "k1", "k8", "k64"]
    book = new_book(cfg)
    with pytest.raises(KeyboardInterrupt):
        run_group(cfg, bench_model, group, book.out(group))
    book.finish(group, ended())
    # round 1 was written: each cell has its first pass
    assert [(r["scenario"], r["status"], len(r["walls_s"])) for r in book.records] == [
        ("add", "ok", 1), ("k1", "ok", 1), ("k8", "ok", 1), ("k64", "ok", 1)]
    assert book.machine == {"gpu": "stand-in"} and (tmp_path / "bench.md").exists()


def test_cells_a_dead_process_never_timed_say_so(new_book, console):
    cfg = bench_conf("batches=[[4,6]]")
    group = next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "b")
    book = new_book(cfg)
    book.finish(group, ended(killed=True))
    assert "[bench] tiny b: engine process still running when the bench was done with it" in console.file.getvalue()
    assert [(r["status"], r["detail"]) for r in book.records] == [
        ("error", "engine process ended with code -9 before this cell had a pass")]


def _stand_in_group(*args):
    """run_group in a child process, its engine a stand-in (vLLM is not there)."""
    engines.RUNNERS["c"] = lambda cfg, m, where, group: stand_in_runner()
    engines.RUNNERS["b"] = engines.RUNNERS["c"]
    engines.machine = lambda: {"gpu": "stand-in"}
    runs.run_group(*args)


def test_engine_processes_take_their_rounds_beside_the_reference_and_end_on_their_own(new_book, bench_model):
    import multiprocessing

    cfg = bench_conf("configs=[b,c]", "batches=[[4,6]]", "repeats=3")
    groups = runs.plan_groups(cfg, "tiny", 4)
    book = new_book(cfg)
    ctx, started = multiprocessing.get_context("spawn"), []

    def start(g):
        started.append(waves.Process(ctx, _stand_in_group, (cfg, cfg.models["tiny"], bench_model, g,
                                                             str(book.out(g)), {})))
        return started[-1]

    waves.run(groups, 2, start, book.finish, timeout_s=120, reference=lambda g: g.config == "b", poll_s=0.05,
              exit_s=30)
    assert len(started) == 3 and not any(e.killed for e in started) and {e.exitcode for e in started} == {0}
    # b beside c's one-tap engine (add, k1, k8, k64, k256, add@eps: rounds 1-3), then beside its ablate_all engine
    # (ablate_all, ablate_all@eps: rounds 4-6)
    by = {(r["config"], r["scenario"]): r for r in book.records}
    assert len(by) == 1 + 8 and {r["status"] for r in book.records} == {"ok"}
    assert by["b", "unsteered"]["rounds"] == [1, 2, 3, 4, 5, 6]
    assert by["c", "add"]["rounds"] == [1, 2, 3] and by["c", "ablate_all"]["rounds"] == [4, 5, 6]


class _InThread:
    """waves.Process's part, its target run in a thread of this process (so that stand-in engines reach it)."""

    def __init__(self, ctx, target, args):
        self._ready, (self._conn, child) = threading.Event(), Pipe()
        self.thread = threading.Thread(target=target, args=(*args, self._ready, waves.Turns(child)), daemon=True)
        self.thread.start()
        self.killed, self.exitcode = False, 0

    def ready(self):
        return self._ready.is_set()

    def alive(self):
        return self.thread.is_alive()

    def round(self, timeout, ask):
        self._conn.send(ask)
        return self._conn.recv() if self._conn.poll(timeout) else None

    def join(self, timeout):
        self.thread.join(timeout)

    def kill(self):
        pass


def test_a_whole_run_times_the_references_beside_every_engine_and_reports_their_ratios(
        engine_c, monkeypatch, tmp_path, cache_dir, bench_model, console):
    import steer.engine.vllm
    from bench_common import COMMAND
    from steer.bench import __main__ as bench_main

    engine_c(lambda cfg, m, where, group: stand_in_runner(), {"gpu": "stand-in"})
    for config in ("a", "b"):
        monkeypatch.setitem(engines.RUNNERS, config, engines.RUNNERS["c"])
    monkeypatch.setattr(steer.engine.vllm, "available", lambda: True)
    monkeypatch.setattr(waves, "Process", _InThread)
    cfg = bench_conf("run=[tiny]", "configs=[a,b,c]", "scenarios=[add,ablate_all]", "batches=[[4,6]]", "repeats=2",
                     "skip=[tiny/c/ablate_all/*]", "models.tiny.engines_at_once=3", cache_dir=cache_dir)
    bench_main.run(cfg, tmp_path, console, COMMAND)
    by = {(r["config"], r["scenario"]): r for r in map(json.loads, open(tmp_path / "records.jsonl"))}
    assert by["c", "ablate_all"]["status"] == "skipped" and by["a", "unsteered"]["rounds"] == [1, 2]
    assert by["c", "add"]["rounds"] == [1, 2] and by["b", "unsteered"]["rounds"] == [1, 2]
    md = (tmp_path / "bench.md").read_text()
    assert "| scenario | a tok/s | b tok/s | c tok/s | b/a | c/a | c/b |" in md
    add = next(line for line in md.splitlines() if line.startswith("| add |"))
    assert add.count("(") == 3 and "*" not in add  # each ratio paired round by round, with its spread
    assert "- tiny c: skipped skip pattern 'tiny/c/ablate_all/*'" in md
    assert not list(tmp_path.glob(".tiny-*.json"))  # every engine's records handed to the book
