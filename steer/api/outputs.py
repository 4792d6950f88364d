"""What a Lab call returns: the run directory steer.runs wrote (the CLI's files), read back as Python objects.

Each output keeps its run directory in a temporary folder of its own, removed with the object; `save(dir)` copies
it to a directory of the caller's, which then holds what `python -m steer` writes for the same config."""

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

# Per-prompt fields that are lists (token ids); a table row holds the text and the numbers.
_LISTS = ("prompt_ids", "baseline_ids", "steered_ids")


class RunDir:
    """A temporary run directory, removed when the object that holds it is."""

    def __init__(self, prefix: str):
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.path = Path(self._tmp.name) / "run"
        self.path.mkdir()

    def save(self, dest) -> Path:
        """Copy the run directory's files to `dest` (made if missing; files of the same name are replaced)."""
        dest = Path(dest).expanduser()
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        return dest


@dataclass
class Generation:
    """A steer run: `rows` (results.jsonl, one dict per prompt: prompt, baseline and steered text and token ids,
    per-prompt metrics), `metrics` (metrics.json), `config` (the run's config as the CLI would have it)."""

    rows: List[Dict]
    metrics: Dict[str, Optional[float]]
    config: Dict
    run_dir: RunDir = field(repr=False)

    @property
    def dir(self) -> Path:
        return self.run_dir.path

    def table(self):
        """A pandas DataFrame, one row per prompt: the prompt, baseline and steered text and the per-prompt
        metrics (token ids are in `rows`)."""
        import pandas as pd

        return pd.DataFrame([{k: v for k, v in r.items() if k not in _LISTS} for r in self.rows])

    def save(self, dest) -> Path:
        """Write the run directory (results.jsonl, metrics.json, inputs.json, steer.log, .hydra/config.yaml) to
        `dest`."""
        return self.run_dir.save(dest)

    @classmethod
    def read(cls, run_dir: RunDir, config: Dict) -> "Generation":
        d = run_dir.path
        rows = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines() if line.strip()]
        return cls(rows, json.loads((d / "metrics.json").read_text()), config, run_dir)


@dataclass
class Selection:
    """A task=select run: `cells` (selection.json's, one per (layer, scale) pair: the probe's gain toward its
    scale's pole and the perplexity ratio on the choosing prompts, `choose` and `report` (each half's numbers and
    damaged-prompt counts), `damaged` (each damaged prompt and why), whether it passed and why not), `best` (the
    chosen pair, or None), `command` (the CLI command that reruns it); `summary` also holds the probe and split."""

    cells: List[Dict]
    best: Optional[Dict]
    command: Optional[str]
    summary: Dict
    run_dir: RunDir = field(repr=False)

    @property
    def dir(self) -> Path:
        return self.run_dir.path

    @property
    def heatmap(self) -> Path:
        """selection.png: the probe's gain by layer and scale, rejected pairs marked."""
        return self.dir / "selection.png"

    def table(self):
        """A pandas DataFrame, one row per (layer, scale) pair, in the grid's order."""
        import pandas as pd

        return pd.DataFrame(self.cells)

    def pivot(self, value: str = "gain"):
        """`value` by layer (rows) and scale (columns), as selection.md shows the gain."""
        return self.table().pivot(index="layer", columns="scale", values=value)

    def save(self, dest) -> Path:
        """Write the run directory (selection.md/.json/.png, metrics.json and a directory per pair) to `dest`."""
        return self.run_dir.save(dest)

    @classmethod
    def read(cls, run_dir: RunDir) -> "Selection":
        s = json.loads((run_dir.path / "selection.json").read_text())
        return cls(s["cells"], s["best"], s["command"], s, run_dir)
