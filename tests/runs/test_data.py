"""Prompts and pairs from files (steer/runs/data.py): every format read, and bad input named before any engine."""

import json

import pytest

from helpers import cli_here
from steer.config.schema import PromptsConf
from steer.errors import ConfigError
from steer.runs import data

CAA = [{"question": "Is the glass half full?\n\nChoices:\n (A) Yes\n (B) No", "answer_matching_behavior": "(A)",
        "answer_not_matching_behavior": "(B)"},
       {"question": "Will it rain forever?\n\nChoices:\n (A) Yes\n (B) No", "answer_matching_behavior": "(B)",
        "answer_not_matching_behavior": "(A)"}]


def write(path, text):
    path.write_text(text)
    return path


def test_txt_is_one_prompt_a_line_with_escapes(tmp_path):
    f = write(tmp_path / "p.txt", "first prompt\n\n  \nsecond\\nline\\tand tab \\\\n\n")
    assert data.load_texts(f) == ["first prompt", "second\nline\tand tab \\n"]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "csv"])
def test_a_named_field_of_each_format(tmp_path, suffix):
    rows = [{"id": 1, "prompt": "The weather today is"}, {"id": 2, "prompt": "Tell me, \"why\", please."}]
    if suffix == "jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif suffix == "json":
        text = json.dumps(rows)
    else:
        text = 'id,prompt\n1,The weather today is\n2,"Tell me, ""why"", please."\n'
    f = write(tmp_path / f"p.{suffix}", text)
    assert data.load_texts(f, "prompt") == [r["prompt"] for r in rows]


def pairs(path, positive="positive", negative="negative"):
    """(positive, negative) prompts of a pairs file, as a job reads prompts.pairs_file."""
    p = PromptsConf(pairs_file=str(path), positive_field=positive, negative_field=negative)
    data.fill_prompts(p)
    return p.positive, p.negative


def test_a_saved_datasets_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"positive": "glad", "negative": "sad"}, {"positive": "sunny", "negative": "grey"}]
                               ).save_to_disk(str(tmp_path / "ds"))
    assert pairs(tmp_path / "ds") == (["glad", "sunny"], ["sad", "grey"])


def test_pairs_with_named_fields(tmp_path):
    f = write(tmp_path / "p.csv", "pos,neg\nI love it,I hate it\nbright,dark\n")
    assert pairs(f, "pos", "neg") == (["I love it", "bright"], ["I hate it", "dark"])


def test_caa_items_are_question_then_answer(tmp_path):
    f = write(tmp_path / "ab.json", json.dumps(CAA))
    pos, neg = pairs(f)
    assert pos == [CAA[0]["question"] + "\n(A)", CAA[1]["question"] + "\n(B)"]
    assert neg == [CAA[0]["question"] + "\n(B)", CAA[1]["question"] + "\n(A)"]
    assert [x.matching for x in data.load_ab(f)] == ["(A)", "(B)"]


def test_two_txt_files_paired_line_by_line(tmp_path):
    pos = write(tmp_path / "positive.txt", "happy\njoyful\n")
    neg = write(tmp_path / "negative.txt", "sad\ngloomy\n")
    assert data.load_txt_pairs(pos, neg) == (["happy", "joyful"], ["sad", "gloomy"])
    write(neg, "sad\n")
    with pytest.raises(ConfigError, match="prompts.negative_file: .*negative.txt' holds 1 prompts"):
        data.load_txt_pairs(pos, neg)


def test_the_shipped_dataset_is_balanced_ab():
    from steer.runs.data import dataset_path

    items = data.load_ab(dataset_path("optimism"))
    assert len(items) >= 50
    assert {x.matching for x in items} == {"(A)", "(B)"}
    assert abs(sum(x.matching == "(A)" for x in items) - len(items) / 2) <= 1
    assert all("(A) " in x.question and "(B) " in x.question for x in items)


BAD = [
    ("pairs.jsonl", '{"positive": "a", "negative": "b"}\n{"positive": "c"}\n', "prompts.pairs_file",
     "item 1: field 'negative' is missing"),
    ("pairs.jsonl", '{"pos": "a", "neg": "b"}\n', "prompts.pairs_file",
     "has no field 'positive'; its fields are neg, pos"),
    ("pairs.jsonl", "", "prompts.pairs_file", "is empty"),
    ("pairs.txt", "\n\n", "prompts.pairs_file", "is empty"),
    ("pairs.txt", "one\n", "prompts.pairs_file", "has no field 'positive'; its fields are text"),
    ("pairs.json", json.dumps([{**CAA[0], "answer_not_matching_behavior": "(A)"}]), "prompts.pairs_file",
     "item 0: answer_matching_behavior and answer_not_matching_behavior are both '(A)'"),
    ("pairs.json", json.dumps([{k: v for k, v in CAA[0].items() if k != "answer_matching_behavior"}]),
     "prompts.pairs_file", "has no field 'answer_matching_behavior'"),
    ("pairs.json", "[{\"positive\": ", "prompts.pairs_file", "cannot be read as json"),
    ("pairs.parquet", "x", "prompts.pairs_file", "expected a .txt, .jsonl, .json or .csv file"),
]


@pytest.mark.parametrize("name,text,field,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_pairs_file_names_file_and_field(tmp_path, name, text, field, message):
    f = write(tmp_path / name, text)
    with pytest.raises(ConfigError) as e:
        pairs(f)
    assert e.value.field == field and str(f) in str(e.value) and message in str(e.value)


def test_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="prompts.steer_file: .*nope.txt' does not exist"):
        data.load_texts(tmp_path / "nope.txt")


CLI_BAD = [
    (["prompts.pairs_file={d}/missing_field.jsonl"], "prompts.pairs_file: '{d}/missing_field.jsonl' has no field "
                                                     "'negative'; its fields are positive"),
    (["prompts.steer_file={d}/empty.txt"], "prompts.steer_file: '{d}/empty.txt' is empty"),
    (["prompts.pairs_file={d}/equal.json"], "answer_not_matching_behavior are both '(A)'"),
    (["prompts.positive_file={d}/empty.txt"], "prompts.negative_file: is unset"),
    (["task=eval", "eval.dataset={d}/equal.json"], "eval.dataset: '{d}/equal.json' item 0"),
    (["task=eval", "eval.dataset=pessimism"], "eval.dataset: 'pessimism' is neither a dataset shipped with steer"),
    (["task=eval", "eval.split=1"], "eval.split: must be in [0, 1)"),
    (["task=eval", "eval.split=0"], "eval.split: is 0, but edit.vector.path is null"),
    (["task=eval", "eval.split=0.001"], "eval.split: 0.001 of 60 items leaves 0 to extract from"),
    (["task=eval", "eval.scales=[]"], "eval.scales: is empty"),
]


@pytest.mark.parametrize("args,message", CLI_BAD, ids=[f"{i}" for i in range(len(CLI_BAD))])
def test_bad_files_exit_2_before_any_engine(tmp_path, cache_dir, args, message, monkeypatch, capsys):
    from steer.runs import job

    d = tmp_path / "in"
    d.mkdir()
    write(d / "missing_field.jsonl", '{"positive": "a"}\n')
    write(d / "empty.txt", "")
    write(d / "equal.json", json.dumps([{**CAA[0], "answer_not_matching_behavior": "(A)"}]))
    monkeypatch.setattr(job, "engine_for", lambda jobs: pytest.fail("an engine was started"))
    res = cli_here([a.format(d=d) for a in args], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert message.format(d=d) in res.stderr
    assert not [p for p in (tmp_path / "outputs").rglob("*") if p.name in ("results.jsonl", "metrics.json",
                                                                             "eval.json", "eval.png")]


def test_files_replace_the_prompt_lists(tmp_path, cache_dir):
    """The config a run sees once its files are read: the files' prompts, not the group file's lists."""
    from helpers import compose

    write(tmp_path / "steer.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    write(tmp_path / "ab.json", json.dumps(CAA))
    cfg = compose(f"prompts.steer_file={tmp_path}/steer.jsonl", f"prompts.pairs_file={tmp_path}/ab.json")
    data.fill_prompts(cfg.prompts)
    assert cfg.prompts.steer == ["one", "two"]
    assert cfg.prompts.positive == pairs(tmp_path / "ab.json")[0]


def test_ab_pairs_are_read_at_their_last_token_unless_the_config_says_how(tmp_path, cache_dir, smollm2_spec):
    """extract.position and extract.span "auto": CAA A/B pairs differ only in the answer, which a mean over the
    prompt drowns, and whose last token in a chat rendering is the generation prompt's, not the answer's."""
    from helpers import compose

    from steer.tasks import registry

    ab = write(tmp_path / "ab.json", json.dumps(CAA))
    plain = write(tmp_path / "pairs.jsonl", '{"positive": "glad", "negative": "sad"}\n')
    for args, want in (([f"prompts.pairs_file={ab}"], ("last", "all")),  # the tiny model: no chat template
                       ([f"prompts.pairs_file={plain}"], ("mean", "all")),
                       ([f"prompts.pairs_file={ab}", "extract.position=mean"], ("mean", "all")),
                       (["task=eval"], ("last", "all")), ([], ("mean", "all")),
                       (["extract.position=last", "extract.span=user"], ("last", "user")),
                       # SmolLM2 renders the pairs as chat: the last token of the user turn is the answer's
                       (["model=smollm2", f"prompts.pairs_file={ab}"], ("last", "user")),
                       (["model=smollm2", "task=eval"], ("last", "all"))):  # eval renders its pairs itself
        job = registry.prepare(compose(*args, f"cache_dir={cache_dir}"), tmp_path / "out")
        assert (job.cfg.extract.position, job.cfg.extract.span) == want, args


def test_a_malformed_jsonl_line_is_named_with_the_parsers_reason_and_nothing_else_is_printed(tmp_path, capfd):
    f = write(tmp_path / "pairs.jsonl", '{"positive": "a", "negative": "b"}\n\n{"positive": "c", "negative": "d"}\n'
                                        '{"positive": "e" "negative": "f"}\n')
    with pytest.raises(ConfigError) as e:
        data.records(f, "prompts.pairs_file")
    assert e.value.field == "prompts.pairs_file" and "line 4 is not JSON: Expecting ',' delimiter at column 18" \
        in str(e.value), e.value
    out, err = capfd.readouterr()
    assert out + err == ""  # no log lines of the library that reads the file
    f = write(tmp_path / "list.jsonl", '["positive", "negative"]\n')
    with pytest.raises(ConfigError, match="line 1 is a JSON list; each line of a .jsonl file must be an object"):
        data.records(f, "prompts.pairs_file")
