"""Conditions on the prompt (CAST) against a direct computation of their scores."""

import pytest
import torch

from interleaver.select import score
from steer.edits.condition import Condition


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 7, 16, generator=g), torch.randn(16, generator=g)


def cast_direct(h, v):
    """CAST's similarity as its paper writes it: P = v v^T / (v^T v) as a matrix, tanh(P h), their cosine."""
    p = torch.outer(v, v) / (v @ v)
    t = torch.tanh(p @ h)
    return float(h @ t / (h.norm() * t.norm()))


def test_cast_score_is_the_cosine_of_h_and_tanh_of_its_projection(data):
    h, v = data
    rows = h[:, 0]
    got = score(rows, v, "cast")
    for i in range(3):
        assert float(got[i]) == pytest.approx(cast_direct(rows[i].double(), v.double()), abs=1e-6)
    # the projector is v's line: a direction of the opposite sense scores the same
    torch.testing.assert_close(score(rows, -3 * v, "cast"), got)


def test_cosine_score_is_the_cosine_with_the_direction(data):
    h, v = data
    got = score(h[:, 0], v, "cosine")
    for i in range(3):
        assert float(got[i]) == pytest.approx(float(h[i, 0] @ v / (h[i, 0].norm() * v.norm())), abs=1e-6)


def test_reduce_reads_the_prompt_rows_only(data):
    h, v = data
    prompt = torch.zeros(3, 7, dtype=torch.bool)
    prompt[0, 2:5] = True  # left padding before, a continuation after
    prompt[1, :] = True
    prompt[2, 6] = True
    mean = Condition("x", v, reduce="mean", score="cosine").scores(h, prompt)
    last = Condition("x", v, reduce="last", score="cosine").scores(h, prompt)
    for i, rows in enumerate([h[0, 2:5], h[1], h[2, 6:]]):
        assert float(mean[i]) == pytest.approx(float(score(rows.mean(0)[None], v, "cosine")[0]), abs=1e-6)
        assert float(last[i]) == pytest.approx(float(score(rows[-1:], v, "cosine")[0]), abs=1e-6)


def test_compare_above_and_below():
    s = torch.tensor([-0.5, 0.1, 0.2, 0.9])
    assert Condition("x", torch.ones(2), compare="above", threshold=0.1).met(s).tolist() == [False, False, True, True]
    assert Condition("x", torch.ones(2), compare="below", threshold=0.1).met(s).tolist() == [True, False, False, False]
