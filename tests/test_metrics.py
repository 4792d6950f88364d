import math

import torch

from steer import metrics


def test_kl_is_zero_for_equal_logits_and_matches_direct():
    a = torch.randn(5, 11)
    assert metrics.kl_mean(a, a.clone()) == 0.0
    b = torch.randn(5, 11)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    assert math.isclose(metrics.kl_mean(a, b), float((p * (p / q).log()).sum(-1).mean()), rel_tol=1e-9)


def test_tokens_changed_counts_length_differences():
    assert metrics.tokens_changed([1, 2, 3], [1, 2, 3]) == 0
    assert metrics.tokens_changed([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.tokens_changed([1, 2, 3], [1, 2]) == 1
    assert metrics.tokens_changed([], [4, 4]) == 2


def test_projection_over_selected_rows():
    d = torch.tensor([[1.0, 0.0]])
    h = torch.tensor([[3.0, 1.0], [-1.0, 2.0], [10.0, 0.0]])
    assert metrics.projection(h, d, torch.tensor([True, True, False])) == 2.0
    assert metrics.projection(h, d, torch.tensor([False, False, False])) is None
    sub = torch.eye(2)
    assert math.isclose(metrics.projection(h, sub, torch.tensor([True, False, False])), math.sqrt(10))


def test_aggregate():
    rows = [dict(kl=0.0, tokens_changed=0, baseline_tokens=4, steered_tokens=4, proj_baseline=2.0, proj_steered=None),
            dict(kl=1.0, tokens_changed=2, baseline_tokens=4, steered_tokens=2, proj_baseline=4.0, proj_steered=None)]
    agg = metrics.aggregate(rows, 10.0)
    assert agg == {"kl_mean": 0.5, "tokens_changed_frac": 0.25, "proj_baseline": 3.0, "proj_steered": None,
                   "tokens_per_s": 10.0, "prompts": 2}
