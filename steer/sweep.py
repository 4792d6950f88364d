"""The multirun callback: when a sweep ends, rebuild its report (summary.csv and plots, see steer.report).

Hydra 1.3 hands `on_multirun_end` no job results, so the report is built from what each job wrote.
"""

import signal
import threading
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def write_report(sweep_dir: Path) -> Optional[Dict[str, Any]]:
    """Rebuild the sweep's report (see steer.report.build) with Ctrl-C held off until it is written; None where
    no job of the sweep finished or failed (one stopped before its first pack)."""
    from steer import report

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return report.build(Path(sweep_dir))
    except report.NoJobs:
        return None
    finally:
        if main and old is not None:
            signal.signal(signal.SIGINT, old)


class SummaryCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The packed launcher names its sweep's jobs in `.jobs`; another launcher (basic, submitit) writes none,
        # and one left there by an earlier packed sweep would hide this sweep's other jobs from its report.
        from steer.report import JOBS

        Path(config.hydra.sweep.dir, JOBS).unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            out = write_report(sweep_dir)
            if out is None:
                print(f"summary: none written (no job in {sweep_dir} finished or failed)")
            else:
                from steer.report import left_out

                print(f"summary: {out['summary']} ({out['jobs']} jobs, {len(out['plots'])} plots{left_out(out)})")
