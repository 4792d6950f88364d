"""The multirun callback: when a sweep ends, rebuild its report (summary.csv and plots, see steer.runs.report). And
the files a sweep's jobs write outside their own directories, each held by one job (`claim`).

Hydra 1.3 hands `on_multirun_end` no job results, so the report is built from what each job wrote.
"""

import hashlib
import json
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from steer.errors import ConfigError

CLAIMS = ".claims"  # in the sweep directory: a file per output path held, naming the job that holds it


STOPS = (signal.SIGINT, signal.SIGTERM)  # what stops a sweep (python -m steer takes SIGTERM as Ctrl-C)
_sweeping: Optional[Path] = None  # the sweep directory of the sweep this process runs, once it has started


def write_report(sweep_dir: Path) -> Optional[Dict[str, Any]]:
    """Rebuild the sweep's report (see steer.runs.report.build) with Ctrl-C and SIGTERM held off until it is
    written; None where no job of the sweep finished or failed (one stopped before its first pack)."""
    from steer.runs import report

    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOPS} if main else {}
    try:
        out = report.build(Path(sweep_dir))
        from steer import report as html

        out["html"] = html.write_quietly(Path(sweep_dir))  # report.html, from the jobs and the plots just written
        return out
    except report.NoJobs:
        return None
    finally:
        for sig, handler in old.items():
            if handler is not None:
                signal.signal(sig, handler)


def interrupted() -> Optional[str]:
    """The line a sweep stopped by Ctrl-C or SIGTERM ends with, its report of the jobs that finished written; None
    outside a sweep. (The packed launcher says its own, with the number of jobs it had.)"""
    if _sweeping is None or not _sweeping.is_dir():
        return None
    for sig in STOPS:  # a second Ctrl-C must not cut the report short
        signal.signal(sig, signal.SIG_IGN)
    from steer import results
    from steer.runs.report import left_out

    done = sum(results.read_json(d / "metrics.json") is not None for d in _sweeping.iterdir() if d.name.isdigit())
    out = write_report(_sweeping)
    said = f"summary written to {out['summary']}{left_out(out)}" if out else \
        f"no summary written (no job in {_sweeping} finished)"
    return f"interrupted: {done} job{'' if done == 1 else 's'} finished; {said}"


def claim(sweep_dir: Path, job: int, field: str, path: Path, hint: str = "") -> None:
    """Hold `path` (named by config field `field`) for job `job` of the sweep: a ConfigError if another job of the
    same sweep holds it, whichever launcher runs them and in whatever batches (each writes a whole file, so one
    would replace the other's). Held until the next sweep into the directory starts."""
    path = Path(path).expanduser().resolve()
    held = Path(sweep_dir) / CLAIMS / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    held.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then linked into place: the link fails if the name exists, so two jobs racing (a cluster
    # launcher's) cannot both hold it, and the holder's number is always there to read.
    record = json.dumps({"job": job, "path": str(path)})
    tmp = held.parent / f".{uuid.uuid4().hex}.tmp"
    tmp.write_text(record)
    try:
        os.link(tmp, held)
        return
    except FileExistsError:
        holder = _holder(held)
    except OSError:  # a file system without hard links: created exclusively, then written
        holder = _hold_exclusively(held, record)
        if holder is None:
            return
    finally:
        tmp.unlink()
    if holder != job:  # the same job again (a requeued cluster job) holds it still
        raise ConfigError(field, f"job #{holder} of this sweep writes {path} too, and each writes the whole file"
                                 f"{hint}")


def _hold_exclusively(held: Path, record: str) -> Optional[int]:
    """`claim` where hard links fail: None once this job holds `held`, else the job that does."""
    try:
        fd = os.open(held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _holder(held)
    with os.fdopen(fd, "w") as f:
        f.write(record)
    return None


def _holder(held: Path, wait_s: float = 5.0) -> int:
    """The job number `held` names (a file created exclusively may not be written yet: read again until it is)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return int(json.loads(held.read_text())["job"])
        except (ValueError, KeyError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SummaryCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweeping
        _sweeping = Path(config.hydra.sweep.dir)
        # The packed launcher names its sweep's jobs in `.jobs`; another launcher (basic, submitit) writes none,
        # and one left there by an earlier packed sweep would hide this sweep's other jobs from its report.
        from steer.report.jobs import JOBS
        from steer.runs.report import clear

        Path(config.hydra.sweep.dir, JOBS).unlink(missing_ok=True)
        clear(Path(config.hydra.sweep.dir))  # stopped before its own report, it must not show the last one's
        shutil.rmtree(Path(config.hydra.sweep.dir, CLAIMS), ignore_errors=True)  # an earlier sweep's hold none

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.exists():
            out = write_report(sweep_dir)
            if out is None:
                print(f"summary: none written (no job in {sweep_dir} finished or failed)")
            else:
                from steer.runs.report import left_out

                print(f"summary: {out['summary']} ({out['jobs']} jobs, {len(out['plots'])} plots{left_out(out)})"
                      + (f"; report: {out['html']}" if out.get("html") else ""))
