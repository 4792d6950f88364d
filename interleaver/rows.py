"""A step's rows: which request owns each, and the `[num_tokens, columns]` weights the taps' programs read, built
from the batch's edits (interleaver.bank.BatchEdits) with array operations and shipped in one pinned host-to-device
copy: the only per-step host work the taps need."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from interleaver import select
from interleaver.bank import BatchEdits, RequestEdits


@dataclass(frozen=True)
class Span:
    """One request's rows in a step: `count` rows from `start`, the first at sequence position `position`."""

    start: int
    count: int
    position: int
    prompt_len: int
    edits: Optional[RequestEdits]


class StepRows:
    """The current step's row facts, read by every tap's replay: how many rows are real, and each weight
    column's per-row weight. Reset between steps so a warm-up or dummy run edits nothing."""

    _RING = 12  # pinned staging buffers in turn (up to three a step): a copy is done long before its buffer comes round
    # Weights a step's rows expand to past which the device expands them (a gather: one more launch, and no
    # [rows, columns] matrix built and copied on the host: 2.7 ms of a join step of 256 x 32 rows at 64 columns)
    _GATHER_FROM = 16384

    def __init__(self) -> None:
        self.order: Optional[np.ndarray] = None  # column -> stage id (None: column i is stage i)
        # In-graph engines: `[max rows, columns]` on the device at a fixed address, read by the captured edits;
        # rows past the step's are kept at 0, so padding rows get no edit.
        self.static: Optional[torch.Tensor] = None
        self._high = 0  # rows of `static` written by the last step
        self._pinned: List[Optional[tuple]] = [None] * self._RING  # (the buffer, numpy's view of it)
        self._turn = 0
        # (batch, rows, weights, used, all_used) of the last decode step whose rows were all generated tokens: the
        # next such step of the same batch has the same weights, already on the device (and in `static`).
        self._steady: Optional[tuple] = None
        self.conditions: Optional[Any] = None  # an interleaver.conditions.Conditions where the engine decides any
        self.clear()

    def clear(self) -> None:
        if self.conditions is not None:
            self.conditions.settle()
        self.num_tokens: Optional[int] = None
        self.weights: Optional[torch.Tensor] = None  # [num_tokens, columns] on the device
        self.used: Optional[np.ndarray] = None  # bool per column: does any row use it this step
        self.all_used = False  # every column is used: a tap need not ask which of its groups are
        self.capturing: Dict[str, List[Span]] = {}  # location -> spans of requests that keep its value

    def set(self, spans: Sequence[Span], num_tokens: int, n_stages: int, device) -> None:
        """Fill the step from its spans (see `set_rows`)."""
        batch = BatchEdits([s.edits for s in spans], np.array([s.prompt_len for s in spans], dtype=np.int64),
                           n_stages, self.order)
        self.set_rows(np.array([s.start for s in spans], dtype=np.int64),
                      np.array([s.count for s in spans], dtype=np.int64),
                      np.array([s.position for s in spans], dtype=np.int64), batch, num_tokens, device)

    def set_rows(self, starts: np.ndarray, counts: np.ndarray, positions: np.ndarray, batch: BatchEdits,
                 num_tokens: int, device) -> None:
        """Fill the step: request i owns `counts[i]` rows from `starts[i]`, the first at sequence position
        `positions[i]`, and asks for `batch.edits[i]`."""
        self.clear()
        self.num_tokens = num_tokens
        if self.conditions is not None:
            slots = batch.slots if batch.slots is not None else np.full(counts.size, self.conditions.scratch)
            self.conditions.set_rows(starts, counts, positions, batch.plen, slots, num_tokens,
                                     lambda arrays: self._stage(arrays, device), batch.held)
        for i in batch.capture:
            e = batch.edits[i]
            for loc in e.capture:
                self.capturing.setdefault(loc, []).append(
                    Span(int(starts[i]), int(counts[i]), int(positions[i]), int(batch.plen[i]), e))
        if batch.dense is None:
            self._steady = None
        else:
            decode = counts.size == num_tokens and bool((counts == 1).all())  # row i is request i
            # Weights by position change from step to step: a batch with any is never steady
            steady = decode and not batch.placed and bool((positions >= batch.plen).all())
            last = self._steady
            if steady and last is not None and last[0] is batch and last[1] == num_tokens:
                self.weights, self.used, self.all_used = last[2:]
                return  # `static` still holds these rows
            if decode:
                w = _weights(positions, batch)
                self.used = w.any(0)
            else:  # a step with prompt rows: its requests' two rows of weights, and each row's pick of them
                table, src = _row_sources(starts, counts, positions, batch, num_tokens)
                picked = np.zeros(len(table), dtype=bool)
                picked[src] = True
                self.used = table[picked].any(0)
                w = table[src] if batch.placed or src.size * table.shape[1] <= self._GATHER_FROM else None
            if batch.placed:
                _place(w, starts, counts, positions, batch)
                self.used = w.any(0)
            self.all_used = bool(self.used.all())
            if self.all_used or self.used.any():
                self.weights = self._upload(w, device) if w is not None else self._gather(table, src, device)
            self._steady = (batch, num_tokens, self.weights, self.used, self.all_used) if steady else None
        if self.static is not None:
            self._to_static(num_tokens)

    def repeat(self, batch: BatchEdits, num_tokens: int) -> bool:
        """Set the step from the last one, without reading its rows, where it is that steady decode step again:
        the same batch (the same requests in the same rows), as many rows as requests (each has at least one, so
        one each, and their positions only grew) and nothing captured (captured spans move with the positions).
        False, and nothing set, otherwise. On a small model a step's host time is most of its time."""
        last = self._steady
        if last is None or last[0] is not batch or last[1] != num_tokens or batch.capture:
            return False
        self.clear()
        self.num_tokens = num_tokens
        self.weights, self.used, self.all_used = last[2:]
        return True

    def use_static(self, rows: int, columns: int, device) -> None:
        """Give the step a zeroed `[rows, columns]` weight buffer at a fixed address, filled every step from now
        on (for programs captured into graphs)."""
        self.static = torch.zeros(rows, max(columns, 1), device=device)
        self._high = 0
        self._steady = None

    def _to_static(self, num_tokens: int) -> None:
        end = num_tokens if self.weights is not None else 0
        if end:
            self.static[:end].copy_(self.weights, non_blocking=True)
        if self._high > end:
            self.static[end : self._high].zero_()
        self._high = end

    def _upload(self, w: np.ndarray, device) -> torch.Tensor:
        return self._stage([w], device)[0]

    def _gather(self, table: np.ndarray, src: np.ndarray, device) -> torch.Tensor:
        """`table[src]`, expanded on the device from what it is made of: a prefill of 256 requests x 32 tokens at
        64 columns ships 2 x 256 rows and 8,192 indices, not the 2 MB matrix they expand to."""
        t, i = self._stage([table, src], device)
        return t.index_select(0, i)

    def _stage(self, arrays: Sequence[np.ndarray], device) -> List[torch.Tensor]:
        """The arrays on the device through one buffer of the ring and one copy, each at an 8-byte boundary so
        that it can be viewed as its own dtype there (the same code on CPU, where the copy is a copy too). Filled
        through numpy: a torch op a write costs more than the write."""
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // 8) * 8
        slot = self._turn % self._RING
        self._turn += 1
        if self._pinned[slot] is None or self._pinned[slot][0].numel() < size:
            buf = torch.empty(max(size, 1 << 18), dtype=torch.uint8)
            # A pageable copy would make the host wait for the GPU to drain; a pinned one is queued and returns.
            buf = buf.pin_memory() if torch.device(device).type == "cuda" else buf
            self._pinned[slot] = (buf, buf.numpy())
        buf, raw = self._pinned[slot]
        for a, at in zip(arrays, offsets):
            raw[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        dev = buf[:size].to(device, non_blocking=True, copy=True)
        return [dev[at : at + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, at in zip(arrays, offsets)]


_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}


def _weights(positions: np.ndarray, batch: BatchEdits) -> np.ndarray:
    """The `[requests, columns]` float32 weights of a decode step (one row per request, in order)."""
    dense = batch.dense
    is_prompt = (positions < batch.plen)[:, None]
    return dense[:, 0] + np.where(is_prompt, dense[:, 1], dense[:, 2])


def _place(w: np.ndarray, starts, counts, positions, batch: BatchEdits) -> None:
    """Add to `w` (`[rows, columns]`, the step's weights) the entries that act on rows by position: every entry's
    rows of this step at once (one element per entry and row), so a decode step of 64 such requests costs a few
    array operations, not 64 Python loops."""
    p = batch.placements()
    entry, offset = select.owners(counts[p.request])
    req = p.request[entry]
    pos, plen = positions[req] + offset, batch.plen[req]
    is_prompt, kind, group = pos < plen, p.kind[entry], p.where[entry]
    on = np.where(kind == 1, is_prompt, np.where(kind == 2, ~is_prompt, True))
    for g, where in enumerate(p.wheres):
        sel = group == g
        on[sel] &= select.mask(where, pos[sel], plen[sel])
    np.add.at(w, (starts[req] + offset, p.column[entry]), p.strength[entry] * on)


def _row_sources(starts, counts, positions, batch: BatchEdits, num_tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """A step's weights as a gather: `table` (`[2n + 1, columns]`: each request's weights on its prompt rows, then
    on its generated rows, then zeros for rows no request owns) and `src` (`[num_tokens]`, each row's table row)."""
    dense, plen = batch.dense, batch.plen
    n = counts.size
    owner, offset = select.owners(counts)
    table = np.concatenate([dense[:, 0] + dense[:, 1], dense[:, 0] + dense[:, 2],
                            np.zeros((1, dense.shape[2]), dtype=np.float32)])
    src = np.full(num_tokens, 2 * n, dtype=np.int64)
    src[starts[owner] + offset] = np.where(positions[owner] + offset < plen[owner], owner, owner + n)
    return table, src
