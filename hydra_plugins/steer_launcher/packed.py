"""`hydra/launcher=packed`: a multirun whose jobs share engines.

A vLLM engine takes tens of seconds to start and capture its graphs, and the basic launcher starts one per job
in one process, where vLLM does not free GPU memory reliably. This launcher first sets every job up as Hydra
would (its run directory, `.hydra/`, its log) while steer validates it without running it; then groups the jobs
that can share an engine (same model, engine and engine settings) and runs each group with one engine, the jobs'
edits as per-request edits in the same batches, in packs of `pack_size` jobs. Each job's directory comes out as
if it had run alone. Groups after the first run in a process of their own.

A job is done where a complete job directory of the sweep (its metrics.json exists) holds the job's settings, as
the job resolves them (steer.runs.job.Job.settings: its prompts as their files hold them, "auto" resolved), and
the files its inputs.json names (its vectors, data files and model's) read as they did: it is skipped unless
`force` is set, so a sweep that was stopped resumes where it left off. Settings decide, not job numbers: a finished
job found in another job's directory (a value added to a sweep shifts the numbers after it) is moved to its own.

A job that fails (error.txt in its directory, no metrics.json) does not stop the others: every pack runs, the
report is written, and the sweep then exits 1. Ctrl-C (or SIGTERM) writes the report of the jobs that finished and
exits 130.
"""

import copy
import logging
import multiprocessing
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from steer.runs import rundir
from steer.config.schema import NOT_RESULTS, PACK

log = logging.getLogger(__name__)


@dataclass
class PackedLauncherConf:
    _target_: str = "hydra_plugins.steer_launcher.packed.PackedLauncher"
    pack_size: int = PACK  # jobs per batch: a stopped sweep loses at most the pack in flight
    force: bool = False  # rerun jobs whose run directory is already complete


ConfigStore.instance().store(group="hydra/launcher", name="packed", node=PackedLauncherConf, provider="steer")


def complete(job_dir: Path) -> bool:
    """A job is complete once its metrics.json holds its metrics: steer writes it atomically, after everything
    else (one damaged since is rerun)."""
    return metrics(job_dir) is not None


def metrics(job_dir: Path) -> Optional[Dict[str, Any]]:
    from steer import results

    return results.read_json(job_dir / "metrics.json")


def settings_of(cfg: DictConfig) -> Optional[str]:
    """The settings digest of a job of the sweep as it would run (steer.runs.job.Job.settings); None where it cannot
    be prepared (its run then says why)."""
    from steer.config import preset, schema
    from steer.tasks.registry import prepare

    try:
        overrides = OmegaConf.select(cfg, "hydra.overrides.task")  # as written: one may hold an interpolation
        given = [str(o).split("=")[0].lstrip("+~")
                 for o in (OmegaConf.to_container(overrides, resolve=False) if overrides is not None else [])]
        task_cfg = copy.deepcopy(cfg)  # as run_job hands it to the task: without its `hydra` node
        with open_dict(task_cfg):
            task_cfg.pop("hydra", None)
        return prepare(preset.apply(schema.to_object(task_cfg), given), Path(".")).settings
    except Exception:
        return None


def resume_note(job_dir: Path, cfg: DictConfig, force: bool = False, settings: Optional[str] = None) -> Optional[str]:
    """None where the job is done (complete, made with the same resolved settings `settings`, its inputs as they
    were) and is skipped; else what its (re)run says of the job dir it finds: "" for a first run (or a forced one).
    `settings`: the job's digest (settings_of), taken here where not given."""
    if complete(job_dir):
        if force:
            return ""
        from steer.runs import inputs
        from steer.tasks import registry

        if _resumes_itself(cfg):  # a select: its pairs hold the record of their settings and inputs
            changed = config_changes(job_dir, cfg)
            return (f" (config changed: {changed}, rerunning)" if changed is not None
                    else " (a select: run again, keeping its pairs that are current)")
        settings = settings if settings is not None else settings_of(cfg)
        changed = inputs.recorded_changes(job_dir, registry.data_paths(cfg))  # vectors, data files, the model's
        if settings is not None and inputs.recorded_settings(job_dir) == settings:
            return None if changed is None else f" (inputs changed: {changed}, rerunning)"
        config = config_changes(job_dir, cfg)
        why = (f"config changed: {config}" if config is not None else f"inputs changed: {changed}" if changed
               else "no record of its settings" if inputs.recorded_settings(job_dir) is None else "settings changed")
        return f" ({why}, rerunning)"
    if (job_dir / "metrics.json").is_file():
        return " (its metrics.json is damaged, rerunning)"
    if (job_dir / "error.txt").is_file():
        return " (failed before, rerunning)"
    if (job_dir / ".hydra" / "config.yaml").is_file():  # set up before, stopped (Ctrl-C, a kill) before its metrics
        return " (unfinished before, rerunning)"
    return ""


EXIT_S = 60.0  # for an engine group's process to end once it has reported (its engine is closed by then)


def _comparable(cfg: DictConfig) -> Dict[str, Any]:
    """A job config as Hydra saves it in .hydra/config.yaml (unresolved, through YAML), less `hydra` and NOT_RESULTS."""
    out = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(cfg)), resolve=False)
    for key in ("hydra", *NOT_RESULTS):
        out.pop(key, None)
    return out


def _flat(node: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
        return {k: v for i, x in enumerate(node) for k, v in _flat(x, f"{prefix}{i}.").items()}  # as overrides say
    return {prefix[:-1]: node}


def _show(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def config_changes(job_dir: Path, cfg: DictConfig, most: int = 3) -> Optional[str]:
    """None if the job's saved config (.hydra/config.yaml, written when it was set up) is `cfg` less its `hydra`
    node and the keys in NOT_RESULTS; else what differs, e.g. `tap.layer 1 -> 2` (what a rerun says of its
    directory; whether the job is done is its resolved settings' to say: resume_note)."""
    saved = job_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return "no saved config"
    old, new = _flat(_comparable(OmegaConf.load(saved))), _flat(_comparable(cfg))
    keys = list(old) + [k for k in new if k not in old]
    diffs = [f"{k} {_show(old[k]) if k in old else '(unset)'} -> {_show(new[k]) if k in new else '(unset)'}"
             for k in keys if k not in old or k not in new or old[k] != new[k]]
    if not diffs:
        return None
    return ", ".join(diffs[:most]) + (f" and {len(diffs) - most} more" if len(diffs) > most else "")


def relocate(sweep_dir: Path, wanted: Sequence[Tuple[Path, Optional[str]]]) -> None:
    """Move each finished job directory of `sweep_dir` whose recorded settings a job of `wanted` ((its directory,
    its settings digest)) has to that job's directory, unless a job wants it where it is. A job's directory a
    finished job moves into held a job whose settings no job wants now (it would be run again): it goes."""
    import shutil

    from steer.runs import inputs

    def recorded(d: Path) -> Optional[str]:
        return inputs.recorded_settings(d) if complete(d) else None

    in_place = {d for d, s in wanted if s is not None and recorded(d) == s}
    found: Dict[str, Path] = {}
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p not in in_place):
        s = recorded(d)
        if s is not None:
            found.setdefault(s, d)
    moves = [(found.pop(s), d) for d, s in wanted if d not in in_place and s is not None and s in found]
    parked = []
    for i, (src, dst) in enumerate(moves):  # aside first: a source may be another move's destination
        park = sweep_dir / f".moving-{i}-{src.name}"
        src.rename(park)
        parked.append((src, park, dst))
    for src, park, dst in parked:
        if dst.exists():
            shutil.rmtree(dst)
        park.rename(dst)
        log.info(f"\t{src.name} -> {dst.name}: a finished job with this job's settings, moved to its directory")


class JobFailed(RuntimeError):
    """A job's failure, as its JobReturn's value: its directory holds error.txt and no metrics.json."""


class PackedLauncher(Launcher):
    def __init__(self, pack_size: int = PACK, force: bool = False) -> None:
        self.pack_size, self.force = max(1, pack_size), force
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        job_dirs: List[Path] = []
        try:
            returns, failed = self._launch(job_overrides, initial_job_idx, sweep_dir, job_dirs)
        except KeyboardInterrupt:
            _list_jobs(sweep_dir, job_dirs, initial_job_idx)
            _interrupted(sweep_dir, job_dirs, len(job_overrides))
        if failed:
            # Hydra's sweeper would raise the first failure as a traceback, before the report: say it here, exit 1.
            # (A sweeper that sends several batches stops after this one.)
            out = _report(sweep_dir)
            print(f"{len(failed)} of {len(job_overrides)} jobs failed (error.txt in their directories: "
                  f"{', '.join(failed)}); {out}", file=sys.stderr)
            sys.exit(1)
        return returns

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, sweep_dir: Path,
                job_dirs: List[Path]) -> Tuple[List[JobReturn], List[str]]:
        from steer.runs.job import Job

        returns: List[JobReturn] = []
        pending: Dict[str, Tuple[int, str, JobReturn]] = {}
        failed: List[str] = []
        jobs: List[Job] = []
        bad: List[str] = []
        composed = self._composed(job_overrides, initial_job_idx, sweep_dir)
        for idx, (cfg, job_dir, _, note) in enumerate(composed, start=initial_job_idx):
            if note is None:  # done: the file it wrote stays its own, whatever the jobs to run name
                _hold_done(sweep_dir, idx, cfg, job_dir)
        for idx, (overrides, (cfg, job_dir, shown, note)) in enumerate(zip(job_overrides, composed),
                                                                       start=initial_job_idx):
            ret = self._validate(idx, overrides, cfg, job_dir, shown, note)
            job_dirs.append(job_dir)
            if ret is None:  # bad input, said on the line above: the others are checked too, then nothing runs
                bad.append(f"#{idx}")
                continue
            returns.append(ret)
            if ret.status == JobStatus.FAILED:
                failed.append(_say_failed(idx, shown, ret, job_dir, f"{type(ret._return_value).__name__}: "
                                                                    f"{ret._return_value}"))
            elif isinstance(ret.return_value, Job):  # validated, waiting for its engine group
                jobs.append(ret.return_value)
                pending[str(ret.return_value.out_dir)] = (idx, shown, ret)
        _list_jobs(sweep_dir, job_dirs, initial_job_idx)
        if bad:
            # A later batch of a sweeper that sends several: the earlier batches' jobs ran, and their report stands
            ran = f"; earlier batches ran, {_report(sweep_dir)}" if initial_job_idx > 0 else ""
            n = len(job_overrides)
            print(f"{len(bad)} of {n} job{'s' if n > 1 else ''} {'has' if len(bad) == 1 else 'have'} bad input "
                  f"({', '.join(bad)}; the error above each, and in its error.txt): no engine started, none of "
                  f"{'this batch' if ran else 'the sweep'}'s jobs ran{ran}", file=sys.stderr)
            sys.exit(2)
        return returns, failed + self._run_groups(jobs, pending)

    def _composed(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, sweep_dir: Path) -> list:
        """(config, job dir, overrides as shown, resume note: None where it is done) of each job of the sweep, each
        finished job found in another's directory moved to its own first."""
        jobs = []
        # Settings are read (each job prepared) only where a job of an earlier run may be found
        resuming = not self.force and any(complete(d) for d in sweep_dir.iterdir() if d.is_dir())
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            job_dir = sweep_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
            settings = settings_of(cfg) if resuming and not _resumes_itself(cfg) else None
            jobs.append((cfg, job_dir, " ".join(filter_overrides(overrides)), settings))
        if resuming:
            relocate(sweep_dir, [(job_dir, settings) for _, job_dir, _, settings in jobs])
        # Before run_job, which rewrites .hydra/: a finished job counts only if the same settings made it.
        return [(cfg, job_dir, shown, resume_note(job_dir, cfg, self.force, settings))
                for cfg, job_dir, shown, settings in jobs]

    def _validate(self, idx: int, overrides: Sequence[str], cfg: DictConfig, job_dir: Path, shown: str,
                  note: Optional[str]) -> Optional[JobReturn]:
        """A job of the sweep: done already if complete with the same config, else handed to the task function,
        which validates it and hands back the job (or runs it, for a task that is not deferred); None where it
        refused the job's input."""
        if note is None:
            log.info(f"\t#{idx} : {shown} (complete, skipped)")
            return _done(cfg, overrides, job_dir)
        rundir.clear_stale(job_dir)  # a rerun that stops part way must not leave the old results beside the new config
        log.info(f"\t#{idx} : {shown}{note}")
        try:
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=cfg,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        except SystemExit as e:  # the task refused its config (exit 2, its error printed): None, to check the rest
            if e.code != 2:
                raise
            ret = None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret

    def _run_groups(self, jobs: list, pending: Dict[str, Tuple[int, str, JobReturn]]) -> List[str]:
        """Run the validated jobs, a group per engine (the first here, each other in a process of its own); set
        each job's return value; the numbers of those that failed."""
        from steer.runs.job import engine_key

        groups: Dict[str, list] = {}
        for job in jobs:
            groups.setdefault(engine_key(job), []).append(job)
        if jobs:  # none where every job was done, failed, or ran as it was set up (task=select)
            log.info(f"{len(jobs)} jobs to run in {len(groups)} engine group(s), packs of {self.pack_size}")
        failed = []
        for i, group in enumerate(groups.values()):
            metrics = run_group(group, self.pack_size) if i == 0 else _in_own_process(group, self.pack_size)
            for job, m in zip(group, metrics):
                idx, shown, ret = pending[str(job.out_dir)]
                if isinstance(m, dict) and "error" in m:
                    failed.append(_say_failed(idx, shown, ret, job.out_dir, str(m["error"])))
                else:
                    ret.return_value = m
        return failed


def _say_failed(idx: int, shown: str, ret: JobReturn, job_dir: Path, message: str) -> str:
    """Mark a job's JobReturn failed and log one line for it; return its number for the sweep's last line."""
    first = (message.strip().splitlines() or [""])[0]
    ret.status = JobStatus.FAILED
    ret.return_value = JobFailed(f"job #{idx} ({shown}) failed: {first}")
    log.error(f"\t#{idx} : {shown} (failed: {first}; see {job_dir / 'error.txt'})")
    return f"#{idx}"


def _list_jobs(sweep_dir: Path, job_dirs: List[Path], initial_job_idx: int) -> None:
    # The report then leaves out the job directories an earlier, larger sweep left in the same sweep dir.
    from steer.report.jobs import list_jobs

    list_jobs(sweep_dir, [d.name for d in job_dirs if d.parent == sweep_dir], append=initial_job_idx > 0)


def _report(sweep_dir: Path) -> str:
    from steer.runs import sweep
    from steer.runs.report import left_out

    out = sweep.write_report(sweep_dir)
    if not out:
        return f"no summary written (no job in {sweep_dir} finished)"
    return f"summary written to {out['summary']}{left_out(out)}"


def _interrupted(sweep_dir: Path, job_dirs: List[Path], total: int) -> None:
    """Ctrl-C (or SIGTERM, which python -m steer takes as one): keep what finished, write its report, say so in one
    line, exit 130."""
    from steer.runs.sweep import STOPS

    for sig in STOPS:  # a second Ctrl-C must not cut the report short
        signal.signal(sig, signal.SIG_IGN)
    done = sum(complete(d) for d in job_dirs)
    print(f"interrupted: {done} of {total} jobs finished; {_report(sweep_dir)}", file=sys.stderr)
    sys.exit(130)


def run_group(jobs: list, pack_size: int) -> List[dict]:
    """Run one engine group, `pack_size` jobs at a time; each pack's files are written when it finishes. A pack
    that fails as a whole (its engine did not start, say) fails its jobs, and the next pack runs."""
    from rich.console import Console

    from steer import progress as progress_bar
    from steer.runs.job import engine_for
    from steer.tasks import registry

    console = Console(stderr=True)
    out = []
    with progress_bar.bar(console, jobs[0].cfg.progress) as progress:
        task = progress.add_task("sweep jobs", total=len(jobs))
        try:
            with engine_for(jobs) as engine:
                out = registry.execute_packs(jobs, console, engine, pack_size,
                                             on_done=lambda job: progress.advance(task), on_pack_error=_pack_failed)
        except Exception as e:  # the engine did not start (or did not close): the jobs not yet done fail
            if len(out) == len(jobs):
                log.warning(f"the engine did not close cleanly: {type(e).__name__}: {e}")
            out += [_pack_failed(job, e) for job in jobs[len(out):]]
    return out


def _pack_failed(job, e: Exception) -> dict:
    """A job of a pack that raised: its metrics if it finished before, else error.txt and `{"error": ...}`."""
    from steer import results

    if complete(job.out_dir):
        return metrics(job.out_dir)
    message = f"{type(e).__name__}: {e}"
    results.write_text(job.out_dir / "error.txt", "".join(traceback.format_exception(e)).rstrip() + "\n")
    return {"error": message}


def _in_own_process(jobs: list, pack_size: int) -> List[dict]:
    """run_group in a fresh process. A process that dies (the OOM killer, a CUDA abort), raises or does not start
    fails the jobs it had not finished, as an engine that does not start would, and the sweep goes on."""
    # vLLM does not reliably free GPU memory when an engine is dropped: a second engine gets a fresh process. A
    # Process and a pipe, not a Pool: a Pool replaces a worker that dies and its apply() then waits forever. The
    # process leads a group of its own, ended whole afterwards: its engine core must not outlive it.
    from steer import procgroup

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=procgroup.lead, args=(_group_child, jobs, pack_size, send))
    reported = False
    try:
        try:
            proc.start()
        except Exception as e:  # its jobs did not pickle, or no process could be made
            return [_pack_failed(job, e) for job in jobs]
        finally:
            send.close()  # the child holds its own copy
        ok, out = _receive(receive, proc)
        reported = ok is not None
        if ok:
            return out
        return [_pack_failed(job, RuntimeError(out)) for job in jobs]
    finally:
        try:
            if proc.pid is not None:
                proc.join(EXIT_S if reported else 0)  # one that reported ends by itself; Ctrl-C ends it now
        finally:  # also after a Ctrl-C in that wait: the terminal's does not reach a group of its own
            if proc.pid is not None:
                procgroup.kill(proc)
            receive.close()


def _receive(receive, proc) -> tuple:
    """What the group's process sent: (True, results) or (False, its traceback); (None, why) where it ended first.
    Polled, not a bare recv(): a process it started may hold the pipe open after it died."""
    try:
        while not receive.poll(1.0):
            if not proc.is_alive() and not receive.poll(0):
                raise EOFError
        return receive.recv()
    except (EOFError, OSError):  # ended, or ended mid-message
        proc.join()
        return None, (f"the process running this engine group ended (exit code {proc.exitcode}) before it reported "
                      f"its jobs")


def _group_child(jobs: list, pack_size: int, send) -> None:
    # It ignores Ctrl-C: the launcher, told too, writes the report and ends it (no second traceback from it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        send.send((True, run_group(jobs, pack_size)))
    except BaseException as e:  # what went wrong, for the jobs' error.txt, rather than an exit code alone
        send.send((False, f"the process running this engine group raised {type(e).__name__}: {e}\n"
                          + "".join(traceback.format_exception(e)).rstrip()))
    finally:
        send.close()


def _hold_done(sweep_dir: Path, idx: int, cfg: DictConfig, job_dir: Path) -> None:
    """A finished job skipped on resume that wrote a file outside its directory (an extraction's vector) holds it
    (steer.runs.sweep.claim), as it did when it ran: a job of the sweep that would write it over is refused."""
    from steer.errors import ConfigError
    from steer.runs.sweep import claim
    from steer.tasks import registry

    key = registry.of(cfg.get("task")).writes
    if key is None:
        return
    vector = metrics(job_dir).get("vector")
    if not vector:
        return
    path = Path(vector)
    if not path.expanduser().is_absolute() and OmegaConf.select(cfg, "hydra.job.chdir"):
        path = job_dir / path  # written from the job's directory
    try:
        claim(sweep_dir.resolve(), idx, key, path)
    except ConfigError:  # two finished jobs hold it (one wrote what the other had): neither writes it again
        pass


def _resumes_itself(cfg: DictConfig) -> bool:
    """Whether a finished job of this config runs again, keeping what it finds current (a select's pairs)."""
    from steer.tasks import registry

    return registry.of(cfg.get("task")).resumes_itself


def _done(cfg: DictConfig, overrides: Sequence[str], job_dir: Path) -> JobReturn:
    ret = JobReturn(overrides=list(overrides), cfg=cfg, hydra_cfg=cfg, working_dir=str(job_dir),
                    task_name=str(cfg.hydra.job.name), status=JobStatus.COMPLETED)
    ret.return_value = metrics(job_dir)
    return ret
