"""task=select's one ruler: the probe that reads the concept of every pair's text.

A pair's concept read along its own layer's direction is a number on that layer's ruler: a direction that barely
separates the prompt sets reads large gains from noise, and gains at two layers cannot be ranked against each other.
So one probe reads every pair: by default the default direction (extracted from prompts.positive/negative) at the
grid layer whose held-out AUC is best (steer/runs/diagnostics.py), or the default direction at
`select.probe_layer`, or a file's (`select.probe_path`, at probe_layer or the tap its metadata names). Each pair's
rows then carry probe_baseline and probe_steered: the unsteered model's reading of each text at the probe's layer,
projected on it.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import torch

from steer.config.schema import SteerConf, TapConf
from steer.edits import vector
from steer.edits.tap import Tap, resolve
from steer.errors import ConfigError


@dataclass(frozen=True)
class Probe:
    layer: int
    tap: Tap
    direction: torch.Tensor  # [hidden]; its length does not matter (metrics.concept reads along the unit vector)
    source: str  # "best held-out AUC", "select.probe_layer" or "select.probe_path"
    file: Optional[str] = None  # the vector file it was read from (the cached default direction's, or the user's)
    auc: Optional[float] = None  # its held-out AUC, where its file records one
    aucs: Dict[int, Optional[float]] = field(default_factory=dict)  # every grid layer's, where it was chosen by them

    def record(self) -> Dict:
        """What selection.json says of it."""
        return {"layer": self.layer, "tap": self.tap.name, "source": self.source, "file": self.file,
                "heldout_auc": self.auc, "heldout_auc_by_layer": {str(k): v for k, v in self.aucs.items()}}

    def identity(self) -> Dict:
        """What a finished pair's reading depends on: its layer and the direction itself."""
        blob = self.direction.detach().to(torch.float32).contiguous().numpy().tobytes()
        return {"layer": self.layer, "sha256": hashlib.sha256(blob).hexdigest()}


def _file_layer(path: str, cfg: SteerConf) -> int:
    """The layer a probe file is read at: select.probe_layer, else the decoder layer its metadata's tap names."""
    if cfg.select.probe_layer is not None:
        return int(cfg.select.probe_layer)
    tap = vector.metadata(path).get("tap", "")
    if tap.startswith("layer") and tap[len("layer"):].isdigit():
        return int(tap[len("layer"):])
    raise ConfigError("select.probe_layer", f"is unset, and the probe file {path!r} names no decoder layer in its "
                                            "metadata (tap): set select.probe_layer to the layer it reads")


def _from_file(cfg: SteerConf, spec) -> Probe:
    path = str(vector.require(cfg.select.probe_path, "select.probe"))
    layer = _file_layer(path, cfg)
    d = vector.load(path, "direction", spec.hidden, field="select.probe", layer=layer)
    if d.shape[0] != 1:
        raise ConfigError("select.probe_path", f"{path!r} holds {d.shape[0]} directions under 'direction'; a probe "
                                               "is one direction")
    meta = vector.metadata(path)
    multi = "layers" in meta
    return Probe(layer, resolve(TapConf(layer=layer), spec, "select.probe_layer"), d[0], "select.probe_path", path,
                 _auc(meta, layer if multi else None))


def _auc(meta: Dict[str, str], layer: Optional[int] = None) -> Optional[float]:
    try:
        return float(meta[f"diag.{layer}.heldout_auc" if layer is not None else "diag.heldout_auc"])
    except (KeyError, ValueError):  # not recorded, or "none"
        return None


def tap(cfg: SteerConf, spec) -> Optional[Tap]:
    """The probe's tap where it is known before an engine starts (select.probe_path, select.probe_layer), its file
    read and checked now; None where the grid's extractions choose it."""
    s = cfg.select
    if s.probe_path is not None:
        return _from_file(cfg, spec).tap
    if s.probe_layer is not None:
        return resolve(TapConf(layer=int(s.probe_layer)), spec, "select.probe_layer")
    return None


def choose(cfg: SteerConf, spec, engine) -> Probe:
    """The probe for a select run of `cfg` on `engine` (module docstring): the default directions it compares are
    the ones the grid's pairs steer with, extracted once into the cache (steer.runs.extract.cached_default)."""
    from steer.runs import diagnostics
    from steer.runs.extract import Recipe, cache_defaults, cached_default, default_path

    s = cfg.select
    if s.probe_path is not None:
        return _from_file(cfg, spec)
    layers = [int(s.probe_layer)] if s.probe_layer is not None else [int(k) for k in s.layers]
    taps = [resolve(TapConf(layer=k), spec, "select.layers") for k in layers]
    pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat)
    cache_defaults(cfg.cache_dir, engine, taps, pos, neg, recipe)
    read = [cached_default(cfg.cache_dir, engine, t, pos, neg, recipe, True) for t in taps]
    diags = [diagnostics.from_metadata(meta) for _, meta in read]
    i = diagnostics.best(diags)
    i = 0 if i is None else i
    file = default_path(cfg.cache_dir, engine, taps[i], pos, neg, recipe)
    source = "select.probe_layer" if s.probe_layer is not None else "best held-out AUC"
    return Probe(layers[i], taps[i], read[i][0][0], source, str(Path(file)), diags[i].get("heldout_auc"),
                 {k: d.get("heldout_auc") for k, d in zip(layers, diags)} if s.probe_layer is None else {})
