"""The multirun callback: when a sweep ends, rebuild its report (summary.csv and plots, see steer.report).

Hydra 1.3 hands `on_multirun_end` no job results, so the report is built from what each job wrote.
"""

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SummaryCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from steer import report

        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            out = report.build(sweep_dir)
            print(f"summary: {out['summary']} ({out['jobs']} jobs, {len(out['plots'])} plots)")
