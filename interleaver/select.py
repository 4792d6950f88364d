"""The rules that pick an edit's rows and decide a condition, as array math that works on numpy arrays (the host
builds a step's weights with them) and on torch tensors (the HF engine, and a tap worker's graphs): defined once,
here, for both engines.

Positions (an edit's `positions`), from a row's absolute position `pos` in its sequence and its request's prompt
length `plen`:

    all                 every row
    last_prompt k       the prompt's last k rows
    first_generated n   the first n generated rows
    window i j          the rows at positions i..j, both included

Conditions (CAST: Lee et al., ICLR 2025), for a prompt reduced to one vector h and a direction v:

    cast     cos(h, tanh(P h)),  P = v v^T / (v^T v)   (as IBM's activation-steering computes it)
    cosine   cos(h, v)
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import torch

SELECTS = ("all", "last_prompt", "first_generated", "window")
REDUCES = ("mean", "last")
SCORES = ("cast", "cosine")
COMPARES = ("above", "below")

Where = Tuple[str, int, int]  # (select, a, b): last_prompt (k, 0), first_generated (n, 0), window (i, j)


def owners(counts: Any) -> Tuple[Any, Any]:
    """(owner, offset) of each row of `counts` laid end to end (numpy): the index of the span it is in, and its
    place in that span (a step's rows, `counts[i]` of them request i's; or an entry's rows, entry i's)."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)


def mask(where: Where, pos: Any, plen: Any) -> Any:
    """Bool, shaped as `pos` (each row's absolute position), `plen` broadcast against it."""
    select, a, b = where
    if select == "last_prompt":
        return (pos < plen) & (pos >= plen - a)
    if select == "first_generated":
        return (pos >= plen) & (pos < plen + a)
    if select == "window":
        return (pos >= a) & (pos <= b)
    return pos >= 0


@dataclass(frozen=True)
class Positions:
    """An edit's positions (`edit.positions`; the config's spelling is parsed by steer.config.checks.positions)."""

    select: str = "all"
    count: int = 1  # last_prompt: k; first_generated: n
    start: int = 0  # window: the first and last positions, both included
    end: int = 0

    @property
    def every(self) -> bool:
        return self.select == "all"

    def mask(self, pos, plen):
        """Bool, shaped as `pos` (each row's absolute position), `plen` broadcast against it (the request's prompt
        length)."""
        return mask(self.where(), pos, plen)

    @classmethod
    def of(cls, where: Where) -> "Positions":
        """`where()`'s selector back."""
        select, a, b = where
        if select == "window":
            return cls("window", start=a, end=b)
        return cls(select, count=a)

    def where(self) -> Where:
        """The selector as the interleaver's request entries carry it (interleaver/select.py)."""
        if self.select == "window":
            return ("window", self.start, self.end)
        return (self.select, self.count, 0)

    def describe(self) -> str:
        if self.select == "last_prompt":
            return f"last {self.count} prompt"
        if self.select == "first_generated":
            return f"first {self.count} generated"
        if self.select == "window":
            return f"positions {self.start}..{self.end}"
        return ""


EVERY = Positions()


def encode(rows: str, where: Optional[Where]) -> str:
    """A request entry's rows: the token kind (`both`, `prompt`, `generated`), and its positions where they are not
    every row (`prompt|last_prompt|3|0`)."""
    if where is None or where[0] == "all":
        return rows
    return "|".join([rows, where[0], str(int(where[1])), str(int(where[2]))])


def decode(code: str) -> Tuple[str, Optional[Where]]:
    """`encode`'s (rows, positions) back."""
    if "|" not in code:
        return code, None
    rows, select, a, b = code.split("|")
    if select not in SELECTS:
        raise ValueError(f"entry rows {code!r}: positions {select!r} is not one of {SELECTS}")
    return rows, (select, int(a), int(b))


def score(h: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
    """The score of each row of `h` (`[n, width]`) against direction `v` (`[width]`), float32 `[n]`."""
    h, v = h.float(), v.float()
    if kind == "cosine":
        return torch.nn.functional.cosine_similarity(h, v[None], dim=-1)
    projected = torch.tanh((h @ v)[:, None] * v[None] / (v @ v))  # tanh(P h), P = v v^T / (v^T v)
    return torch.nn.functional.cosine_similarity(h, projected, dim=-1, eps=1e-30)


def met(scores: torch.Tensor, compare: str, threshold: float) -> torch.Tensor:
    """The decisions (bool) for `scores`: `above` holds where a score exceeds the threshold, `below` under it."""
    return scores > threshold if compare == "above" else scores < threshold
