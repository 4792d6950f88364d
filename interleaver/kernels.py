"""A tap's edits as one fused GPU kernel: one launch per tap and step instead of one per torch op.

The torch form of a tap's program (float cast, residual add, two small matmuls, a scale, an add into `hidden`) is
several kernels, each reading and writing the whole slab, and on a large model that costs a sizeable fraction of
the unsteered step even inside a CUDA graph (docs/perf-log.md). This kernel reads a row's `hidden` (and
`residual`) once, computes every direction's delta in float32 against the same stream, and writes `hidden` once,
rounding once: the arithmetic of `program._run` for a program whose groups are all of one index.

Per direction row j of the flattened groups (kind 0 add, 1 scale, 2 projection move), with w the row's weight
in column col[j] and b_j the direction (add: the vector; scale: the centre):
    add:      delta += w b_j
    scale:    delta += w (x - b_j)
    project:  p = x.b_j; delta += (clip(offset_j + slope_j p, lo_j, hi_j) - p) w b_j
A row whose weights are all 0 gets a delta of exactly 0, so it is left bit for bit. Triton is imported only when
a CUDA tensor asks for the kernel; elsewhere (CPU, no Triton) `available` is False and the torch form runs.
"""

import warnings
import weakref
from functools import lru_cache
from typing import Optional

import torch

from interleaver import triton_internals

ADD, RESCALE, PROJECT = 0, 1, 2


def _kernel():
    """The Triton kernel `tap_edit` (None without Triton)."""
    built = _kernels()
    return None if built is None else built[0]


def _norm_kernel():
    """The Triton kernel `tap_edit_norm` (None without Triton)."""
    built = _kernels()
    return None if built is None else built[1]


@lru_cache(maxsize=1)
def _kernels():
    try:
        from interleaver import tap_kernels
    except ImportError:  # no Triton
        return None
    return tap_kernels.tap_edit, tap_kernels.tap_edit_norm


class Fused:
    """One single-index program's direction table on the device, ready to launch.

    A launch through Triton's JIT (`kernel[grid](...)`) binds and specialises every argument and builds a cache
    key on each call, host time several times a torch op's (docs/perf-log.md), which a replayed step pays at every
    tap. So after its first launch for a given activation dtype, residual and alignment, a Fused launches the
    compiled kernel directly (triton_internals.launch), the same binary with the same arguments. What the JIT would
    re-check each call is in the key: the activations' dtypes and what Triton specialises on
    (triton_internals.specialization); the strides and the direction count are not specialised on. A direct
    launch is bound once per set of addresses and strides (triton_internals.bind), so that a tap at a replayed
    graph's break, whose tensors sit at the same addresses every step, pays one call of Triton's C launcher and
    the lookup. `warm` checks the direct launch against the JIT's on the device, bit for bit, and keeps the JIT
    launch if they differ or the direct one fails."""

    def __init__(self, basis: torch.Tensor, col: torch.Tensor, kind: torch.Tensor, slope: torch.Tensor,
                 offset: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
        self.basis = basis.float().contiguous()
        self.col, self.kind = col.to(torch.int64).contiguous(), kind.to(torch.int32).contiguous()
        self.slope, self.offset = slope.float().contiguous(), offset.float().contiguous()
        self.lo, self.hi = lo.float().contiguous(), hi.float().contiguous()
        # A row in one block (the next power of two of the hidden size), so the launch computes nothing per call.
        self._block = 1 << (self.basis.shape[1] - 1).bit_length()
        self._warps = max(1, min(8, self._block // 512))
        self.direct = True  # launch compiled kernels directly once they exist (False: every launch through the JIT)
        self.bound = True  # bind a direct launch to its tensors' addresses (False: each one resolves them again)
        self._compiled: dict = {}
        self._bound: dict = {}  # _addresses(...) -> a bound launch (triton_internals.bind)
        self._seen: dict = {}  # at a break: (id(hidden), id(residual)) -> _Known

    def warm(self) -> None:
        """Compile and load the kernel for every activation dtype, with and without a residual, and check its
        direct launch against the JIT's: an in-graph engine's first launch is inside a graph capture, where
        neither compiling nor loading may happen."""
        hidden = self.basis.shape[1]
        device = self.basis.device
        gen = torch.Generator(device=device).manual_seed(0)
        weights = torch.rand(2, int(self.col.max()) + 1, generator=gen, device=device)
        weights[1] = 0  # a row that asks for nothing
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for with_r in (False, True):
                h = torch.randn(2, hidden, generator=gen, device=device).to(dtype)
                r = torch.randn(2, hidden, generator=gen, device=device).to(dtype) if with_r else None
                by_jit = h.clone()
                self._launch(by_jit, r, weights)  # through the JIT; keeps the compiled kernel
                if not self.direct or _key(h, r, weights) not in self._compiled:
                    continue
                direct = h.clone()
                try:
                    self(direct, r, weights)
                    same = torch.equal(direct, by_jit)
                except Exception as e:  # an API the installed Triton does not have: the JIT launch still works
                    same, why = False, f"{type(e).__name__}: {e}"
                else:
                    why = "its result differs from the JIT launch's"
                if not same:
                    warnings.warn(f"the fused tap kernel's direct launch is not used ({why}); every launch goes "
                                  "through Triton's JIT", RuntimeWarning, stacklevel=2)
                    self.direct, self._compiled, self._bound, self._seen = False, {}, {}, {}

    def __call__(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], weights: torch.Tensor,
                 rows: Optional[int] = None) -> bool:
        """Edit the first `rows` rows of `hidden` (None: all of them) in place; False (nothing done) where the
        kernel does not apply."""
        if rows is not None and self.direct and self.bound and self._known_launch(hidden, residual, weights, rows):
            return True
        n = hidden.shape[0] if rows is None else rows
        at = _addresses(hidden, residual, weights) if self.direct and self.bound else None
        go = self._bound.get(at) if at is not None else None
        # The addresses, strides, dtypes and widths are the key's; of the shapes, only the rows can differ
        if go is not None and 0 < n <= min(_rows_held(hidden, residual), weights.shape[0]) and go(n):
            self._saw(hidden, residual, weights, rows, at, go)
            return True
        if not _fits(hidden, residual, weights, self.basis, n):
            return False
        compiled = self._compiled.get(_key(hidden, residual, weights)) if self.direct else None
        if compiled is None:
            self._launch(hidden, residual, weights, n)
            return True
        args = self._args(hidden, residual, weights)
        if go is None and at is not None:  # (bound already: launch hooks are installed, the unbound launch calls them)
            # The tensors' own device's stream (a vLLM worker's current device is its tensors')
            go = triton_internals.bind(compiled, hidden.device.index, args)
            if go is not None:
                if len(self._bound) >= _BOUND_MAX:  # addresses of tensors long freed: start again
                    self._bound.clear()
                self._bound[at] = go
        if go is None or not go(n):
            triton_internals.launch(compiled, (n, 1, 1), args)
        else:
            self._saw(hidden, residual, weights, rows, at, go)
        return True

    def _known_launch(self, hidden, residual, weights, rows: int) -> bool:
        """A break's bound launch, found by its tensors' identity (`_saw`): True if it launched. A step with new
        weights reads only the weights' own part of the key."""
        known = self._seen.get((id(hidden), id(residual)))
        if known is None or known.hidden() is not hidden or known.residual() is not residual:
            return False
        if known.weights() is not weights:
            go = self._bound.get(known.key + _weights_key(weights))
            if go is None:
                return False
            known.weights, known.most, known.go = weakref.ref(weights), min(known.rows, weights.shape[0]), go
        return 0 < rows <= known.most and known.go(rows)

    def _saw(self, hidden, residual, weights, rows, at: tuple, go) -> None:
        """Remember a break's tensors by identity for its bound launch. A replayed graph hands each break the same
        tensor objects every replay (vLLM writes their data, never their storage or layout; `_trim` hands trace
        code views, never these), and a steady decode step keeps its weights tensor, so the next break finds its
        launch without reading a tensor's attributes, which costs most of a break's host time when the step's
        first break runs with the caches cold (docs/perf-log.md). Weak references: a tensor that has gone is never
        taken for the one now at its id."""
        if rows is None:  # an eager step's trimmed views are new objects every call
            return
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        self._seen[(id(hidden), id(residual))] = _Known(hidden, residual, at[:-_WEIGHTS_KEY], weights, go)

    def edit_norm(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], weights: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float) -> bool:
        """Edit `hidden`'s rows as a call does, then add `residual` and RMS-normalise the sum, all in one launch
        and in place: `residual` becomes the edited stream, `hidden` its norm times `norm_weight` (what vLLM's
        fused add + RMSNorm leaves). False (nothing done) where the kernel does not apply. Through Triton's JIT:
        an in-graph engine launches it only while its graphs are captured."""
        if (residual is None or not _fits(hidden, residual, weights, self.basis, hidden.shape[0])
                or _norm_kernel() is None):
            return False
        if (norm_weight.shape != (hidden.shape[1],) or norm_weight.device != hidden.device
                or norm_weight.stride(0) != 1 or norm_weight.dtype != hidden.dtype):
            return False
        args = self._args(hidden, residual, weights)  # tap_edit's, the norm's weight and eps after the table's
        _norm_kernel()[(hidden.shape[0],)](*args[:10], norm_weight, float(eps), *args[10:15], BLOCK=self._block,
                                           num_warps=self._warps)
        return True

    def warm_norm(self) -> None:
        """Compile `edit_norm`'s kernel for every activation dtype, outside any capture (a capture may not
        compile)."""
        hidden, device = self.basis.shape[1], self.basis.device
        weights = torch.zeros(1, int(self.col.max()) + 1, device=device)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            h, r = (torch.zeros(1, hidden, device=device, dtype=dtype) for _ in range(2))
            self.edit_norm(h, r, weights, torch.ones(hidden, device=device, dtype=dtype), 1e-6)

    def _args(self, hidden, residual, weights) -> tuple:
        """The kernel's arguments in its signature's order, constexprs included (what a direct launch takes)."""
        r = residual if residual is not None else hidden
        return (hidden, r, weights, self.basis, self.col, self.kind, self.slope, self.offset, self.lo, self.hi,
                self.col.shape[0], hidden.shape[1], hidden.stride(0), r.stride(0), weights.stride(0),
                residual is not None, self._block)

    def _launch(self, hidden, residual, weights, rows: Optional[int] = None) -> None:
        """Launch through Triton's JIT (on the first `rows` rows; None: all), and keep the compiled kernel it
        returns for direct launches."""
        *args, has_r, block = self._args(hidden, residual, weights)
        grid = (hidden.shape[0] if rows is None else rows,)
        compiled = triton_internals.compiled_of(
            _kernel()[grid](*args, HAS_R=has_r, BLOCK=block, num_warps=self._warps))
        if self.direct and compiled is not None:
            self._compiled[_key(hidden, residual, weights)] = compiled


def folded(table: Fused, hidden: torch.Tensor, residual: Optional[torch.Tensor],
           weights: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic as plain torch ops, out of place: `hidden` as the kernel would leave it. Written for a
    compiler (torch.compile) to fuse into the kernels around it, such as the next layer's residual add and RMSNorm,
    so that the edit costs no launch of its own (a candidate beside the fused kernel). A row whose weights
    are all 0 comes back bit for bit."""
    x = hidden.float() if residual is None else hidden.float() + residual.float()
    w = weights[: hidden.shape[0]].index_select(1, table.col)  # [rows, directions]
    p = x @ table.basis.T
    target = torch.clamp(table.offset + table.slope * p, table.lo, table.hi)
    coef = torch.where(table.kind == ADD, w, torch.where(table.kind == RESCALE, -w, (target - p) * w))
    on_x = (w * (table.kind == RESCALE)).sum(1, keepdim=True)
    return (hidden.float() + (coef @ table.basis + on_x * x)).to(hidden.dtype)


_BOUND_MAX = 4096  # bound launches a table keeps: a tap's tensors in each graph size, and the weights' few homes
_SEEN_MAX = 256  # breaks' tensors a table knows by identity: a tap's value in each graph size


def _none() -> None:
    """The weak reference of an absent residual."""
    return None


class _Known:
    """A break's tensors, known by identity: weak references to them, the key's part that hidden and residual
    make (`_addresses` less `_weights_key`), the rows they hold with and without the weights, and the launch."""

    __slots__ = ("hidden", "residual", "key", "rows", "weights", "most", "go")

    def __init__(self, hidden, residual, key: tuple, weights, go):
        self.hidden, self.residual = weakref.ref(hidden), _none if residual is None else weakref.ref(residual)
        self.rows = _rows_held(hidden, residual)
        self.key, self.weights, self.most, self.go = key, weakref.ref(weights), min(self.rows, weights.shape[0]), go


def _rows_held(hidden, residual) -> int:
    """The rows a launch can edit in `hidden` beside `residual`."""
    return hidden.shape[0] if residual is None else min(hidden.shape[0], residual.shape[0])


def _addresses(hidden, residual, weights) -> tuple:
    """Everything a bound launch's arguments depend on but the rows: the tensors' addresses, strides, dtypes and
    the width. (A CUDA address names one device's memory: with unified addressing, no two devices share one.)"""
    r = hidden if residual is None else residual
    return (hidden.data_ptr(), r.data_ptr(), hidden.stride(), r.stride(), hidden.shape[1:], r.shape[1:],
            residual is None, hidden.dtype, r.dtype, hidden.is_cuda) + _weights_key(weights)


def _weights_key(weights) -> tuple:
    """The weights' part of `_addresses` (its last `_WEIGHTS_KEY` items)."""
    return weights.data_ptr(), weights.stride(), weights.dtype


_WEIGHTS_KEY = 3


def _key(hidden, residual, weights) -> tuple:
    """What the compiled kernel depends on, of what varies between launches: the activations' dtypes, and what
    Triton specialises the pointers and the (unspecialised) strides on."""
    tensors = (hidden, weights) if residual is None else (hidden, residual, weights)
    spec = triton_internals.specialization(tensors, [t.stride(0) for t in tensors])
    return (hidden.dtype, None if residual is None else residual.dtype, *spec)


def available(device) -> bool:
    """Whether programs on `device` can run as the fused kernel (a CUDA device and Triton)."""
    return torch.device(device).type == "cuda" and _kernel() is not None


def _fits(hidden, residual, weights, basis, rows: int) -> bool:
    if not hidden.is_cuda or basis.device != hidden.device or _kernel() is None:
        return False
    return _shaped(hidden, residual, weights, basis, rows)


def _shaped(hidden, residual, weights, basis, rows: int) -> bool:
    """Whether the tensors' shapes, strides and dtypes are the kernel's, over the first `rows` rows."""
    if hidden.dim() != 2 or not 0 < rows <= hidden.shape[0] or hidden.stride(1) != 1:
        return False
    if residual is not None and (residual.shape != hidden.shape or residual.stride(1) != 1):
        return False
    if weights.dtype != torch.float32 or weights.stride(1) != 1 or weights.shape[0] < rows:
        return False
    return basis.shape[1] == hidden.shape[1]
