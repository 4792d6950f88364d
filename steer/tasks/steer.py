"""task=steer: baseline and steered continuations of prompts.steer with the config's edits, scored (steer/runs/run.py,
the machinery a select's pairs share), into results.jsonl and metrics.json. The packed launcher runs a sweep's
steer jobs that share an engine together, their requests in the same batches."""

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from rich.console import Console

from steer.config import checks
from steer.config.schema import SteerConf, Task
from steer.edits.plan import build
from steer.runs import inputs, run as runner
from steer.runs.job import Job
from steer.runs.run import Outcome
from steer.tasks.base import TaskDef


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine)


def prepare(job: Job) -> Job:
    """Its plan: the edits with vectors from files, and every tap they and their conditions touch."""
    vectors = inputs.vectors(job.cfg)  # first: a file rewritten while it loads then reads as changed on resume
    plan = build(job.cfg, job.spec)
    return replace(job, vectors=vectors, plan=plan, taps=tuple({**plan.taps, **plan.condition_taps}.values()))


def run(job: Job, console: Console, engine=None) -> Dict:
    return runner.run_jobs([job], console, engine=engine)[0].value()


def run_pack(jobs: Sequence[Job], console: Console, engine, on_done=None, summary: Optional[bool] = None,
             say: Optional[bool] = None) -> List[Outcome]:
    return runner.run_jobs(jobs, console, on_done, summary, engine, say)


TASK = TaskDef(Task.steer, check, prepare, run, run_pack=run_pack)
