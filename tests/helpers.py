"""Helpers the tests share: composing configs as the commands do, one-edit plans, running the CLI and reading
what a sweep wrote."""

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


# The default config steers SmolLM2 (a real model, seconds a prompt on a CPU); the suite runs on the tiny model, at
# the tap and strength its tests were written for, unless a test names a model, tap, strength or experiment.
TINY = {"model": "model=tiny", "tap": "tap=layer1", "edit.scale": "edit.scale=4"}

# Two prompts, for runs that want more than one prompt and little time.
TWO_PROMPTS = "prompts.steer=['The weather today is','My friend looked at me and said']"


def on_tiny(overrides):
    """`overrides` and then the tiny model's defaults that they do not set themselves (after them, since Hydra's
    command line wants its flags, such as -m, before the overrides)."""
    keys = [o.lstrip("+~").split("=")[0] for o in overrides if not o.startswith("-")]
    if any(k == "experiment" for k in keys):
        return list(overrides)

    def named(k):
        return any(x == k or x.startswith(k + ".") or (k == "edit.scale" and x == "edit") for x in keys)

    return list(overrides) + [v for k, v in TINY.items() if not named(k)]


# The schema each top-level config is checked against, as its command registers it.
SCHEMAS = {"config": "steer.config.schema", "serve": "steer.serve.schema", "bench": "steer.bench.schema"}


def compose_conf(name, overrides, **kw):
    """conf/<name>.yaml composed with `overrides` (a DictConfig), as Hydra composes it for the command that reads
    it; `kw` goes to Hydra's compose (e.g. return_hydra_config)."""
    from hydra import compose as _compose, initialize_config_dir

    importlib.import_module(SCHEMAS[name]).register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return _compose(config_name=name, overrides=list(overrides), **kw)


def compose(*overrides, tiny=True):
    """Compose conf/config.yaml with overrides, as Hydra does for `python -m steer` (on the tiny model unless
    `tiny` is False or the overrides say otherwise)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_conf("config", on_tiny(overrides) if tiny else overrides))


def plan(spec, layer, edit):
    """A plan of one edit at the residual stream after decoder `layer`."""
    from steer.edits.plan import Plan
    from steer.config.schema import TapConf
    from steer.edits.tap import resolve

    p = Plan()
    p.add(resolve(TapConf(layer=layer), spec), edit)
    return p


def sweep_jobs(sweep):
    """The job directories of a sweep, in job order ([] before the sweep has started)."""
    if not sweep.exists():
        return []
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def summary_rows(sweep):
    """The rows of a sweep's summary.csv."""
    with (sweep / "summary.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def cli_env(cache_dir):
    """The environment a CLI subprocess runs in: this checkout first on the path, then what the path held (the GPU
    machine's site folder of vLLM and its dependencies)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "STEER_CACHE": str(cache_dir), "PYTHONPATH": path}


def run_cli(args, cwd, cache_dir, timeout=600):
    """Run `python -m steer` in a subprocess from `cwd`; outputs land under cwd/outputs."""
    env = cli_env(cache_dir)
    return subprocess.run([sys.executable, "-m", "steer", *on_tiny(args), "progress=false"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


class DiesWhenRun:
    """A sweep job whose group's process is killed (as the OOM killer would) the moment it starts running it;
    importable by a spawned process, as a test's own class is not."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    @property
    def cfg(self):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class DiesLeavingAChild(DiesWhenRun):
    """A sweep job whose group's process starts a child (as vLLM starts its engine core: here forked, so it also
    holds the group's pipe open), writes the child's pid to out_dir/child.pid and is killed."""

    @property
    def cfg(self):
        import signal
        import time

        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        (self.out_dir / "child.pid").write_text(str(pid))
        os.kill(os.getpid(), signal.SIGKILL)


class RaisesWhenRun(DiesWhenRun):
    """A sweep job whose group's process raises the moment it starts running it."""

    @property
    def cfg(self):
        raise ValueError("no config here")
