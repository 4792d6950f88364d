"""Conditions decided on the device, per request, as data in the graph: no branch, no host read-back.

Each request that asks for a decision (`RequestEdits.decide`) holds a slot while it runs (a scoring pass's first
request keeps it for the reading that follows, `RequestEdits.hold` and `held`). A step's rows carry four
int64 rows of facts at a fixed address (`rows`, filled by the host with the step's weights; rows past the step's
point at the scratch slot, so padding and unconditioned rows sum and decide nothing a request reads):

    0  the row's slot                  every row of a deciding request (the gate reads its decision; a scoring
                                       pass's continuation rows read the slot its prompt's decisions were kept in)
    1  the slot to accumulate into     the request's prompt rows until it has decided (reduce=mean sums them)
    2  the slot to decide              the prompt's last row, the first time it runs (score and decision written)
    3  the prompt length               the mean's divisor

At a condition's tap, after the tap's edits, `decide` adds the prompt rows to their slot's sum (or keeps the last
row), and on the prompt's last row scores the reduced vector and writes the decision (1.0 or 0.0) into `flags`.
A gated edit's weight on a row is its weight times `flags[slot of the row, condition]` (`weigh`): 0 before the
decision (earlier chunks of a prompt, and taps up to the condition's in the forward that decides), the decision
from then on; generated rows read the decision their prompt made and never decide again. The host zeroes a slot
(outside any graph, before the step runs) when a request takes it, or starts its prompt over undecided (a request
preempted mid-prompt and run again from its first token), so nothing of an earlier holder or run is read; a request
run again after it decided keeps its decision and decides nothing more. A step's end points its summing and deciding
rows back at the scratch slot (`settle`), so a graph replayed outside a step changes no slot.

On a CUDA device with Triton, `decide` is two launches and `weigh` one (interleaver/condition_kernels.py); the
torch form below is the same arithmetic, and runs elsewhere.
"""

import warnings
from dataclasses import replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from interleaver import select
from interleaver.edit import Condition


class Conditions:
    """The engine's conditions and every slot's running state, on the device."""

    def __init__(self, conditions: Sequence[Condition], slots: int, max_rows: int, device) -> None:
        # Float32 and contiguous, as the kernels read them
        self.list: List[Condition] = [replace(c, vector=c.vector.to(device, torch.float32).contiguous())
                                      for c in conditions]
        self.scratch = slots
        self.acc = [torch.zeros(slots + 1, c.vector.shape[0], device=device) for c in self.list]
        self.scores = torch.zeros(len(self.list), slots + 1, device=device)
        self.flags = torch.zeros(slots + 1, max(len(self.list), 1), device=device)
        self.rows = torch.full((4, max_rows), slots, dtype=torch.int64, device=device)
        self.rows[3] = 1
        self._high = 0  # rows of `rows` the last step wrote
        self.deciding = False  # the host knows: some row of this step is a deciding request's prompt row
        self._slot: Dict[str, int] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._fresh: List[int] = []  # slots taken since the last step: zeroed before it runs
        self._decided: set = set()  # slots whose prompt's last row has run
        # A scoring pass's decisions (RequestEdits.hold, .held): name -> the slot kept after its request ended,
        # and which request keeps or reads which name
        self._kept: Dict[str, int] = {}
        self._holds: Dict[str, str] = {}
        self._reads: Dict[str, str] = {}
        self.kernels = _kernels() is not None and torch.device(device).type == "cuda"
        if self.kernels:
            try:
                self.warm()
            except Exception as e:  # a kernel that does not build costs speed, never a decision
                warnings.warn(f"the condition kernels did not build ({type(e).__name__}: {e}); conditions run in "
                              "the torch form", RuntimeWarning, stacklevel=2)
                self.kernels = False

    def adopt(self, old: "Conditions") -> None:
        """Take over `old`'s slots and what they hold (this engine's conditions are `old`'s and more after them)."""
        n = min(len(old.list), len(self.list))
        if old.scratch != self.scratch or n == 0:
            return
        self._slot, self._free, self._fresh = dict(old._slot), list(old._free), list(old._fresh)
        self._decided = set(old._decided)
        self._kept, self._holds, self._reads = dict(old._kept), dict(old._holds), dict(old._reads)
        for i in range(n):
            self.acc[i].copy_(old.acc[i])
        self.scores[:n].copy_(old.scores[:n])
        self.flags[:, :n].copy_(old.flags[:, :n])

    def slots_for(self, rids: Sequence, edits: Sequence) -> np.ndarray:
        """Each request's slot (the scratch slot where it decides nothing), taking one for a request seen first."""
        out = np.full(len(rids), self.scratch, dtype=np.int64)
        for i, (rid, e) in enumerate(zip(rids, edits)):
            if e is None or not e.decide:
                continue
            slot = self._slot.get(rid)
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"no condition slot left for request {rid!r} ({self.scratch} in use)")
                slot = self._slot[rid] = self._free.pop()
                self._fresh.append(slot)
                if e.hold:
                    self._holds[rid] = e.hold
            out[i] = slot
        return out

    def held_for(self, rids: Sequence, edits: Sequence) -> Optional[np.ndarray]:
        """Each request's slot of kept decisions its rows past the prompt read (`RequestEdits.held`; the scratch
        slot where none), or None where no request reads any."""
        if not self._kept:
            return None
        out = np.full(len(rids), self.scratch, dtype=np.int64)
        for i, (rid, e) in enumerate(zip(rids, edits)):
            slot = self._kept.get(e.held) if e is not None and e.held else None
            if slot is not None:
                out[i] = slot
                self._reads[rid] = e.held
        return out

    def release(self, rids) -> None:
        """Free the slots of requests that ended: a request that holds its decisions keeps its slot under its
        name, and the request that read a kept slot frees it."""
        for rid in rids:
            slot, name = self._slot.pop(rid, None), self._holds.pop(rid, None)
            if slot is not None and name:
                self.drop_kept(name)  # a name kept again: the newer decisions
                self._kept[name] = slot
            elif slot is not None:
                self._free.append(slot)
                self._decided.discard(slot)
            read = self._reads.pop(rid, None)
            if read is not None:
                self.drop_kept(read)

    def drop_kept(self, name: str) -> None:
        """Free the slot kept under `name`, if one is."""
        slot = self._kept.pop(name, None)
        if slot is not None:
            self._free.append(slot)
            self._decided.discard(slot)

    def set_rows(self, starts: np.ndarray, counts: np.ndarray, positions: np.ndarray, plen: np.ndarray,
                 slots: np.ndarray, num_tokens: int, stage, held: Optional[np.ndarray] = None) -> None:
        """Fill `rows` for a step (`slots`: each request's; `stage(arrays)`: the arrays on the device in one copy;
        `held`: each request's slot of kept decisions for its rows past the prompt, `held_for`'s)."""
        live = slots != self.scratch
        decided = np.isin(slots, list(self._decided))
        if live.any():
            last = positions + counts - 1
            # A request starting its prompt over before it decided (preempted mid-prompt): its sums start again
            again = live & (positions == 0) & ~np.isin(slots, self._fresh) & ~decided
            self._fresh += slots[again].tolist()
        if self._fresh:
            (fresh,) = stage([np.array(self._fresh, dtype=np.int64)])
            self._fresh = []
            self.flags.index_fill_(0, fresh, 0.0)
            self.scores.index_fill_(1, fresh, 0.0)
            for acc in self.acc:
                acc.index_fill_(0, fresh, 0.0)
        if not live.any():
            self.deciding = False
            self._fill(0)
            return
        # Requests that decided in an earlier step (run again after a preemption, or generating) decide nothing more
        open_ = live & ~decided
        owner, offset = select.owners(counts)
        pos, plen_r, slot = positions[owner] + offset, plen[owner], slots[owner]
        table = np.full((4, num_tokens), self.scratch, dtype=np.int64)
        table[3] = 1
        at = starts[owner] + offset
        if held is None:
            table[0, at] = slot
        else:  # a scoring pass's continuation rows read the decisions its prompt made before
            kept = held[owner]
            table[0, at] = np.where((kept != self.scratch) & (pos >= plen_r), kept, slot)
        deciding = open_[owner]
        table[1, at] = np.where(deciding & (pos < plen_r), slot, self.scratch)
        table[2, at] = np.where(deciding & (pos == plen_r - 1), slot, self.scratch)
        table[3, at] = np.maximum(plen_r, 1)
        self._decided.update(slots[open_ & (positions <= plen - 1) & (last >= plen - 1)].tolist())
        self.deciding = bool((table[1] != self.scratch).any())
        (dev,) = stage([table])
        self.rows[:, :num_tokens].copy_(dev, non_blocking=True)
        self._fill(num_tokens)

    def settle(self) -> None:
        """End the step: no row sums or decides until the next step's rows are set, so a graph replayed outside a
        step (a warm-up or dummy batch, whose graphs hold the decide kernels) leaves every slot as it is. Only a
        step where some prompt row summed wrote such rows: a decode step costs nothing here."""
        if self.deciding:
            self.rows[1:3, : self._high].fill_(self.scratch)
            self.deciding = False

    def _fill(self, end: int) -> None:
        """Point rows `end`.. that the last step wrote back at the scratch slot."""
        if self._high > end:
            self.rows[:, end : self._high].fill_(self.scratch)
            self.rows[3, end : self._high].fill_(1)
        self._high = max(end, 0)

    def decide(self, indices: Sequence[int], hidden: torch.Tensor, residual: Optional[torch.Tensor] = None) -> None:
        """Conditions `indices` (a tap's) on the stream `hidden` (+ `residual`), `[rows, width]`, the rows the
        step's `rows` describe."""
        x = None
        for i in indices:
            if self.kernels and self._fits(i, hidden, residual):
                self._decide_fused(i, hidden, residual)
                continue
            if x is None:
                x = hidden.float() if residual is None else torch.add(hidden.float(), residual)
            c, acc = self.list[i], self.acc[i]
            r = self.rows[:, : x.shape[0]]
            if c.reduce == "mean":
                acc.index_add_(0, r[1], x)
                h = acc.index_select(0, r[2]) / r[3, :, None].to(x.dtype)
            else:
                acc.index_copy_(0, r[2], x)
                h = acc.index_select(0, r[2])
            s = select.score(h, c.vector, c.score)
            self.scores[i].index_copy_(0, r[2], s)
            self.flags[:, i].index_copy_(0, r[2], select.met(s, c.compare, c.threshold).to(self.flags.dtype))

    def _fits(self, i: int, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
        """Whether the stream is what `warm` compiled the kernels for: on the state's device, `[rows, width]` with
        rows the table holds, unit column stride and a 16-byte aligned start, a residual alike and of the same
        dtype (any other would compile anew, which inside a graph capture may not happen)."""
        if (hidden.device != self.flags.device or hidden.dim() != 2 or hidden.shape[1] != self.list[i].vector.shape[0]
                or not 0 < hidden.shape[0] <= self.rows.shape[1] or hidden.dtype not in _DTYPES):
            return False
        return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.shape == hidden.shape and t.dtype == hidden.dtype
                   for t in (hidden, residual) if t is not None)

    def _decide_fused(self, i: int, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        c, acc = self.list[i], self.acc[i]
        width, n = c.vector.shape[0], hidden.shape[0]
        r = hidden if residual is None else residual
        block = 1 << (width - 1).bit_length()
        warps = max(1, min(8, block // 512))
        cond_sum, cond_score, _ = _kernels()
        cond_sum[(n,)](hidden, r, self.rows, acc, self.scratch, width, hidden.stride(0), r.stride(0),
                       self.rows.stride(0), HAS_R=residual is not None, LAST=c.reduce == "last", BLOCK=block,
                       num_warps=warps)
        cond_score[(n,)](self.rows, acc, c.vector, self.scores, self.flags, self.scratch, self.rows.stride(0),
                         self.scores.stride(0), self.flags.shape[1], i, float(c.threshold), width,
                         MEAN=c.reduce == "mean", CAST=c.score == "cast", ABOVE=c.compare == "above", BLOCK=block,
                         num_warps=warps)

    def warm(self) -> None:
        """Compile the kernels for every activation dtype, with and without a residual, and each condition's
        variant: an in-graph engine first decides inside a graph capture, where nothing may compile. Run while
        every row of `rows` points at the scratch slot (a new state's), so nothing is summed or decided."""
        device = self.flags.device
        for i, c in enumerate(self.list):
            # Triton's compiled kernels are the process's: a variant warmed once (a replay engine makes a new state
            # whenever a request brings a condition of its own) is not launched again
            variant = (str(device), c.vector.shape[0], c.reduce, c.score, c.compare)
            if variant in _WARMED:
                continue
            for dtype in _DTYPES:
                h = torch.zeros(1, c.vector.shape[0], device=device, dtype=dtype)
                for residual in (None, torch.zeros_like(h)):
                    self._decide_fused(i, h, residual)
            _WARMED.add(variant)
        if (str(device), "gate") not in _WARMED:
            self.weigh(torch.zeros(1, 1, device=device), self.gating([0], [0]))
            _WARMED.add((str(device), "gate"))

    def gating(self, cols: Sequence[int], conds: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `weigh` reads of a program whose weight columns `cols` are gated by conditions `conds`, on the
        device: the columns, their conditions, and each column's condition (-1: none) up to the last gated one."""
        device = self.flags.device
        table = torch.full((max(cols) + 1,), -1, dtype=torch.int64)
        table[list(cols)] = torch.tensor(list(conds), dtype=torch.int64)
        return (torch.tensor(list(cols), device=device), torch.tensor(list(conds), device=device),
                table.to(device))

    def weigh(self, w: torch.Tensor, gating: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A copy of the weights `w` (`[rows, columns]`, float32), the gated columns (`gating`) weighed by each
        row's decisions so far (`gate`)."""
        cols, conds, table = gating
        rows = w.shape[0]
        if (self.kernels and w.device == self.flags.device and w.dtype == torch.float32 and w.stride(1) == 1
                and 0 < rows <= self.rows.shape[1]):
            out = torch.empty_like(w, memory_format=torch.contiguous_format)
            grid = (rows, -(-w.shape[1] // _COLUMNS))
            _kernels()[2][grid](w, out, self.rows, self.flags, table, self.scratch, w.shape[1], table.shape[0],
                                self.flags.shape[1], w.stride(0), out.stride(0), BLOCK=_COLUMNS)
            return out
        out = w.clone()
        out[:, cols] = out[:, cols] * self.gate(rows)[:, conds]
        return out

    def gate(self, rows: int) -> torch.Tensor:
        """`[rows, conditions]`: each row's request's decisions so far (1.0 met, 0.0 not or not yet; 0.0 on rows of
        no deciding request, whatever the scratch slot holds)."""
        r = self.rows[0, :rows]
        return self.flags.index_select(0, r) * (r != self.scratch).to(self.flags.dtype)[:, None]


_COLUMNS = 64  # the gate kernel's columns a program
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activations' dtypes the kernels are compiled for
_WARMED: set = set()  # the kernel variants `warm` has compiled in this process


@lru_cache(maxsize=1)
def _kernels():
    """The Triton kernels (condition_sum, condition_score, condition_gate), or None without Triton."""
    try:
        from interleaver import condition_kernels as k
    except ImportError:
        return None
    return k.condition_sum, k.condition_score, k.condition_gate

