"""Config plus loaded vectors -> a Plan: the compiled edits of a run, grouped by tap, in config order.

Vectors named by a file are loaded and checked here; a vector left to the default (no path) is asked of
`default_vector(tap)`, which the caller backs with extraction (see steer.runs.extract). Nothing here loads a model.
"""

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from steer.config import checks
from steer.edits import formats, vector
from steer.errors import ConfigError
from steer.edits.condition import Condition
from steer.edits.edit import Edit, compile_edit
from steer.models.spec import ModelSpec
from steer.config.schema import EditConf, EditKind, SteerConf, TapConf
from steer.edits.tap import Tap, resolve, where

log = logging.getLogger(__name__)
DefaultVector = Union[torch.Tensor, Tuple[torch.Tensor, Optional[Dict[str, str]]]]


@dataclass
class Plan:
    """Compiled edits by tap path, each list in config order; `primary` is the config's first edit."""

    taps: Dict[str, Tap] = field(default_factory=dict)
    edits: Dict[str, List[Edit]] = field(default_factory=dict)
    primary: Optional[Tuple[Tap, Edit]] = None
    # Edits compiled on a stand-in until their tap's default direction is known: (tap path, index in its list,
    # config field prefix, edit config).
    pending: List[Tuple[str, int, str, EditConf]] = field(default_factory=list)
    # Conditions compiled on a stand-in until their direction is extracted from the condition prompts: (the stand-in,
    # its tap, its config field)
    pending_when: List[Tuple[Condition, Tap, str]] = field(default_factory=list)
    condition_taps: Dict[str, Tap] = field(default_factory=dict)  # where the conditions read the prompt

    def conditions(self) -> List[Condition]:
        """The distinct conditions the edits name, in order."""
        return list(dict.fromkeys(e.when for edits in self.edits.values() for e in edits if e.when is not None))

    def with_conditions(self, default_vector: Callable[[Tap], torch.Tensor], hidden: int) -> "Plan":
        """This plan with every condition that waits for a direction compiled on `default_vector(tap)` (the
        condition prompts' direction at its tap)."""
        if not self.pending_when:
            return self
        new: Dict[Condition, Condition] = {}
        for stand_in, tap, _ in self.pending_when:
            d = vector.check(default_vector(tap), hidden, f"condition direction at {tap.name}")
            new[stand_in] = replace(stand_in, vector=d.reshape(-1).float())
        out = Plan(taps=dict(self.taps), condition_taps=dict(self.condition_taps))
        out.edits = {path: [replace(e, when=new.get(e.when, e.when)) for e in edits]
                     for path, edits in self.edits.items()}
        out.pending = list(self.pending)
        first = self.primary[0]
        out.primary = (first, out.edits[first.path][0])
        return out

    def add(self, tap: Tap, edit: Edit) -> None:
        self.taps.setdefault(tap.path, tap)
        self.edits.setdefault(tap.path, []).append(edit)
        if self.primary is None:
            self.primary = (tap, edit)

    def with_defaults(self, default_vector: Callable[[Tap], DefaultVector], hidden: int) -> "Plan":
        """This plan with every pending edit compiled on its tap's default direction (files are not read again).
        `default_vector(tap)` gives the direction, or (direction, its file's metadata) for edit.scale_by=resid."""
        if not self.pending:
            return self
        out = Plan(taps=dict(self.taps), edits={path: list(edits) for path, edits in self.edits.items()},
                   pending_when=list(self.pending_when), condition_taps=dict(self.condition_taps))
        for path, i, prefix, e in self.pending:
            tap = self.taps[path]
            got = default_vector(tap)
            d, meta = got if isinstance(got, tuple) else (got, None)
            where = f"default vector at {tap.name}"
            vecs = scaled(e, vector.check(d, tap.width or hidden, where), meta, "direction", tap, prefix, where)
            out.edits[path][i] = _compile(e, vecs, prefix, self.edits[path][i].when)
        first = self.primary[0]
        out.primary = (first, out.edits[first.path][0])  # the config's first edit is the first at its tap
        return out

    def active(self) -> "Plan":
        """The same plan without edits that change nothing (so scale 0 runs no edit at all)."""
        out = Plan(primary=self.primary, condition_taps=dict(self.condition_taps))
        for path, edits in self.edits.items():
            for e in edits:
                if not e.is_noop:
                    out.taps.setdefault(path, self.taps[path])
                    out.edits.setdefault(path, []).append(e)
        return out


def entries(cfg: SteerConf) -> List[Tuple[str, object, EditConf]]:
    """Every (config field prefix, tap config, edit config) of a run, in config order."""
    out = [("", cfg.tap, cfg.edit)]
    out += [(f"extra_edits[{i}].", te.tap, te.edit) for i, te in enumerate(cfg.extra_edits)]
    return out


def needs_default_vector(e: EditConf) -> bool:
    return e.vector.path is None and e.kind != EditKind.rescale


def build(cfg: SteerConf, spec: ModelSpec, default_vector: Callable[[Tap], torch.Tensor] | None = None) -> Plan:
    """Resolve taps, load and check vectors, compile edits. With `default_vector` None, only files are read (the
    validation pass): an edit that needs an extracted vector is checked for everything else and waits in
    `pending` (`Plan.with_defaults`)."""
    return compile_entries(entries(cfg), spec, default_vector)


def compile_entries(items: Sequence[Tuple[str, TapConf, EditConf]], spec: ModelSpec,
                    default_vector: Callable[[Tap], torch.Tensor] | None = None) -> Plan:
    """`build` for any (field prefix, tap config, edit config) list, e.g. a steer.serve preset's edits; with
    `default_vector`, the pending edits are then compiled on it."""
    plan = Plan()
    conditions: Dict[tuple, Condition] = {}
    for prefix, tap_conf, e in items:
        when = _condition(e, spec, prefix, plan, conditions)
        if e.vector.layers is not None:
            meta = vector.metadata(Path(e.vector.path).expanduser()) if e.vector.path is not None else {}
            for k, tap, vecs in _per_layer(e, spec, prefix):
                vecs = scaled(e, vecs, meta, f"direction.{k}", tap, prefix, f"{e.vector.path}:direction.{k}")
                plan.add(tap, _compile(e, vecs, prefix, when))
            continue
        tap = resolve(tap_conf, spec, f"{prefix}tap")
        width, what = tap_width(tap, spec)
        if e.vector.path is not None:
            layer = spec_layer(tap, spec)
            vecs = vector.load(e.vector.path, e.vector.key, width, f"{prefix}edit.vector", layer=layer,
                               feature=e.vector.feature, any_layer=e.vector.any_layer, what=what)
            _check_origin(e.vector.path, tap, spec, f"{prefix}edit.vector.path")
            meta = vector.metadata(Path(e.vector.path).expanduser())
            vecs = scaled(e, vecs, meta, e.vector.key, tap, prefix, f"{e.vector.path}:{e.vector.key}")
        elif needs_default_vector(e) and where(tap.path)[2]:
            if e.kind != EditKind.ablate:
                raise ConfigError(f"{prefix}edit.vector.path", f"an edit of heads takes a vector of head_dim "
                                                               f"({width}) from a file; only ablate goes without one "
                                                               "(it ablates the heads' whole slices)")
            vecs = torch.eye(width)  # every direction of the head's slice: the head ablated
        elif needs_default_vector(e):
            vecs = torch.ones(1, width)  # stands in for the extracted direction until `with_defaults`
            plan.pending.append((tap.path, len(plan.edits.get(tap.path, [])), prefix, e))
        else:
            vecs = None
        plan.add(tap, _compile(e, vecs, prefix, when))
    return plan if default_vector is None else plan.with_defaults(default_vector, spec.hidden)


def _condition(e: EditConf, spec: ModelSpec, prefix: str, plan: Plan, made: Dict[tuple, Condition]
               ) -> Optional[Condition]:
    """The edit's condition (None: it has none), its tap resolved and its direction read from its file, or a
    stand-in in `plan.pending_when` until the condition prompts' direction is extracted. Edits whose `when` is the
    same share one Condition, and so one decision."""
    w = e.when
    if w.layer is None:
        return None
    field = f"{prefix}edit.when"
    key = (w.layer, w.vector, w.key, w.reduce, w.score, w.compare, float(w.threshold))
    if key in made:
        return made[key]
    tap = resolve(TapConf(layer=w.layer), spec, field)  # names {field}.layer
    if w.vector is not None:
        v = when_vector(w.vector, w.key, spec.hidden, field, w.layer)
        if v.shape[0] != 1:
            raise ConfigError(f"{field}.vector", f"a condition reads one direction [hidden]; {w.vector!r} holds "
                                                 f"{v.shape[0]} rows")
        c = Condition(tap.path, v[0].float(), str(w.reduce), str(w.score), str(w.compare), float(w.threshold))
    else:
        c = Condition(tap.path, torch.ones(spec.hidden), str(w.reduce), str(w.score), str(w.compare),
                      float(w.threshold))
        plan.pending_when.append((c, tap, field))
    plan.condition_taps.setdefault(tap.path, tap)
    made[key] = c
    return c


def tap_width(tap: Tap, spec: ModelSpec) -> Tuple[int, str]:
    """The width of a tap's rows, which its vectors must have, and what names it in an error."""
    if not tap.width or tap.width == spec.hidden and not where(tap.path)[1]:
        return spec.hidden, "the model's hidden size"
    module, _, heads, dim = where(tap.path)
    if heads:
        return dim, f"a head's width at {module}'s input (head_dim)"
    return tap.width, f"the width of {module}'s input"


def spec_layer(tap: Tap, spec: ModelSpec) -> Optional[int]:
    """The decoder layer whose output `tap` is, None for any other module."""
    if not tap.residual:
        return None
    return next(i for i in range(spec.layers) if spec.layer_path(i) == tap.path)


def _per_layer(e: EditConf, spec: ModelSpec, prefix: str) -> List[Tuple[int, Tap, torch.Tensor]]:
    """`edit.vector.layers`: one (layer, tap, direction) per layer it names, in place of the entry's tap."""
    field = f"{prefix}edit.vector"
    if e.vector.path is None:
        raise ConfigError(f"{field}.layers", "runs a multi-layer file's directions; give the file (edit.vector.path)")
    if e.vector.feature is not None:
        raise ConfigError(f"{field}.layers", "an SAE feature is one direction at one layer; leave layers unset")
    directions = vector.load_layers(e.vector.path, spec.hidden, field)
    chosen = formats.choose_layers(e.vector.layers, list(directions), f"{field}.layers", repr(str(e.vector.path)))
    out = []
    for k in chosen:
        tap = resolve(TapConf(layer=k), spec, f"{field}.layers")
        out.append((k, tap, directions[k]))
    return out


def _check_origin(path: str, tap: Tap, spec: ModelSpec, field: str) -> None:
    """Warn where a vector file says it was made at another tap or on another model than it is used with: legal
    (a direction can carry over), and also what a wrong interpolation in a per-layer sweep looks like."""
    if formats.kind(Path(path).expanduser()) != "safetensors":
        return  # only steer's own files say where they were made
    made = vector.metadata(Path(path).expanduser())
    if formats.is_multi_layer(made) and tap.name.removeprefix("layer") in made["layers"].split(","):
        made = {**made, "tap": tap.name}  # a direction per layer: the one made at this tap is the one that runs
    for what, used in (("tap", tap.name), ("model", spec.name)):
        said = (field, path, what, made.get(what), used)
        if made.get(what) and made[what] != used and said not in _WARNED:  # once: select's grid reuses one file
            _WARNED.add(said)
            log.warning("%s: %s was extracted at %s %s and is used at %s", field, path, what, made[what], used)


_WARNED: set = set()


def scaled(e: EditConf, vecs: torch.Tensor, meta: Optional[Dict[str, str]], key: str, tap: Tap, prefix: str,
           where: str) -> torch.Tensor:
    """The vector `add` adds at scale 1, by `edit.scale_by`: as it is ("vector"), its unit direction ("unit"), or
    that times the mean residual norm at the tap ("resid"). The norm is the one extraction measured and recorded in
    the vector's metadata (steer/runs/diagnostics.py), not one measured again on the run's prompts: a file names
    its strength whatever the run's prompts, and a run resumed with the same file (inputs.json holds its sha256)
    adds exactly what it added before. Other kinds use the direction alone, so scale_by changes nothing there."""
    field = f"{prefix}edit.scale_by"
    if e.scale_by == "vector" or e.kind != EditKind.add:
        return vecs
    unit = vecs / vecs.norm(dim=-1, keepdim=True)
    if e.scale_by == "unit":
        return unit
    norm, at = vector.resid_norm(meta or {}, key)
    if norm is None:
        raise ConfigError(field, f"resid multiplies the unit direction by the mean residual norm at its tap, which "
                                 f"extraction records in the vector's metadata (diag.resid_norm); {where} records "
                                 "none: extract it with task=extract, or use scale_by=unit")
    if at != tap.name:
        raise ConfigError(field, f"{where} recorded the residual norm at {at}, and the edit runs at {tap.name}, "
                                 "where the stream's norm differs: extract the direction at this tap (a file per "
                                 "layer, or extract.layers), or use scale_by=unit")
    return unit * norm


def when_vector(path: str, key: str, hidden: int, field: str, layer: Optional[int] = None) -> torch.Tensor:
    """`vector.load` for a condition's file, its errors naming `<field>.vector` and `<field>.key` (a condition's
    file is one value, not a section)."""
    try:
        return vector.load(path, key, hidden, f"{field}.vector", layer=layer)
    except ConfigError as e:
        name = {f"{field}.vector.path": f"{field}.vector", f"{field}.vector.key": f"{field}.key"}.get(e.field, e.field)
        raise ConfigError(name, str(e).split(": ", 1)[1]) from None


def _compile(e: EditConf, vecs: Optional[torch.Tensor], prefix: str, when: Optional[Condition] = None) -> Edit:
    return compile_edit(e.kind, e.scale, vecs, tokens=e.tokens, lo=e.lo, hi=e.hi, value=e.value,
                        field=f"{prefix}edit", when=when,
                        positions=checks.positions(e.positions, f"{prefix}edit.positions"))
