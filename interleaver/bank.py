"""Which rows of a step get which edit, computed once per step on the host, for every request at once.

A step's activation is a flat `[num_tokens, hidden]` slab of every scheduled request (prefill chunks and decode
tokens mixed). Each request carries a list of (stage, strength, tokens) entries; a stage is one unit edit at one
tap (steer.edit.Edit.unit), shared by every request whose edit has the same shape, so requests that differ only
in scale share one vectorised op and differ in their row weights. `row_weights` turns the step's spans into a
`[stages, num_tokens]` weight matrix: the only per-step host work the taps need.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from steer.edit import Edit
from steer.schema import Tokens


@dataclass(frozen=True)
class Stage:
    id: int
    location: str
    edit: Edit  # at unit strength


@dataclass
class RequestEdits:
    """What one request asks for: (stage id, strength, tokens) entries, and where its prompt ends (None: the
    request's own prompt length; a scoring pass that feeds a continuation as prompt sets it)."""

    entries: List[Tuple[int, float, str]] = field(default_factory=list)
    prompt_len: Optional[int] = None
    capture: List[str] = field(default_factory=list)  # tap locations whose (edited) rows to keep, for scoring
    key: str = ""  # names the request's captures

    def to_args(self) -> Dict:
        """A plain dict that rides SamplingParams.extra_args into the worker."""
        return {"entries": [list(e) for e in self.entries], "prompt_len": self.prompt_len,
                "capture": list(self.capture), "key": self.key}

    @classmethod
    def from_args(cls, d: Optional[Dict]) -> Optional["RequestEdits"]:
        if not d:
            return None
        return cls([(int(s), float(w), str(t)) for s, w, t in d.get("entries", [])], d.get("prompt_len"),
                   list(d.get("capture", [])), str(d.get("key", "")))


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

    def register(self, location: str, edits: Sequence[Edit]) -> List[Tuple[int, float, str]]:
        """Register a tap's edits (in order) and return the request entries that ask for them."""
        out = []
        for index, e in enumerate(edits):
            unit = e.unit()
            key = (location, index, unit.kind.value, _digest(unit.basis), unit.lo, unit.hi, unit.value)
            if key not in self._ids:
                self._ids[key] = len(self.stages)
                self.stages.append(Stage(len(self.stages), location, unit))
            out.append((self._ids[key], e.strength, e.tokens.value))
        return out

    def at(self, location: str) -> List[Stage]:
        return [s for s in self.stages if s.location == location]


def row_weights(n_stages: int, spans: Sequence[Span], num_tokens: int) -> Tuple[np.ndarray, List[int]]:
    """The `[n_stages, num_tokens]` float32 weights of a step, and the stage ids any row uses."""
    w = np.zeros((n_stages, num_tokens), dtype=np.float32)
    used = set()
    for sp in spans:
        if sp.edits is None or not sp.edits.entries:
            continue
        prompt_len = sp.edits.prompt_len if sp.edits.prompt_len is not None else sp.prompt_len
        positions = np.arange(sp.position, sp.position + sp.count)
        is_prompt = positions < prompt_len
        rows = slice(sp.start, sp.start + sp.count)
        for stage, strength, tokens in sp.edits.entries:
            if strength == 0.0:
                continue
            if tokens == Tokens.both.value:
                w[stage, rows] += strength
            else:
                w[stage, rows] += strength * (is_prompt if tokens == Tokens.prompt.value else ~is_prompt)
            used.add(stage)
    return w, sorted(used)


class StepRows:
    """The current step's row facts, read by every tap's replay: how many rows are real, and each stage's
    per-row weight. Reset between steps so a warm-up or dummy run edits nothing."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.num_tokens: Optional[int] = None
        self.weights: Optional[torch.Tensor] = None
        self.active: frozenset = frozenset()
        self.capturing: Dict[str, List[Span]] = {}  # location -> spans of requests that keep its value

    def set(self, spans: Sequence[Span], num_tokens: int, n_stages: int, device) -> None:
        """Fill the step from its spans: one host->device copy of the weight matrix, nothing per request."""
        self.num_tokens = num_tokens
        w, used = row_weights(n_stages, spans, num_tokens)
        self.active = frozenset(used)
        self.capturing = {}
        for sp in spans:
            for loc in (sp.edits.capture if sp.edits else ()):
                self.capturing.setdefault(loc, []).append(sp)
        self.weights = torch.from_numpy(w).to(device, non_blocking=True) if used else None


def _digest(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return ""
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
