"""steer.report without a browser: which page a directory gets, the texts' marking, every results.jsonl field
shown by its type (flags and per-prompt metrics that later versions add appear with no change here), the command
line, and a 100-job sweep's report size."""

import json
import subprocess
import sys

import pytest

from steer import report
from steer.report import build, text
from synthetic import make


@pytest.mark.parametrize("base, steered", [("The weather is nice today.", "The weather today is a joy 😊!"),
                                           ("", "Only steered"), ("same words", "same words"),
                                           ("a  b\n\nc", "a b\nc d"), ("<b>&amp;</b>", "<i>&</i> 🌈🌈")])
def test_marked_pieces_join_to_the_texts(base, steered):
    a, b = text.diff(base, steered)
    assert "".join(t for t, _ in a) == base and "".join(t for t, _ in b) == steered
    only_a = {t.strip() for t, changed in a if changed and t.strip()}
    only_b = {t.strip() for t, changed in b if changed and t.strip()}
    assert all(w not in steered.split() for w in " ".join(only_a).split() if w.isalpha())
    assert all(w not in base.split() for w in " ".join(only_b).split() if w.isalpha())


def test_a_prompts_fields_are_shown_by_their_type():
    row = {"prompt": "p", "fed": "p", "baseline": "a", "steered": "b", "prompt_ids": [1, 2], "kl": 0.5,
           "ppl_steered": None, "looping": True, "ppl_over_cap": False, "damage": ["looping"],
           "checks": {"ppl_ratio": 2.5, "over_cap": True}, "note": "kept"}
    v = build.prompt_view(row)
    assert v["flags"] == ["looping", "damage: looping", "checks.over_cap"]
    assert v["numbers"] == [("kl", 0.5), ("ppl_steered", None), ("checks.ppl_ratio", 2.5)]
    assert v["other"] == [("note", "kept")]


def test_numbers_are_rounded_for_reading_and_exact_on_hover():
    assert text.number(0.123456789) == "0.1235" and text.full(0.123456789) == "0.123456789"
    assert text.number(None) == "-" and text.number(6) == "6" and text.number(True) == "true"


def test_the_kind_of_a_directory(tmp_path):
    with pytest.raises(report.build.NothingToReport):
        build.kind(tmp_path)
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.json").write_text("{}")
    assert build.kind(tmp_path) == "sweep"
    (tmp_path / "0" / "selection.json").write_text("{}")
    assert build.kind(tmp_path / "0") == "select"
    (tmp_path / "metrics.json").write_text("{}")
    assert build.kind(tmp_path) == "run"


def test_the_command_rewrites_a_report_and_refuses_an_empty_directory(tmp_path):
    d = make(tmp_path / "sweep", layers=2, scales=2, prompts=2)
    job = d / "0"
    got = subprocess.run([sys.executable, "-m", "steer.report", str(job)], capture_output=True, text=True)
    assert got.returncode == 0 and str(job / "report.html") in got.stdout
    page = (job / "report.html").read_text()
    rows = [json.loads(x) for x in (job / "results.jsonl").read_text().splitlines()]
    assert "&lt;things&gt; &amp; more" in page and "<things>" not in page  # the prompt's markup is text
    assert "looping" in page or not any(r["looping"] for r in rows)
    got = subprocess.run([sys.executable, "-m", "steer.report", str(tmp_path / "empty")], capture_output=True,
                         text=True)
    assert got.returncode == 2 and "not a directory" in got.stderr
    (tmp_path / "empty").mkdir()
    got = subprocess.run([sys.executable, "-m", "steer.report", str(tmp_path / "empty")], capture_output=True,
                         text=True)
    assert got.returncode == 2 and "holds no run" in got.stderr


def test_a_hundred_job_sweeps_report_stays_under_5_mb(tmp_path):
    from steer.runs import report as summary

    d = make(tmp_path / "sweep", layers=10, scales=10)
    summary.build(d)
    out = report.write(d)
    assert out.stat().st_size < 5e6
    page = out.read_text()
    assert page.count("<tr>") >= 100 and "http://" not in page and "https://" not in page
