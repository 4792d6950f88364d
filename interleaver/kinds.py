"""The edit kinds and token selectors, as plain enums: the config schema (schema.py) types its fields with them,
and code that must not import Hydra (compiled edits, engine workers) reads them from here."""

from enum import Enum


class EditKind(str, Enum):
    add = "add"
    ablate = "ablate"
    clamp = "clamp"
    set = "set"
    scale = "scale"


class Tokens(str, Enum):
    """Which rows of the residual stream an edit touches: rows fed a prompt token, a generated token, or both."""

    both = "both"
    prompt = "prompt"
    generated = "generated"
