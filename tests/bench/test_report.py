"""The bench report from records: ratios to a and b, targets, and the files, on CPU."""

import csv
import json
import re
from statistics import median

import pytest
from omegaconf import OmegaConf

from bench_common import bench_conf
from steer.bench import bootstrap, report


def records(cfg):
    out = []
    for model in cfg.run:
        for req, tok in cfg.batches:
            out += [{"model": model, "config": c, "scenario": "unsteered", "requests": req, "tokens": tok,
                     "status": "ok", "tok_s": t, "wall_s": 1.0} for c, t in (("a", 1000.0), ("b", 980.0))]
            for scen in cfg.scenarios:
                for c, t in (("c", 950.0), ("d", 300.0), ("e", 200.0), ("g", 960.0), ("f", 975.0)):
                    out.append({"model": model, "config": c, "scenario": scen, "requests": req, "tokens": tok,
                                "status": "ok", "tok_s": t, "wall_s": 1.0})
    out[-1] = {**out[-1], "status": "error", "tok_s": None, "detail": "RuntimeError: boom"}
    return out


def test_fastest_passes_give_a_second_ratio_beside_the_medians():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "scenarios=[add]", "configs=[a,b,c,d]")
    n = 64 * 128
    # b's passes are noisy (median 0.5 s, fastest 0.4 s), c's tight: the medians say c is 0.5/0.55 of b, the
    # fastest passes 0.4/0.5
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(w), "wall_s": median(w), "walls_s": w}
            for c, s, w in (("a", "unsteered", [0.45]), ("b", "unsteered", [0.4, 0.5, 0.7]),
                            ("c", "add", [0.5, 0.55, 0.6]), ("d", "add", [2.0]))]
    rows = report.cells(recs, cfg)
    c = next(r for r in rows if r["config"] == "c")
    assert c["vs_b"] == pytest.approx(0.5 / 0.55) and c["best_vs_b"] == pytest.approx(0.4 / 0.5)
    assert c["best_tok_s"] == pytest.approx(n / 0.5)
    goal = next(g for g in report.targets(rows, cfg) if g["target"] == "c/b >= 0.9")
    assert goal["ratio"] == pytest.approx(0.5 / 0.55) and goal["best"] == pytest.approx(0.8) and goal["holds"]
    md = report.markdown(rows, report.targets(rows, cfg), cfg, {}, "now", "cmd")
    lo, hi = bootstrap.interval([0.5, 0.55, 0.6], [0.4, 0.5, 0.7])  # the medians' ratio on the passes' noise
    assert lo < 0.9 <= hi  # the noise reaches past the threshold
    assert f"| c/b >= 0.9 | add | tiny | 64x128 | 0.91 | 0.80 | - | {lo:.2f}-{hi:.2f} | - | - | yes, undecided |" in md
    assert "| c/d >= 3 | add | tiny | 64x128 | 3.64 | 4.00 | - | - | - | - | yes |" in md  # d has one pass: no interval


def test_a_target_whose_interval_clears_its_threshold_is_decided():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "scenarios=[add]", "configs=[b,c]",
                     "targets=[{scenario:add,at_least:0.9},{scenario:add,at_least:0.99}]")
    n = 64 * 128
    tight = {"b": [0.50, 0.501, 0.502, 0.503], "c": [0.52, 0.521, 0.522, 0.523]}  # c is 0.96 of b, little noise
    recs = [{"model": "tiny", "config": c, "scenario": "unsteered" if c == "b" else "add", "requests": 64,
             "tokens": 128, "status": "ok", "tok_s": n / median(w), "wall_s": median(w), "walls_s": w}
            for c, w in tight.items()]
    goals = report.targets(report.cells(recs, cfg), cfg)
    assert [g["holds"] for g in goals] == [True, False]
    assert 0.95 < goals[0]["interval"][0] < goals[0]["interval"][1] < 0.97
    md = report.markdown(report.cells(recs, cfg), goals, cfg, {}, "now", "cmd")
    assert "| c/b >= 0.9 | add | tiny | 64x128 | 0.96 | 0.96 | - | 0.96-0.96 | - | - | yes |" in md
    assert "| c/b >= 0.99 | add | tiny | 64x128 | 0.96 | 0.96 | - | 0.96-0.96 | - | - | **no** (-0.028) |" in md


def test_a_run_s_report_is_rewritten_from_what_the_run_left(tmp_path):
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]")
    recs = records(cfg)
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


def test_ratios_and_targets():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]")
    rows = report.cells(records(cfg), cfg)
    c_add = next(r for r in rows if (r["scenario"], r["config"]) == ("add", "c"))
    assert c_add["vs_a"] == pytest.approx(0.95) and c_add["vs_b"] == pytest.approx(950 / 980)
    b_k8 = next(r for r in rows if (r["scenario"], r["config"]) == ("k8", "b"))
    assert b_k8["tok_s"] == 980.0  # the unsteered batch stands for every scenario
    goals = {(g["target"], g["scenario"]): g for g in report.targets(rows, cfg)}
    assert goals[("c/b >= 0.9", "add")]["holds"] is True
    assert goals[("c/d >= 3", "add")]["ratio"] == pytest.approx(950 / 300) and goals[("c/d >= 3", "add")]["holds"]
    assert ("c/b >= 0.97", "add") not in goals  # the 8B target: that model is not in this run


def test_report_files(tmp_path):
    cfg = bench_conf("configs=[a,b,c,g,f,d,e]")
    rows = report.cells(records(cfg), cfg)
    goals = report.targets(rows, cfg)
    md = report.markdown(rows, goals, cfg, {"gpu": "NVIDIA H200"}, "2026-11-29 10:00 UTC", "python -m steer.bench")
    report.write(tmp_path, rows, goals, md, cfg)
    assert {p.name for p in tmp_path.iterdir()} == {"bench.md", "bench.csv", "bench.png"}
    table = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert len(table) == 2 * 2 * 7 * 7  # models, batches, scenarios (two of them faint twins), configurations
    assert "| add | 1,000 | 980 | 950 | 960 | 975 | 300 | 200 |" in md and "NVIDIA H200" in md
    assert "f: error RuntimeError: boom" in md
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_report_says_which_lanes_ran_side_by_side():
    cfg = bench_conf('lanes=[{gpus:"0",runs:["*/[abcf]"]},{gpus:"1",runs:["*/[de]"]}]')
    md = report.markdown(report.cells([], cfg), [], cfg, {}, "2026-11-29 10:00 UTC", "python -m steer.bench")
    assert "GPU 0 runs */[abcf]; GPU 1 runs */[de]." in md
    one = bench_conf()
    assert "side by side" not in report.markdown(report.cells([], one), [], one, {}, "now", "cmd")


def test_report_names_a_model_s_own_time_floor_and_cap():
    cfg = bench_conf("run=[tiny,smollm2]", "min_timed_s=4", "max_timed_s=15", "models.smollm2.min_timed_s=10",
                     "models.smollm2.max_timed_s=40", "repeats=3", "models.smollm2.repeats=10")
    md = report.markdown(report.cells([], cfg), [], cfg, {}, "now", "c")
    assert "at least 4 s of them (smollm2 10 s)," in md and "none once 15 s (smollm2 40 s) are timed" in md
    assert "(at least 3 (smollm2 10), and" in md
    plain = bench_conf("run=[tiny]", "min_timed_s=4", "max_timed_s=15")  # a model out of the run is not named
    md = report.markdown(report.cells([], plain), [], plain, {}, "now", "c")
    assert "at least 4 s of them, at most" in md and "none once 15 s are timed" in md and "(at least 3, and" in md


def test_machinery_and_data_are_reported_apart():
    cfg = bench_conf("run=[llama3_8b]", "batches=[[64,128]]", "configs=[b,c,f]", "scenarios=[add,add@eps,k1]")
    n = 64 * 128
    walls = {("b", "unsteered"): [1.0, 1.1], ("c", "add"): [0.9, 1.0], ("c", "add@eps"): [1.2, 1.25],
             ("f", "add"): [1.0], ("f", "add@eps"): [1.0, 1.05], ("c", "k1"): [1.0], ("f", "k1"): [1.0]}
    recs = [{"model": "llama3_8b", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(w), "wall_s": median(w), "walls_s": w} for (c, s), w in walls.items()]
    rows = {(r["scenario"], r["config"]): r for r in report.cells(recs, cfg)}
    # the faint twin over b is the machinery; the full edit over its faint twin, the data (here: 8% faster on it)
    assert rows["add@eps", "c"]["vs_b"] == pytest.approx(1.05 / 1.225)
    assert rows["add", "c"]["vs_eps"] == pytest.approx(1.225 / 0.95)
    assert rows["add", "c"]["best_vs_eps"] == pytest.approx(1.2 / 0.9)
    assert rows["k1", "c"]["vs_eps"] is None and rows["add", "b"]["vs_eps"] is None  # no twin; unsteered
    md = report.markdown(list(rows.values()), [], cfg, {}, "now", "cmd")
    assert "Machinery (the edits at 1e-06 of their strength, over the unsteered baseline of the same pipeline)" in md
    assert "| scenario | c: machinery (/b) | c: data | f: machinery (/b) | f: data |" in md
    assert "| add | 0.86 (0.83) | 1.29 (1.33) | 1.02 (1.00) | 1.02 (1.00) |" in md
    assert "`<scenario>@eps`: the scenario's edits at 1e-06 of their strength" in md
    plain = bench_conf("run=[llama3_8b]", "batches=[[64,128]]", "configs=[b,c]", "scenarios=[add]")
    assert "Machinery" not in report.markdown(report.cells(recs, plain), [], plain, {}, "now", "cmd")


def test_the_fold_is_measured_against_the_edits_it_folds():
    cfg = bench_conf("run=[llama3_8b]", "batches=[[64,128]]", "configs=[b,f,j]", "scenarios=[add]")
    n = 64 * 128
    walls = {("b", "unsteered"): [1.0], ("f", "add"): [1.1], ("j", "add"): [1.0]}
    recs = [{"model": "llama3_8b", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(w), "wall_s": median(w), "walls_s": w} for (c, s), w in walls.items()]
    md = report.markdown(report.cells(recs, cfg), [], cfg, {}, "now", "cmd")
    assert "| f/b | j/b | j/f |" in md and "| 0.91 | 1.00 | 1.10 |" in md


def test_compiled_edits_are_measured_against_their_own_pipeline():
    # h (compiled edits) keeps a's compile and graphs on steer's V1 runner: its machinery is over i, not b or a
    cfg = bench_conf("run=[llama3_8b]", "batches=[[64,128]]", "configs=[a,b,h,i]", "scenarios=[add,add@eps]")
    n = 64 * 128
    walls = {("a", "unsteered"): [1.0], ("b", "unsteered"): [1.1], ("i", "unsteered"): [1.25],
             ("h", "add"): [1.3], ("h", "add@eps"): [1.25]}
    recs = [{"model": "llama3_8b", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(w), "wall_s": median(w), "walls_s": w} for (c, s), w in walls.items()]
    md = report.markdown(report.cells(recs, cfg), [], cfg, {}, "now", "cmd")
    assert "| scenario | h: machinery (/i) | h: data |" in md
    assert "| add | 1.00 (1.00) | 0.96 (0.96) |" in md
    assert "| scenario | a tok/s | b tok/s | h tok/s | i tok/s | h/a | h/b | h/i |" in md
    without_i = bench_conf("run=[llama3_8b]", "batches=[[64,128]]", "configs=[a,h]", "scenarios=[add,add@eps]")
    assert "h: machinery (/a)" in report.markdown(report.cells(recs, without_i), [], without_i, {}, "now", "cmd")


def test_the_gpu_clock_and_power_stand_beside_every_cell(tmp_path):
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[a,b,c]", "scenarios=[add]")
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": 1000.0, "wall_s": 1.0, **gpu}
            for c, s, gpu in (("a", "unsteered", {"sm_mhz": 1980.0, "power_w": 512.4}),
                              ("b", "unsteered", {"sm_mhz": 1755.0, "power_w": 650.0}), ("c", "add", {}))]
    rows = report.cells(recs, cfg)
    md = report.markdown(rows, [], cfg, {}, "now", "cmd")
    assert "| MHz / W | a | b | c |" in md and "| add | 1,980 / 512 | 1,755 / 650 | - |" in md
    report.write(tmp_path, rows, [], md, cfg)
    table = {r["config"]: r for r in csv.DictReader(open(tmp_path / "bench.csv"))}
    assert (table["a"]["sm_mhz"], table["a"]["power_w"], table["c"]["sm_mhz"]) == ("1980.0", "512.4", "")
    unread = [{k: v for k, v in r.items() if k not in ("sm_mhz", "power_w")} for r in recs]
    md = report.markdown(report.cells(unread, cfg), [], cfg, {}, "now", "cmd")
    assert "MHz / W" not in md and "SM clock and power: not read (no NVML in the engine processes" in md


def test_a_target_between_fastest_passes_is_decided_there():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95,between:fastest},{scenario:add,of:f,at_least:0.95}]")
    n = 64 * 128
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(w), "wall_s": median(w), "walls_s": w}
            for c, s, w in (("b", "unsteered", [0.4, 0.5, 0.5]), ("f", "add", [0.41, 0.6, 0.7]))]
    fastest, medians = report.targets(report.cells(recs, cfg), cfg)
    assert fastest["best"] == pytest.approx(0.4 / 0.41) and fastest["holds"] is True
    assert medians["ratio"] == pytest.approx(0.5 / 0.6) and medians["holds"] is False
    md = report.markdown(report.cells(recs, cfg), [fastest, medians], cfg, {}, "now", "cmd")
    span = "{:.2f}-{:.2f}".format(*bootstrap.interval([0.41, 0.6, 0.7], [0.4, 0.5, 0.5]))
    # the same interval beside both; only the target between medians can be left undecided by it
    chance = f"{bootstrap.chance_below([0.4, 0.5, 0.5], 3, 0.95):.0%}"  # an engine as fast as b, 3 passes
    # f's one 0.41 s pass decides it (its next, 0.6 s, gives 0.67)
    assert f"| f/b >= 0.95 (fastest) | add | tiny | 64x128 | 0.83 | 0.98 | - | {span} | - | - | {chance} | yes, " \
        "turns on one pass |" in md
    assert f"| f/b >= 0.95 | add | tiny | 64x128 | 0.83 | 0.98 | - | {span} | - | - | - | **no** (-0.117), " \
        "undecided |" in md


def test_a_target_between_paired_passes_is_decided_by_each_pass_against_its_neighbours():
    cfg = bench_conf("run=[tiny]", "batches=[[64,128]]", "configs=[b,f]", "scenarios=[add]",
                     "targets=[{scenario:add,of:f,at_least:0.95,between:paired},"
                     "{scenario:add,of:f,at_least:0.95,between:fastest}]")
    n = 64 * 128
    # b f b f b, about 0.1 s apart: f's first pass between b's 0.58 and 0.4, its second between 0.4 and 0.6; b has
    # a fast pass (0.3 s) far from any of f's, which only its fastest pass overall sees
    b = {"walls_s": [0.58, 0.4, 0.6, 0.3], "started_s": [0.0, 1.3, 2.4, 60.0], "paired": True}
    f = {"walls_s": [0.6, 0.41], "started_s": [0.68, 1.8]}
    recs = [{"model": "tiny", "config": c, "scenario": s, "requests": 64, "tokens": 128, "status": "ok",
             "tok_s": n / median(r["walls_s"]), "wall_s": median(r["walls_s"]), **r}
            for c, s, r in (("b", "unsteered", b), ("f", "add", f))]
    paired, fastest = report.targets(report.cells(recs, cfg), cfg)
    assert paired["paired"] == pytest.approx(median([0.49 / 0.6, 0.5 / 0.41])) and paired["holds"] is True
    # between fastest passes: the fastest of b's passes just before f's (0.4 s), not its 0.3 s a minute away
    assert fastest["best"] == pytest.approx(0.4 / 0.41) and fastest["holds"] is True
    md = report.markdown(report.cells(recs, cfg), [paired, fastest], cfg, {}, "now", "cmd")
    lo, hi = paired["paired_interval"]
    assert f"| f/b >= 0.95 (paired) | add | tiny | 64x128 | 0.97 | 0.98 | 1.02 ({lo:.2f}-{hi:.2f}) | " in md
    unpaired = [{**r, "paired": False} for r in recs]  # the same passes, b not the run's reference
    paired, fastest = report.targets(report.cells(unpaired, cfg), cfg)
    assert paired["paired"] is None and paired["holds"] is None
    assert fastest["best"] == pytest.approx(0.3 / 0.41) and fastest["holds"] is False
