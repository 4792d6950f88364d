"""Helpers the tests share: composing configs as `python -m steer` does, and running the CLI."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


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
