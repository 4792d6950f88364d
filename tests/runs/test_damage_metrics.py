"""distinct-2 and repetition on continuations counted by hand."""

import pytest

from steer.runs.metrics import distinct2, repetition


def test_distinct2_counts_distinct_bigrams_over_all():
    assert distinct2([1, 2, 3, 4]) == 1.0
    assert distinct2([7, 7, 7, 7, 7]) == pytest.approx(1 / 4)  # "la la la la la": one bigram, four times
    assert distinct2([1, 2, 1, 2, 3]) == pytest.approx(3 / 4)  # (1,2) (2,1) (1,2) (2,3)
    assert distinct2([5]) is None and distinct2([]) is None


def test_repetition_is_the_share_of_tokens_inside_a_repeated_trigram():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition([9, 9, 9, 9]) == 1.0  # (9,9,9) twice covers every token
    # (1,2,3) at 0 and 4 covers tokens 0-2 and 4-6; token 3 (the 8) and 7 (the 5) are outside
    assert repetition([1, 2, 3, 8, 1, 2, 3, 5]) == pytest.approx(6 / 8)
    assert repetition([1, 2]) == 0.0 and repetition([]) is None


def test_a_run_flags_each_prompt_and_counts_them(tmp_path, cache_dir, console):
    """Every prompt's flags in results.jsonl, recomputed here from its token ids (bigrams and runs counted by hand),
    and metrics.json's counts of them. Thresholds strict enough that the tiny model's texts trip them."""
    import json

    from helpers import TWO_PROMPTS, compose
    from steer.tasks import registry

    cfg = compose("gen.max_new_tokens=12", "edit.scale=8", TWO_PROMPTS, "select.max_run=2",
                  "select.min_distinct_ratio=1.01", "select.max_ppl_ratio=1.01", "progress=false")
    (tmp_path / "run").mkdir()
    agg = registry.main(cfg, tmp_path / "run", console)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]

    def runs(ids):  # the longest run of one token, by hand (units of two and more tokens aside)
        best, n = (1 if ids else 0), 1
        for a, b in zip(ids, ids[1:]):
            n = n + 1 if a == b else 1
            best = max(best, n)
        return best

    for r in rows:
        b, s = r["baseline_ids"], r["steered_ids"]
        d2 = lambda ids: len(set(zip(ids, ids[1:]))) / (len(ids) - 1)  # noqa: E731
        assert r["repeat_steered"] >= runs(s) and r["repeat_baseline"] >= runs(b)
        loops = d2(s) < 1.01 * d2(b) or (r["repeat_steered"] >= 2 and r["repeat_steered"] > r["repeat_baseline"])
        assert r["looping"] is loops, r
        assert r["ppl_over"] is (r["ppl_steered"] > 1.01 * r["ppl_baseline"]), r
        assert r["ppl_ratio"] == pytest.approx(r["ppl_steered"] / r["ppl_baseline"])
        assert bool(r["damage"]) is (r["looping"] or r["ppl_over"])
    assert agg["prompts_looping"] == sum(r["looping"] for r in rows)
    assert agg["prompts_ppl_over"] == sum(r["ppl_over"] for r in rows)
    assert agg["prompts_looping"] + agg["prompts_ppl_over"] > 0  # the thresholds tripped: the test saw a flag


def test_a_text_cut_inside_a_character_ends_at_its_last_whole_one():
    from steer.runs.run import whole_chars

    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731  (a byte-level tokenizer)
    bulb = list("💡".encode())  # four byte tokens
    assert whole_chars(decode, list(b"ok ") + bulb + bulb[:2]) == "ok 💡"
    assert whole_chars(decode, list(b"ok ") + bulb) == "ok 💡"
    assert whole_chars(decode, bulb[:3]) == ""
    assert whole_chars(decode, list(b"plain")) == "plain"
