"""`python -m steer preset=NAME`: a preset (conf/preset/NAME.yaml, the server's presets) run as a steer run. Its
edits for the run's model (its `models` entry for model.name, else its `edits`) take the place of tap, edit and
extra_edits: the first as tap/edit, the rest as extra_edits, as the server applies them to a request."""

import copy
from dataclasses import replace
from typing import List, Optional, Sequence

from steer.config import checks
from steer.config.schema import PresetConf, SteerConf, TapEditConf
from steer.errors import ConfigError


def edits_for(conf: PresetConf, model: Optional[str], name: str) -> List[TapEditConf]:
    """The edits preset `name` gives `model` (its `models` entry for that model.name, else its `edits`)."""
    edits = conf.models[model] if model in conf.models else conf.edits
    if not edits:
        raise ConfigError(f"preset {name}: edits", "is empty; a preset needs at least one {tap, edit} pair")
    return list(edits)


def apply(cfg: SteerConf, given: Sequence[str], name: str = "preset") -> SteerConf:
    """A copy of `cfg` with its preset's edits as tap, edit and extra_edits (`cfg` itself where it names no preset).
    `given`: the keys the command line set (a tap or edit set beside a preset would be dropped without a word)."""
    if cfg.preset is None:
        return cfg
    checks.preset(cfg, given)
    part = f"models.{cfg.model.name}" if cfg.model.name in cfg.preset.models else "edits"
    edits = [_typed(te, f"preset.{part}[{i}]") for i, te in enumerate(edits_for(cfg.preset, cfg.model.name, name))]
    return replace(cfg, tap=edits[0].tap, edit=edits[0].edit, extra_edits=edits[1:])


def _typed(item, field: str) -> TapEditConf:
    """A preset's edit as TapEditConf (a `models` entry composes as a plain mapping: OmegaConf types no list nested
    in a dict), an unknown key or a wrong type named."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(item, TapEditConf):
        return copy.deepcopy(item)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TapEditConf), item))
    except (OmegaConfBaseException, ValueError) as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{field}.{key}" if key else field, str(e).splitlines()[0]) from e
