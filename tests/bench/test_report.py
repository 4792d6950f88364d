"""The bench report from records: each configuration's ratios to a and b with their spread, the targets, and the
files, on CPU."""

import csv
import json
import re

import pytest
from omegaconf import OmegaConf

from bench_common import bench_conf
from steer.bench import report

N = 64 * 128  # the requests x new tokens of every record below


def rec(config, scenario, walls, rounds=None, model="tiny"):
    """A cell's record as an engine process writes it: its passes' wall times and rounds (1, 2, ... by default)."""
    walls = list(walls)
    ordered = sorted(walls)
    mid = (ordered[(len(walls) - 1) // 2] + ordered[len(walls) // 2]) / 2
    return {"model": model, "config": config, "scenario": scenario, "requests": 64, "tokens": 128, "status": "ok",
            "tok_s": N / mid, "wall_s": mid, "walls_s": walls, "rounds": rounds or list(range(1, len(walls) + 1))}


def test_a_ratio_is_the_median_of_the_rounds_both_timed_with_their_least_and_greatest():
    # a's passes swing with the host (1.0, then 2.0 in a slow spell, then 1.0); c's swing with them, 10% slower
    a = rec("a", "unsteered", [1.0, 2.0, 1.0, 1.0], rounds=[1, 2, 3, 4])
    c = rec("c", "add", [1.1, 2.2, 1.25], rounds=[1, 2, 4])
    med, lo, hi, paired = report.ratio(c, a)
    assert paired and med == pytest.approx(1 / 1.1) and (lo, hi) == pytest.approx((1 / 1.25, 1 / 1.1))
    # between medians the slow spell, in c's middle pass and not in a's, would read 0.8
    assert a["wall_s"] / c["wall_s"] == pytest.approx(0.8)


def test_cells_that_share_no_round_give_the_medians_ratio_and_the_extremes_of_their_passes():
    i = rec("i", "unsteered", [1.0, 1.2], rounds=[1, 2])
    h = rec("h", "add", [1.5, 1.0, 2.0], rounds=[3, 4, 5])
    med, lo, hi, paired = report.ratio(h, i)
    assert not paired and med == pytest.approx(1.1 / 1.5) and (lo, hi) == pytest.approx((1.0 / 2.0, 1.2 / 1.0))
    assert report.ratio(h, {**i, "status": "error"}) is None and report.ratio(None, i) is None


def test_every_configuration_is_set_against_a_and_each_steered_one_against_b():
    assert report.pairs(["a", "b", "b2", "c", "f", "h", "i", "d"]) == [
        ("b", "a"), ("b2", "a"), ("c", "a"), ("f", "a"), ("h", "a"), ("i", "a"), ("d", "a"),
        ("c", "b"), ("f", "b"), ("h", "b"), ("d", "b"), ("h", "i"), ("b2", "b"), ("c", "d")]
    assert report.pairs(["b", "c"]) == [("c", "b")] and report.pairs(["b", "f", "j"])[-1] == ("j", "f")


def test_a_peer_is_set_against_a_and_each_of_steer_s_steered_configurations_against_it():
    # EasySteer over a (what a user runs without steer); steer's f and h over EasySteer; never EasySteer over b
    # (b's breakable graphs are steer's baseline, not EasySteer's)
    assert report.pairs(["a", "b", "f", "h", "easysteer", "d"]) == [
        ("b", "a"), ("f", "a"), ("h", "a"), ("easysteer", "a"), ("d", "a"), ("f", "b"), ("h", "b"), ("d", "b"),
        ("f", "easysteer"), ("h", "easysteer")]


def test_a_target_over_easysteer_reads_the_same_rounds():
    cfg = bench_conf("run=[qwen2_1p5b]", "batches=[[64,128]]", "configs=[a,h,easysteer]", "scenarios=[add,k64]",
                     "k_kinds=[add]", "targets=[{scenario:k64,of:h,over:easysteer,at_least:3.0}]")
    host = [1.0, 1.6, 1.1]
    recs = [rec("a", "unsteered", host, model="qwen2_1p5b"), rec("h", "k64", host, model="qwen2_1p5b"),
            rec("easysteer", "k64", [3.2 * h for h in host[:2]] + [2.9 * host[2]], model="qwen2_1p5b")]
    (goal,) = report.targets(report.cells(recs, cfg), cfg)
    assert goal["target"] == "h/easysteer >= 3" and goal["holds"]
    assert goal["ratio"][:3] == pytest.approx((3.2, 2.9, 3.2)) and goal["ratio"][3]
    md = report.markdown(report.cells(recs, cfg), [goal], cfg, {}, "now", "cmd")
    assert "h/easysteer" in md and "| 3.20 (2.90-3.20) |" in md


def _run(cfg):
    """A run's records: a and b unsteered, c 0.9 of b and f 0.95 of it in every round while the host moves all."""
    host = [1.0, 1.5, 1.0]
    out = []
    for model in cfg.run:
        out += [rec("a", "unsteered", [0.98 * h for h in host], model=model),
                rec("b", "unsteered", host, model=model)]
        for scen in cfg.scenarios:
            out += [rec("c", scen, [h / 0.9 for h in host], model=model),
                    rec("f", scen, [h / 0.95 for h in host], model=model)]
    out[-1] = {**out[-1], "status": "error", "tok_s": None, "detail": "RuntimeError: boom"}
    return out


def test_the_tables_give_each_ratio_with_its_spread_and_the_unsteered_figure_for_every_scenario():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[a,b,c,f]", "scenarios=[add,k64]")
    rows = report.cells(_run(cfg), cfg)
    c_add = next(r for r in rows if (r["scenario"], r["config"]) == ("add", "c"))
    assert (c_add["vs_a"], c_add["vs_a_lo"], c_add["vs_a_hi"]) == pytest.approx((0.882, 0.882, 0.882))
    assert c_add["vs_b"] == pytest.approx(0.9)
    assert next(r for r in rows if (r["scenario"], r["config"]) == ("k64", "b"))["tok_s"] == pytest.approx(N)
    md = report.markdown(rows, [], cfg, {"gpu": "NVIDIA H200"}, "2026-11-29 10:00 UTC", "python -m steer.bench")
    assert "| scenario | a tok/s | b tok/s | c tok/s | f tok/s | b/a | c/a | f/a | c/b | f/b |" in md
    assert "| add | 8,359 | 8,192 | 7,373 | 7,782 | 0.98 (0.98-0.98) | 0.88 (0.88-0.88) | 0.93 (0.93-0.93) | " \
           "0.90 (0.90-0.90) | 0.95 (0.95-0.95) |" in md
    assert "| k64 | 8,359 | 8,192 | 7,373 | error | 0.98 (0.98-0.98) | 0.88 (0.88-0.88) | - | 0.90 (0.90-0.90) | - |" \
           in md
    assert "- tiny f: error RuntimeError: boom" in md and "NVIDIA H200" in md


def test_a_target_holds_on_its_median_and_is_undecided_where_its_spread_reaches_past_it():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,c]", "scenarios=[add]",
                     "targets=[{scenario:add,at_least:0.9},{scenario:add,at_least:0.95},"
                     "{scenario:add,at_least:0.8},{scenario:add,of:f,at_least:0.9}]")
    recs = [rec("b", "unsteered", [1.0, 1.0, 1.0]), rec("c", "add", [1 / 0.94, 1 / 0.92, 1 / 0.96])]
    rows = report.cells(recs, cfg)
    goals = report.targets(rows, cfg)
    assert [g["holds"] for g in goals] == [True, False, True, None]
    md = report.markdown(rows, goals, cfg, {}, "now", "cmd")
    assert "| c/b >= 0.9 | add | tiny | 64x128 | 0.94 (0.92-0.96) | yes |" in md
    assert "| c/b >= 0.95 | add | tiny | 64x128 | 0.94 (0.92-0.96) | **no** (-0.010), undecided |" in md
    assert "| c/b >= 0.8 | add | tiny | 64x128 | 0.94 (0.92-0.96) | yes |" in md
    assert "| f/b >= 0.9 | add | tiny | 64x128 | - | not run |" in md  # f is not in the run


def test_report_files(tmp_path):
    cfg = bench_conf("batches=[[64,128]]", "configs=[a,b,c,f]")
    md = report.publish(tmp_path, _run(cfg), cfg, {"gpu": "NVIDIA H200"}, "2026-11-29 10:00 UTC", "cmd")
    assert {p.name for p in tmp_path.iterdir()} == {"bench.md", "bench.csv", "bench.png", "run.json"}
    table = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert len(table) == 2 * 8 * 4  # models, scenarios (two of them faint twins), configurations
    c = next(r for r in table if (r["model"], r["scenario"], r["config"]) == ("llama3_8b", "add", "c"))
    assert float(c["vs_b"]) == pytest.approx(0.9) and float(c["vs_b_lo"]) == pytest.approx(0.9)
    assert c["passes"] == "3" and "`<scenario>@eps`: the scenario's edits at 1e-06 of their strength" in md
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_s_report_is_rewritten_from_what_the_run_left(tmp_path):
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[a,b,c,f]")
    recs = _run(cfg)
    report.publish(tmp_path, recs, cfg, {"gpu": "NVIDIA H200"}, "2026-11-29 19:40 UTC", "python -m steer.bench x=1")
    first = (tmp_path / "bench.md").read_text()
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra/config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "bench.md").unlink()
    assert report.rewrite(tmp_path) == first == (tmp_path / "bench.md").read_text()
    assert "NVIDIA H200" in first and "python -m steer.bench x=1" in first
    good = {name: (tmp_path / name).read_text() for name in ("run.json", "records.jsonl", ".hydra/config.yaml")}
    for name, damage, says in [("records.jsonl", good["records.jsonl"][:-40], "records.jsonl:"),
                               ("records.jsonl", "", "holds no record"),
                               ("run.json", '{"machine": {}}', "expected an object with machine, when and command"),
                               ("run.json", "{", "run.json: not JSON"),
                               (".hydra/config.yaml", "repeats: [", "config.yaml: "),
                               (".hydra/config.yaml", "bogus: 1", "config.yaml: ")]:
        (tmp_path / name).write_text(damage)
        with pytest.raises(report.Damaged, match=re.escape(says)):
            report.rewrite(tmp_path)
        assert (tmp_path / "bench.md").read_text() == first  # the report there is left as it was
        (tmp_path / name).write_text(good[name])
    (tmp_path / "run.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no run.json"):
        report.rewrite(tmp_path)


def test_the_rewrite_command_names_what_a_directory_lacks(tmp_path, capsys):
    with pytest.raises(SystemExit) as out:
        report.main([str(tmp_path)])
    assert out.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error run_dir: ") and "has no records.jsonl, .hydra/config.yaml, run.json" in err
