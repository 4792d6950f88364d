"""`python -m steer`: the Hydra entry point. Config groups live in the checkout's conf/."""

import argparse
import signal
import sys
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from steer.config import preset, schema
from steer.errors import ConfigError, run_app
from steer.runs import rundir

schema.register()


PACKED = "hydra_plugins.steer_launcher.packed.PackedLauncher"


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def app(cfg: DictConfig):
    """One job. Under the packed launcher a job of a task that packs (steer, extract) comes back validated (Hydra
    hands the return value to the launcher), to run with the other jobs that share its engine."""
    # heavy imports (torch, transformers) after Hydra has parsed the command line
    from steer.runs import run
    from steer.tasks import registry

    console = Console(stderr=True, soft_wrap=True)
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        conf = preset.apply(schema.to_object(cfg), [o.split("=")[0].lstrip("+~") for o in hc.overrides.task])
        packed = multirun and OmegaConf.select(hc, "launcher._target_") == PACKED
        return registry.main(conf, out_dir, console, defer=packed, hold=_claimer(hc) if multirun else None)
    except ConfigError as e:
        # Bad input: a single run's directory made for it goes (the line says why); a sweep's job keeps error.txt,
        # which its report and resume read, as does a directory that was there before
        run.close_log(out_dir)
        if multirun or not rundir.discard_made(out_dir):
            run.record_failure(out_dir, e)
        console.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        sys.exit(2)
    except Exception as e:
        run.record_failure(out_dir, e)
        raise


def _claimer(hc):
    """A sweep's job holds the file it writes outside its directory (steer.runs.sweep.claim)."""
    from steer.runs import sweep

    hint = (": give each its own (e.g. extract.out='vectors/layer${tap.layer}.safetensors'), or leave it unset (each "
            "job's directory)")
    sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir  # where the sweep was launched: a job may run elsewhere (chdir)
    return lambda path: sweep.claim(sweep_dir, int(hc.job.num), "extract.out", path, hint)


def main() -> None:
    """Run the app (steer.errors.run_app: a config error is one line, exit 2). SIGTERM stops it as Ctrl-C does (a
    sweep keeps what finished, writes its report and says so; exit 130): a job scheduler's or `kill`'s stop is the
    user's stop too."""
    from steer.runs import sweep

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.argv[1:] = _flags_first(sys.argv[1:])
    run_app(app, on_interrupt=sweep.interrupted)


def _flags_first(argv: List[str]) -> List[str]:
    """`argv` with Hydra's flags (--config-dir DIR, -m, ...) before the overrides, where Hydra's own parser takes
    them: an override after a flag is otherwise an "unrecognized argument". Unchanged where the parser cannot read
    it (Hydra then says why)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        ns, extra = parser.parse_known_intermixed_args(argv)
    except (argparse.ArgumentError, TypeError):
        return argv
    if extra:
        return argv
    flags = list(argv)
    for o in ns.overrides:
        flags.remove(o)
    return flags + list(ns.overrides)


if __name__ == "__main__":
    main()
