"""A tap's compiled edits as one replay callable: the vectorised in-place program a replayed step runs.

On vLLM's Llama-family layers a residual tap's value is the pair `(hidden, residual)` and the stream is their
sum (the next layer's fused add-norm forms it). Deltas are computed on the summed stream, in float32, and land
on `hidden` alone: the next layer then sees exactly `h + delta`, the HF engine's semantics, and a row whose
weights are all 0 is left bit for bit as it was.

Stages are run in groups of one (index in the tap's edit list, kind). A request holds at most one stage per
index at a tap, so every row sees at most one stage of a group, and computing a group's deltas side by side on
the same stream is exactly the sequential composition: one batched op per group per step, however many
requests and distinct vectors. Groups of a later index see the stream after the earlier ones.
"""

from dataclasses import dataclass
from itertools import groupby
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from interleaver.bank import Stage, StepRows
from steer.schema import EditKind


@dataclass
class _Group:
    index: int
    kind: EditKind
    cols: Any  # a slice of the weight matrix's columns (adjacent under bank.layout) or a LongTensor of them
    live: np.ndarray  # the group's columns, for the host-side check that a step uses any of them
    basis: torch.Tensor  # [m, hidden] (add: vectors; scale: centres; ablate: stacked orthonormal rows)
    expand: Optional[torch.Tensor]  # ablate: basis row -> group column, when some stage has k > 1
    lo: Optional[torch.Tensor] = None  # clamp/set: per column bounds, -inf/inf when open
    hi: Optional[torch.Tensor] = None
    is_set: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None


class TapProgram:
    def __init__(self, location: str, stages: List[Stage], residual: bool,
                 columns: Optional[Dict[int, int]] = None, device: Any = None):
        """`columns`: stage id -> weight column (None: a stage's column is its id); `device`: the
        activations' (None: the stages' vectors')."""
        self.location = location
        self.stages = stages
        self.residual = residual
        col = (lambda s: s.id) if columns is None else (lambda s: columns[s.id])
        key = lambda s: (s.index, s.edit.kind.value)  # noqa: E731
        if device is None:
            device = next((s.edit.basis.device for s in stages if s.edit.basis is not None), "cpu")
        self.groups = [_group(list(g), col, device) for _, g in groupby(sorted(stages, key=lambda s: (*key(s), col(s))),
                                                                key=key)]
        # request key -> row blocks kept for it (scoring passes only; clones, since the graph rewrites the slab)
        self.kept: Dict[str, List[torch.Tensor]] = {}

    def __call__(self, live: Any, step: StepRows) -> None:
        """Edit the step's rows of `live` in place (`live` already trimmed to the step's real rows)."""
        keep = step.capturing.get(self.location) if step.capturing else None
        groups = [g for g in self.groups if step.live is not None and step.live[g.live].any()]
        if not groups and not keep:
            return
        hidden, residual = _split(live, self.residual)
        n = hidden.shape[0]
        x = None
        if keep or any(g.kind != EditKind.add for g in groups):
            x = hidden.float() if residual is None else hidden.float() + residual.float()
        if groups:
            w_all = step.weights[:n]
            acc = None
            for index, level in groupby(groups, key=lambda g: g.index):
                delta = None
                for g in level:
                    delta = _delta(g, x, w_all[:, g.cols], delta)
                acc = delta if acc is None else acc.add_(delta)
                if x is not None:
                    x = x + delta
            # In-place add of a float32 delta computes in float32 and rounds once into hidden's dtype.
            hidden.add_(acc)
        for sp in keep or ():
            self.kept.setdefault(sp.edits.key, []).append(x[sp.start : sp.start + sp.count].detach().cpu().clone())


def _delta(g: _Group, x: Optional[torch.Tensor], w: torch.Tensor, acc: Optional[torch.Tensor]) -> torch.Tensor:
    """`acc` plus the group's delta on rows `x` under per-row, per-column weights `w` ([rows, columns])."""
    if g.kind == EditKind.add:
        return w @ g.basis if acc is None else acc.addmm_(w, g.basis)
    if g.kind == EditKind.scale:  # unit scale 2: delta = w * (x - centre)
        d = w.sum(1, keepdim=True) * x - w @ g.basis
    elif g.kind == EditKind.ablate:
        p = x @ g.basis.T
        d = -((p * (w if g.expand is None else w[:, g.expand])) @ g.basis)
    else:  # clamp and set: move the projection p to its target
        p = x @ g.basis.T
        target = torch.where(g.is_set, g.value, torch.maximum(torch.minimum(p, g.hi), g.lo))
        d = ((target - p) * w) @ g.basis
    return d if acc is None else acc.add_(d)


def _group(stages: List[Stage], col, device) -> _Group:
    s0 = stages[0]
    kind = s0.edit.kind
    cols = [col(s) for s in stages]
    contiguous = cols == list(range(cols[0], cols[0] + len(cols)))
    g = _Group(s0.index, kind, slice(cols[0], cols[-1] + 1) if contiguous else torch.tensor(cols, device=device),
               np.array(cols), None, None)
    if kind == EditKind.add:
        g.basis = torch.cat([s.edit.basis[:1] * s.edit.scale for s in stages]).to(device)
    elif kind == EditKind.scale:  # a stage with no centre scales about 0 (a [1, 1] zero broadcasts)
        hidden = max(s.edit.basis.shape[1] if s.edit.basis is not None else 1 for s in stages)
        g.basis = torch.cat([s.edit.basis[:1].to(device) if s.edit.basis is not None
                             else torch.zeros(1, hidden, device=device) for s in stages])
    elif kind == EditKind.ablate:
        g.basis = torch.cat([s.edit.basis for s in stages]).to(device)
        if any(s.edit.basis.shape[0] > 1 for s in stages):
            g.expand = torch.tensor([i for i, s in enumerate(stages) for _ in range(s.edit.basis.shape[0])],
                                    device=device)
    else:
        g.basis = torch.cat([s.edit.basis[:1] for s in stages]).to(device)
        inf = float("inf")
        g.lo = torch.tensor([s.edit.lo if s.edit.lo is not None else -inf for s in stages], device=device)
        g.hi = torch.tensor([s.edit.hi if s.edit.hi is not None else inf for s in stages], device=device)
        g.is_set = torch.tensor([kind == EditKind.set] * len(stages), device=device)
        g.value = torch.tensor([s.edit.value for s in stages], dtype=torch.float32, device=device)
    return g


def _split(live: Any, residual: bool):
    if isinstance(live, (tuple, list)):
        if residual and len(live) > 1 and isinstance(live[1], torch.Tensor):
            return live[0], live[1]
        return live[0], None
    return live, None
