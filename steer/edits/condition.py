"""Conditions on the prompt (conditional activation steering, CAST: Lee et al., ICLR 2025): a request's prompt is
read at a tap, reduced to one vector, scored against a condition direction and compared with a threshold; the
edits that name the condition act on that request's rows only where it holds.

For the reduced prompt vector h and the condition direction v:

    cast     cos(h, tanh(P h)),  P = v v^T / (v^T v)   (CAST's similarity, as IBM's activation-steering computes it)
    cosine   cos(h, v)

Both are cosines, so a threshold lies in [-1, 1]. `compare=above` holds where the score exceeds the threshold,
`below` where it is under it (IBM's library names these the other way round: its "smaller" means "the threshold is
smaller than the similarity"). The score is computed once per request, from the prompt's rows of the tap's value
(after that tap's own edits), and held: generated rows never decide again. Nothing here knows an engine; the
math is interleaver/select.py's, which a vLLM worker runs too.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from interleaver import select
from interleaver.select import score


@dataclass(frozen=True, eq=False)
class Condition:
    """One compiled condition. `path`: the module whose output is read; `vector`: float32 `[hidden]`. Edits that
    name the same condition hold the same object, and share its decision."""

    path: str
    vector: torch.Tensor
    reduce: str = "mean"  # the choices of steer.config.schema's Reduce, Score and Compare (edit.when)
    score: str = "cast"
    compare: str = "above"
    threshold: float = 0.0

    def scores(self, h: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """Each row's score, float32 `[batch]`, from `h` `[batch, positions, hidden]` and the bool mask `prompt`
        `[batch, positions]` of the positions holding the row's prompt (at least one each)."""
        x = h.float()
        m = prompt.to(x.dtype)[..., None]
        if self.reduce == "mean":
            r = (x * m).sum(1) / m.sum(1)
        else:  # last: the prompt's last position (positions are in order, so the highest marked one)
            idx = (prompt.long() * torch.arange(prompt.shape[1], device=prompt.device)).argmax(1)
            r = x[torch.arange(x.shape[0], device=x.device), idx]
        return score(r, self.vector.to(r.device), self.score)

    def met(self, scores: torch.Tensor) -> torch.Tensor:
        """The decisions (bool `[batch]`) for `scores`."""
        return select.met(scores, self.compare, self.threshold)

    def to(self, device) -> "Condition":
        return Condition(self.path, self.vector.to(device), self.reduce, self.score, self.compare, self.threshold)


def describe(c: Optional[Condition], name: str) -> str:
    """`when(cast@layer4 mean > 0.1)`, for the run's description of its edits."""
    if c is None:
        return ""
    sign = ">" if c.compare == "above" else "<"
    return f"when({c.score}@{name} {c.reduce} {sign} {c.threshold:g})"
