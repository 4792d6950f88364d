"""The tasks by name, registered once, and what every task's job goes through: `prepare` checks and resolves a
config into a Job (every task's shared steps, then its own), `main` runs the configured task into a run directory,
and `execute_packs` runs a sweep's deferred jobs that share an engine. `of` is the one switch on the task."""

import copy
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

from rich.console import Console

from steer import engine as engines
from steer.config import checks
from steer.config.schema import PACK, ExtractPosition, ExtractSpan, SteerConf, Task
from steer.edits import vector
from steer.edits.plan import entries
from steer.errors import ConfigError
from steer.models import prompt
from steer.models.spec import spec as model_spec
from steer.runs import data, inputs, rundir
from steer.runs.extract import Recipe
from steer.runs.job import Job
from steer.runs.run import Outcome, packs
from steer.tasks import condition, evaluate, export, extract, select, steer
from steer.tasks.base import TaskDef

TASKS: Dict[Task, TaskDef] = {t.name: t for t in (steer.TASK, extract.TASK, export.TASK, select.TASK, evaluate.TASK,
                                                  condition.TASK)}


def of(task: Union[Task, str]) -> TaskDef:
    """The task named `task` (a Task, or its name as a config composed by Hydra holds it)."""
    return TASKS[Task(task)]


def check(cfg: SteerConf, engine: str) -> None:
    """What the config must hold before its model is looked at (`engine`: what cfg.engine resolves to)."""
    of(cfg.task).check(cfg, engine)


def data_paths(cfg) -> List[str]:
    """The data files a job reads: its prompts and pairs files, and its task's own (task=eval's A/B dataset); a job
    config, typed or as Hydra composed it."""
    return inputs.data_paths(cfg, of(cfg.task).data_files(cfg))


def prepare(cfg: SteerConf, out_dir: Path) -> Job:
    """The job, ready to run: its config checked (steer.config.checks and the task's own rules) with everything
    that needs no weights, then what its task runs resolved (vectors loaded and checked against the model). `cfg`
    itself is left as it is: the job resolves a copy of it."""
    task = of(cfg.task)
    data_files = inputs.data(data_paths(cfg))  # first: a file rewritten while it loads then reads as changed
    cfg = copy.deepcopy(cfg)
    caa = data.fill_prompts(cfg.prompts)  # prompts and pairs from files replace the lists they stand for
    engine = engines.resolve(cfg.engine)
    task.check(cfg, engine)
    # checked before the model's files are read; "auto" is resolved below, once the chat rendering is known
    checks.extraction(cfg.extract.method, cfg.prompts.positive, cfg.prompts.negative)
    if task.edits:
        _vector_files(cfg)
    spec = model_spec(cfg.model, cfg.cache_dir)
    limit = cfg.vllm.max_model_len if engine == "vllm" and cfg.vllm.max_model_len else spec.positions
    checks.room_for_a_prompt("gen.max_new_tokens", cfg.gen.max_new_tokens, limit, spec.name)
    prompt.check(cfg.prompts.chat, spec.chat_template)
    # A/B items a task renders itself are read raw, so only a pairs file's are in a chat rendering
    templated = not task.ab_items and prompt.renders_chat(cfg.prompts.chat, spec.chat_template)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat, task.ab_items or caa, templated)
    # "auto" resolved once for the job
    cfg.extract.position, cfg.extract.span = ExtractPosition(recipe.position), ExtractSpan(recipe.span)
    return task.prepare(Job(cfg, spec, Path(out_dir), engine, recipe, data=data_files))


def _vector_files(cfg: SteerConf) -> None:
    """Every edit's vector file, and a condition's, is there (read later, once the model is known)."""
    for prefix, _, e in entries(cfg):
        if e.vector.path is not None:
            vector.require(e.vector.path, f"{prefix}edit.vector")
        if e.when.vector is not None and e.when.layer is not None and not Path(e.when.vector).expanduser().exists():
            raise ConfigError(f"{prefix}edit.when.vector", f"vector file {e.when.vector!r} does not exist")


def run(job: Job, console: Console, engine=None) -> Dict:
    """Run a prepared job into its run directory (on `engine`, else one its task holds); what it wrote. A failure
    raises."""
    return of(job.cfg.task).run(job, console, engine)


def main(cfg: SteerConf, out_dir: Path, console: Console, defer: bool = False,
         hold: Optional[Callable[[Path], None]] = None) -> Union[Dict, Job]:
    """Run the configured task into `out_dir`; return what it wrote as a dict (metrics, or the vector path).
    With `defer` (the packed launcher), a job of a task that packs (steer, extract) is returned validated, for the
    launcher to run with the other jobs that share its engine. `hold`: called, once the job is valid, with the file
    it will write outside `out_dir` (a sweep's jobs must not share one: steer.runs.sweep.claim)."""
    rundir.clear_stale(out_dir)  # a run into a directory that held one: none of its results may stand beside ours
    job = prepare(cfg, out_dir)
    task = of(job.cfg.task)
    outside = _setting(cfg, task.writes) if task.writes else None
    if hold is not None and outside:
        hold(Path(outside))
    if defer and task.run_pack is not None:
        return job
    return task.run(job, console)


def _setting(cfg: SteerConf, key: str):
    """The config's value at dotted `key`."""
    value: object = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def execute_packs(jobs: Sequence[Job], console: Console, engine, pack_size: int = PACK,
                  on_done: Optional[Callable[[Job], None]] = None,
                  on_pack_error: Optional[Callable[[Job, Exception], Dict]] = None) -> List[Dict]:
    """Deferred jobs (of tasks that pack) on one engine, `pack_size` jobs at a time (each pack's files are written when
    it finishes), without printing each job's summary: each pack's jobs of a task run together by that task (a steer
    pack's requests in the same batches). Each job's result, or `{"error": message}`. A pack that raises as a whole
    raises, or with `on_pack_error` gives each of its jobs what that returns, and the next pack runs."""
    out: List[Dict] = []
    for pack in packs(jobs, pack_size):
        try:
            out += [o.result for o in _run_pack(pack, console, engine, on_done)]
        except Exception as e:
            if on_pack_error is None:
                raise
            out += [on_pack_error(job, e) for job in pack]
    return out


def _run_pack(pack: Sequence[Job], console: Console, engine, on_done) -> List[Outcome]:
    by_task: Dict[Task, List[int]] = {}
    for i, job in enumerate(pack):
        by_task.setdefault(Task(job.cfg.task), []).append(i)
    got: Dict[int, Outcome] = {}
    for task, index in by_task.items():
        outcomes = of(task).run_pack([pack[i] for i in index], console, engine, on_done=on_done, summary=False,
                                     say=len(pack) > 1)
        got.update(zip(index, outcomes))
    return [got[i] for i in range(len(pack))]
