"""Taps: named locations whose output an edit rewrites. `layer: i` is the residual stream after decoder
layer i; `path` is any module's output, by its dotted name in the transformers module tree. A `path` is the
more specific of the two and wins when both are set (so `tap.path=...` works on top of a `tap=layerN` group)."""

from dataclasses import dataclass

from steer.errors import ConfigError
from steer.models.spec import ModelSpec
from steer.config.schema import TapConf


@dataclass(frozen=True)
class Tap:
    name: str  # what logs and metadata call it: "layer3" or the raw path
    path: str  # module path in the transformers tree, e.g. "model.layers.3"
    residual: bool  # True when the value is the residual stream after a decoder layer


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
