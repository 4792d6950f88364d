"""One run per run directory: a run holds an exclusive lock on its directory until its process ends, so a
second run pointed at the same `hydra.run.dir` refuses before Hydra writes its config there."""

import fcntl
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from steer.errors import ConfigError

# What a job writes as its results (task=select: its selection): a job run again in its directory must not keep
# the old ones meanwhile (nor beside its error, should it fail). metrics.json comes last and marks a job complete.
STALE = ("metrics.json", "results.jsonl", "inputs.json", "error.txt", "selection.json", "selection.md",
         "selection.png", "vectors.json", "report.html")

_held: List[int] = []  # open descriptors of the directories this process holds (released when it exits)
# single runs' directories that did not exist when this process took them, each with the outermost directory it
# made for them (outputs/<date> too, where the date's first run made it)
_made: Dict[Path, Path] = {}


def hold(run_dir: Path) -> None:
    """Take the run directory for this process, or raise ConfigError if another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError("hydra.run.dir", f"{str(run_dir)!r} is in use by another steer run; wait for it to end "
                                           f"or choose another directory") from None
    _held.append(fd)


def discard_made(run_dir: Path) -> bool:
    """Remove `run_dir` where this process made it (a single run refused for bad input then leaves nothing behind,
    Hydra's .hydra/ included), and the parents made for it that are empty then (another run may have started in
    one since); False, and nothing removed, where it was there before."""
    import shutil

    run_dir = Path(run_dir).resolve()
    top = _made.pop(run_dir, None)
    if top is None:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:
        if not parent.is_relative_to(top):
            break
        try:
            parent.rmdir()  # only where empty
        except OSError:
            break
    return True


def clear_stale(run_dir: Path) -> None:
    """Remove the results a job that ran in `run_dir` before left there."""
    for name in STALE:
        path = Path(run_dir) / name
        if path.is_file():
            path.unlink()


class RunDirLock(Callback):
    """Holds `hydra.run.dir` for a single run (called before Hydra writes .hydra/ into it)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.run.dir)).resolve()
        missing = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        if missing:
            _made[run_dir] = missing[-1]
        try:
            hold(run_dir)
        except ConfigError as e:
            print(f"error {e}", file=sys.stderr)
            sys.exit(2)
        # Before Hydra writes this run's config there: stopped before registry.main clears them, an earlier run's
        # results would stand beside it as if they were this run's
        clear_stale(run_dir)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        _made.pop(Path(str(config.hydra.run.dir)).resolve(), None)  # the run finished: its directory stays
