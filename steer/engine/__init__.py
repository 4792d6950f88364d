"""Engines run a model with a Plan's edits at its taps. `make` picks one by the config's `engine`.

Every engine is an `Engine` (steer/engine/base.py): encode/render/decode, max_len, generate(_many) (prompt ids,
plan or None, seed), score(_many) (prompt, continuation, plan, captured tap paths) returning `Scores` (log-probs
and tap values), and close (also as a context manager); run.py needs nothing else.
"""

from steer.engine.base import Engine, Scores, stop_ids
from steer.errors import ConfigError

__all__ = ["ENGINES", "Engine", "Scores", "make", "resolve", "stop_ids"]

ENGINES = ("auto", "hf", "vllm")


def resolve(name: str) -> str:
    """The engine a config's `engine` names (a plain str): `auto` is vllm where CUDA and vLLM are available, else
    hf."""
    name = str(name)  # a config's EngineName is its value
    if name not in ENGINES:
        raise ConfigError("engine", f"unknown engine {name!r}; expected one of {list(ENGINES)}")
    if name == "auto":
        from steer.engine.vllm import available

        return "vllm" if available() else "hf"
    if name == "vllm":
        from steer.engine.vllm import available

        if not available():
            raise ConfigError("engine", "engine=vllm needs CUDA and vLLM (pip install -e '.[vllm]'); use engine=hf")
    return name


def make(name: str, spec, device: str, vllm_conf=None, taps=(), hf_conf=None) -> Engine:
    """Start the named engine on the model `spec` (this loads the weights); `taps` are fixed for its life;
    `hf_conf`: the HF engine's batch bounds (steer.config.schema.HfConf; None: its defaults)."""
    if resolve(name) == "vllm":
        from steer.engine.vllm import VLLMEngine

        return VLLMEngine(spec, vllm_conf, list(taps))
    from steer.engine.hf import HFEngine
    from steer.engine.hf_batch import Bound

    if hf_conf is None:
        return HFEngine(spec, device)
    return HFEngine(spec, device, Bound(hf_conf.batch_size, hf_conf.batch_tokens))
