"""Taps that survive CUDA-graph replay. A leaf package: it imports torch, numpy and nnsight, vLLM and Triton only
where it runs on them, and never the application that drives it (a vLLM worker imports this package alone).

`VLLMInterleaver` serves nnsight traces and compiled edit programs at declared taps; `EditBank` and `StepRows`
map each step's flat token rows to the requests that own them and the edits (`Edit`) they carry.

The names below load on first use, so that `interleaver.kinds` (imported while a command line is parsed) brings
neither torch nor nnsight with it. Only anyio loads here, first, whatever module of the package is imported.
"""

import importlib
import pkgutil
import warnings

_WHERE = {"EditBank": "bank", "RequestEdits": "bank", "Span": "rows", "StepRows": "rows",
          "VLLMInterleaver": "interleaver", "TapProgram": "program", "Edit": "edit", "Condition": "edit",
          "EditKind": "kinds", "Tokens": "kinds"}

__all__ = sorted(_WHERE)


def _load_anyio() -> None:
    """Import every anyio module before nnsight (nnsight_internals.py): nnsight mounts `.save` on `object`, and
    anyio's TypedAttributeSet refuses a subclass defined after that ("Attribute 'save' is missing its type
    annotation"). anyio loads its modules lazily, so in a server that imports nnsight early (vLLM's OpenAI server,
    through the tap worker's package) the first streamed response would define anyio's socket and stream attribute
    sets too late."""
    try:
        import anyio
    except ImportError:
        return
    for mod in pkgutil.walk_packages(anyio.__path__, "anyio."):
        if mod.name.endswith(("pytest_plugin", "_trio")):
            continue  # pytest's hook and the trio backend need packages a server does not have
        try:
            importlib.import_module(mod.name)
        except ImportError:
            pass
        except TypeError as e:  # nnsight came first, by a path that does not pass here: say so, do not fail
            warnings.warn(f"interleaver: anyio's {mod.name} did not load after nnsight's `.save` mount ({e}); a web "
                          "server in this process may refuse streamed responses. Import interleaver before nnsight.",
                          stacklevel=2)


_load_anyio()


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'interleaver' has no attribute {name!r}")
    return getattr(importlib.import_module(f"interleaver.{_WHERE[name]}"), name)
