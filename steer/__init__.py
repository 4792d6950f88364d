"""steer: steering LLMs declared in Hydra configs. `python -m steer` is the CLI; in Python (a notebook):

    import steer
    lab = steer.Lab(model="smollm2", overrides=["gen.max_new_tokens=32"])
    v = lab.extract(positive=pos, negative=neg, layer=12)
    out = lab.generate(prompts, edits=[steer.add(v, layer=12, scale=4)])

Names load on first use, so `import steer` stays cheap (no torch until a Lab or Vector is needed).
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees; at run time each name loads on first use (below)
    from steer.api.edits import EditSpec as EditSpec, ablate as ablate, add as add, clamp as clamp
    from steer.api.edits import rescale as rescale, set_projection as set_projection
    from steer.api.outputs import Generation as Generation, Selection as Selection
    from steer.api.vector import Vector as Vector
    from steer.errors import ConfigError as ConfigError
    from steer.lab import Lab as Lab

# name -> the module that defines it
_LAZY = {
    "Lab": "steer.lab",
    "Vector": "steer.api.vector",
    "Generation": "steer.api.outputs",
    "Selection": "steer.api.outputs",
    "EditSpec": "steer.api.edits",
    "add": "steer.api.edits",
    "ablate": "steer.api.edits",
    "clamp": "steer.api.edits",
    "set_projection": "steer.api.edits",
    "rescale": "steer.api.edits",
    "ConfigError": "steer.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    from steer.renamed import api_message

    raise AttributeError(api_message(name) or f"module 'steer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
