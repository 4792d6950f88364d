"""The edit kinds and token selectors, defined once as plain enums: the tap layer's stages, the config schema
(steer/config/schema.py) and the engines all read them from here. No torch, no Hydra: the CLI imports it to parse."""

from enum import Enum


class EditKind(str, Enum):
    add = "add"
    ablate = "ablate"
    clamp = "clamp"
    set = "set"
    rescale = "rescale"  # h = c + scale * (h - c), the stream multiplied about a centre (strength scale - 1)


class Tokens(str, Enum):
    """Which rows of the residual stream an edit touches: rows fed a prompt token, a generated token, or both."""

    both = "both"
    prompt = "prompt"
    generated = "generated"
