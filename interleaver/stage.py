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
An edit under a condition (`when`: an index into the engine's `StageCondition`s) is weighed on a row only where the
row's request met that condition, a decision made on the device while its prompt runs (interleaver/conditions.py).
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from interleaver import select
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
    when: Optional[int] = None  # the condition that gates it (an index into the engine's conditions), or None
    positions: Optional[select.Where] = None  # the rows it acts on by position (None: every row)

    def unit(self) -> "StageEdit":
        """The same edit at strength 1 on every row: what a bank stage holds (its condition stays: a stage's
        column is gated by it)."""
        return replace(self, strength=1.0, rows=Tokens.both, positions=None)

    def entry_rows(self) -> str:
        """The rows a request entry weighs: the token kind, and positions where set (select.encode)."""
        return select.encode(self.rows.value, self.positions)

    def to(self, device) -> "StageEdit":
        """The same edit with its vectors on `device` (so running it does no host-to-device copy)."""
        return self if self.basis is None else replace(self, basis=self.basis.to(device))

    def to_dict(self) -> dict:
        """Plain data (vLLM's RPC and additional_config carry no tensors): the inverse of `from_dict`."""
        return {"kind": self.kind.value, "basis": None if self.basis is None else self.basis.tolist(),
                "lo": self.lo, "hi": self.hi, "value": self.value, "strength": self.strength,
                "rows": self.rows.value, "when": self.when,
                "positions": None if self.positions is None else list(self.positions)}

    @classmethod
    def from_dict(cls, d: dict) -> "StageEdit":
        basis = None if d["basis"] is None else torch.tensor(d["basis"], dtype=torch.float32)
        where = d.get("positions")
        return cls(EditKind(d["kind"]), basis, d["lo"], d["hi"], float(d["value"]), float(d.get("strength", 1.0)),
                   Tokens(d.get("rows", Tokens.both.value)), d.get("when"),
                   None if where is None else (str(where[0]), int(where[1]), int(where[2])))


@dataclass(frozen=True, eq=False)
class StageCondition:
    """A condition on the prompt as the tap layer decides it: the prompt's rows of the value at `location` (after
    that tap's edits) reduced to one vector (`reduce`: mean or last), scored against `vector` (float32 `[width]`)
    by `score` (cast or cosine) and compared with `threshold` (`compare`: above or below). See select.py."""

    location: str
    vector: torch.Tensor
    reduce: str = "mean"
    score: str = "cast"
    compare: str = "above"
    threshold: float = 0.0

    def to(self, device) -> "StageCondition":
        return replace(self, vector=self.vector.to(device))

    def key(self) -> tuple:
        """What makes two conditions one (the engine registers each once)."""
        v = self.vector.detach().float().cpu().contiguous()
        return (self.location, v.shape[0], v.numpy().tobytes(), self.reduce, self.score, self.compare,
                float(self.threshold))

    def to_dict(self) -> dict:
        return {"location": self.location, "vector": self.vector.tolist(), "reduce": self.reduce,
                "score": self.score, "compare": self.compare, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: dict) -> "StageCondition":
        return cls(str(d["location"]), torch.tensor(d["vector"], dtype=torch.float32), str(d["reduce"]),
                   str(d["score"]), str(d["compare"]), float(d["threshold"]))
