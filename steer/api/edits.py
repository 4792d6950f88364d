"""Edits as Python calls: `steer.add(v, layer=12, scale=4)` is the config's `{tap: {layer: 12}, edit: {kind: add,
scale: 4, vector: ...}}`. A field left out keeps its default from conf/edit/<kind>.yaml, as `edit=<kind>` on the
command line does; everything is checked where the CLI checks it (steer.tasks.registry.prepare)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional, Union

if TYPE_CHECKING:  # names for annotations alone: `import steer` loads no torch
    import torch

    from steer.api.vector import Vector

TOKENS = {"both": "both", "all": "both", "prompt": "prompt", "generated": "generated"}  # "all": every row, as "both"


@dataclass(frozen=True)
class EditSpec:
    """One edit at one tap. `vector`: a steer.Vector, a tensor or array of its values (`[hidden]`, or `[k, hidden]`
    for a subspace), a safetensors path, or None (the direction extracted from prompts.positive / prompts.negative
    at the tap, as the CLI does). `layer`: the residual stream after that decoder layer; `path`: any module's
    output instead. `fields`: the edit's own settings given (scale, tokens, lo, hi, value, key)."""

    kind: str
    vector: object = None
    layer: Optional[int] = None
    path: Optional[str] = None
    fields: Dict[str, object] = field(default_factory=dict)

    def tap(self) -> Dict[str, object]:
        return {"layer": self.layer, "path": self.path}


def _edit(kind: str, vector, layer, path, **given) -> EditSpec:
    fields = {k: v for k, v in given.items() if v is not _DEFAULT}
    if "tokens" in fields and isinstance(fields["tokens"], str):
        fields["tokens"] = TOKENS.get(fields["tokens"], fields["tokens"])  # an unknown one: the schema names it
    return EditSpec(kind, vector, layer, path, fields)


class _Default:
    def __repr__(self):
        return "<conf/edit default>"


_DEFAULT = _Default()  # a field left out: conf/edit/<kind>.yaml's value (None is a value: an unbounded clamp side)
Vec = Union["Vector", "torch.Tensor", str, None]


def add(vector: Vec = None, layer: Optional[int] = None, scale=_DEFAULT, *, path: Optional[str] = None,
        tokens=_DEFAULT, key=_DEFAULT) -> EditSpec:
    """h += scale * v."""
    return _edit("add", vector, layer, path, scale=scale, tokens=tokens, key=key)


def ablate(vector: Vec = None, layer: Optional[int] = None, scale=_DEFAULT, *, path: Optional[str] = None,
           tokens=_DEFAULT, key=_DEFAULT) -> EditSpec:
    """h -= scale * (h . d) d, d the unit direction (a `[k, hidden]` vector: its orthonormalised subspace)."""
    return _edit("ablate", vector, layer, path, scale=scale, tokens=tokens, key=key)


def clamp(vector: Vec = None, layer: Optional[int] = None, lo=_DEFAULT, hi=_DEFAULT, *, scale=_DEFAULT,
          path: Optional[str] = None, tokens=_DEFAULT, key=_DEFAULT) -> EditSpec:
    """p = h . d; h += scale * (clip(p, lo, hi) - p) d (lo or hi None: unbounded on that side)."""
    return _edit("clamp", vector, layer, path, lo=lo, hi=hi, scale=scale, tokens=tokens, key=key)


def set_projection(vector: Vec = None, layer: Optional[int] = None, value=_DEFAULT, *, scale=_DEFAULT,
                   path: Optional[str] = None, tokens=_DEFAULT, key=_DEFAULT) -> EditSpec:
    """h += scale * (value - h . d) d: the projection on d moved to `value` (the edit kind `set`)."""
    return _edit("set", vector, layer, path, value=value, scale=scale, tokens=tokens, key=key)


def rescale(factor=_DEFAULT, layer: Optional[int] = None, *, centre: Vec = None, path: Optional[str] = None,
            tokens=_DEFAULT, key=_DEFAULT) -> EditSpec:
    """h = c + factor * (h - c), c the `centre` vector (none: 0, so h *= factor; factor 0 is zero ablation): the edit
    kind `rescale`, its factor the edit's `scale`."""
    return _edit("rescale", centre, layer, path, scale=factor, tokens=tokens, key=key)
