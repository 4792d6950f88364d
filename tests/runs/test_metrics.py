import math

import pytest

import torch

from steer.runs import metrics


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


def test_perplexity_is_exp_of_the_mean_negative_log_likelihood():
    import math

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [5.0, 5.0, 5.0]])
    targets = [0, 1]  # row 2 predicts nothing (the continuation has two tokens)
    p0 = math.exp(2) / (math.exp(2) + 1 + math.exp(-1))
    p1 = math.e / (math.e + 2)
    assert metrics.perplexity(logits, targets) == pytest.approx(math.exp(-(math.log(p0) + math.log(p1)) / 2))
    assert metrics.perplexity(logits, []) is None


def test_concept_is_the_mean_signed_projection_on_the_unit_direction():
    h = torch.tensor([[3.0, 4.0], [-1.0, 0.0]])
    d = torch.tensor([2.0, 0.0])  # not unit: the metric normalises it
    assert metrics.concept(h, d) == pytest.approx((3.0 - 1.0) / 2)
    assert metrics.concept(h[:0], d) is None and metrics.concept(h, None) is None


def test_sentiment_is_vader_compound():
    assert metrics.sentiment("What a wonderful, happy day!") > 0.5
    assert metrics.sentiment("This is a terrible, miserable day.") < -0.5
    assert metrics.sentiment("The table has four legs.") == 0.0


def test_aggregate_keeps_the_old_keys_and_adds_the_new_where_rows_have_them():
    rows = [{"kl": 0.1, "tokens_changed": 1, "baseline_tokens": 2, "steered_tokens": 2, "proj_baseline": 1.0,
             "proj_steered": 2.0, "ppl_baseline": 3.0, "ppl_steered": 5.0, "concept_baseline": None,
             "concept_steered": 1.0}]
    agg = metrics.aggregate(rows, 10.0)
    assert agg["ppl_steered"] == 5.0 and agg["concept_baseline"] is None and "sentiment_steered" not in agg
    assert {"kl_mean", "tokens_changed_frac", "proj_baseline", "proj_steered", "tokens_per_s", "prompts"} <= set(agg)
