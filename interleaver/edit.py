"""One edit as every layer reads it: the config compiles into it (steer.edits), the HF engine applies it, the tap
layer registers it as a stage of an EditBank and ships it to a vLLM worker as plain data. The tap layer imports
nothing of the application, so a vLLM worker that imports the interleaver knows edits through this record alone.

Semantics, for a row h of the stream (float32) and unit direction rows b of `basis`:

    add      delta = strength * basis[0]
    rescale  delta = strength * (h - basis[0])        (no basis: about 0; the stream's factor is strength + 1)
    ablate   delta = -strength * (h @ b.T) @ b        (k orthonormal rows)
    clamp    delta = strength * (clip(p, lo, hi) - p) * b, p = h @ b
    set      delta = strength * (value - p) * b

Every kind is linear in `strength`, so a stage is registered once at strength 1 and each request weighs its rows.
An edit under a condition (`when`) is weighed on a row only where the row's request met it: a decision made once,
while its prompt runs (on a vLLM worker on the device, interleaver/conditions.py).

Conditions on the prompt (conditional activation steering, CAST: Lee et al., ICLR 2025): a request's prompt is
read at a tap, reduced to one vector, scored against a condition direction (`cast` or `cosine`, as
interleaver/select.py defines them) and compared with a threshold. Both scores are cosines, so a threshold lies in
[-1, 1]. `compare=above` holds where the score exceeds the threshold, `below` where it is under it (IBM's library
names these the other way round: its "smaller" means "the threshold is smaller than the similarity"). The score is
computed from the prompt's rows of the tap's value (after that tap's own edits), and held: generated rows never
decide again.
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from interleaver import select
from interleaver.kinds import EditKind, Tokens
from interleaver.select import EVERY, Positions
from interleaver.vllm_internals import tap_location, tap_path

# Kinds that move the projection onto a direction: each is "move p = x.d to target(p)", with target(p) =
# clip(slope * p + offset, lo, hi): ablate 0 (slope 0), set `value` (slope 0), clamp clip(p) (slope 1).
PROJECT = (EditKind.ablate, EditKind.clamp, EditKind.set)


@dataclass(frozen=True, eq=False)
class Condition:
    """A condition on the prompt: `path`, the module whose output is read; `vector`, float32 `[width]`. Edits that
    name the same condition hold the same object, and share its decision."""

    path: str
    vector: torch.Tensor
    reduce: str = "mean"  # the choices of steer.config.schema's Reduce, Score and Compare (edit.when)
    score: str = "cast"
    compare: str = "above"
    threshold: float = 0.0

    @property
    def location(self) -> str:
        """The tap it reads, as the tap layer names taps."""
        return tap_location(self.path)

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
        return select.score(r, self.vector.to(r.device), self.score)

    def met(self, scores: torch.Tensor) -> torch.Tensor:
        """The decisions (bool `[batch]`) for `scores`."""
        return select.met(scores, self.compare, self.threshold)

    def to(self, device) -> "Condition":
        return replace(self, vector=self.vector.to(device))

    def key(self) -> tuple:
        """What makes two conditions one (an engine registers each once)."""
        v = self.vector.detach().float().cpu().contiguous()
        return (self.path, v.shape[0], v.numpy().tobytes(), self.reduce, self.score, self.compare,
                float(self.threshold))

    def to_dict(self) -> dict:
        """Plain data, as the tap layer ships it (by tap location): the inverse of `from_dict`."""
        return {"location": self.location, "vector": self.vector.tolist(), "reduce": self.reduce,
                "score": self.score, "compare": self.compare, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: dict) -> "Condition":
        return cls(tap_path(str(d["location"])), torch.tensor(d["vector"], dtype=torch.float32), str(d["reduce"]),
                   str(d["score"]), str(d["compare"]), float(d["threshold"]))


@dataclass(frozen=True, eq=False)
class Edit:
    """One edit. `basis` is float32 `[k, hidden]`: the vector for `add`, the centre for `rescale` (or None),
    orthonormal rows for `ablate`, one unit row for `clamp` and `set`. It acts on the rows `tokens` and
    `positions` select, of the requests whose prompt meets `when` (None: every request)."""

    kind: EditKind
    basis: Optional[torch.Tensor]
    strength: float = 1.0  # the factor delta is linear in
    tokens: Tokens = Tokens.both
    lo: Optional[float] = None  # clamp bounds on the projection; None is unbounded
    hi: Optional[float] = None
    value: float = 0.0  # set: the projection to move to
    when: Optional[Condition] = None
    positions: Positions = EVERY

    @property
    def inert(self) -> bool:
        """True when no strength makes the edit do anything (a clamp without bounds)."""
        return self.kind == EditKind.clamp and self.lo is None and self.hi is None

    @property
    def is_noop(self) -> bool:
        """True when the edit changes nothing, so an engine may skip it (the math is exact either way)."""
        return self.strength == 0.0 or self.inert

    def unit(self) -> "Edit":
        """The same edit at strength 1 on every row, so `delta(h) == strength * unit().delta(h)`: what a bank
        stage holds (its condition stays: a stage's column is gated by it)."""
        return replace(self, strength=1.0, tokens=Tokens.both, positions=EVERY)

    def entry_rows(self) -> str:
        """The rows a request entry weighs: the token kind, and positions where set (select.encode)."""
        return select.encode(self.tokens.value, None if self.positions.every else self.positions.where())

    def to(self, device) -> "Edit":
        """The same edit with its vectors on `device` (so applying it does no host-to-device copy)."""
        return self if self.basis is None else replace(self, basis=self.basis.to(device))

    def delta(self, h: torch.Tensor) -> torch.Tensor:
        """The change the edit makes to float32 rows `h` (`[rows, hidden]`)."""
        b = self.basis.to(h.device) if self.basis is not None else None
        if self.kind == EditKind.add:
            return (self.strength * b[0]).expand_as(h)
        if self.kind == EditKind.ablate:
            return -self.strength * (h @ b.T) @ b
        if self.kind == EditKind.rescale:
            return self.strength * (h - (b[0] if b is not None else 0.0))
        d = b[0]
        p = h @ d
        if self.kind == EditKind.clamp:
            target = p if self.lo is None and self.hi is None else p.clamp(min=self.lo, max=self.hi)
        else:  # set
            target = torch.full_like(p, self.value)
        return (self.strength * (target - p))[:, None] * d

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

    def to_dict(self, when: Optional[int] = None) -> dict:
        """Plain data (vLLM's RPC and additional_config carry no tensors): the inverse of `from_dict`. Its
        condition travels by `when`, its index in the engine's condition list, which travels beside it."""
        return {"kind": self.kind.value, "basis": None if self.basis is None else self.basis.tolist(),
                "strength": self.strength, "tokens": self.tokens.value, "lo": self.lo, "hi": self.hi,
                "value": self.value, "when": when,
                "positions": None if self.positions.every else list(self.positions.where())}

    @classmethod
    def from_dict(cls, d: dict, conditions: Sequence[Condition] = ()) -> "Edit":
        """`to_dict`'s edit, its condition looked up in `conditions` (the list its `when` indexes)."""
        basis = None if d["basis"] is None else torch.tensor(d["basis"], dtype=torch.float32)
        where, when = d.get("positions"), d.get("when")
        if when is not None and not 0 <= when < len(conditions):
            raise ValueError(f"an edit under condition {when}, and {len(conditions)} condition(s) given with it")
        return cls(EditKind(d["kind"]), basis, float(d.get("strength", 1.0)), Tokens(d.get("tokens", "both")),
                   d["lo"], d["hi"], float(d["value"]), None if when is None else conditions[when],
                   EVERY if where is None else Positions.of((str(where[0]), int(where[1]), int(where[2]))))
