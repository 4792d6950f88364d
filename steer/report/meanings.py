"""What each metric means, shown on hover in a report (docs/metrics.md says it at length)."""

from typing import Optional

MEANINGS = {
    "kl_mean": "mean KL(steered || baseline) of the next-token distributions over the steered continuation",
    "tokens_changed_frac": "share of steered tokens that differ from the baseline's, position by position",
    "tokens_changed": "positions where the steered tokens differ from the baseline's",
    "kl": "mean KL(steered || baseline) of the next-token distributions over this continuation",
    "proj_baseline": "mean |h . d| at the first edit's tap as the unsteered model reads the steered text",
    "proj_steered": "mean |h . d| at the first edit's tap as the steered model reads the steered text",
    "ppl_baseline": "perplexity of the baseline continuation under the unsteered model",
    "ppl_steered": "perplexity of the steered continuation under the unsteered model (damage raises it)",
    "concept_baseline": "mean signed projection on the edit's direction as the unsteered model re-reads the baseline",
    "concept_steered": "mean signed projection on the edit's direction as the unsteered model re-reads the steered "
                       "text: does the text itself carry the concept",
    "distinct2_baseline": "distinct bigrams over all bigrams of the baseline: near 1 for varied text, low for a loop",
    "distinct2_steered": "distinct bigrams over all bigrams of the steered text: near 1 for varied text, low for a "
                         "loop",
    "rep_steered": "share of the steered tokens inside a 3-gram that occurs more than once",
    "sentiment_baseline": "VADER's compound sentiment of the baseline, in [-1, 1]",
    "sentiment_steered": "VADER's compound sentiment of the steered text, in [-1, 1]",
    "tokens_per_s": "generated tokens per second, baseline and steered together (a packed sweep: the pack's)",
    "prompts": "prompts in the run",
    "baseline_tokens": "tokens in the baseline continuation",
    "steered_tokens": "tokens in the steered continuation",
    "best_layer": "the layer of the chosen pair",
    "best_scale": "the scale of the chosen pair",
    "best_gain": "concept gain of the chosen pair (concept_steered - concept_baseline)",
    "best_ppl_ratio": "ppl_steered / ppl_baseline of the chosen pair",
    "pairs": "(layer, scale) pairs run",
    "pairs_kept": "pairs within the perplexity cap whose text does not loop",
    "norm": "the direction's length",
    "resid_norm": "mean length of the residual stream at the tap",
    "norm_ratio": "the direction's length over the stream's: what scale 1 moves a token by",
    "heldout_acc": "share of held-out prompts on the right side of the fitted midpoint (k-fold)",
    "heldout_auc": "chance a held-out positive projects above a held-out negative (0.5: chance)",
    "heldout_effect": "gap between the held-out sets' mean projections in pooled standard deviations (Cohen's d)",
    "folds": "folds of the held-out check",
    "gain": "concept_steered - concept_baseline",
    "ppl_ratio": "ppl_steered / ppl_baseline",
}


def meaning(key: str) -> Optional[str]:
    """The meaning of a metric key (`diag.12.heldout_auc` reads as `heldout_auc`), None where none is written."""
    key = str(key).removesuffix(" (metric)")
    return MEANINGS.get(key) or MEANINGS.get(key.rsplit(".", 1)[-1])
