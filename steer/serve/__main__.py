"""`python -m steer.serve`: the Hydra entry point of the server (conf/serve.yaml)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from steer.errors import ConfigError, run_app
from steer.config.schema import to_object
from steer.serve import schema

schema.register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="serve")
def app(cfg: DictConfig) -> None:
    from steer.serve import start  # heavy imports (torch, transformers) after Hydra has parsed the command line

    console = Console(stderr=True, soft_wrap=True)
    try:
        conf = to_object(cfg)
        start.main(conf, Path(HydraConfig.get().runtime.output_dir), console)
    except ConfigError as e:
        console.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":  # vLLM's spawned workers re-import this module: nothing may start at import
    import signal

    # Ctrl-C stops the server (exit 130) even where its parent started it with Ctrl-C ignored, which Python keeps
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_app(app)
