import csv
import json

from steer.report import build, job_rows, swept


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
    rows = job_rows(tmp_path)
    assert swept(rows) == ["edit.scale", "tap.layer"]
    out = build(tmp_path)
    assert {p.name for p in out["plots"]} == {"kl_mean.png", "tokens_per_s.png"}
    assert all(p.stat().st_size > 1000 for p in out["plots"])


def test_report_cli_rebuilds_from_job_dirs(tmp_path):
    import subprocess
    import sys

    for n, scale in enumerate((0, 4)):
        job(tmp_path, n, [f"edit.scale={scale}"], {"kl_mean": float(scale)})
    res = subprocess.run([sys.executable, "-m", "steer.report", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "2 jobs, swept ['edit.scale']" in res.stdout and (tmp_path / "summary.csv").exists()
    res = subprocess.run([sys.executable, "-m", "steer.report", str(tmp_path / "nope")], capture_output=True, text=True)
    assert res.returncode == 2 and "is not a directory" in res.stderr
