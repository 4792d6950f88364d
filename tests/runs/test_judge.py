"""The optional judge (metrics.judge) against steer's own CPU server on the tiny model as the endpoint: the requests it
sends, what it records of the replies (the tiny model's hold no rating: recorded as unparsed, and the run goes on),
the parsing of replies, and no request at all where no endpoint is named. The judge's quality is not tested here."""

import json

import pytest

from helpers import TWO_PROMPTS, compose
from serve_common import MODEL, client
from steer.runs import judge
from steer.tasks import registry

RUN = [TWO_PROMPTS, "gen.max_new_tokens=4", "progress=false"]


def test_replies_are_parsed_for_their_last_rating_and_scored_as_axbench_does():
    assert judge.parse("Clear and fluent. Rating: [[2]]") == 2
    assert judge.parse("Rating: [[1]] ... on reflection, Rating: [[0]]") == 0
    assert judge.parse("Rating: [[1.0]]") == 1
    for reply in ("I would say 2.", "Rating: [[3]]", "Rating: [[two]]", "", None):
        assert judge.parse(reply) is None, reply
    assert judge.score({"concept": 2, "instruction": 1, "fluency": 2}) == pytest.approx(3 / (1 / 2 + 1 + 1 / 2))
    assert judge.score({"concept": 2, "instruction": 0, "fluency": 2}) == 0.0
    assert judge.score({"concept": 2, "instruction": None, "fluency": 2}) is None


def test_the_judge_asks_the_endpoint_and_a_reply_without_a_rating_is_recorded_and_the_run_goes_on(
        tmp_path, hf_url, console):
    out = tmp_path / "run"
    out.mkdir()
    cfg = compose(*RUN, f"metrics.judge.base_url={hf_url}/v1", f"metrics.judge.model={MODEL}",
                  "metrics.judge.concept=joy", "metrics.judge.max_tokens=6")
    agg = registry.main(cfg, out, console)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    c = client(hf_url)
    for r in rows:  # each reply is the endpoint's own answer to the request the judge describes
        for name in judge.CRITERIA:
            content = judge.ASK[name].format(concept="joy", prompt=r["prompt"], text=r["steered"]) + judge.END
            got = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
                {"role": "system", "content": judge.SYSTEM}, {"role": "user", "content": content}])
            assert r["judge_replies"][name] == got.choices[0].message.content
    for r in rows:  # the tiny model writes no "Rating: [[N]]"
        assert r["judge_unparsed"] == list(judge.CRITERIA) and r["judge"] is None
        assert all(r[f"judge_{name}"] is None for name in judge.CRITERIA)
    assert agg["judge"] is None and agg["judge_unparsed"] == 3 * len(rows)
    assert json.loads((out / "metrics.json").read_text())["judge_unparsed"] == 6


def test_no_request_leaves_the_machine_without_an_endpoint(tmp_path, cache_dir, tiny_spec, console, monkeypatch):
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **kw: pytest.fail(f"a request was made: {a}"))
    (tmp_path / "run").mkdir()
    agg = registry.main(compose(*RUN), tmp_path / "run", console)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert "judge" not in agg and not any(k.startswith("judge") for r in rows for k in r)


def test_a_judge_without_its_model_or_concept_is_refused_before_any_engine(tmp_path):
    from steer.errors import ConfigError

    url = "metrics.judge.base_url=http://127.0.0.1:9/v1"
    for over, field in (([url, "metrics.judge.concept=joy"], "metrics.judge.model"),
                        ([url, "metrics.judge.model=m", "metrics.judge.concept=null"], "metrics.judge.concept"),
                        (["metrics.judge.base_url=localhost:8000"], "metrics.judge.base_url"),
                        (["task=select", "select.layers=[1,2]", "select.rank_by=judge"], "select.rank_by")):
        with pytest.raises(ConfigError) as e:
            registry.prepare(compose(*RUN, *over), tmp_path)
        assert e.value.field == field, (over, e.value)
