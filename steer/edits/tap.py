"""Taps: named locations whose output an edit rewrites. `layer: i` is the residual stream after decoder
layer i; `path` is any module's output, by its dotted name in the transformers module tree. A `path` is the
more specific of the two and wins when both are set (so `tap.path=...` works on top of a `tap=layerN` group)."""

from dataclasses import dataclass
from typing import Tuple

from steer.errors import ConfigError
from steer.models.spec import ModelSpec
from steer.config.schema import TapConf


@dataclass(frozen=True)
class Tap:
    name: str  # what logs and metadata call it: "layer3" or the raw path
    path: str  # module path in the transformers tree, e.g. "model.layers.3" (with INPUT...: its input, by head)
    residual: bool  # True when the value is the residual stream after a decoder layer
    width: int = 0  # the rows' width an edit's vectors must have (0: the model's hidden size)

    @property
    def module(self) -> str:
        return where(self.path)[0]


# A tap path's suffix for a module's input: "<module>#input", or by head "<module>#input:<head_dim>:h0,h3"
INPUT = "#input"


def head_rows(path: str, h):
    """A captured value `[T, width]` at tap `path` as its edits' vectors see it: at a tap of heads, the mean of the
    heads' slices `[T, head_dim]`; elsewhere `h` itself."""
    _, _, heads, dim = where(path)
    if not heads:
        return h
    return h.reshape(*h.shape[:-1], -1, dim)[..., list(heads), :].mean(-2)


def where(path: str) -> Tuple[str, bool, Tuple[int, ...], int]:
    """(module path, whether the tap is its input, the heads it edits, their width) of a tap path."""
    module, mark, rest = path.partition(INPUT)
    if not mark or not rest:
        return module, bool(mark), (), 0
    dim, _, heads = rest.lstrip(":").partition(":")
    return module, True, tuple(int(h[1:]) for h in heads.split(",")), int(dim)


def _no_module(path: str, spec: ModelSpec) -> str:
    """What is wrong with a module path the model lacks: a decoder layer out of range, or the modules under the
    deepest part of it that exists."""
    parts = path.split(".")
    index = parts[len(spec.layers_path.split("."))] if path.startswith(spec.layers_path + ".") else None
    if index is not None and index.isdigit() and int(index) >= spec.layers:
        return (f"{path!r} names decoder layer {index}, and {spec.name} has {spec.layers} (0..{spec.layers - 1}) "
                f"under {spec.layers_path}")
    known = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in spec.modules]
    under = known[0] if known else None
    depth = len(under.split(".")) + 1 if under else 1
    near = sorted(m for m in spec.modules
                  if (under is None or m.startswith(under + ".")) and len(m.split(".")) == depth)
    where = f"modules under {under}" if under else "top-level modules"
    return f"{path!r} names no module of {spec.name}; {where}: {near[:12]}{' ...' if len(near) > 12 else ''}"


def resolve(conf: TapConf, spec: ModelSpec, field: str = "tap") -> Tap:
    """Turn a tap config into a module path, checking it against the model's module tree."""
    heads = list(getattr(conf, "heads", None) or [])
    if getattr(conf, "input", False):
        return _input(conf, heads, spec, field)
    if heads:
        raise ConfigError(f"{field}.heads", "slices a module's input by head: set tap.input=true (with tap.path an "
                                            "attention output projection)")
    if conf.layer is None and conf.path is None:
        raise ConfigError(field, "names no location: set `layer` (decoder layer index) or `path` (module path)")
    if conf.path is None:
        if not 0 <= conf.layer < spec.layers:
            raise ConfigError(f"{field}.layer", f"layer {conf.layer} is out of range: {spec.name} has "
                                                f"{spec.layers} decoder layers (0..{spec.layers - 1}); "
                                                f"choose one with {field}.layer=N")
        return Tap(f"layer{conf.layer}", spec.layer_path(conf.layer), residual=True)
    if conf.path not in spec.modules:
        raise ConfigError(f"{field}.path", _no_module(conf.path, spec))
    layer_paths = {spec.layer_path(i): i for i in range(spec.layers)}
    if conf.path in layer_paths:
        return Tap(f"layer{layer_paths[conf.path]}", conf.path, residual=True)
    out = spec.outputs.get(conf.path)
    if isinstance(out, str):
        raise ConfigError(f"{field}.path", f"{conf.path!r} is {out}, with no rows of its own to edit: tap a module "
                                           f"whose output is a tensor of the model's hidden size ({spec.hidden}), "
                                           f"such as {spec.layer_path(0)} or {spec.layer_path(0)}.mlp")
    if out is not None and out != spec.hidden:
        raise ConfigError(f"{field}.path", f"{conf.path!r} outputs rows of {out} values, and an edit changes rows of "
                                           f"the model's hidden size ({spec.hidden}): tap a module whose output is "
                                           f"that wide (a decoder layer, a norm, an attention or MLP block, their "
                                           f"output projections)")
    return Tap(conf.path, conf.path, residual=False)


def _input(conf: TapConf, heads, spec: ModelSpec, field: str) -> Tap:
    """`tap.input`: the input of module `tap.path`, whole or (`tap.heads`) by head."""
    if conf.path is None:
        raise ConfigError(f"{field}.path", "tap.input reads a module's input: name the module (e.g. "
                                           f"{spec.layer_path(0)}.self_attn.o_proj)")
    if conf.path not in spec.modules:
        raise ConfigError(f"{field}.path", _no_module(conf.path, spec))
    width = spec.inputs.get(conf.path)
    if width is None:
        raise ConfigError(f"{field}.input", f"{conf.path!r} is passed no tensor as its first argument in a forward "
                                            "pass; tap its output, or another module's input")
    if not heads:
        return Tap(f"{conf.path}[input]", conf.path + INPUT, residual=False, width=width)
    if conf.path not in spec.attn_out:
        near = sorted(spec.attn_out)[:1]
        raise ConfigError(f"{field}.heads", f"{conf.path!r} is not an attention output projection, whose input holds "
                                            f"the heads side by side; e.g. {near[0] if near else 'none here'}")
    bad = [h for h in heads if not (isinstance(h, int) and 0 <= h < spec.heads)]
    if bad:
        raise ConfigError(f"{field}.heads", f"{bad} out of range: {spec.name} has {spec.heads} heads "
                                            f"(0..{spec.heads - 1})")
    if len(set(heads)) != len(heads):
        raise ConfigError(f"{field}.heads", f"{list(heads)} names a head twice")
    hs = ",".join(f"h{h}" for h in heads)
    return Tap(f"{conf.path}[heads {','.join(map(str, heads))}]", f"{conf.path}{INPUT}:{spec.head_dim}:{hs}",
               residual=False, width=spec.head_dim)
