"""What a task is to the registry (steer/tasks/registry.py): its checks, how its job is prepared and how it runs.
Each task's module ends with its `TASK`."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from steer.config.schema import SteerConf, Task
from steer.runs.job import Job
from steer.runs.run import Outcome


def _no_files(cfg) -> Sequence[str]:
    return ()


@dataclass(frozen=True)
class TaskDef:
    """A task, as the registry and the runs around its jobs know it."""

    name: Task
    # check(cfg, engine): what its config must hold before its model is looked at (steer.config.checks.run, and
    # its own rules); `engine`: what cfg.engine resolves to
    check: Callable[[SteerConf, str], None]
    # prepare(job): the job with the task's own parts resolved (plan, taps, grid, items), its model's spec known
    prepare: Callable[[Job], Job]
    # run(job, console, engine=None): run a prepared job into its directory (on `engine`, else one it holds);
    # what it wrote (its metrics). A failure raises.
    run: Callable[..., Dict]
    # run_pack(jobs, console, engine, on_done, summary, say): jobs of a pack on the engine they share, what each
    # gave; a task with one has its jobs deferred by the packed launcher, to run with the others of their engine
    run_pack: Optional[Callable[..., List[Outcome]]] = None
    edits: bool = True  # it runs the config's edits: their vector files are checked before the model is read
    ab_items: bool = False  # it extracts from A/B items it renders itself (read raw, not in a chat rendering)
    data_files: Callable[[Any], Sequence[str]] = _no_files  # data files it reads beside the prompts' (a config)
    # the config key of a file it writes outside its run directory, which no two jobs of a sweep may share
    writes: Optional[str] = None
    resumes_itself: bool = False  # a finished job runs again, keeping itself what is current (a select's pairs)
