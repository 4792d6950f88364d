"""The reports opened in a real headless browser (tests/browser.py): what a reader sees is what the run's files
hold, the controls work, nothing is fetched from anywhere, and the accessibility basics hold."""

import json
from pathlib import Path

import pytest

from browser import Page, axe_violations, boxes_overlap, browser, keyboard_reach
from steer.report import jobs

# One worker runs these (--dist loadgroup): one browser and one sweep for all of them
pytestmark = pytest.mark.xdist_group("report_pages")


def rows_of_jobs(d: Path):
    """The sweep's rows as its summary.csv has them (steer.report.jobs reads them from the jobs)."""
    return jobs.read_jobs(jobs.job_dirs(d)[0])

HTML_PROMPTS = ['Tell me about <b>bold</b> & "quoted" text', "The weather today is"]
CONTROLS = "button, select, a[href], summary, input, textarea, [tabindex='0']"


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


def rows(d: Path):
    return [json.loads(line) for line in (d / "results.jsonl").read_text(encoding="utf-8").splitlines()]


def opened(chromium, path: Path) -> Page:
    p = Page(chromium)
    p.page.goto(path.resolve().as_uri())
    return p


def only_the_file(p: Page, path: Path) -> None:
    """Every request the page made was for the report file itself (images are inline data)."""
    others = [u for u in p.requests if u != path.resolve().as_uri() and not u.startswith("data:")]
    assert not others, f"the report fetched {others}"


def texts_as_results(p: Page, d: Path) -> None:
    cards = p.page.locator("article.prompt")
    want = rows(d)
    assert cards.count() == len(want)
    for i, row in enumerate(want):
        card = cards.nth(i)
        assert card.locator(".prompt-text").text_content() == row["prompt"]
        assert card.locator("[data-role=baseline]").text_content() == row["baseline"]
        assert card.locator("[data-role=steered]").text_content() == row["steered"]


def test_run_report_shows_each_prompts_texts_escaped(chromium, cli, tmp_path):
    (tmp_path / "prompts.txt").write_text("\n".join(HTML_PROMPTS) + "\n")
    d = tmp_path / "run"
    res = cli(["prompts.steer_file=prompts.txt", "gen.max_new_tokens=12", f"hydra.run.dir={d}"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "report:" in res.stdout + res.stderr and (d / "report.html").is_file()
    p = opened(chromium, d / "report.html")
    try:
        texts_as_results(p, d)
        assert p.page.locator("b").count() == 0  # the prompt's <b> is text, not markup
        for key, value in json.loads((d / "metrics.json").read_text()).items():  # every metric, exact on hover
            assert p.page.locator(f".num[title='{value!r}']").count() >= 1 or value is None, key
        assert not axe_violations(p.page)
        assert not keyboard_reach(p.page, CONTROLS)
        only_the_file(p, d / "report.html")
        assert not p.errors
    finally:
        p.close()


def test_smollm2_joy_report_keeps_emoji(chromium, cli, smollm2_spec, tmp_path):
    d = tmp_path / "joy"
    res = cli(["+experiment=smollm2_joy", f"hydra.run.dir={d}"], tmp_path)  # the README's main job
    assert res.returncode == 0, res.stderr
    steered = [r["steered"] for r in rows(d)]
    assert any(ord(c) > 0xFFFF for s in steered for c in s), f"no emoji in {steered!r}: the test checks nothing"
    p = opened(chromium, d / "report.html")
    try:
        texts_as_results(p, d)
        only_the_file(p, d / "report.html")
    finally:
        p.close()


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, cache_dir, tiny_spec):
    from helpers import cli_once

    cwd = tmp_path_factory.mktemp("sweep")
    d = cwd / "sweep"
    res = cli_once(["-m", "tap.layer=1,2", "edit.scale=2,16", "gen.max_new_tokens=8",
                    "prompts.steer=['The weather today is','When I opened the letter, I felt','My friend said']",
                    f"hydra.sweep.dir={d}"], cwd)
    assert res.returncode == 0, res.stderr
    return d


def test_sweep_text_view_switches_prompts(chromium, sweep_dir):
    jobs = {r["job"]: r for r in rows_of_jobs(sweep_dir)}
    p = opened(chromium, sweep_dir / "report.html")
    try:
        for i, prompt in [(1, "When I opened the letter, I felt"), (2, "My friend said"), (0, "The weather today is")]:
            p.page.select_option("#prompt-pick", str(i))
            shown = p.page.locator(f".textview[data-prompt='{i}']")
            assert shown.is_visible() and p.page.locator(".textview:visible").count() == 1
            cells = shown.locator(".text.steered")
            assert cells.count() == len(jobs)
            for k in range(cells.count()):
                job = cells.nth(k).get_attribute("data-job")
                row = next(r for r in rows(sweep_dir / job) if r["prompt"] == prompt)
                assert cells.nth(k).text_content() == row["steered"], (job, prompt)
        # the grid is layer x scale: each job's cell sits in its layer's row and its scale's column
        heads = p.page.locator(".textview[data-prompt='0'] table.textgrid thead th").all_text_contents()[1:]
        for tr in p.page.locator(".textview[data-prompt='0'] table.textgrid tbody tr").all():
            layer = tr.locator("th").text_content()
            for c_i, td in enumerate(tr.locator("td").all()):
                job = td.locator(".text").get_attribute("data-job")
                assert (str(jobs[job]["tap.layer"]), str(jobs[job]["edit.scale"])) == (layer, heads[c_i])
        assert not axe_violations(p.page)
        only_the_file(p, sweep_dir / "report.html")
    finally:
        p.close()


def test_sweep_table_sorts_by_a_column(chromium, sweep_dir):
    jobs = rows_of_jobs(sweep_dir)
    p = opened(chromium, sweep_dir / "report.html")
    try:
        heads = p.page.locator("#jobs thead th").all_text_contents()
        col = heads.index("kl_mean")

        def column():
            return [float(x) for x in p.page.locator(f"#jobs tbody tr td:nth-child({col + 1})").evaluate_all(
                "tds => tds.map(td => td.dataset.v)")]

        def job_order():
            return p.page.locator("#jobs tbody tr td:nth-child(1)").all_text_contents()

        button = p.page.locator(f"#jobs thead button[data-col='{col}']")
        assert button.text_content() == "kl_mean"
        button.click()
        assert column() == sorted(r["kl_mean"] for r in jobs)
        assert job_order() == [r["job"] for r in sorted(jobs, key=lambda r: r["kl_mean"])]
        button.press("Enter")  # the keyboard sorts too
        assert p.page.get_by_role("button", name="kl_mean", exact=True).count() == 1  # the arrow is not its name
        assert column() == sorted((r["kl_mean"] for r in jobs), reverse=True)
        assert p.page.locator("#jobs thead th").nth(col).get_attribute("aria-sort") == "descending"
        assert p.page.locator("figure.plot img").count() >= 1  # the plots, inline
        assert not keyboard_reach(p.page, CONTROLS)
    finally:
        p.close()


def test_select_heat_map_labels_do_not_overlap(chromium, cli, tmp_path):
    d = tmp_path / "select"
    res = cli(["task=select", "select.layers=[0,1,2,3]", "select.scales=[1,8,64,512]", "gen.max_new_tokens=8",
               f"hydra.run.dir={d}"], tmp_path)
    assert res.returncode == 0, res.stderr
    sel = json.loads((d / "selection.json").read_text())
    assert any(not c["ok"] and c["why"] for c in sel["cells"]), "no rejected pair: the labels' test checks less"
    p = opened(chromium, d / "report.html")
    try:
        labels = p.page.locator("#heatmap .label, #heatmap .mark, #heatmap th").all()
        boxes = [x.bounding_box() for x in labels]
        assert all(b and b["width"] > 0 for b in boxes)
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert not boxes_overlap(boxes[i], boxes[j]), (labels[i].text_content(), labels[j].text_content())
        for cell in p.page.locator("#heatmap button.cell").all():  # each label inside its own cell
            outer = cell.bounding_box()
            for inner in cell.locator(".label, .mark").all():
                b = inner.bounding_box()
                assert outer["x"] <= b["x"] and b["x"] + b["width"] <= outer["x"] + outer["width"] + 0.5
        reasons = p.page.locator("#reasons dd").all_text_contents()
        assert set(reasons) == {c["why"] for c in sel["cells"] if not c["ok"]}
        # the chosen pair is framed, and a cell's texts are one click away
        if sel["best"]:
            assert p.page.locator("#heatmap button.cell.best").get_attribute("data-cell") == sel["best"]["dir"]
        cell = sel["cells"][-1]
        p.page.locator(f"#heatmap button[data-cell='{cell['dir']}']").click()
        view = p.page.locator(f".cellview[data-cell='{cell['dir']}']")
        assert view.is_visible()
        got = view.locator("[data-role=steered]").all_text_contents()
        assert got == [r["steered"] for r in rows(d / cell["dir"])]
        assert not axe_violations(p.page)
        only_the_file(p, d / "report.html")
    finally:
        p.close()
