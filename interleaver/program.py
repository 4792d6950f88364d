"""A tap's compiled edits as one replay callable: the vectorised in-place program a replayed step runs.

On vLLM's Llama-family layers a residual tap's value is the pair `(hidden, residual)` and the stream is their
sum (the next layer's fused add-norm forms it). Deltas are computed on the summed stream, in float32, and land
on `hidden` alone: the next layer then sees exactly `h + delta`, the HF engine's semantics, and a row whose
weights are all 0 is left bit for bit as it was.

Stages are run in groups of one (index in the tap's edit list, family), the families being `add`, `rescale`, and
the projection moves (`ablate`, `clamp`, `set`). A request holds at most one stage per index at a tap, so every
row sees at most one stage of a group, and computing a group's deltas side by side on the same stream is exactly
the sequential composition: one batched op per group per step, however many requests and distinct vectors.
Groups of a later index see the stream after the earlier ones.
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from interleaver import kernels
from interleaver.bank import Stage
from interleaver.rows import StepRows
from interleaver.edit import PROJECT
from interleaver.kinds import EditKind


FORMS = ("fused", "direct", "jit", "torch")  # how a program's call can run (TapProgram.form)


def _family(kind: EditKind) -> str:
    return "project" if kind in PROJECT else "rescale" if kind == EditKind.rescale else kind.value


@dataclass
class _Group:
    index: int
    family: str  # "add", "rescale" or "project"
    cols: Any  # a slice of the weight matrix's columns (adjacent under bank.layout) or a LongTensor of them
    host_cols: Any  # the same columns (a slice, or an index array), for the host-side check that a step uses any
    basis: torch.Tensor  # [m, hidden]: add vectors, scale centres, or the directions (an ablate's k rows each)
    expand: Optional[torch.Tensor] = None  # project: direction row -> group column, when some stage has k > 1
    centred: bool = True  # scale: some stage has a centre
    ablate_only: bool = False  # project: every target is 0, no bounds
    neg_basis: Optional[torch.Tensor] = None  # project: -basis
    slope: Optional[torch.Tensor] = None  # project: per direction row
    offset: Optional[torch.Tensor] = None
    lo: Optional[torch.Tensor] = None
    hi: Optional[torch.Tensor] = None


class TapProgram:
    def __init__(self, location: str, stages: List[Stage], residual: bool,
                 columns: Optional[Dict[int, int]] = None, device: Any = None, conditions: Any = None):
        """`columns`: stage id -> weight column (None: a stage's column is its id); `device`: the
        activations' (None: the stages' vectors'); `conditions`: the engine's interleaver.conditions.Conditions,
        where it decides any (gated stages read their decisions, and the conditions read here are decided here)."""
        self.location = location
        self.stages = stages
        self.residual = residual
        col = (lambda s: s.id) if columns is None else (lambda s: columns[s.id])
        key = lambda s: (s.index, _family(s.edit.kind))  # noqa: E731
        if device is None:
            device = next((s.edit.basis.device for s in stages if s.edit.basis is not None), "cpu")
        self.groups = [_group(list(g), col, device) for _, g in groupby(sorted(stages, key=lambda s: (*key(s), col(s))),
                                                                        key=key)]
        self._needs_x = any(g.family != "add" for g in self.groups)
        self.conditions = conditions
        gated = [(col(s), s.when) for s in stages if s.when is not None]
        if gated and conditions is None:
            raise ValueError(f"{location}: a stage under a condition, and no conditions given")
        # What Conditions.weigh reads of the gated weight columns: each one's condition (the row's decision on it
        # weighs the column)
        self._gate = None if not gated else conditions.gating([c for c, _ in gated], [w for _, w in gated])
        self._decides = ([] if conditions is None
                         else [i for i, c in enumerate(conditions.list) if c.location == location])
        # Every weight column the tap reads: a step that uses none of them has nothing to edit here
        self._cols = np.concatenate([np.arange(g.host_cols.start, g.host_cols.stop) if isinstance(g.host_cols, slice)
                                     else g.host_cols for g in self.groups] or [np.zeros(0, dtype=np.int64)])
        # One launch for the whole tap on a GPU, where every group is of one index (they all see one stream).
        self._fused = (_fused(self.groups) if self.groups and len({g.index for g in self.groups}) == 1
                       and kernels.available(device) else None)
        if self._fused is not None:
            try:
                self._fused.warm()
            except Exception as e:  # a kernel that does not build costs speed, never the edit: the torch form is exact
                warnings.warn(f"{location}: the fused tap kernel did not build ({type(e).__name__}: {e}); "
                              "this tap runs its edits in the torch form", RuntimeWarning, stacklevel=2)
                self._fused = None
        # request key -> row blocks kept for it (scoring passes only; clones, since the graph rewrites the slab)
        self.kept: Dict[str, List[torch.Tensor]] = {}
        # How the calls edited: the fused kernel or the torch form (a profile says which a GPU engine took;
        # an in-graph or tap-graph call is counted when it is captured, not at each replay).
        self.ran = {"fused": 0, "torch": 0}

    def __call__(self, live: Any, step: StepRows) -> None:
        """Edit the step's rows of `live` in place (`live` already trimmed to the step's real rows)."""
        if self.at_break(live, None, step):  # the fused kernel's one launch, where it serves the step
            return
        keep = step.capturing.get(self.location) if step.capturing else None
        used = step.used
        if used is None:
            groups = ()
        elif step.all_used:
            groups = self.groups
        else:
            groups = [g for g in self.groups if used[g.host_cols].any()]
        hidden, residual = _split(live, self.residual)
        if groups or keep:
            self.ran["torch"] += 1
            x = None
            if keep or (self._needs_x and any(g.family != "add" for g in groups)):
                # Never in place: .float() of a float32 hidden is hidden itself.
                x = hidden.float() if residual is None else torch.add(hidden.float(), residual)
            if groups:
                x = _run(groups, hidden, x, self._weights(step.weights, hidden.shape[0]), keep_stream=bool(keep))
            for sp in keep or ():
                self.kept.setdefault(sp.edits.key, []).append(
                    x[sp.start : sp.start + sp.count].detach().cpu().clone())
        if self._decides and self.conditions.deciding:
            self._decide(hidden, residual)

    def _weights(self, w_all: torch.Tensor, rows: int) -> torch.Tensor:
        """The first `rows` rows of the weights, the gated columns weighed by each row's decisions (a copy)."""
        if self._gate is None:
            return w_all[:rows]
        return self.conditions.weigh(w_all[:rows], self._gate)

    def _decide(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        """Decide the conditions read at this tap, on the stream after its edits."""
        self.conditions.decide(self._decides, hidden, residual)

    @property
    def conditional(self) -> bool:
        """Whether the program decides a condition or weighs a stage by one (no fused-only or tap-graph path)."""
        return bool(self._decides) or self._gate is not None

    def at_break(self, live: Any, rows: Optional[int], step: StepRows) -> bool:
        """The step's edit on the first `rows` rows of `live` (a replayed graph's whole padded value, untrimmed;
        None: every row of a trimmed one) as one launch of the fused kernel, which skips the directions a row does
        not ask for: True when done, or when no row asks for any of the tap's stages; False where the step needs
        the torch form (no fused kernel, a kernel that does not fit, or a request keeps the tap's value)."""
        if self._decides and self.conditions.deciding:
            return False  # the step decides here: the general path
        if self._fused is None or (step.capturing and step.capturing.get(self.location)):
            return False
        if step.used is None or not (step.all_used or step.used[self._cols].any()):
            return True
        hidden, residual = _split(live, self.residual)
        weights = step.weights if self._gate is None else self._weights(step.weights, step.weights.shape[0])
        if not self._fused(hidden, residual, weights, rows):
            return False
        self.ran["fused"] += 1
        return True

    def table(self) -> kernels.Fused:
        """The direction table the fused kernel runs, built here where the kernel does not (off a GPU); for a
        program whose groups are all of one index, as the kernel's are."""
        if len({g.index for g in self.groups}) != 1:
            raise ValueError(f"{self.location}: a direction table needs groups of one index")
        return self._fused if self._fused is not None else _fused(self.groups)

    @property
    def fused(self) -> bool:
        """Whether the program runs as the fused kernel (a CUDA device with Triton, groups of one index, and a
        kernel that built); else as its torch form."""
        return self._fused is not None

    @contextmanager
    def form(self, name: str) -> Iterator[None]:
        """Run the program's calls inside the block in form `name`, to measure one against another: "fused",
        the kernel as it launches by default (directly once compiled, bound to its
        tensors' addresses); "direct", launched directly but resolving its arguments at each launch; "jit", every
        launch through Triton's JIT; "torch", the torch form. The same edit either way."""
        if name not in FORMS:
            raise ValueError(f"form {name!r}: expected one of {FORMS}")
        fused = self._fused
        if name != "torch" and fused is None:
            raise ValueError(f"{self.location}: no fused kernel here (no CUDA or Triton, or it did not build)")
        was = (fused.direct, fused.bound) if fused is not None else None
        if name == "torch":
            self._fused = None
        elif name != "fused":
            fused.direct, fused.bound = name == "direct", False
        try:
            yield
        finally:
            self._fused = fused
            if fused is not None:
                fused.direct, fused.bound = was

    def in_graph_norm(self, live: Any, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> bool:
        """`in_graph`, then the next layer's residual add and RMSNorm, as one launch (kernels.Fused.edit_norm):
        `live`'s hidden becomes the normed sum and its residual the sum. False, nothing done, where that kernel
        does not run (no residual, no fused kernel, or nothing to edit: the caller's norm runs as it would)."""
        if not self.groups or self._fused is None or not self.residual or self.conditional:
            return False
        hidden, residual = _split(live, self.residual)
        if not self._fused.edit_norm(hidden, residual, weights, norm_weight, eps):
            return False
        self.ran["fused"] += 1
        return True

    def warm_norm(self) -> None:
        """Compile `in_graph_norm`'s kernel now, outside any capture (where the program runs fused)."""
        if self._fused is not None and self.residual:
            self._fused.warm_norm()

    def in_graph(self, live: Any, weights: torch.Tensor) -> None:
        """Edit every row of `live` in place with the weights' first rows, running every group whatever the
        step: no host decision, so a CUDA graph can capture it. Rows whose weights are 0 (padding, unsteered
        requests) get a delta of exactly 0."""
        hidden, residual = _split(live, self.residual)
        if self.groups:
            w = self._weights(weights, hidden.shape[0])
            if self._fused is not None and self._fused(hidden, residual, w):
                self.ran["fused"] += 1
            else:
                self.ran["torch"] += 1
                x = None
                if self._needs_x:
                    x = hidden.float() if residual is None else torch.add(hidden.float(), residual)
                _run(self.groups, hidden, x, w, keep_stream=False)
        if self._decides:  # every step: what the rows decide is data
            self._decide(hidden, residual)


def _run(groups: List[_Group], hidden: torch.Tensor, x: Optional[torch.Tensor], w_all: torch.Tensor,
         keep_stream: bool) -> Optional[torch.Tensor]:
    """Land the groups' deltas on `hidden`, a later index seeing the stream after the earlier ones. Returns the
    stream after all of them when `keep_stream` (a capture wants it), else the stream the last level saw."""
    levels = [groups] if len(groups) == 1 else [list(level) for _, level in groupby(groups, key=lambda g: g.index)]
    acc = None
    for k, level in enumerate(levels):
        delta = None
        for g in level:
            delta = _delta(g, x, w_all[:, g.cols], delta)
        acc = delta if acc is None else acc.add_(delta)
        if x is not None and (keep_stream or k + 1 < len(levels)):
            x = x + delta
    # In-place add of a float32 delta computes in float32 and rounds once into hidden's dtype.
    hidden.add_(acc)
    return x


def _delta(g: _Group, x: Optional[torch.Tensor], w: torch.Tensor, acc: Optional[torch.Tensor]) -> torch.Tensor:
    """`acc` plus the group's delta on rows `x` under per-row, per-column weights `w` ([rows, columns]); a row
    has at most one stage of a group, so the group's stages are computed side by side."""
    if g.family == "add":
        return w @ g.basis if acc is None else acc.addmm_(w, g.basis)
    if g.family == "project" and g.expand is not None:
        w = w[:, g.expand]
    if g.ablate_only:  # -(p w) d, with p taken against -d (exact): one product, no zeroed buffer
        pw = (x @ g.neg_basis.T).mul_(w)
        return torch.mm(pw, g.basis) if acc is None else acc.addmm_(pw, g.basis)
    if acc is None:
        acc = torch.zeros_like(x)
    if g.family == "rescale":  # unit strength: delta = w * (x - centre)
        acc.addcmul_(w.sum(1, keepdim=True), x)
        return acc.addmm_(w, g.basis, alpha=-1.0) if g.centred else acc
    p = x @ g.basis.T
    target = torch.clamp(torch.addcmul(g.offset, g.slope, p), g.lo, g.hi)
    return acc.addmm_(target.sub_(p).mul_(w), g.basis)


def _group(stages: List[Stage], col, device) -> _Group:
    s0 = stages[0]
    family = _family(s0.edit.kind)
    cols = [col(s) for s in stages]
    contiguous = cols == list(range(cols[0], cols[0] + len(cols)))
    span = slice(cols[0], cols[-1] + 1)
    g = _Group(s0.index, family, span if contiguous else torch.tensor(cols, device=device),
               span if contiguous else np.array(cols), None)
    if family == "add":
        g.basis = torch.cat([s.edit.basis[:1] for s in stages]).to(device)  # unit strength: the vectors as they are
    elif family == "rescale":  # a stage with no centre rescales about 0
        hidden = max(s.edit.basis.shape[1] if s.edit.basis is not None else 1 for s in stages)
        g.centred = any(s.edit.basis is not None for s in stages)
        g.basis = torch.cat([s.edit.basis[:1].to(device) if s.edit.basis is not None
                             else torch.zeros(1, hidden, device=device) for s in stages])
    else:
        rows = [(i, s, r) for i, s in enumerate(stages) for r in range(s.edit.basis.shape[0])]
        g.basis = torch.cat([s.edit.basis for s in stages]).to(device)
        if len(rows) != len(stages):
            g.expand = torch.tensor([i for i, _, _ in rows], device=device)
        g.ablate_only = all(s.edit.kind == EditKind.ablate for s in stages)
        g.neg_basis = -g.basis
        inf = float("inf")

        def per_row(f):
            return torch.tensor([f(s.edit) for _, s, _ in rows], dtype=torch.float32, device=device)

        g.slope = per_row(lambda e: 1.0 if e.kind == EditKind.clamp else 0.0)
        g.offset = per_row(lambda e: e.value if e.kind == EditKind.set else 0.0)
        g.lo = per_row(lambda e: e.lo if e.kind == EditKind.clamp and e.lo is not None else -inf)
        g.hi = per_row(lambda e: e.hi if e.kind == EditKind.clamp and e.hi is not None else inf)
    return g


def _fused(groups: List[_Group]) -> kernels.Fused:
    """The groups as one direction table for the fused kernel (see interleaver/kernels.py)."""
    code = {"add": kernels.ADD, "rescale": kernels.RESCALE, "project": kernels.PROJECT}
    col, kind, params, bases = [], [], [], []
    width = max(g.basis.shape[1] for g in groups)
    for g in groups:
        # A scale group with no centre holds [m, 1] zeros (it never needed the width); the table needs full rows.
        bases.append(g.basis if g.basis.shape[1] == width else g.basis.new_zeros(g.basis.shape[0], width))
        cols = list(range(g.cols.start, g.cols.stop)) if isinstance(g.cols, slice) else g.cols.tolist()
        if g.family == "project":  # a direction row's column is its stage's
            cols = [cols[i] for i in (g.expand.tolist() if g.expand is not None else range(len(cols)))]
            params.append((g.slope, g.offset, g.lo, g.hi))
        else:
            params.append((torch.zeros(len(cols), device=g.basis.device),) * 4)
        col += cols
        kind += [code[g.family]] * len(cols)
    device = groups[0].basis.device
    slope, offset, lo, hi = (torch.cat(p) for p in zip(*params))
    return kernels.Fused(torch.cat(bases), torch.tensor(col, device=device),
                         torch.tensor(kind, device=device), slope, offset, lo, hi)


def _split(live: Any, residual: bool):
    if isinstance(live, (tuple, list)):
        if residual and len(live) > 1 and isinstance(live[1], torch.Tensor):
            return live[0], live[1]
        return live[0], None
    return live, None
