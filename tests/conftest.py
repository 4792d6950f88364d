import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One steer cache for the whole session: the tiny model is built once and shared by every test."""
    d = tmp_path_factory.mktemp("steer-cache")
    os.environ["STEER_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_spec(cache_dir):
    from steer import tiny
    from steer.model import spec
    from steer.schema import ModelConf

    conf = ModelConf(name="tiny")
    tiny.ensure_tiny(str(cache_dir), conf.tiny)
    return spec(conf, str(cache_dir))


@pytest.fixture(scope="session")
def hf_engine(tiny_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(tiny_spec)


def compose(*overrides):
    """Compose conf/config.yaml with overrides, as Hydra does for `python -m steer`."""
    from hydra import compose as _compose, initialize_config_dir
    from omegaconf import OmegaConf

    from steer import schema

    schema.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = _compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


def run_cli(args, cwd, cache_dir, timeout=600):
    """Run `python -m steer` in a subprocess from `cwd`; outputs land under cwd/outputs."""
    env = {**os.environ, "STEER_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "steer", *args, "progress=false"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where there is no CUDA or no vLLM (CI, laptops)."""
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        from steer.engine.vllm import available

        ok = available()
    except ImportError:
        ok = False
    if ok:
        return
    skip = pytest.mark.skip(reason="needs CUDA and vLLM (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
