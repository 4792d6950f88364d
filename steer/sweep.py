"""Multirun results: a Hydra callback that gathers every job's metrics into `summary.csv` at the sweep root.

Hydra 1.3 hands `on_multirun_end` no job results, so it reads what each job wrote: `metrics.json` and the
job's `.hydra/overrides.yaml`.
"""

import csv
import io
import json
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from steer import results


def job_rows(sweep_dir: Path) -> List[Dict[str, Any]]:
    """One row per finished job under `sweep_dir`: its number, overrides and metrics."""
    rows = []
    for metrics_file in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: _job_key(p.parent.name)):
        job = metrics_file.parent
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml") if (job / ".hydra" / "overrides.yaml").exists() else []
        row: Dict[str, Any] = {"job": job.name}
        for o in overrides:
            key, _, value = str(o).partition("=")
            row[key] = value
        row.update(json.loads(metrics_file.read_text()))
        rows.append(row)
    return rows


def write_summary(sweep_dir: Path) -> Path:
    """Write `summary.csv` at the sweep root (atomically) and return its path."""
    rows = job_rows(sweep_dir)
    fields: List[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    return results.write_text(sweep_dir / "summary.csv", buf.getvalue())


def _job_key(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)


class SummaryCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            path = write_summary(sweep_dir)
            print(f"summary: {path}")
