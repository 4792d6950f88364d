"""Edits under a condition on the prompt (edit.when) on the HF engine, on the tiny model: a request whose prompt
meets the condition is steered exactly as by the unconditional edit, one that does not exactly as unsteered, in a
mixed batch as alone."""

import pytest
import torch

from helpers import plan as plan_of
from steer.config.schema import EditKind, GenConf, TapConf, Tokens
from steer.edits.condition import Condition
from steer.edits.edit import compile_edit
from steer.edits.tap import resolve

PROMPTS = ["When I opened the letter, I felt", "The", "Tell me about the weather in the mountains today",
           "My favourite food is", "Once upon a time, in a quiet village by the sea, there lived",
           "The music in the hall was", "After the long journey we finally", "He said"]
GEN = GenConf(max_new_tokens=10)


@pytest.fixture(scope="module")
def setup(batched, tiny_spec):
    """The prompts' ids, a condition direction, the prompts' cosine scores at layer 1 (read directly from the
    unsteered model) and an add at layer 2."""
    torch.manual_seed(1)
    ids = [batched.encode(p) for p in PROMPTS]
    v = torch.randn(tiny_spec.hidden)
    path = resolve(TapConf(layer=1), tiny_spec).path
    scores = []
    for x in ids:
        h = batched.score(x, [], None, (path,)).captured[path]
        scores.append(float(torch.nn.functional.cosine_similarity(h.mean(0), v, dim=0)))
    add = torch.randn(1, tiny_spec.hidden)
    return ids, v, path, scores, add


def conditional(spec, setup, threshold, compare="above", score="cosine", layer=2, tokens=Tokens.both):
    ids, v, path, scores, add = setup
    c = Condition(path, v, "mean", score, compare, threshold)
    return plan_of(spec, layer, compile_edit(EditKind.add, 6.0, add, tokens=tokens, when=c))


def test_each_row_is_steered_exactly_where_its_prompt_meets_the_condition(batched, tiny_spec, setup):
    ids, _, _, scores, add = setup
    threshold = sorted(scores)[len(scores) // 2] - 1e-4  # half the prompts above it
    met = [s > threshold for s in scores]
    assert 0 < sum(met) < len(met)
    plan = conditional(tiny_spec, setup, threshold)
    always = plan_of(tiny_spec, 2, compile_edit(EditKind.add, 6.0, add))
    base = [batched.generate(x, None, GEN, 0) for x in ids]
    steered = [batched.generate(x, always, GEN, 0) for x in ids]
    assert sum(a != b for a, b in zip(base, steered)) >= len(ids) // 2  # the edit does change the text
    want = [s if m else b for s, b, m in zip(steered, base, met)]
    alone = [batched.generate(x, plan, GEN, 0) for x in ids]
    assert alone == want
    jobs = [(x, plan, 0) for x in ids] + [(x, None, 0) for x in ids[:3]]
    assert batched.generate_many(jobs, GEN) == want + base[:3]


def test_thresholds_minus_one_and_one_are_always_and_never(batched, tiny_spec, setup):
    ids, _, _, _, add = setup
    always = plan_of(tiny_spec, 2, compile_edit(EditKind.add, 6.0, add))
    jobs = [(x, always, 0) for x in ids] + [(x, None, 0) for x in ids]
    unconditional = batched.generate_many(jobs, GEN)
    for threshold, want in ((-1.0, unconditional[: len(ids)]), (1.0, unconditional[len(ids):])):
        plan = conditional(tiny_spec, setup, threshold)
        assert batched.generate_many([(x, plan, 0) for x in ids], GEN) == want


def test_an_edit_before_the_condition_tap_acts_on_generated_rows_only(batched, tiny_spec, setup):
    """At a tap the prompt passes before its condition is read, a met condition's edit can act only on the rows
    generated after: as the same edit on generated rows."""
    ids, _, _, _, add = setup
    plan = conditional(tiny_spec, setup, -1.0, layer=0)
    generated = plan_of(tiny_spec, 0, compile_edit(EditKind.add, 6.0, add, tokens=Tokens.generated))
    assert batched.generate_many([(x, plan, 0) for x in ids], GEN) == \
        batched.generate_many([(x, generated, 0) for x in ids], GEN)


def test_scores_under_a_condition_in_a_batch_equal_each_alone(batched, tiny_spec, setup):
    ids, _, path, scores, add = setup
    threshold = sorted(scores)[len(scores) // 2] - 1e-4
    plans = [conditional(tiny_spec, setup, threshold), conditional(tiny_spec, setup, -1.0, layer=0)]
    cont = batched.encode(" and then the rain came down")[1:6]
    jobs = [(x, cont, plans[i % 2], (path,)) for i, x in enumerate(ids)]
    for job, s in zip(jobs, batched.score_many(jobs)):
        ref = batched.score(*job)
        torch.testing.assert_close(s.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
    # a met condition scores the continuation as the unconditional edit does, an unmet one as no edit
    always = plan_of(tiny_spec, 2, compile_edit(EditKind.add, 6.0, add))
    for x, s in zip(ids, scores):
        got = batched.score(x, cont, plans[0]).logprobs
        want = batched.score(x, cont, always if s > threshold else None).logprobs
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
