"""What a tap program runs: one edit as plain data, with the kind and row codes the bank and programs read.

The tap layer knows edits only through this record (an application compiles its own edits and converts them), so a
vLLM worker that imports the interleaver imports nothing of the application. Semantics, for a row h of the stream
(float32) and unit direction rows b of `basis`:

    add      delta = strength * basis[0]
    scale    delta = strength * (h - basis[0])        (no basis: about 0)
    ablate   delta = -strength * (h @ b.T) @ b        (k orthonormal rows)
    clamp    delta = strength * (clip(p, lo, hi) - p) * b, p = h @ b
    set      delta = strength * (value - p) * b

Every kind is linear in `strength`, so a stage is registered once at strength 1 and each request weighs its rows.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from interleaver.kinds import EditKind, Tokens

# Kinds that move the projection onto a direction: each is "move p = x.d to target(p)", with target(p) =
# clip(slope * p + offset, lo, hi): ablate 0 (slope 0), set `value` (slope 0), clamp clip(p) (slope 1).
PROJECT = (EditKind.ablate, EditKind.clamp, EditKind.set)


@dataclass(frozen=True, eq=False)
class StageEdit:
    """One edit as the tap layer runs it. `basis` is float32 `[k, hidden]`: the vector for `add`, the centre for
    `scale` (or None), orthonormal rows for `ablate`, one unit row for `clamp` and `set`."""

    kind: EditKind
    basis: Optional[torch.Tensor]
    lo: Optional[float] = None  # clamp bounds on the projection; None is unbounded
    hi: Optional[float] = None
    value: float = 0.0  # set: the projection to move to
    strength: float = 1.0  # the factor the delta is linear in
    rows: Tokens = Tokens.both

    def unit(self) -> "StageEdit":
        """The same edit at strength 1 on every row: what a bank stage holds."""
        return replace(self, strength=1.0, rows=Tokens.both)

    def to(self, device) -> "StageEdit":
        """The same edit with its vectors on `device` (so running it does no host-to-device copy)."""
        return self if self.basis is None else replace(self, basis=self.basis.to(device))

    def to_dict(self) -> dict:
        """Plain data (vLLM's RPC and additional_config carry no tensors): the inverse of `from_dict`."""
        return {"kind": self.kind.value, "basis": None if self.basis is None else self.basis.tolist(),
                "lo": self.lo, "hi": self.hi, "value": self.value, "strength": self.strength,
                "rows": self.rows.value}

    @classmethod
    def from_dict(cls, d: dict) -> "StageEdit":
        basis = None if d["basis"] is None else torch.tensor(d["basis"], dtype=torch.float32)
        return cls(EditKind(d["kind"]), basis, d["lo"], d["hi"], float(d["value"]), float(d.get("strength", 1.0)),
                   Tokens(d.get("rows", Tokens.both.value)))
