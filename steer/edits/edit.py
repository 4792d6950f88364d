"""An edit's config compiled into the one edit record (interleaver/edit.py's `Edit`, whose `delta` is the math;
docs/configs.md, "Edits"): its vectors checked and made orthonormal where the kind moves a projection, its strength
from `edit.scale`.

Every kind is written as `h += w * delta(h)`, where `delta` is the full edit and `w` a per-row weight (1 on
rows the edit selects, 0 elsewhere), computed in float32 and cast back. Written so, one vectorised op serves a
step that mixes prompt and generated rows, and an engine that only sees a sum of tensors (vLLM's
`hidden + residual`) can compute `delta` on the sum and land it on one of them. Nothing here knows an engine.
"""

from typing import Optional

import torch

from interleaver.edit import PROJECT, Condition, Edit
from interleaver.select import EVERY, Positions
from steer.config.schema import EditKind, Tokens

__all__ = ["Edit", "compile_edit", "direction", "orthonormal", "scale_of"]


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
    # the record's strength is what delta is linear in: `edit.scale` itself, but for `rescale`, whose scale is the
    # stream's factor about its centre, scale - 1
    strength = float(scale) - 1.0 if kind == EditKind.rescale else float(scale)
    return Edit(kind, vectors, strength, tokens, lo, hi, value, when, positions)


def scale_of(e: Edit) -> float:
    """The edit's `edit.scale` (compile_edit's inverse for strength): the factor for `rescale`, else the strength."""
    return e.strength + 1.0 if e.kind == EditKind.rescale else e.strength


def direction(e: Edit) -> Optional[torch.Tensor]:
    """Orthonormal `[k, hidden]` rows spanning what the edit acts on, for projection metrics."""
    if e.basis is None:
        return None
    return e.basis if e.kind in PROJECT else orthonormal(e.basis)
