"""task=select's grid: the steer config of every (layer, scale) pair, and the directory each pair runs in.
(steer.config.checks.select_grid checks the grid against the model first.)"""

import copy
from typing import List

from steer.config.schema import SteerConf, TapConf, Task


def cells(cfg: SteerConf) -> List[SteerConf]:
    """The steer config of every (layer, scale) pair of `select.layers` x `select.scales`, layers outer."""
    out = []
    for layer in cfg.select.layers:
        for scale in cfg.select.scales:
            c = copy.deepcopy(cfg)
            c.task, c.tap, c.edit.scale = Task.steer, TapConf(layer=layer), float(scale)
            out.append(c)
    return out


def cell_name(cfg: SteerConf) -> str:
    return f"layer{cfg.tap.layer}_scale{cfg.edit.scale:g}"
