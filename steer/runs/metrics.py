"""Per-prompt and aggregate metrics of a steered run against its baseline."""

from typing import Dict, List, Optional

import torch

from steer.runs import damage


def kl_mean(steered_logits: torch.Tensor, baseline_logits: torch.Tensor) -> float:
    """Mean over rows of KL(steered || baseline) between next-token distributions (float32 logits or log-probs,
    as an engine's Scores hold)."""
    ls, lb = torch.log_softmax(steered_logits.double(), -1), torch.log_softmax(baseline_logits.double(), -1)
    return float((ls.exp() * (ls - lb)).sum(-1).mean())


def tokens_changed(baseline: List[int], steered: List[int]) -> int:
    """Positions where the two continuations differ (a position only one of them reaches counts)."""
    n = max(len(baseline), len(steered))
    return sum(1 for i in range(n) if i >= len(baseline) or i >= len(steered) or baseline[i] != steered[i])


def projection(h: torch.Tensor, basis: torch.Tensor, rows: torch.Tensor) -> Optional[float]:
    """Mean over the selected rows of |h . d| (of ||B h|| for a subspace B of orthonormal rows)."""
    if not bool(rows.any()):
        return None
    return float((h[rows].double() @ basis.double().T).norm(dim=-1).mean())


def aggregate(rows: List[Dict], tokens_per_s: float) -> Dict[str, Optional[float]]:
    """The run's metrics.json: means over prompts, the changed-token fraction over all positions."""
    def mean(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    positions = sum(max(r["baseline_tokens"], r["steered_tokens"]) for r in rows)
    out = {
        "kl_mean": mean("kl"),
        "tokens_changed_frac": sum(r["tokens_changed"] for r in rows) / positions if positions else 0.0,
        "proj_baseline": mean("proj_baseline"),
        "proj_steered": mean("proj_steered"),
        "tokens_per_s": tokens_per_s,
        "prompts": len(rows),
    }
    for key in DAMAGE_AND_CONCEPT:
        if any(key in r for r in rows):
            out[key] = mean(key)
    if any("looping" in r for r in rows):  # judged per prompt (steer/runs/damage.py): how many, not a mean
        counted = damage.counts(rows)
        out["prompts_looping"], out["prompts_ppl_over"] = counted["prompts_looping"], counted["prompts_ppl_over"]
    if any("when_met" in r for r in rows):  # edits under a condition (edit.when): how many prompts met it
        out["when_met"] = sum(bool(r.get("when_met")) for r in rows)
    return out


# Per-prompt keys that tell steering from damage, averaged into metrics.json when the rows have them.
DAMAGE_AND_CONCEPT = ("ppl_baseline", "ppl_steered", "distinct2_baseline", "distinct2_steered", "rep_steered",
                      "concept_baseline", "concept_steered", "probe_baseline", "probe_steered", "sentiment_baseline",
                      "sentiment_steered")


def perplexity(logits: torch.Tensor, targets: List[int]) -> Optional[float]:
    """exp of the mean negative log-likelihood of `targets`, row t of `logits` (or log-probs) predicting
    targets[t]; None for an empty continuation."""
    if not targets:
        return None
    lp = torch.log_softmax(logits[: len(targets)].double(), -1)
    nll = -lp[torch.arange(len(targets)), torch.tensor(targets)].mean()
    return float(nll.exp())


def distinct2(tokens: List[int]) -> Optional[float]:
    """Distinct bigrams over all bigrams of a continuation's tokens: 1 where no bigram repeats, near 0 for a loop
    ("La la la la ..."); None under two tokens. Perplexity misses such a loop (the model predicts it well)."""
    bigrams = list(zip(tokens, tokens[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else None


def repetition(tokens: List[int], n: int = 3) -> Optional[float]:
    """The fraction of a continuation's tokens that lie inside an n-gram occurring in it more than once; None for
    an empty continuation."""
    if not tokens:
        return None
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: Dict[tuple, int] = {}
    for g in grams:
        seen[g] = seen.get(g, 0) + 1
    inside = [False] * len(tokens)
    for i, g in enumerate(grams):
        if seen[g] > 1:
            inside[i : i + n] = [True] * n
    return sum(inside) / len(tokens)


def concept(h: torch.Tensor, direction: Optional[torch.Tensor]) -> Optional[float]:
    """Mean signed projection of the rows `h` on the unit `direction`: how much of the concept the text carries
    where the model reads it. None without rows or a direction."""
    if direction is None or h.shape[0] == 0:
        return None
    d = direction.double()
    return float((h.double() @ (d / d.norm())).mean())


_analyzer = None


def sentiment(text: str) -> float:
    """VADER's compound sentiment of `text`, in [-1, 1] (vaderSentiment's lexicon ships with the package)."""
    global _analyzer
    if _analyzer is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _analyzer = SentimentIntensityAnalyzer()
    return float(_analyzer.polarity_scores(text)["compound"])
