import csv
import json

from steer.sweep import write_summary


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
    rows = list(csv.DictReader(write_summary(tmp_path).open()))
    assert [r["job"] for r in rows] == ["1", "2", "10"]
    assert [r["edit.scale"] for r in rows] == ["1", "2", "10"] and rows[2]["kl_mean"] == "1.0"
