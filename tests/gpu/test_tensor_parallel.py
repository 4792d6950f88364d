"""Tensor parallelism on two GPUs: every rank holds the whole residual stream, so each must make the same edit
on the same rows with the same vectors, or the ranks diverge.

Tolerance: greedy tokens at TP=2 must equal TP=1; first-step log-probs within 2e-3 (absolute; float32, the
runs differ in the all-reduce's summation order only)."""

import pytest
import torch

from gpu_common import GEN, LOGPROB_ATOL, PROMPTS, edits, vllm_engine
from helpers import plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two GPUs")]


@pytest.fixture(scope="module")
def tp1(tiny_spec, taps):
    return vllm_engine(tiny_spec, taps, tensor_parallel_size=1)


@pytest.fixture(scope="module")
def tp2(tiny_spec, taps):
    return vllm_engine(tiny_spec, taps, tensor_parallel_size=2)


@pytest.mark.parametrize("name", ["add", "ablate"])
def test_two_ranks_steer_like_one(tp1, tp2, tiny_spec, direction, name):
    p = plan(tiny_spec, 1, edits(direction)[name])
    jobs = [(tp1.encode(x), p, 0) for x in PROMPTS]
    steered = tp2.generate_many(jobs, GEN)
    assert steered == tp1.generate_many(jobs, GEN)
    assert steered != tp1.generate_many([(i, None, s) for i, _, s in jobs], GEN)  # the edit did something
    first2 = tp2.score(jobs[0][0], [], p).logprobs[-1]
    first1 = tp1.score(jobs[0][0], [], p).logprobs[-1]
    torch.testing.assert_close(first2, first1, atol=LOGPROB_ATOL, rtol=0)


def test_two_ranks_serve_a_mixed_batch_like_one(tp1, tp2, tiny_spec, direction):
    e = edits(direction)
    plans = [plan(tiny_spec, 1, e["add"]), plan(tiny_spec, 2, e["ablate"]), None]
    jobs = [(tp1.encode(x), p, 0) for x, p in zip(PROMPTS, plans)]
    assert tp2.generate_many(jobs, GEN) == tp1.generate_many(jobs, GEN)


def test_two_ranks_keep_one_copy_of_a_capture(tp1, tp2, tiny_spec, direction):
    p = plan(tiny_spec, 1, edits(direction)["add"])
    ids = tp1.encode(PROMPTS[0])
    path = tiny_spec.layer_path(1)
    cap2 = tp2.score(ids, [], p, (path,)).captured[path]
    cap1 = tp1.score(ids, [], p, (path,)).captured[path]
    assert cap2.shape == cap1.shape == (len(ids), tiny_spec.hidden)
    torch.testing.assert_close(cap2, cap1, atol=1e-4, rtol=1e-4)
