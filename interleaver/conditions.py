"""Conditions decided on the device, per request, as data in the graph: no branch, no host read-back.

Each request that asks for a decision (`RequestEdits.decide`) holds a slot while it runs. A step's rows carry four
int64 rows of facts at a fixed address (`rows`, filled by the host with the step's weights; rows past the step's
point at the scratch slot, so padding and unconditioned rows write only there):

    0  the row's slot                  every row of a deciding request (the gate reads its decision)
    1  the slot to accumulate into     the request's prompt rows until it has decided (reduce=mean sums them)
    2  the slot to decide              the prompt's last row, the first time it runs (score and decision written)
    3  the prompt length               the mean's divisor

At a condition's tap, after the tap's edits, `decide` adds the prompt rows to their slot's sum (or keeps the last
row), and on the prompt's last row scores the reduced vector and writes the decision (1.0 or 0.0) into `flags`.
A gated edit's weight on a row is its weight times `flags[slot of the row, condition]` (`gate`): 0 before the
decision (earlier chunks of a prompt, and taps up to the condition's in the forward that decides), the decision
from then on; generated rows read the decision their prompt made and never decide again. The host zeroes a slot
(outside any graph, before the step runs) when a request takes it, or starts its prompt over undecided (a request
preempted mid-prompt and run again from its first token), so nothing of an earlier holder or run is read; a request
run again after it decided keeps its decision and decides nothing more.
"""

from typing import Dict, List, Sequence

import numpy as np
import torch

from interleaver import select
from interleaver.edit import Condition


class Conditions:
    """The engine's conditions and every slot's running state, on the device."""

    def __init__(self, conditions: Sequence[Condition], slots: int, max_rows: int, device) -> None:
        self.list: List[Condition] = [c.to(device) for c in conditions]
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

    def adopt(self, old: "Conditions") -> None:
        """Take over `old`'s slots and what they hold (this engine's conditions are `old`'s and more after them)."""
        n = min(len(old.list), len(self.list))
        if old.scratch != self.scratch or n == 0:
            return
        self._slot, self._free, self._fresh = dict(old._slot), list(old._free), list(old._fresh)
        self._decided = set(old._decided)
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
            out[i] = slot
        return out

    def release(self, rids) -> None:
        for rid in rids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
                self._decided.discard(slot)

    def set_rows(self, starts: np.ndarray, counts: np.ndarray, positions: np.ndarray, plen: np.ndarray,
                 slots: np.ndarray, num_tokens: int, stage) -> None:
        """Fill `rows` for a step (`slots`: each request's; `stage(arrays)`: the arrays on the device in one copy)."""
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
        table[0, at] = slot
        deciding = open_[owner]
        table[1, at] = np.where(deciding & (pos < plen_r), slot, self.scratch)
        table[2, at] = np.where(deciding & (pos == plen_r - 1), slot, self.scratch)
        table[3, at] = np.maximum(plen_r, 1)
        self._decided.update(slots[open_ & (positions <= plen - 1) & (last >= plen - 1)].tolist())
        self.deciding = bool((table[1] != self.scratch).any())
        (dev,) = stage([table])
        self.rows[:, :num_tokens].copy_(dev, non_blocking=True)
        self._fill(num_tokens)

    def _fill(self, end: int) -> None:
        """Point rows `end`.. that the last step wrote back at the scratch slot."""
        if self._high > end:
            self.rows[:, end : self._high].fill_(self.scratch)
            self.rows[3, end : self._high].fill_(1)
        self._high = max(end, 0)

    def decide(self, i: int, x: torch.Tensor) -> None:
        """Condition `i` on the stream `x` (float32 `[rows, width]`, the rows the step's `rows` describe)."""
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

    def gate(self, rows: int) -> torch.Tensor:
        """`[rows, conditions]`: each row's request's decisions so far (1.0 met, 0.0 not or not yet; 0.0 on rows of
        no deciding request, whatever the scratch slot holds)."""
        r = self.rows[0, :rows]
        return self.flags.index_select(0, r) * (r != self.scratch).to(self.flags.dtype)[:, None]
