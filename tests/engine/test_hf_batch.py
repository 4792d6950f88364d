"""The HF engine's batches against the same engine one request at a time (its `generate` and `score`, which run no
padding, no batch and no merged cache), on the tiny model in float32."""

import dataclasses

import pytest
import torch

from helpers import plan as plan_of
from steer.config.schema import EditKind, GenConf, Tokens
from steer.edits.edit import compile_edit
from steer.edits.plan import Plan
from steer.engine.hf_batch import Bound
from steer.errors import ConfigError

PROMPTS = ["When I opened the letter, I felt", "The", "Tell me about the weather in the mountains today",
           "My favourite food is", "Once upon a time, in a quiet village by the sea, there lived"]


def every_kind(spec):
    """A plan of each edit kind, on prompt, generated or all rows, and one of several edits on two taps."""
    torch.manual_seed(0)
    v = torch.randn(1, spec.hidden)
    sub = torch.randn(2, spec.hidden)
    plans = [
        plan_of(spec, 1, compile_edit(EditKind.add, 4.0, v)),
        plan_of(spec, 1, compile_edit(EditKind.add, 6.0, v, tokens=Tokens.generated)),
        plan_of(spec, 2, compile_edit(EditKind.add, -5.0, v, tokens=Tokens.prompt)),
        plan_of(spec, 1, compile_edit(EditKind.ablate, 1.0, sub)),
        plan_of(spec, 2, compile_edit(EditKind.clamp, 1.0, v, lo=-0.5, hi=0.5)),
        plan_of(spec, 1, compile_edit(EditKind.set, 1.0, v, value=3.0, tokens=Tokens.generated)),
        plan_of(spec, 2, compile_edit(EditKind.rescale, 1.7, v)),
        plan_of(spec, 0, compile_edit(EditKind.rescale, 0.5, None, tokens=Tokens.prompt)),
    ]
    two = plan_of(spec, 0, compile_edit(EditKind.add, 3.0, v))
    two.add(plans[3].taps["model.layers.1"], compile_edit(EditKind.clamp, 1.0, v, lo=0.0, hi=1.0))
    return plans + [two]


def jobs_of(engine, spec):
    """Every plan on prompts of different lengths, mixed with unsteered rows of the same prompts."""
    ids = [engine.encode(p) for p in PROMPTS]
    jobs = []
    for k, plan in enumerate(every_kind(spec)):
        jobs.append((ids[k % len(ids)], plan, k))
        jobs.append((ids[(k + 2) % len(ids)], None, 100 + k))
    return jobs


def test_greedy_batches_equal_each_job_alone(batched, tiny_spec):
    gen = GenConf(max_new_tokens=12)
    jobs = jobs_of(batched, tiny_spec)
    alone = [batched.generate(ids, plan, gen, seed) for ids, plan, seed in jobs]
    assert batched.generate_many(jobs, gen) == alone
    plain = [batched.generate(ids, None, gen, seed) for ids, plan, seed in jobs[::2]]
    assert sum(a != b for a, b in zip(alone[::2], plain)) >= len(plain) // 2  # the edits do change the text


def test_sampled_batches_are_reproducible_per_seed(batched, tiny_spec):
    gen = GenConf(max_new_tokens=10, temperature=1.0, top_p=0.9)
    jobs = jobs_of(batched, tiny_spec)[:8]
    got = batched.generate_many(jobs, gen)
    assert got == [batched.generate(ids, plan, gen, seed) for ids, plan, seed in jobs]
    # each row's sampler is its own: the same job in another batch, among other rows, samples the same
    assert batched.generate_many(jobs[3:5], gen) == got[3:5]


def test_rows_join_and_leave_within_the_bound(batched, tiny_spec):
    """A bound of 3 rows: jobs join as others finish (some stop early on max_new_tokens of their own length)."""
    gen = GenConf(max_new_tokens=9)
    jobs = jobs_of(batched, tiny_spec)
    alone = [batched.generate(ids, plan, gen, seed) for ids, plan, seed in jobs]
    batched.bound = Bound(rows=3, tokens=4096)
    try:
        assert batched.generate_many(jobs, gen) == alone
        batched.bound = Bound(rows=16, tokens=2 * (max(len(ids) for ids, _, _ in jobs) + 9))  # 2 rows by tokens
        assert batched.generate_many(jobs, gen) == alone
    finally:
        batched.bound = Bound(rows=8, tokens=4096)


def test_one_row_bound_runs_jobs_one_at_a_time(hf_engine, tiny_spec):
    was = hf_engine.bound
    hf_engine.bound = Bound(rows=1)
    try:
        jobs = jobs_of(hf_engine, tiny_spec)[:4]
        gen = GenConf(max_new_tokens=6)
        assert hf_engine.generate_many(jobs, gen) == [hf_engine.generate(i, p, gen, s) for i, p, s in jobs]
    finally:
        hf_engine.bound = was


def test_scores_in_a_batch_equal_each_job_scored_alone(batched, tiny_spec):
    taps = ("model.layers.1", "model.layers.2")
    jobs = []
    for ids, plan, seed in jobs_of(batched, tiny_spec):
        cont = batched.encode(" and then the rain came down")[1 : 2 + seed % 5]
        jobs.append((ids, cont, plan, taps[: 1 + seed % 2]))
    got = batched.score_many(jobs)
    for job, s in zip(jobs, got):
        ref = batched.score(*job)
        assert s.logprobs.shape == ref.logprobs.shape
        torch.testing.assert_close(s.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
        assert s.captured.keys() == ref.captured.keys()
        for path in ref.captured:
            torch.testing.assert_close(s.captured[path], ref.captured[path], atol=1e-4, rtol=1e-4)


def test_a_prompt_beyond_the_bound_is_a_config_error(batched):
    ids = batched.encode(PROMPTS[4])
    batched.bound = Bound(rows=8, tokens=len(ids) + 3)
    try:
        with pytest.raises(ConfigError, match="hf.batch_tokens"):
            batched.generate_many([(ids, None, 0)], GenConf(max_new_tokens=4))
        with pytest.raises(ConfigError, match="hf.batch_tokens"):
            batched.score_many([(ids, ids[:4], None, ())])
        assert len(batched.generate_many([(ids, None, 0)], GenConf(max_new_tokens=3))[0]) <= 3
    finally:
        batched.bound = Bound(rows=8, tokens=4096)


def test_no_tokens_asked_gives_none(batched):
    ids = batched.encode(PROMPTS[0])
    gen = dataclasses.replace(GenConf(), max_new_tokens=0)
    assert batched.generate_many([(ids, None, 0), (ids, Plan(), 1)], gen) == [[], []]
