"""Compiled edits: plain in-place tensor programs on a `[rows, hidden]` activation (docs/configs.md, "Edits").

Every kind is written as `h += w * delta(h)`, where `delta` is the full edit and `w` a per-row weight (1 on
rows the edit selects, 0 elsewhere), computed in float32 and cast back. Written so, one vectorised op serves a
step that mixes prompt and generated rows, and an engine that only sees a sum of tensors (vLLM's
`hidden + residual`) can compute `delta` on the sum and land it on one of them. Nothing here knows an engine.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from steer.config.schema import EditKind, Tokens
from steer.edits.condition import Condition
from interleaver.select import EVERY, Positions


@dataclass(frozen=True, eq=False)
class Edit:
    """One compiled edit. `basis` is float32 `[k, hidden]`: the raw vector for `add` and the centre for
    `rescale`; orthonormal rows for `ablate`; one unit row for `clamp` and `set`."""

    kind: EditKind
    scale: float
    basis: Optional[torch.Tensor]
    tokens: Tokens = Tokens.both
    lo: Optional[float] = None
    hi: Optional[float] = None
    value: float = 0.0
    when: Optional[Condition] = None  # act only on the rows of requests whose prompt meets it
    positions: Positions = EVERY  # where in the sequence, beside `tokens`

    @property
    def is_noop(self) -> bool:
        """True when the edit changes nothing, so an engine may skip it (the math is exact either way)."""
        if self.kind == EditKind.rescale:
            return self.scale == 1.0
        if self.kind == EditKind.clamp and self.lo is None and self.hi is None:
            return True
        return self.scale == 0.0

    @property
    def strength(self) -> float:
        """The factor `delta` is linear in: `scale`, or `scale - 1` for the `rescale` kind."""
        return self.scale - 1.0 if self.kind == EditKind.rescale else self.scale

    def unit(self) -> "Edit":
        """The same edit at strength 1, so `delta(h) == strength * unit().delta(h)`; engines that batch
        requests with different scales run the unit edit once with a per-row weight of `strength`."""
        return replace(self, scale=2.0 if self.kind == EditKind.rescale else 1.0)

    def to(self, device) -> "Edit":
        """The same edit with its vectors on `device` (so applying it does no host-to-device copy)."""
        return self if self.basis is None else replace(self, basis=self.basis.to(device))

    def direction(self) -> Optional[torch.Tensor]:
        """Orthonormal `[k, hidden]` rows spanning what the edit acts on, for projection metrics."""
        if self.basis is None:
            return None
        return self.basis if self.kind in (EditKind.ablate, EditKind.clamp, EditKind.set) else orthonormal(self.basis)

    def delta(self, h: torch.Tensor) -> torch.Tensor:
        """The change the edit makes to float32 rows `h` (`[rows, hidden]`)."""
        b = self.basis.to(h.device) if self.basis is not None else None
        if self.kind == EditKind.add:
            return (self.scale * b[0]).expand_as(h)
        if self.kind == EditKind.ablate:
            return -self.scale * (h @ b.T) @ b
        if self.kind == EditKind.rescale:
            centre = b[0] if b is not None else 0.0
            return (self.scale - 1.0) * (h - centre)
        d = b[0]
        p = h @ d
        if self.kind == EditKind.clamp:
            target = p if self.lo is None and self.hi is None else p.clamp(min=self.lo, max=self.hi)
        else:  # set
            target = torch.full_like(p, self.value)
        return (self.scale * (target - p))[:, None] * d

    def apply_(self, h: torch.Tensor, weight: Optional[torch.Tensor] = None) -> None:
        """Edit `h` (`[rows, hidden]`, any float dtype) in place; `weight` (`[rows]`) scales each row's edit."""
        x = h.float()
        d = self.delta(x)
        if weight is not None:
            d = d * weight.to(device=h.device, dtype=torch.float32)[:, None]
        h.copy_((x + d).to(h.dtype))

    def row_weight(self, is_prompt: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-row weights from a bool mask of prompt rows (None: every row)."""
        if self.tokens == Tokens.both:
            return None
        return (is_prompt if self.tokens == Tokens.prompt else ~is_prompt).float()


def orthonormal(vectors: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """Orthonormal rows spanning `vectors` (`[k, hidden]`), in their order, each keeping its source's sense;
    a row (numerically) in the span of those before it is dropped. Gram-Schmidt, twice, in float64."""
    kept = []
    for v in vectors.double():
        u = v.clone()
        for _ in range(2):
            for q in kept:
                u -= (u @ q) * q
        if u.norm() > rtol * v.norm():
            kept.append(u / u.norm())
    return torch.stack(kept).float()


def compile_edit(kind: EditKind, scale: float, vectors: Optional[torch.Tensor], *, tokens: Tokens = Tokens.both,
                 lo: Optional[float] = None, hi: Optional[float] = None, value: float = 0.0,
                 field: str = "edit", when: Optional[Condition] = None, positions: Positions = EVERY) -> Edit:
    """Turn an edit's config and its float32 `[k, hidden]` vectors into an Edit, checking they fit the kind
    (steer.config.checks: edit_numbers, edit_vectors)."""
    from steer.config import checks

    checks.edit_numbers(field, scale, lo, hi, value)
    checks.edit_vectors(field, kind, scale, vectors)
    if vectors is not None and kind not in (EditKind.add, EditKind.rescale):
        vectors = orthonormal(vectors)
    return Edit(kind, float(scale), vectors, tokens, lo, hi, value, when, positions)
