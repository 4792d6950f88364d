"""Garbage collections in the timing process through a pass (steer/bench/pauses.py), and the report's account."""

import gc

from bench_common import bench_conf, first_cell, stand_in_runner
from steer.bench import pauses, report


def test_a_window_times_the_collections_within_it_and_counts_the_full_ones():
    with pauses.Window() as w:
        gc.collect(0)
    assert w.full == 0 and w.seconds > 0.0
    with pauses.Window() as w:
        gc.collect()  # a full one
        gc.collect(1)
    assert w.full == 1 and w.seconds > 0.0
    gc.collect()  # after the window: neither seen nor left hooked
    assert w.full == 1 and w._seen not in gc.callbacks
    assert w.summary() == {"gc_s": w.seconds, "gc_full": 1.0}


def test_a_cell_records_each_passs_collections(engine_c, tmp_path, bench_model):
    cfg = bench_conf("batches=[[4,6]]", "repeats=3", "min_timed_s=0")
    runner = stand_in_runner()
    engine_c(lambda cfg, m, where, group: lambda *a: (gc.collect(), runner(*a))[1])  # a full collection a pass
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert len(rec["gc_s_passes"]) == 3 and all(s > 0 for s in rec["gc_s_passes"])
    # the warm-up pass collected too, outside the timed ones
    assert rec["gc_full_passes"] == [1.0, 1.0, 1.0] and rec["gc_full"] == 1.0


def test_the_report_follows_pass_times_with_the_collections():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,c]", "scenarios=[add]")
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": 1000.0, "wall_s": 1.0, "walls_s": [1.0, 1.2, 0.9], "gc_s_passes": [0.0, 0.2, 0.0],
             "gc_full_passes": [0.0, 1.0, 0.0]} for c, s in (("b", "unsteered"), ("c", "add"))]
    md = report.markdown(report.cells(recs, cfg), [], cfg, {}, "now", "cmd", recs)
    assert "the timing process's garbage collections' time r = +0.94 (6 passes of 2 cells)" in md
    assert "its full collections r = +0.94" in md
