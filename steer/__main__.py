"""`python -m steer`: the Hydra entry point. Config groups live in the checkout's conf/."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from steer.config import schema
from steer.errors import ConfigError, run_app

schema.register()


PACKED = "hydra_plugins.steer_launcher.packed.PackedLauncher"


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def app(cfg: DictConfig):
    """One job. Under the packed launcher a steer or extract job comes back validated (Hydra hands the return
    value to the launcher), to run with the other jobs that share its engine."""
    from steer.runs import run  # heavy imports (torch, transformers) after Hydra has parsed the command line

    console = Console(stderr=True, soft_wrap=True)
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    try:
        conf = schema.to_object(cfg)
        multirun = hc.mode == RunMode.MULTIRUN
        packed = multirun and OmegaConf.select(hc, "launcher._target_") == PACKED
        return run.main(conf, out_dir, console, defer=packed, hold=_claimer(hc) if multirun else None)
    except ConfigError as e:
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
    """Run the app (steer.errors.run_app: a config error is one line, exit 2)."""
    run_app(app)


if __name__ == "__main__":
    main()
