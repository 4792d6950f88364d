"""`hydra/launcher=packed`: a multirun whose jobs share engines.

A vLLM engine takes tens of seconds to start and capture its graphs, and the basic launcher starts one per job
in one process, where vLLM does not free GPU memory reliably. This launcher first sets every job up as Hydra
would (its run directory, `.hydra/`, its log) while steer validates it without running it; then groups the jobs
that can share an engine (same model, engine and engine settings) and runs each group with one engine, the jobs'
edits as per-request edits in the same batches, in packs of `pack_size` jobs. Each job's directory comes out as
if it had run alone. Groups after the first run in a process of their own. A job whose directory is complete
(its metrics.json exists) is skipped unless `force` is set, so a sweep that was stopped resumes where it left off.
"""

import logging
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class PackedLauncherConf:
    _target_: str = "hydra_plugins.steer_launcher.packed.PackedLauncher"
    pack_size: int = 16  # jobs per batch: a stopped sweep loses at most the pack in flight
    force: bool = False  # rerun jobs whose run directory is already complete


ConfigStore.instance().store(group="hydra/launcher", name="packed", node=PackedLauncherConf, provider="steer")


def complete(job_dir: Path) -> bool:
    """A job is complete once its metrics.json exists: steer writes it atomically, after everything else."""
    return (job_dir / "metrics.json").is_file()


class PackedLauncher(Launcher):
    def __init__(self, pack_size: int = 16, force: bool = False) -> None:
        self.pack_size, self.force = max(1, pack_size), force
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from steer import run

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns: List[JobReturn] = []
        pending: Dict[str, JobReturn] = {}
        with run.deferring() as jobs:
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(cfg):
                    cfg.hydra.job.id = cfg.hydra.job.num = idx
                job_dir = sweep_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
                if complete(job_dir) and not self.force:
                    log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))} (complete, skipped)")
                    returns.append(_done(cfg, overrides, job_dir))
                    continue
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                n = len(jobs)
                ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=cfg,
                              job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
                returns.append(ret)
                if len(jobs) > n:  # a steer job, validated and waiting for its group
                    pending[str(jobs[-1].out_dir)] = ret
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        groups: Dict[str, list] = {}
        for job in jobs:
            groups.setdefault(run.engine_key(job), []).append(job)
        log.info(f"{len(jobs)} jobs to run in {len(groups)} engine group(s), packs of {self.pack_size}")
        for i, group in enumerate(groups.values()):
            metrics = run_group(group, self.pack_size) if i == 0 else _in_own_process(group, self.pack_size)
            for job, m in zip(group, metrics):
                pending[str(job.out_dir)].return_value = m
        return returns


def run_group(jobs: list, pack_size: int) -> List[dict]:
    """Run one engine group, `pack_size` jobs at a time; each pack's files are written when it finishes."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from steer import run

    console = Console(stderr=True)
    out = []
    with Progress(TextColumn("sweep jobs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not jobs[0].cfg.progress) as progress:
        task = progress.add_task("jobs", total=len(jobs))
        for start in range(0, len(jobs), pack_size):
            out += run.execute(jobs[start : start + pack_size], console, on_done=lambda job: progress.advance(task))
    return out


def _in_own_process(jobs: list, pack_size: int) -> List[dict]:
    # vLLM does not reliably free GPU memory when an engine is dropped: a second engine gets a fresh process.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(run_group, (jobs, pack_size))


def _done(cfg: DictConfig, overrides: Sequence[str], job_dir: Path) -> JobReturn:
    import json

    ret = JobReturn(overrides=list(overrides), cfg=cfg, hydra_cfg=cfg, working_dir=str(job_dir),
                    task_name=str(cfg.hydra.job.name), status=JobStatus.COMPLETED)
    ret.return_value = json.loads((job_dir / "metrics.json").read_text())
    return ret
