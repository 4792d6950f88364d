"""How good an extracted direction is, said beside it (docs/extraction.md, "Diagnostics").

- `norm`: the direction's length, and `resid_norm`: the mean length of the residual stream at its tap over the
  tokens a row is read from (both prompt sets' kept tokens). Their ratio, `norm_ratio`, is what `edit.scale`
  means for `add`: scale 1 moves each token by `norm_ratio` of a typical activation. Directions of different
  concepts and layers differ here by several times, which is what `edit.scale_by` evens out.
- Held-out separation (k-fold): the prompts are cut into k folds (prompt i in fold i mod k, pairs kept together);
  the direction is fitted on k-1 folds, and the held-out prompts' rows are projected on it, less the midpoint of
  the fitted sets' projections. `heldout_acc` is the share on the right side of that midpoint (positive above,
  negative below), `heldout_auc` the chance a held-out positive projects above a held-out negative (ties count
  half), `heldout_effect` the gap between the two sets' mean projections in pooled standard deviations (Cohen's
  d). A direction that only fits its own prompts reads about 0.5 on both.
"""

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

KEYS = ("norm", "resid_norm", "norm_ratio", "heldout_acc", "heldout_auc", "heldout_effect", "folds")


def measure(direction: torch.Tensor, resid_norm: float, pos: torch.Tensor, neg: torch.Tensor,
            fit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], folds: int = 5) -> Dict[str, Optional[float]]:
    """The diagnostics of `direction`, fitted by `fit(pos_rows, neg_rows)` on rows `pos` and `neg`; `resid_norm`:
    the mean residual norm at its tap. Held-out figures are None where a set has fewer than 2 prompts."""
    norm = float(direction.double().norm())
    out: Dict[str, Optional[float]] = {"norm": norm, "resid_norm": resid_norm,
                                       "norm_ratio": norm / resid_norm if resid_norm > 0 else None}
    k = min(folds, len(pos), len(neg))
    out.update(dict.fromkeys(("heldout_acc", "heldout_auc", "heldout_effect"), None))
    out["folds"] = float(k) if k >= 2 else 0.0
    if k < 2:
        return out
    held_pos, held_neg = heldout_scores(pos, neg, fit, k)
    out.update(separation(held_pos, held_neg))
    return out


def heldout_scores(pos: torch.Tensor, neg: torch.Tensor, fit: Callable, k: int):
    """Every prompt's projection on the direction fitted without its fold, less that fit's midpoint."""
    fold_p, fold_n = torch.arange(len(pos)) % k, torch.arange(len(neg)) % k
    scores_p, scores_n = [], []
    for f in range(k):
        tp, tn = pos[fold_p != f], neg[fold_n != f]
        d = fit(tp, tn).double()
        u = d / d.norm() if float(d.norm()) > 0 else d
        mid = float(((tp.double().mean(0) + tn.double().mean(0)) / 2) @ u)
        scores_p += (pos[fold_p == f].double() @ u - mid).tolist()
        scores_n += (neg[fold_n == f].double() @ u - mid).tolist()
    return scores_p, scores_n


def separation(pos: Sequence[float], neg: Sequence[float]) -> Dict[str, Optional[float]]:
    """Accuracy of the sign, AUC and Cohen's d of held-out scores (positive set above 0, negative below)."""
    p, n = torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)
    acc = (float((p > 0).sum()) + float((n < 0).sum())) / (len(p) + len(n))
    diff = p[:, None] - n[None, :]
    auc = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    var = (float(p.var()) * (len(p) - 1) + float(n.var()) * (len(n) - 1)) / max(len(p) + len(n) - 2, 1)
    gap = float(p.mean() - n.mean())
    effect = gap / math.sqrt(var) if var > 0 else None
    return {"heldout_acc": acc, "heldout_auc": auc, "heldout_effect": effect}


def metadata(diag: Dict[str, Optional[float]], prefix: str = "diag.") -> Dict[str, str]:
    """The diagnostics as a vector file's metadata (strings): `diag.norm`, ... ("none" where not measured)."""
    return {f"{prefix}{k}": ("none" if diag.get(k) is None else f"{diag[k]:.8g}") for k in KEYS}


def from_metadata(meta: Dict[str, str], prefix: str = "diag.") -> Dict[str, Optional[float]]:
    """The diagnostics a vector file's metadata holds (`metadata`'s inverse; None where not measured)."""
    out: Dict[str, Optional[float]] = {}
    for k in KEYS:
        try:
            out[k] = float(meta[f"{prefix}{k}"])
        except (KeyError, ValueError):
            out[k] = None
    return out


WEAK_AUC = 0.7  # held-out AUC below this: the two prompt sets barely separate at the tap (0.5 is chance)


def line(name: str, d: Dict[str, Optional[float]]) -> str:
    """One line of a direction's diagnostics (a run that extracts its default direction says it so)."""
    parts = [f"{name}: norm {_fmt(d.get('norm'))} ({_fmt(d.get('norm_ratio'))} of the stream's "
             f"{_fmt(d.get('resid_norm'))})"]
    if d.get("heldout_auc") is not None:
        parts.append(f"held-out AUC {_fmt(d['heldout_auc'])}, d {_fmt(d.get('heldout_effect'))} over "
                     f"{int(d.get('folds') or 0)} folds")
        if d["heldout_auc"] < WEAK_AUC:
            parts.append("the prompt sets barely separate here, so it may steer little")
    return "; ".join(parts)


def best(diags: Sequence[Dict[str, Optional[float]]]) -> Optional[int]:
    """The index of the best-separating direction: highest held-out AUC, then effect size; None unmeasured."""
    def key(i):
        d = diags[i]
        return (d.get("heldout_auc") if d.get("heldout_auc") is not None else -1.0,
                d.get("heldout_effect") if d.get("heldout_effect") is not None else -math.inf)

    measured = [i for i, d in enumerate(diags) if d.get("heldout_auc") is not None]
    return max(measured, key=key) if measured else None


def table(names: List[str], diags: Sequence[Dict[str, Optional[float]]], chosen: Optional[int] = None):
    """A rich Table of the diagnostics, one row per tap; the best-separating one marked."""
    from rich.table import Table

    t = Table(title="extraction diagnostics" + (" (* separates best)" if chosen is not None and len(names) > 1
                                                else ""))
    for col in ("tap", "norm", "resid", "ratio", "acc", "AUC", "d", "k"):
        t.add_column(col, justify="left" if col == "tap" else "right", no_wrap=True)
    t.caption = ("norm: the direction's; resid: the stream's mean norm at the tap; ratio: norm / resid; acc, AUC, "
                 "d: held-out accuracy at the midpoint, AUC and effect size (Cohen's d) over k folds")
    for i, (name, d) in enumerate(zip(names, diags)):
        cells = [_fmt(d.get(k)) for k in ("norm", "resid_norm", "norm_ratio", "heldout_acc", "heldout_auc",
                                          "heldout_effect")]
        t.add_row(name + ("*" if i == chosen and len(names) > 1 else ""), *cells, str(int(d.get("folds") or 0)))
    return t


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"
