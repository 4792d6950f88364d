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
        near = sorted(m for m in spec.modules if m.startswith(conf.path.rsplit(".", 1)[0]))[:12]
        raise ConfigError(f"{field}.path", f"{conf.path!r} names no module of {spec.name}; "
                                           f"modules near it: {near or sorted(spec.modules)[:12]}")
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
