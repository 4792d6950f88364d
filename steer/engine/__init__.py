"""Engines run a model with a Plan's edits at its taps. `make` picks one by the config's `engine`."""

from steer.errors import ConfigError

ENGINES = ("hf",)


def check(name: str) -> None:
    """Fail early on an engine name that does not exist."""
    if name not in ENGINES:
        raise ConfigError("engine", f"unknown engine {name!r}; expected one of {list(ENGINES)}")


def make(name: str, spec, device: str):
    """Start the named engine on the model `spec` (this loads the weights)."""
    check(name)
    from steer.engine.hf import HFEngine

    return HFEngine(spec, device)
