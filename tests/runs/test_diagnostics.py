"""Extraction diagnostics against direct computations: scipy's Mann-Whitney U for the AUC, numpy for the k-fold
fits, Cohen's d and the accuracy; no model."""

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu

from steer.runs import diagnostics
from steer.runs.extract import Recipe, fit


def rows(seed, n, shift, hidden=16):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, hidden))
    x[:, 0] += shift
    return x


def test_separation_matches_scipy_and_numpy():
    g = np.random.default_rng(0)
    pos, neg = g.normal(0.5, 1, 9), g.normal(-0.2, 1, 7)
    pos[0] = neg[0]  # a tie counts half
    got = diagnostics.separation(pos.tolist(), neg.tolist())
    u = mannwhitneyu(pos, neg).statistic
    assert got["heldout_auc"] == pytest.approx(u / (len(pos) * len(neg)))
    pooled = ((len(pos) - 1) * pos.var(ddof=1) + (len(neg) - 1) * neg.var(ddof=1)) / (len(pos) + len(neg) - 2)
    assert got["heldout_effect"] == pytest.approx((pos.mean() - neg.mean()) / np.sqrt(pooled))
    assert got["heldout_acc"] == pytest.approx(((pos > 0).sum() + (neg < 0).sum()) / 16)


def test_heldout_scores_fit_without_the_scored_fold():
    pos, neg = rows(1, 7, 2.0), rows(2, 6, -2.0)
    k = 3
    expect_p, expect_n = [], []
    for f in range(k):  # prompt i in fold i mod k; diffmean without orthogonalisation, in numpy
        tp, tn = pos[np.arange(7) % k != f], neg[np.arange(6) % k != f]
        u = tp.mean(0) - tn.mean(0)
        u /= np.linalg.norm(u)
        mid = (tp.mean(0) + tn.mean(0)) / 2 @ u
        expect_p += list(pos[np.arange(7) % k == f] @ u - mid)
        expect_n += list(neg[np.arange(6) % k == f] @ u - mid)
    plain = Recipe(orthogonal_to_mean=False)
    got_p, got_n = diagnostics.heldout_scores(torch.tensor(pos, dtype=torch.float32),
                                              torch.tensor(neg, dtype=torch.float32),
                                              lambda a, b: fit(a, b, plain), k)
    np.testing.assert_allclose(got_p, expect_p, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_n, expect_n, rtol=1e-4, atol=1e-4)


def test_measure_says_norm_ratio_and_tells_a_real_direction_from_noise():
    sep_p, sep_n = torch.tensor(rows(3, 10, 4.0)).float(), torch.tensor(rows(4, 10, -4.0)).float()
    noise_p, noise_n = torch.tensor(rows(5, 10, 0.0)).float(), torch.tensor(rows(6, 10, 0.0)).float()
    f = lambda a, b: fit(a, b, Recipe(orthogonal_to_mean=False))  # noqa: E731
    d = f(sep_p, sep_n)
    good = diagnostics.measure(d, 2.0, sep_p, sep_n, f, folds=5)
    assert good["norm"] == pytest.approx(float(d.norm()), rel=1e-6)
    assert good["norm_ratio"] == pytest.approx(float(d.norm()) / 2.0, rel=1e-6)
    assert good["heldout_acc"] == 1.0 and good["heldout_auc"] == 1.0 and good["folds"] == 5
    bad = diagnostics.measure(f(noise_p, noise_n), 2.0, noise_p, noise_n, f, folds=5)
    assert bad["heldout_auc"] < 0.8 and bad["heldout_effect"] < good["heldout_effect"] / 4
    assert diagnostics.best([bad, good, {"heldout_auc": None}]) == 1
    one = diagnostics.measure(d, 2.0, sep_p[:1], sep_n, f)  # one positive prompt: nothing to hold out
    assert one["heldout_auc"] is None and one["folds"] == 0
    meta = diagnostics.metadata(one)
    assert meta["diag.heldout_auc"] == "none" and float(meta["diag.norm"]) == pytest.approx(one["norm"])


def test_a_line_of_diagnostics_warns_where_the_sets_barely_separate():
    good = {"norm": 6.27, "resid_norm": 142.0, "norm_ratio": 0.0441, "heldout_acc": 1.0, "heldout_auc": 1.0,
            "heldout_effect": 6.71, "folds": 5.0}
    assert diagnostics.from_metadata(diagnostics.metadata(good)) == pytest.approx(good)
    assert diagnostics.line("default direction at layer12", good) == (
        "default direction at layer12: norm 6.27 (0.0441 of the stream's 142); held-out AUC 1, d 6.71 over 5 folds")
    weak = diagnostics.line("d", {**good, "heldout_auc": 0.52})
    assert weak.endswith("the prompt sets barely separate here, so it may steer little")
    unmeasured = {**good, "heldout_acc": None, "heldout_auc": None, "heldout_effect": None, "folds": 0.0}
    assert diagnostics.line("d", diagnostics.from_metadata(diagnostics.metadata(unmeasured))) == (
        "d: norm 6.27 (0.0441 of the stream's 142)")
