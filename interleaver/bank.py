"""Which rows of a step get which edit, computed once per step on the host, for every request at once.

A step's activation is a flat `[num_tokens, hidden]` slab of every scheduled request (prefill chunks and decode
tokens mixed). Each request carries a list of (stage, strength, rows) entries; a stage is one edit at unit strength
at one tap and one position in that tap's edit list (`Edit.unit`), shared by every request whose edit has the
same shape, so requests that differ only in scale share one op and differ in their row weights. A batch's
requests' weights (`BatchEdits`) are what interleaver.rows turns into each step's `[num_tokens, columns]` matrix.
"""

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from interleaver import select
from interleaver.edit import Condition, Edit
from interleaver.kinds import EditKind, Tokens
from interleaver.vllm_internals import tap_path

_ROWS = {Tokens.both.value: 0, Tokens.prompt.value: 1, Tokens.generated.value: 2}


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
    edit: Edit  # at unit strength
    when: Optional[int] = None  # the index of its condition in the bank's (the edit's `when`), or None


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
    # Some entry's stage is under a condition: the request's prompt is scored while it runs (conditions.py)
    decide: bool = False
    # The request's own condition, gating its own vectors: (location, direction as base64 little-endian f32, reduce,
    # score, compare, threshold); it becomes a condition of the worker that sees it first (InlineStages)
    inline_when: Optional[Tuple[str, str, str, str, str, float]] = None
    # A scoring pass's two requests (conditions.py): the first, its prompt alone, keeps its decisions under `hold`
    # after it ends; the second, prompt and continuation as one prompt, has its rows past `prompt_len` read them
    hold: str = ""
    held: str = ""
    _dense: Optional[Tuple[int, np.ndarray]] = field(default=None, repr=False, compare=False)
    _placed: Optional[list] = field(default=None, repr=False, compare=False)

    def to_args(self) -> str:
        """What rides SamplingParams.extra_args["steer"] into the worker: the request's fields as one JSON string.
        A string because vLLM deep-copies every request's SamplingParams (68 us for a dict of 32 entries, about
        1 us for its string: 17 ms before a 256-request batch that edits at 32 layers could start) and because an
        OpenAI server's vllm_xargs carry flat values only."""
        out = {"entries": [list(e) for e in self.entries], "prompt_len": self.prompt_len,
               "capture": list(self.capture), "key": self.key}
        if self.inline:
            out["inline"] = [list(v) for v in self.inline]
        if self.decide:
            out["decide"] = True
        if self.inline_when is not None:
            out["inline_when"] = list(self.inline_when)
        for name in ("hold", "held"):
            if getattr(self, name):
                out[name] = getattr(self, name)
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
                   [(str(loc), int(i), float(w), str(t), str(v)) for loc, i, w, t, v in d.get("inline", [])],
                   bool(d.get("decide", False)), _when(d.get("inline_when")), str(d.get("hold", "")),
                   str(d.get("held", "")))

    def strengths(self, n_stages: int) -> np.ndarray:
        """`[3, n_stages]` float32: this request's strength per stage on every row, on prompt rows only, and
        on generated rows only (cached: a request asks every step). Entries with positions are `placed`'s."""
        if self._dense is None or self._dense[0] != n_stages:
            s = np.zeros((3, n_stages), dtype=np.float32)
            for stage, strength, rows in self.entries:
                if rows in _ROWS:
                    s[_ROWS[rows], stage] += strength
            self._dense = (n_stages, s)
        return self._dense[1]

    def placed(self) -> List[Tuple[int, float, int, select.Where]]:
        """The entries that act on rows by position: (stage, strength, token kind as `_ROWS` codes it, positions)."""
        if self._placed is None:
            out = []
            for stage, strength, rows in self.entries:
                if rows not in _ROWS:
                    kind, where = select.decode(rows)
                    out.append((stage, strength, _ROWS[kind], where))
            self._placed = out
        return self._placed


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


class EditBank:
    """Every stage an engine serves, registered before requests arrive; ids index the weight matrix."""

    def __init__(self) -> None:
        self.stages: List[Stage] = []
        self._ids: Dict[tuple, int] = {}
        self.conditions: List[Condition] = []
        self._conditions: Dict[tuple, int] = {}

    def register(self, location: str, edits: Sequence[Edit], start: int = 0) -> List[Tuple[int, float, str]]:
        """Register a tap's edits (in order, from position `start` of the tap's edit list) and their conditions,
        and return the request entries that ask for them, at the edits' own strengths and rows."""
        out = []
        for index, e in enumerate(edits, start):
            unit = e.unit()
            when = None if e.when is None else self.condition(e.when)
            key = (location, index, unit.kind.value, _digest(unit.basis), unit.lo, unit.hi, unit.value, when)
            if key not in self._ids:
                self._ids[key] = len(self.stages)
                self.stages.append(Stage(len(self.stages), location, index, unit, when))
            out.append((self._ids[key], e.strength, e.entry_rows()))
        return out

    def condition(self, c: Condition) -> int:
        """The index of condition `c` (registered the first time it is seen): what a stage's `when` names."""
        key = c.key()
        if key not in self._conditions:
            self._conditions[key] = len(self.conditions)
            self.conditions.append(c)
        return self._conditions[key]

    def stage_list(self) -> list:
        """[(id, location, index, Edit.to_dict(when))]: the stages as a vLLM worker's steer_set_stages takes them
        (plain data: vLLM's RPC and additional_config carry no tensors)."""
        return [[s.id, s.location, s.index, s.edit.to_dict(s.when)] for s in self.stages]

    def condition_list(self) -> list:
        """[Condition.to_dict()]: the conditions the stages' `when` index, beside `stage_list`."""
        return [c.to_dict() for c in self.conditions]

    def truncate(self, n: int) -> None:
        """Forget the stages registered after the first `n` (an engine refused them)."""
        self.stages = self.stages[:n]
        self._ids = {k: i for k, i in self._ids.items() if i < n}

    def drop_conditions(self, n: int) -> None:
        """Forget the conditions registered after the first `n`."""
        self.conditions = self.conditions[:n]
        self._conditions = {k: i for k, i in self._conditions.items() if i < n}

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
        self._first_condition: Optional[int] = None  # the bank's conditions before the first request's own

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
            edits._dense = edits._placed = None
            return set()
        changed, mine, when = set(), [], None
        if edits.inline_when is not None:
            loc, data, reduce, score, compare, threshold = edits.inline_when
            if self._first_condition is None:
                self._first_condition = len(self.bank.conditions)
            when = self.bank.condition(Condition(tap_path(loc), torch.from_numpy(decode_vector(data)), reduce, score,
                                                 compare, threshold))
            edits.decide = True
        for loc, index, strength, rows, data in edits.inline:
            key = (loc, int(index), hashlib.sha256(data.encode()).hexdigest(), when)
            sid = self._ids.get(key)
            if sid is None:
                sid = self._place(key, loc, int(index), data, device, changed, when)
            elif self._refs.get(sid, 0) == 0:
                self._free.remove(sid)  # freed but not yet reused: the same vector again
            self._refs[sid] = self._refs.get(sid, 0) + 1
            mine.append((sid, float(strength), str(rows)))
        self._of[rid] = mine
        edits.entries.extend(mine)
        edits._dense = edits._placed = None
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
        if self._first_condition is not None:  # and the requests' own conditions after every other
            self.bank.drop_conditions(self._first_condition)
            self._first_condition = None
        return changed

    def _place(self, key: tuple, loc: str, index: int, data: str, device, changed: set,
               when: Optional[int] = None) -> int:
        vec = decode_vector(data)
        edit = Edit(EditKind.add, torch.from_numpy(vec)[None].to(device),
                    when=None if when is None else self.bank.conditions[when])
        stages = self.bank.stages
        sid = self._free.pop(0) if self._free else len(stages)
        if sid in self._key:
            del self._ids[self._key.pop(sid)]
        if sid == len(stages):
            stages.append(Stage(sid, loc, index, edit, when))
        else:
            changed.add(stages[sid].location)
            stages[sid] = Stage(sid, loc, index, edit, when)
        changed.add(loc)
        self._ids[key], self._key[sid] = sid, key
        return sid


def layout(stages: Sequence[Stage]) -> np.ndarray:
    """The weight matrix's column order: stage ids sorted by (tap, index, kind), so that the stages one tap
    program runs as one batched op are adjacent columns and it reads them as a slice."""
    order = sorted(stages, key=lambda s: (s.location, s.index, s.edit.kind.value, s.id))
    return np.array([s.id for s in order], dtype=np.int64)


def _when(w) -> Optional[Tuple[str, str, str, str, str, float]]:
    if not w:
        return None
    loc, data, reduce, score, compare, threshold = w
    return (str(loc), str(data), str(reduce), str(score), str(compare), float(threshold))


def _steers(e: Optional[RequestEdits]) -> bool:
    return e is not None and bool(e.entries)


def _places(e: Optional[RequestEdits]) -> bool:
    return e is not None and bool(e.placed())


class Placements(NamedTuple):
    """A batch's entries that act on rows by position, one per element, in request order: the request, the weight
    column, the strength, the token kind as `_ROWS` codes it, and the index of its positions in `wheres`."""

    request: np.ndarray
    column: np.ndarray
    strength: np.ndarray
    kind: np.ndarray
    where: np.ndarray
    wheres: List[select.Where]


class BatchEdits:
    """What the scheduled requests ask for, in batch order: built once per batch composition (vLLM keeps its
    batch order from step to step until a request joins or leaves), so a step costs array operations only."""

    def __init__(self, edits: Sequence[Optional[RequestEdits]], prompt_lens: np.ndarray, n_stages: int,
                 order: Optional[np.ndarray] = None):
        self.edits = list(edits)
        self.n_stages, self.order = n_stages, order
        self.capture = [i for i, e in enumerate(self.edits) if e is not None and e.capture]
        self.placed = [i for i, e in enumerate(self.edits) if _places(e)]
        self._placements: Optional[Placements] = None
        self.deciding = [i for i, e in enumerate(self.edits) if e is not None and e.decide]
        self.slots: Optional[np.ndarray] = None  # each request's condition slot (the worker's; conditions.py)
        self.held: Optional[np.ndarray] = None  # the slot of the decisions its rows past the prompt read, if others
        self.plen = np.asarray(prompt_lens, dtype=np.int64).copy()
        steered = [i for i, e in enumerate(self.edits) if _steers(e)]
        self.steered = len(steered)
        self.dense: Optional[np.ndarray] = None  # [requests, 3 (both, prompt, generated), columns]
        if steered and n_stages:
            dense = np.zeros((len(self.edits), 3, n_stages), dtype=np.float32)
            for i in steered:  # the columns reordered once for the whole table, not per row
                self._fill(dense, i, self.edits[i], None)
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
        out.placed = sorted({i for i in self.placed if i < keep and i not in rows}
                            | {i for i, (e, _) in rows.items() if _places(e)})
        out._placements = None
        out.deciding = sorted({i for i in self.deciding if i < keep and i not in rows}
                              | {i for i, (e, _) in rows.items() if e is not None and e.decide})
        out.slots = out.held = None
        steered = [i for i, (e, _) in rows.items() if _steers(e)]
        gone = [i for i in rows if i < keep] + list(range(keep, len(self.edits)))
        out.steered = self.steered - sum(1 for i in gone if _steers(self.edits[i])) + len(steered)
        out.dense = None
        if self.n_stages and out.steered:  # none steered: no weights at all, as a batch built whole has
            out.dense = np.zeros((n, 3, self.n_stages), dtype=np.float32)
            if self.dense is not None:
                out.dense[:keep] = self.dense[:keep]
                out.dense[list(rows)] = 0.0
            for i in steered:
                out._fill(out.dense, i, out.edits[i], self.order)
        return out

    def placements(self) -> Placements:
        """`placed`'s entries as arrays (built once per batch: a step with positions costs array operations)."""
        if self._placements is None:
            col_of = None if self.order is None else np.argsort(self.order)  # stage id -> column
            wheres: List[select.Where] = []
            rows = []
            for i in self.placed:
                for stage, strength, kind, where in self.edits[i].placed():
                    if where not in wheres:
                        wheres.append(where)
                    rows.append((i, stage if col_of is None else col_of[stage], strength, kind, wheres.index(where)))
            r, c, s, k, w = zip(*rows) if rows else ((),) * 5
            self._placements = Placements(np.array(r, dtype=np.int64), np.array(c, dtype=np.int64),
                                          np.array(s, dtype=np.float32), np.array(k, dtype=np.int8),
                                          np.array(w, dtype=np.int64), wheres)
        return self._placements

    def _fill(self, dense: np.ndarray, i: int, e: RequestEdits, order: Optional[np.ndarray]) -> None:
        s = e.strengths(self.n_stages)
        dense[i] = s if order is None else s[:, order]
        if e.prompt_len is not None:
            self.plen[i] = e.prompt_len


def _digest(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return ""
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
