"""Which rows of a step get which edit, computed once per step on the host, for every request at once.

A step's activation is a flat `[num_tokens, hidden]` slab of every scheduled request (prefill chunks and decode
tokens mixed). Each request carries a list of (stage, strength, rows) entries; a stage is one edit at unit strength
at one tap and one position in that tap's edit list (`StageEdit.unit`), shared by every request whose edit has the
same shape, so requests that differ only in scale share one op and differ in their row weights. `StepRows.set`
turns the step's rows into a `[num_tokens, columns]` weight matrix with array operations (no Python per row,
one small loop per steered request) and ships it in one pinned host-to-device copy: the only per-step host work
the taps need.
"""

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from interleaver.stage import Kind, Rows, StageEdit

_ROWS = {Rows.both.value: 0, Rows.prompt.value: 1, Rows.generated.value: 2}


def encode_vector(v) -> str:
    """A request's own vector as it travels (steer_vector, RequestEdits.inline): base64 of its values as
    little-endian float32."""
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(data: str) -> np.ndarray:
    """encode_vector's values back, as float32 (binascii.Error where `data` is not base64)."""
    return np.frombuffer(base64.b64decode(data, validate=True), dtype="<f4").astype(np.float32)


@dataclass(frozen=True)
class Stage:
    id: int
    location: str
    index: int  # position in the tap's edit list: a request's edits at one tap run in this order
    edit: StageEdit  # at unit strength


@dataclass
class RequestEdits:
    """What one request asks for: (stage id, strength, rows) entries, and where its prompt ends (None: the
    request's own prompt length; a scoring pass that feeds a continuation as prompt sets it)."""

    entries: List[Tuple[int, float, str]] = field(default_factory=list)
    prompt_len: Optional[int] = None
    capture: List[str] = field(default_factory=list)  # tap locations whose (edited) rows to keep, for scoring
    key: str = ""  # names the request's captures
    # The request's own vectors, added at (location, index) at strength on rows: each becomes a stage in the
    # worker that sees it first (InlineStages), its entry appended to `entries` there.
    inline: List[Tuple[str, int, float, str, str]] = field(default_factory=list)  # (..., base64 little-endian f32)
    _dense: Optional[Tuple[int, np.ndarray]] = field(default=None, repr=False, compare=False)

    def to_args(self) -> str:
        """What rides SamplingParams.extra_args["steer"] into the worker: the request's fields as one JSON string.
        A string because vLLM deep-copies every request's SamplingParams (68 us for a dict of 32 entries, about
        1 us for its string: 17 ms before a 256-request batch that edits at 32 layers could start) and because an
        OpenAI server's vllm_xargs carry flat values only."""
        out = {"entries": [list(e) for e in self.entries], "prompt_len": self.prompt_len,
               "capture": list(self.capture), "key": self.key}
        if self.inline:
            out["inline"] = [list(v) for v in self.inline]
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_args(cls, d) -> Optional["RequestEdits"]:
        """The request's edits from to_args' string (or its dict), None where it asks for nothing."""
        if isinstance(d, str):
            d = json.loads(d)
        if not d:
            return None
        return cls([(int(s), float(w), str(t)) for s, w, t in d.get("entries", [])], d.get("prompt_len"),
                   list(d.get("capture", [])), str(d.get("key", "")),
                   [(str(loc), int(i), float(w), str(t), str(v)) for loc, i, w, t, v in d.get("inline", [])])

    def strengths(self, n_stages: int) -> np.ndarray:
        """`[3, n_stages]` float32: this request's strength per stage on every row, on prompt rows only, and
        on generated rows only (cached: a request asks every step)."""
        if self._dense is None or self._dense[0] != n_stages:
            s = np.zeros((3, n_stages), dtype=np.float32)
            for stage, strength, rows in self.entries:
                s[_ROWS[rows], stage] += strength
            self._dense = (n_stages, s)
        return self._dense[1]


class ParsedArgs:
    """Requests' edits parsed once per distinct `extra_args["steer"]` string: requests on one preset carry the
    same string, and a join step of 256 of them would otherwise parse it 256 times (9 us each). Strings with
    vectors of their own are parsed each time: their entries grow in the worker that reads them."""

    _MAX = 1024

    def __init__(self) -> None:
        self._seen: Dict[str, Optional[RequestEdits]] = {}

    def __call__(self, args) -> Optional[RequestEdits]:
        if not isinstance(args, str):
            return RequestEdits.from_args(args)
        if args in self._seen:
            return self._seen[args]
        edits = RequestEdits.from_args(args)
        if edits is None or not edits.inline:
            if len(self._seen) >= self._MAX:
                self._seen.clear()
            self._seen[args] = edits
        return edits


@dataclass(frozen=True)
class Span:
    """One request's rows in a step: `count` rows from `start`, the first at sequence position `position`."""

    start: int
    count: int
    position: int
    prompt_len: int
    edits: Optional[RequestEdits]


class EditBank:
    """Every stage an engine serves, registered before requests arrive; ids index the weight matrix."""

    def __init__(self) -> None:
        self.stages: List[Stage] = []
        self._ids: Dict[tuple, int] = {}

    def register(self, location: str, edits: Sequence[StageEdit], start: int = 0) -> List[Tuple[int, float, str]]:
        """Register a tap's edits (in order, from position `start` of the tap's edit list) and return the request
        entries that ask for them, at the edits' own strengths and rows."""
        out = []
        for index, e in enumerate(edits, start):
            unit = e.unit()
            key = (location, index, unit.kind.value, _digest(unit.basis), unit.lo, unit.hi, unit.value)
            if key not in self._ids:
                self._ids[key] = len(self.stages)
                self.stages.append(Stage(len(self.stages), location, index, unit))
            out.append((self._ids[key], e.strength, e.rows.value))
        return out

    def truncate(self, n: int) -> None:
        """Forget the stages registered after the first `n` (an engine refused them)."""
        self.stages = self.stages[:n]
        self._ids = {k: i for k, i in self._ids.items() if i < n}

    def at(self, location: str) -> List[Stage]:
        return [s for s in self.stages if s.location == location]


class InlineStages:
    """Requests' own vectors as stages of `bank`: a vector gets a stage (an `add` at its location and index) when a
    request first brings it, shared by every request that brings the same one there, and its id is free for another
    once the last such request has finished; when none is in use the bank drops them all. Ids stay put while in
    use, and an inline stage's weight column is placed after every other stage's, so the entries and columns of
    requests in flight stay valid as others come and go, and only the taps whose stages changed need new
    programs."""

    def __init__(self, bank: EditBank) -> None:
        self.bank = bank
        self._ids: Dict[tuple, int] = {}  # (location, index, digest) -> stage id
        self._key: Dict[int, tuple] = {}  # and back
        self._refs: Dict[int, int] = {}  # stage id -> requests using it
        self._free: List[int] = []
        self._of: Dict[str, List[Tuple[int, float, str]]] = {}  # request id -> its entries

    def held(self) -> List[int]:
        """The ids of the bank's inline stages (in use or free), in order."""
        return sorted(self._key)

    def take(self, rid: str, edits: RequestEdits, device) -> set:
        """Give the request's inline vectors stages and append their entries to `edits.entries` (a request read
        again gets the same ones); the locations whose stages changed (their programs must be rebuilt)."""
        if not edits.inline:
            return set()
        if rid in self._of:
            edits.entries.extend(self._of[rid])
            edits._dense = None
            return set()
        changed, mine = set(), []
        for loc, index, strength, rows, data in edits.inline:
            key = (loc, int(index), hashlib.sha256(data.encode()).hexdigest())
            sid = self._ids.get(key)
            if sid is None:
                sid = self._place(key, loc, int(index), data, device, changed)
            elif self._refs.get(sid, 0) == 0:
                self._free.remove(sid)  # freed but not yet reused: the same vector again
            self._refs[sid] = self._refs.get(sid, 0) + 1
            mine.append((sid, float(strength), str(rows)))
        self._of[rid] = mine
        edits.entries.extend(mine)
        edits._dense = None
        return changed

    def release(self, rids) -> set:
        """Requests that have finished (or were aborted): their vectors' stages are free once no request uses
        them, and once none is in use the bank forgets them all. The locations whose stages changed."""
        for rid in rids:
            for sid, _, _ in self._of.pop(rid, ()):
                self._refs[sid] -= 1
                if self._refs[sid] == 0:
                    self._free.append(sid)
        if not self._key or any(self._refs.values()):
            return set()
        first = min(self._key)  # inline ids follow every other stage's
        changed = {s.location for s in self.bank.stages[first:]}
        self.bank.stages = self.bank.stages[:first]
        self._ids, self._key, self._refs, self._free = {}, {}, {}, []
        return changed

    def _place(self, key: tuple, loc: str, index: int, data: str, device, changed: set) -> int:
        vec = decode_vector(data)
        edit = StageEdit(Kind.add, torch.from_numpy(vec)[None].to(device))
        stages = self.bank.stages
        sid = self._free.pop(0) if self._free else len(stages)
        if sid in self._key:
            del self._ids[self._key.pop(sid)]
        if sid == len(stages):
            stages.append(Stage(sid, loc, index, edit))
        else:
            changed.add(stages[sid].location)
            stages[sid] = Stage(sid, loc, index, edit)
        changed.add(loc)
        self._ids[key], self._key[sid] = sid, key
        return sid


def layout(stages: Sequence[Stage]) -> np.ndarray:
    """The weight matrix's column order: stage ids sorted by (tap, index, kind), so that the stages one tap
    program runs as one batched op are adjacent columns and it reads them as a slice."""
    order = sorted(stages, key=lambda s: (s.location, s.index, s.edit.kind.value, s.id))
    return np.array([s.id for s in order], dtype=np.int64)


class BatchEdits:
    """What the scheduled requests ask for, in batch order: built once per batch composition (vLLM keeps its
    batch order from step to step until a request joins or leaves), so a step costs array operations only."""

    def __init__(self, edits: Sequence[Optional[RequestEdits]], prompt_lens: np.ndarray, n_stages: int,
                 order: Optional[np.ndarray] = None):
        self.edits = list(edits)
        self.n_stages, self.order = n_stages, order
        self.capture = [i for i, e in enumerate(self.edits) if e is not None and e.capture]
        self.plen = np.asarray(prompt_lens, dtype=np.int64).copy()
        steered = [i for i, e in enumerate(self.edits) if e is not None and e.entries]
        self.dense: Optional[np.ndarray] = None  # [requests, 3 (both, prompt, generated), columns]
        if steered and n_stages:
            dense = np.zeros((len(self.edits), 3, n_stages), dtype=np.float32)
            for i in steered:
                dense[i] = self.edits[i].strengths(n_stages)
                if self.edits[i].prompt_len is not None:
                    self.plen[i] = self.edits[i].prompt_len
            self.dense = dense if order is None else dense[:, :, order]

    def replaced(self, n: int, rows: Dict[int, Tuple[Optional[RequestEdits], int]]) -> "BatchEdits":
        """This batch cut or grown to `n` requests with `rows` (index -> (edits, prompt length)) new, the others
        kept: vLLM keeps each request in its row until one leaves and moves the last ones into the gaps, so a
        step where a few join or leave costs those few rows, not a batch of them (a new object: a steady step
        knows its batch by identity)."""
        out = BatchEdits.__new__(BatchEdits)
        out.n_stages, out.order = self.n_stages, self.order
        keep = min(n, len(self.edits))
        out.edits = self.edits[:keep] + [None] * (n - keep)
        out.plen = np.zeros(n, dtype=np.int64)
        out.plen[:keep] = self.plen[:keep]
        for i, (e, plen) in rows.items():
            out.edits[i], out.plen[i] = e, plen
        out.capture = sorted({i for i in self.capture if i < keep and i not in rows}
                             | {i for i, (e, _) in rows.items() if e is not None and e.capture})
        steered = [i for i, (e, _) in rows.items() if e is not None and e.entries]
        out.dense = None
        if self.n_stages and (self.dense is not None or steered):
            out.dense = np.zeros((n, 3, self.n_stages), dtype=np.float32)
            if self.dense is not None:
                out.dense[:keep] = self.dense[:keep]
                out.dense[list(rows)] = 0.0
            for i in steered:
                s = out.edits[i].strengths(self.n_stages)
                out.dense[i] = s if self.order is None else s[:, self.order]
                if out.edits[i].prompt_len is not None:
                    out.plen[i] = out.edits[i].prompt_len
        return out


class StepRows:
    """The current step's row facts, read by every tap's replay: how many rows are real, and each weight
    column's per-row weight. Reset between steps so a warm-up or dummy run edits nothing."""

    _RING = 4  # pinned staging buffers in turn: a step's copy is done long before its buffer comes round again
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
        self.clear()

    def clear(self) -> None:
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
        for i in batch.capture:
            e = batch.edits[i]
            for loc in e.capture:
                self.capturing.setdefault(loc, []).append(
                    Span(int(starts[i]), int(counts[i]), int(positions[i]), int(batch.plen[i]), e))
        if batch.dense is None:
            self._steady = None
        else:
            decode = counts.size == num_tokens and bool((counts == 1).all())  # row i is request i
            steady = decode and bool((positions >= batch.plen).all())
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
                w = table[src] if src.size * table.shape[1] <= self._GATHER_FROM else None
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


def _row_sources(starts, counts, positions, batch: BatchEdits, num_tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """A step's weights as a gather: `table` (`[2n + 1, columns]`: each request's weights on its prompt rows, then
    on its generated rows, then zeros for rows no request owns) and `src` (`[num_tokens]`, each row's table row)."""
    dense, plen = batch.dense, batch.plen
    n = counts.size
    owner = np.repeat(np.arange(n), counts)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.concatenate([dense[:, 0] + dense[:, 1], dense[:, 0] + dense[:, 2],
                            np.zeros((1, dense.shape[2]), dtype=np.float32)])
    src = np.full(num_tokens, 2 * n, dtype=np.int64)
    src[starts[owner] + offset] = np.where(positions[owner] + offset < plen[owner], owner, owner + n)
    return table, src


def _digest(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return ""
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
