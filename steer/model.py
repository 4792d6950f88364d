"""What a run needs to know about its model before any weights load: where it is, its shape, its modules.

The module tree is built on the meta device from the config alone, so a tap that names no module, or a layer
out of range, fails in a second even for an 8B model, and offline use of a hub model fails with a clear message.
"""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import FrozenSet, Tuple

import torch

from steer import tiny
from steer.errors import ConfigError
from steer.schema import ModelConf

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # "tiny", a local directory, or a hub id
    revision: str | None
    dtype: torch.dtype
    hidden: int
    layers: int
    layers_path: str  # the ModuleList holding the decoder layers, e.g. "model.layers"
    modules: FrozenSet[str]

    def layer_path(self, i: int) -> str:
        return f"{self.layers_path}.{i}"


def spec(conf: ModelConf, cache_dir: str) -> ModelSpec:
    """Read the model's shape and module tree from its config (the tiny model's recipe needs no files)."""
    if conf.dtype not in _DTYPES:
        raise ConfigError("model.dtype", f"{conf.dtype!r} is not one of {sorted(_DTYPES)}")
    if conf.source == "tiny":
        config = tiny.llama_config(conf.tiny)
        source = str(tiny.tiny_dir(cache_dir, conf.tiny))
    else:
        config = _hub_config(conf.source if conf.source != "hub" else conf.name, conf.revision)
        source = conf.source if conf.source != "hub" else conf.name
    layers_path, modules = _modules(config)
    return ModelSpec(conf.name, source, conf.revision, _DTYPES[conf.dtype], config.hidden_size,
                     config.num_hidden_layers, layers_path, modules)


def _hub_config(where: str, revision: str | None):
    from transformers import AutoConfig

    field = "model.source" if Path(where).exists() else "model.name"
    try:
        return AutoConfig.from_pretrained(where, revision=revision)
    except Exception as e:  # transformers raises OSError, ValueError or hub errors depending on the cause
        raise ConfigError(field, f"could not read the config of {where!r} (a local directory or a Hugging "
                                 f"Face hub id; offline, or a gated model without `hf auth login`?): "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _modules(config) -> Tuple[str, FrozenSet[str]]:
    return _module_tree(config.to_json_string())


@lru_cache(maxsize=8)
def _module_tree(config_json: str) -> Tuple[str, FrozenSet[str]]:
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads(config_json)
    config = AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {n: m for n, m in model.named_modules() if n}
    stacks = [n for n, m in names.items() if isinstance(m, torch.nn.ModuleList) and len(m) == config.num_hidden_layers]
    if not stacks:
        raise ConfigError("model", f"found no list of {config.num_hidden_layers} decoder layers in "
                                   f"{type(model).__name__}")
    return stacks[0], frozenset(names)
