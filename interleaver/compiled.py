"""Edits inside a torch.compile'd model: each tap is a forward hook that calls one custom op, `steer::tap_edit`,
which Dynamo traces into the model's graph as an opaque call and inductor leaves in place.

Breakable CUDA graphs need vLLM's compile pipeline off (and with it inductor's fusions, about 5% of an 8B decode
step). An engine whose edits are all declared at start (`edits_in_graph`) needs no break: its taps only run the
tap programs' in-graph form on the step's fixed weight buffer. So here the hook is two lines Dynamo can trace, and
the op's body, which Dynamo never traces, runs that form: on the whole padded value while a CUDA graph is being
captured (vLLM's FULL and PIECEWISE graphs both capture it: it is not a splitting op), on the step's real rows when
a compiled step runs without a graph, and not at all outside a step (warm-ups, profiling runs). The op must be
registered before a compiled artifact that calls it is loaded, so importing this module registers it.

The tap is named by an opaque value (`TapName`) that torch.compile lifts to a graph input rather than baking in, so
the layers' pieces stay alike and inductor compiles one of them, not one per layer (vLLM's LayerName does the same).
"""

from typing import Any, Dict, Optional

import torch
from torch.library import Library

try:  # torch >= 2.11: opaque value types
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # older torch: the name is a plain string, baked into each layer's piece
    OpaqueBase, register_opaque_type = object, None


class TapName(OpaqueBase):  # type: ignore[misc, valid-type]
    """A tap's location as an op argument."""

    def __init__(self, value: str):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, TapName) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __fx_repr__(self):
        return f"TapName({self.value!r})", {"TapName": TapName}


if register_opaque_type is not None:
    register_opaque_type(TapName, typ="value", hoist=True)
    TapArg: Any = TapName
else:
    TapArg = str

# location -> the interleaver that serves it; one tap worker per process, so one interleaver
_SERVED: Dict[str, Any] = {}


def _tap_edit(hidden: torch.Tensor, residual: Optional[torch.Tensor], tap: TapArg) -> None:
    loc = tap.value if isinstance(tap, TapName) else tap
    _SERVED[loc].serve_in_graph(loc, hidden if residual is None else (hidden, residual),
                                torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tap_edit_fake(hidden: torch.Tensor, residual: Optional[torch.Tensor], tap: TapArg) -> None:
    return None


def _register(lib: Library) -> None:
    from torch._library.infer_schema import infer_schema

    lib.define("tap_edit" + infer_schema(_tap_edit, mutates_args=["hidden"]))
    for key in ("CPU", "CUDA"):
        lib.impl("tap_edit", _tap_edit, key)
    lib._register_fake("tap_edit", _tap_edit_fake)


_LIB = Library("steer", "FRAGMENT")  # the op lives as long as this library object
_register(_LIB)


def serve(il: Any, location: str) -> None:
    """Route the op's calls for `location` to `il` (its `serve_in_graph(location, value, capturing)`)."""
    _SERVED[location] = il


def hook(location: str, residual: bool):
    """The forward hook of a tap: the module's output edited in place by the op (the output flows on)."""
    name = TapName(location) if TapArg is TapName else location

    def tap_hook(module, args, output):
        # A module tap's value is its output's first tensor, as the breakable path reads it (vLLM's linear layers
        # hand on (output, bias))
        h, r = (output[0], output[1]) if residual else (output[0] if isinstance(output, tuple) else output, None)
        torch.ops.steer.tap_edit(h, r, name)
        return None

    return tap_hook
