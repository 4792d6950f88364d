"""A sweep directory's finished and failed jobs read as rows (their overrides, status, metrics or error): what the
sweep's summary and plots (steer.runs.report) and its page (steer.report) show, read once here.
"""

import re
from pathlib import Path
from typing import Any, Dict, List

import yaml

from steer import results
from steer.config.schema import NOT_RESULTS

METRICS = ("kl_mean", "tokens_changed_frac", "proj_baseline", "proj_steered", "tokens_per_s")  # plotted first
NOT_PLOTTED = ("prompts",)  # metrics.json keys that are counts, not metrics
JOBS = ".jobs"  # the names of the job directories of the sweep launched last into the directory, a line each


def read_jobs(jobs) -> List[Dict[str, Any]]:
    """One row per finished or failed job of `jobs`, in job order: its number, its overrides, `status` (`ok` or
    `failed`), then metrics.json's keys or the `error` (in that order: `swept` and `metrics` rely on it)."""
    rows = []
    for job in sorted(jobs, key=lambda p: job_order(p.name)):
        over = job / ".hydra" / "overrides.yaml"
        row: Dict[str, Any] = {"job": job.name}
        # As written: an override may hold an interpolation (`extract.out=v${tap.layer}.safetensors`), which
        # OmegaConf would try to resolve against the list.
        for o in (yaml.safe_load(over.read_text()) or [] if over.exists() else []):
            key, _, value = str(o).partition("=")
            quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
            row[key] = value[1:-1] if quoted else _unescaped(value)  # Hydra's quoting, not part of the value
        got = results.read_json(job / "metrics.json")
        if got is not None:
            row["status"] = "ok"
            for k, v in got.items():
                row[f"{k} (metric)" if k in row else k] = v  # `prompts` is an override group and a count
        elif (job / "metrics.json").is_file():
            row["status"] = "failed"
            row["error"] = "its metrics.json is damaged (no JSON object): a resume reruns it"
        else:
            row["status"] = "failed"
            row["error"] = _error_line((job / "error.txt").read_text(errors="replace"))
        rows.append(row)
    return rows


def _unescaped(value: str) -> str:
    """A scalar override as the user wrote it: a sweeper writes each job's value with Hydra's escapes
    (`v$\\{tap.layer\\}.safetensors`). A list or dict is left as written, where an escaped comma is structure."""
    return value if value[:1] in "[{" else re.sub(r"\\([\\()\[\]{}:=, \t])", r"\1", value)


def job_dirs(sweep_dir: Path):
    """(the finished or failed job directories of the sweep, how many others of an earlier sweep are left out)."""
    jobs = {p.parent for name in ("metrics.json", "error.txt") for p in sweep_dir.glob(f"*/{name}")}
    listed = sweep_dir / JOBS
    if not listed.is_file():
        return jobs, 0
    mine = set(listed.read_text().splitlines())  # a name may hold spaces (a subdir from override_dirname)
    return {j for j in jobs if j.name in mine}, sum(j.name not in mine for j in jobs)


def list_jobs(sweep_dir: Path, names: List[str], append: bool = False) -> None:
    """Name the sweep's job directories (`append`: a later batch of the same sweep)."""
    listed = Path(sweep_dir) / JOBS
    before = listed.read_text().splitlines() if append and listed.is_file() else []
    results.write_text(listed, "".join(f"{n}\n" for n in dict.fromkeys(before + list(names))))


def _error_line(text: str) -> str:
    """error.txt's message: its first line, or the last line of a traceback (the exception itself)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    if not lines[0].startswith("Traceback"):
        return lines[0].strip()
    # The exception's own line: the last one not indented (OmegaConf's messages go on with indented `full_key:`
    # and `object_type=` lines, which alone say nothing)
    return [line for line in lines if not line[0].isspace()][-1]


def _overrides(row: Dict[str, Any]) -> List[str]:
    keys = list(row)
    return keys[1 : keys.index("status")] if "status" in keys else [k for k in keys[1:] if k not in METRICS]


def swept(rows: List[Dict[str, Any]]) -> List[str]:
    """The override keys whose value differs between jobs, in the order they first appear (not the settings that
    change no result: a sweep resumed with `progress=false` is the same sweep)."""
    keys: List[str] = []
    for r in rows:
        keys += [k for k in _overrides(r) if k not in keys and k.lstrip("+~") not in NOT_RESULTS]
    return [k for k in keys if len({str(r.get(k)) for r in rows}) > 1]


def metrics(rows: List[Dict[str, Any]]) -> List[str]:
    """The metrics the finished jobs report: METRICS first, then any other number in their metrics.json."""
    keys: List[str] = []
    for r in rows:
        if r.get("status", "ok") == "ok":
            over = set(_overrides(r))
            keys += [k for k in r if k not in keys and k not in over and k not in ("job", "status", "error")]
    number = (int, float, type(None))
    keys = [k for k in keys
            if k.removesuffix(" (metric)") not in NOT_PLOTTED and all(isinstance(r.get(k), number) for r in rows)]
    return [k for k in METRICS if k in keys] + [k for k in keys if k not in METRICS]


def job_order(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)
