"""engine=vllm: every preset's edits as bank stages, registered before the first request, and the translation of a
request's (preset names, scale) into the per-request entries the tap worker reads (interleaver/bank.py).

A request's edits at one tap run in the order of their position in that tap's edit list (a stage's `index`), and
a request holds at most one stage per position. A preset composed after others at a tap starts after their edits
there, so each preset's edits are registered at every position they can start from: 0 and each sum of the other
presets' edit counts at that tap. A preset alone at its taps has one position, which keeps the tap's fused kernel
(one launch for a tap whose stages all share a position); presets that share a tap add positions there.

The stage list travels to the worker as plain data in vLLM's additional_config (no pickles), and the
`Translator` (plain data too, JSON) is all the request middleware needs: it never touches a tensor.
"""

import json
from typing import Dict, List, Optional, Sequence

from steer.serve.presets import Preset
from steer.serve.protocol import InlinePolicy, InlineVector, InlineWhen
from steer.edits.tap import Tap


class StageTable:
    def __init__(self, presets: Dict[str, Preset], inline_taps: Optional[Dict[int, Tap]] = None):
        from interleaver.bank import EditBank
        from interleaver.vllm_internals import tap_location

        self.bank = EditBank()
        self.taps = {}
        by_tap: Dict[str, Dict[str, list]] = {}  # tap path -> preset -> its edits there, in order
        for name, p in presets.items():
            for tap, e in p.items:
                self.taps.setdefault(tap.path, tap)
                by_tap.setdefault(tap.path, {}).setdefault(name, []).append(e)
            for tap in p.reads:
                self.taps.setdefault(tap.path, tap)
        # presets whose edits are under a condition: a request on one has its prompt scored while it runs
        self.deciding = sorted(name for name, p in presets.items() if any(e.when is not None for _, e in p.items))
        # preset -> [[location, count, {start: [[stage, strength, tokens, always a no-op], ...]}], ...]
        self.presets: Dict[str, list] = {name: [] for name in presets}
        for path, mine in by_tap.items():
            loc = tap_location(path)
            for name, edits in mine.items():
                starts = {}
                for start in sorted(_sums([len(v) for m, v in mine.items() if m != name])):
                    entries = self.bank.register(loc, edits, start)
                    starts[str(start)] = [[sid, strength, tokens, e.inert]
                                          for (sid, strength, tokens), e in zip(entries, edits)]
                self.presets[name].append([loc, len(edits), starts])
        # layer -> location where a request's own vectors go: taps of the worker, with no stage until one comes
        self.inline = {}
        for layer, tap in (inline_taps or {}).items():
            self.taps.setdefault(tap.path, tap)
            self.inline[str(layer)] = tap_location(tap.path)

    def tap_list(self) -> list:
        return [[t.path, t.residual] for t in self.taps.values()]

    def translator(self, listing: list, max_scale: float, hidden: Optional[int] = None) -> "Translator":
        """The request side's table; `hidden`, the model's hidden size, is needed where inline vectors are taken."""
        inline = {"hidden": int(hidden), "layers": self.inline} if self.inline else None
        return Translator({"presets": self.presets, "listing": listing, "max_steer_scale": max_scale,
                           "inline": inline, "deciding": self.deciding})


class Translator:
    """Preset names and a scale -> the request's stage entries; plain data, built from a StageTable or its JSON."""

    def __init__(self, table: dict):
        self.table = table
        self.presets: Dict[str, list] = table["presets"]
        self.listing: list = table["listing"]
        self.max_scale = float(table["max_steer_scale"])
        self.deciding = set(table.get("deciding", ()))
        inline = table.get("inline")
        self.inline_at: Dict[str, str] = inline["layers"] if inline else {}  # layer -> location
        self.inline = InlinePolicy(inline["hidden"], tuple(sorted(int(k) for k in self.inline_at))) if inline else None

    @classmethod
    def load(cls, path: str) -> "Translator":
        with open(path) as f:
            return cls(json.load(f))

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.table, f)

    def entries(self, names: Sequence[str], scale: float, used: Optional[Dict[str, int]] = None) -> List[list]:
        """[[stage, strength, tokens], ...] for presets `names` (distinct) composed in order, strengths times
        `scale`, leaving out what changes nothing (as Plan.active does on the HF engine). `used` is filled with
        each tap's count of edit positions taken."""
        used = {} if used is None else used
        out = []
        for name in names:
            for loc, count, starts in self.presets[name]:
                start = used.get(loc, 0)
                used[loc] = start + count
                for sid, strength, tokens, noop in starts[str(start)]:
                    w = strength * scale
                    if not noop and w != 0.0:
                        out.append([sid, w, tokens])
        return out

    def steer_arg(self, names: Sequence[str], scale: float, inline: Sequence[InlineVector] = (),
                  when: Optional[InlineWhen] = None):
        """The worker's `extra_args["steer"]` for these presets and the request's own vectors, each added after the
        edits before it at its tap (under the request's own condition `when`, where it sends one) (a JSON string:
        vllm_xargs values are flat), or None when nothing is left to edit (the request is served untouched)."""
        used: Dict[str, int] = {}
        entries = self.entries(names, scale, used)
        own = []
        for v in inline:
            loc = self.inline_at[str(v.layer)]
            index = used[loc] = used.get(loc, 0) + 1
            if v.strength != 0.0:
                own.append([loc, index - 1, v.strength, v.tokens, v.data])
        if not entries and not own:
            return None
        from interleaver.bank import RequestEdits

        gate = None
        if when is not None and own:
            gate = (self.inline_at[str(when.layer)], when.data, when.reduce, when.score, when.compare, when.threshold)
        return RequestEdits([tuple(e) for e in entries], inline=[tuple(v) for v in own],
                            decide=any(n in self.deciding for n in names) or gate is not None,
                            inline_when=gate).to_args()


def _sums(counts: List[int]) -> set:
    """Every sum of a subset of `counts` (0 included)."""
    out = {0}
    for c in counts:
        out |= {s + c for s in out}
    return out
