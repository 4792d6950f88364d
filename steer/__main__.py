"""`python -m steer`: the Hydra entry point. Config groups live in the checkout's conf/."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from steer import schema
from steer.errors import ConfigError

schema.register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def app(cfg: DictConfig) -> None:
    from steer import run  # heavy imports (torch, transformers) after Hydra has parsed the command line

    console = Console(stderr=True, soft_wrap=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    conf = OmegaConf.to_object(cfg)
    try:
        run.main(conf, out_dir, console)
    except ConfigError as e:
        console.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    app()
