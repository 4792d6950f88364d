import csv
import json

import pytest

from helpers import run

from steer.report.jobs import swept
from steer.runs.report import build


def job(root, num, overrides, metrics):
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps(metrics))


def test_summary_has_a_row_per_finished_job_in_job_order(tmp_path):
    for n in (10, 2, 1):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10})
    job(tmp_path, 3, ["edit.scale=3"], None)  # died before writing metrics: not a row
    out = build(tmp_path)
    rows = list(csv.DictReader(out["summary"].open()))
    assert [r["job"] for r in rows] == ["1", "2", "10"]
    assert [r["edit.scale"] for r in rows] == ["1", "2", "10"] and rows[2]["kl_mean"] == "1.0"
    assert out["swept"] == ["edit.scale"] and {p.name for p in out["plots"]} == {"kl_mean.png"}


def test_swept_keys_and_plots_one_line_per_other_value(tmp_path):
    n = 0
    for scale in (0, 2, 4):
        for layer in (1, 2):
            job(tmp_path, n, [f"edit.scale={scale}", f"tap.layer={layer}", "edit=add"],
                {"kl_mean": scale * layer / 10, "proj_steered": None, "tokens_per_s": 5.0})
            n += 1
    rows = build(tmp_path)["rows"]
    assert swept(rows) == ["edit.scale", "tap.layer"]
    out = build(tmp_path)
    # tokens_per_s is the same for every job (a pack's): in summary.csv, and no plot
    assert {p.name for p in out["plots"]} == {"kl_mean.png"}
    assert all(p.stat().st_size > 1000 for p in out["plots"])
    assert [r["tokens_per_s"] for r in csv.DictReader(out["summary"].open())] == ["5.0"] * 6


def test_report_cli_rebuilds_from_job_dirs(tmp_path):
    import sys

    for n, scale in enumerate((0, 4)):
        job(tmp_path, n, [f"edit.scale={scale}"], {"kl_mean": float(scale)})
    res = run([sys.executable, "-m", "steer.runs.report", str(tmp_path)])
    assert res.returncode == 0, res.stderr
    assert "2 jobs, swept ['edit.scale']" in res.stdout and (tmp_path / "summary.csv").exists()
    res = run([sys.executable, "-m", "steer.runs.report", str(tmp_path / "nope")])
    assert res.returncode == 2 and "is not a directory" in res.stderr


def test_failed_job_is_a_row_with_its_error_and_no_metrics(tmp_path):
    job(tmp_path, 0, ["edit.scale=0"], {"kl_mean": 0.0})
    job(tmp_path, 1, ["edit.scale=2"], None)
    (tmp_path / "1" / "error.txt").write_text('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
                                              "IsADirectoryError: [Errno 21] Is a directory: 'results.jsonl'\n")
    job(tmp_path, 2, ["edit.scale=4"], None)
    (tmp_path / "2" / "error.txt").write_text("tap.layer: layer 9 is out of range\n")
    job(tmp_path, 3, ["edit.scale=8"], None)  # set up, never ran: not a row
    out = build(tmp_path)
    rows = list(csv.DictReader(out["summary"].open()))
    assert [(r["job"], r["edit.scale"], r["status"]) for r in rows] == [("0", "0", "ok"), ("1", "2", "failed"),
                                                                         ("2", "4", "failed")]
    assert rows[0]["error"] == "" and rows[0]["kl_mean"] == "0.0"
    assert rows[1]["error"] == "IsADirectoryError: [Errno 21] Is a directory: 'results.jsonl'"
    assert rows[1]["kl_mean"] == ""
    assert rows[2]["error"] == "tap.layer: layer 9 is out of range"
    assert out["jobs"] == 3 and out["swept"] == ["edit.scale"]


def test_summary_csv_ends_lines_with_lf(tmp_path):
    for n in (0, 1):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10})
    data = build(tmp_path)["summary"].read_bytes()
    assert b"\r" not in data and data.count(b"\n") == 3


def test_report_of_a_directory_without_jobs_is_an_error_and_writes_nothing(tmp_path):
    import sys

    job(tmp_path, 0, ["edit.scale=0"], None)  # set up but never finished: still no job to report
    res = run([sys.executable, "-m", "steer.runs.report", str(tmp_path)])
    assert res.returncode == 2
    assert str(tmp_path) in res.stderr and "metrics.json" in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0"]  # no summary.csv, no plots


def test_summary_and_plots_honour_the_umask(tmp_path):
    import os

    for n in (0, 1):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10})
    old = os.umask(0o022)
    try:
        out = build(tmp_path)
    finally:
        os.umask(old)
    for p in [out["summary"], *out["plots"]]:
        assert oct(p.stat().st_mode & 0o777) == oct(0o644), p.name


def test_metrics_are_told_from_overrides_whatever_their_names(tmp_path):
    # metrics.json gains keys (ppl_*, concept_*) and `prompts` is both an override group and a count: neither is
    # a swept parameter, every number is plotted, and the second edit's parameter is swept like the first's.
    n = 0
    for scale in (0, 6):
        for hi in (10, 40):
            job(tmp_path, n, ["+experiment=joy_two_taps", f"edit.scale={scale}", f"extra_edits.0.edit.hi={hi}",
                              "prompts=refusal"],
                {"kl_mean": scale / 10, "tokens_per_s": 5.0 + n, "prompts": 6, "ppl_steered": 3.0 + scale + hi / 100,
                 "concept_steered": None})
            n += 1
    out = build(tmp_path)
    assert out["swept"] == ["edit.scale", "extra_edits.0.edit.hi"]
    assert {p.name for p in out["plots"]} == {"kl_mean.png", "tokens_per_s.png", "ppl_steered.png"}
    rows = list(csv.DictReader(out["summary"].open()))
    assert [(r["prompts"], r["prompts (metric)"]) for r in rows] == [("refusal", "6")] * 4


def test_a_smaller_sweep_into_the_same_directory_reports_its_own_jobs_alone(tmp_path, capsys):
    from hydra_plugins.steer_launcher.packed import _list_jobs
    from steer.runs.report import main

    for n in range(6):  # an earlier sweep of six
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10})
    assert build(tmp_path)["jobs"] == 6  # no list of its own: every job directory there
    _list_jobs(tmp_path, [tmp_path / "0"], 0)
    _list_jobs(tmp_path, [tmp_path / "1"], 1)  # the sweeper's second batch of the same sweep
    out = build(tmp_path)
    assert [r["job"] for r in out["rows"]] == ["0", "1"] and out["jobs"] == 2 and out["left_out"] == 4
    assert main([str(tmp_path)]) == 0
    assert "4 job directories of an earlier sweep here left out" in capsys.readouterr().out
    _list_jobs(tmp_path, [tmp_path / str(n) for n in range(6)], 0)  # the first sweep again: all of it
    assert build(tmp_path)["left_out"] == 0
    job(tmp_path, "lr=1 x", ["lr=1 x"], {"kl_mean": 1.0})  # a name with a space (a subdir from override_dirname)
    _list_jobs(tmp_path, [tmp_path / "lr=1 x"], 0)
    assert [r["job"] for r in build(tmp_path)["rows"]] == ["lr=1 x"]


def test_a_sweep_starting_forgets_the_job_list_of_the_one_before(tmp_path):
    from omegaconf import OmegaConf

    from hydra_plugins.steer_launcher.packed import _list_jobs
    from steer.runs.sweep import SummaryCallback

    for n in range(3):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10})
    _list_jobs(tmp_path, [tmp_path / "0", tmp_path / "1"], 0)  # an earlier packed sweep of two
    SummaryCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert build(tmp_path)["jobs"] == 3  # a later sweep of three by a launcher that lists none: all of them


def test_a_sweep_starting_removes_the_report_of_the_one_before_and_only_it(tmp_path):
    from omegaconf import OmegaConf

    from steer.runs.sweep import SummaryCallback

    for n in range(2):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10, "ppl_steered": 3.0 + n})
    written = build(tmp_path)
    for name in ("notes.png", "edit.scale.png", "status.png", "job.png"):  # named by no metric column
        (tmp_path / name).write_bytes(b"the user's")
    SummaryCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert not any(p.exists() for p in [written["summary"], *written["plots"]]) and len(written["plots"]) == 2
    assert all((tmp_path / n).read_bytes() == b"the user's" for n in ("notes.png", "edit.scale.png", "status.png",
                                                                       "job.png"))


def test_a_report_rebuilt_drops_the_plots_of_metrics_no_job_has_now(tmp_path):
    for n in range(2):
        job(tmp_path, n, [f"edit.scale={n}"], {"kl_mean": n / 10, "ppl_steered": 3.0 + n})
    assert (tmp_path / "ppl_steered.png").name in [p.name for p in build(tmp_path)["plots"]]
    for n in range(2):
        (tmp_path / str(n) / "metrics.json").write_text(json.dumps({"kl_mean": n / 5}))
    out = build(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["kl_mean.png"] == [p.name for p in out["plots"]]


def test_a_sweep_resumed_with_progress_off_has_the_same_swept_parameters(tmp_path):
    for n in range(3):  # job 2 added by a resume that also turned progress off (which changes no result)
        job(tmp_path, n, [f"edit.scale={n}"] + (["progress=false", "cache_dir=/c"] if n == 2 else []),
            {"kl_mean": n / 10})
    out = build(tmp_path)
    assert out["swept"] == ["edit.scale"] and {p.name for p in out["plots"]} == {"kl_mean.png"}


def test_a_sweepers_escapes_are_not_part_of_the_reported_value(tmp_path):
    for n in range(2):  # as the basic sweeper writes overrides.yaml for -m 'extract.out=v${tap.layer}.safetensors'
        job(tmp_path, n, [f"tap.layer={n}", "extract.out=v$\\{tap.layer\\}.safetensors",
                          "prompts.steer=[Hello\\ there,Bye]"], {"kl_mean": n / 10})
    rows = build(tmp_path)["rows"]
    assert [r["extract.out"] for r in rows] == ["v${tap.layer}.safetensors"] * 2
    assert rows[0]["prompts.steer"] == "[Hello\\ there,Bye]"  # a list keeps its escapes: a comma there is structure


def test_an_override_holding_an_interpolation_is_reported_as_written(tmp_path):
    for n in range(2):
        job(tmp_path, n, [f"tap.layer={n}", "extract.out='v${tap.layr}.safetensors'"], {"kl_mean": n / 10})
    assert [r["extract.out"] for r in build(tmp_path)["rows"]] == ["v${tap.layr}.safetensors"] * 2


def test_a_failed_jobs_error_is_the_exceptions_own_line_not_its_indented_tail(tmp_path):
    job(tmp_path, 0, ["edit.scale=1"], None)
    (tmp_path / "0" / "error.txt").write_text(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
        "omegaconf.errors.InterpolationKeyError: Interpolation key 'nope' not found\n"
        "    full_key: edit.vector.path\n    object_type=VectorConf\n")
    assert build(tmp_path)["rows"][0]["error"] == ("omegaconf.errors.InterpolationKeyError: Interpolation key "
                                                   "'nope' not found")


def test_a_plot_over_an_integer_setting_has_integer_ticks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from steer.runs.report import plot

    for layer in range(4):
        job(tmp_path, layer, [f"tap.layer={layer}"], {"kl_mean": layer / 10})
    rows = build(tmp_path)["rows"]
    ticks = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (ticks.append(list(fig.axes[0].get_xticks())), close(fig)))
    plot(tmp_path, rows, ["tap.layer"])
    assert ticks and all(float(t).is_integer() for t in ticks[0])


def test_a_file_is_held_by_one_job_of_a_sweep(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from steer.errors import ConfigError
    from steer.runs.sweep import claim

    out = tmp_path / "v.safetensors"
    claim(tmp_path, 3, "extract.out", out)
    claim(tmp_path, 3, "extract.out", out)  # the same job again (requeued) still holds it
    with pytest.raises(ConfigError, match=rf"^extract.out: job #3 of this sweep writes {out} too"):
        claim(tmp_path, 4, "extract.out", tmp_path / "x" / ".." / "v.safetensors")  # the same file, another name
    claim(tmp_path, 4, "extract.out", tmp_path / "w.safetensors")

    def take(job):
        try:
            claim(tmp_path / "race", job, "extract.out", out)
            return job
        except ConfigError:
            return None
    with ThreadPoolExecutor(8) as pool:
        held = [j for j in pool.map(take, range(64)) if j is not None]
    assert len(held) == 1 and not list((tmp_path / "race").rglob("*.tmp"))


def test_a_file_is_held_by_one_job_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    import errno
    import os
    from concurrent.futures import ThreadPoolExecutor

    from steer.errors import ConfigError
    from steer.runs.sweep import claim

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)

    def take(job):
        try:
            claim(tmp_path, job, "extract.out", tmp_path / "v.safetensors")
            return job
        except ConfigError:
            return None
    with ThreadPoolExecutor(8) as pool:
        held = [j for j in pool.map(take, range(64)) if j is not None]
    assert len(held) == 1
    claim(tmp_path, held[0], "extract.out", tmp_path / "v.safetensors")


def test_a_steered_metric_is_drawn_against_its_baseline_and_the_baseline_gets_no_plot_of_its_own(tmp_path,
                                                                                                   monkeypatch):
    import matplotlib.pyplot as plt

    for n, scale in enumerate((2, 4, 8)):
        job(tmp_path, n, [f"edit.scale={scale}"], {"concept_baseline": 0.5, "concept_steered": 1.0 + scale,
                                                   "distinct2_baseline": 0.9, "distinct2_steered": 0.75})
    drawn = {}
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.update({fig.axes[0].get_ylabel(): [
        (ln.get_linestyle(), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()]}), close(fig)))
    out = build(tmp_path)["plots"]
    # distinct2_steered is the same everywhere: no plot; concept_baseline is concept_steered's reference line
    assert [p.name for p in out] == ["concept_steered.png"]
    assert drawn["concept_steered"] == [("-", [3.0, 5.0, 9.0]), ("--", [0.5, 0.5, 0.5])]


def test_texts_md_puts_each_jobs_texts_side_by_side_with_their_damage(tmp_path):
    rows = [{"prompt": "The weather | today", "baseline": "is fine.", "steered": "💡💡💡\nis", "damage": [
        "distinct-2 0.10 < 0.7 x 0.90"], "looping": True, "ppl_over": False},
        {"prompt": "Hi", "baseline": "there", "steered": "friend", "damage": [], "looping": False, "ppl_over": False}]
    for n, scale in enumerate((2, 4)):
        job(tmp_path, n, [f"edit.scale={scale}", "progress=false"], {"kl_mean": float(n)})
        (tmp_path / str(n) / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = build(tmp_path)
    text = out["texts"].read_text()
    assert "## job 0: `edit.scale=2`" in text and "## job 1: `edit.scale=4`" in text
    assert "| 1 | The weather \\| today | is fine. | 💡💡💡<br>is | distinct-2 0.10 < 0.7 x 0.90 |" in text
    assert "| 2 | Hi | there | friend | ok |" in text
