"""Helpers the tests share: composing configs as the commands do, one-edit plans, running the CLI and reading
what a sweep wrote."""

import csv
import importlib
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


# The default config steers SmolLM2 (a real model, seconds a prompt on a CPU); the suite runs on the tiny model, at
# the tap and strength its tests were written for, unless a test names a model, tap, strength or experiment.
TINY = {"model": "model=tiny", "tap": "tap=layer1", "edit.scale": "edit.scale=4"}

# Two prompts, for runs that want more than one prompt and little time.
TWO_PROMPTS = "prompts.steer=['The weather today is','My friend looked at me and said']"


def on_tiny(overrides):
    """`overrides` and then the tiny model's defaults that they do not set themselves (after them, since Hydra's
    command line wants its flags, such as -m, before the overrides)."""
    keys = [o.lstrip("+~").split("=")[0] for o in overrides if not o.startswith("-")]
    if any(k == "experiment" for k in keys):
        return list(overrides)
    if any(k == "preset" for k in keys):  # a preset gives the tap and edit
        return list(overrides) + ([] if "model" in keys else [TINY["model"]])

    def named(k):
        return any(x == k or x.startswith(k + ".") or (k == "edit.scale" and x == "edit") for x in keys)

    return list(overrides) + [v for k, v in TINY.items() if not named(k)]


# The schema each top-level config is checked against, as its command registers it.
SCHEMAS = {"config": "steer.config.schema", "serve": "steer.serve.schema", "bench": "steer.bench.schema"}


def compose_conf(name, overrides, **kw):
    """conf/<name>.yaml composed with `overrides` (a DictConfig), as Hydra composes it for the command that reads
    it; `kw` goes to Hydra's compose (e.g. return_hydra_config)."""
    from hydra import compose as _compose, initialize_config_dir

    importlib.import_module(SCHEMAS[name]).register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return _compose(config_name=name, overrides=list(overrides), **kw)


def compose(*overrides, tiny=True):
    """Compose conf/config.yaml with overrides, as Hydra does for `python -m steer` (on the tiny model unless
    `tiny` is False or the overrides say otherwise)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_conf("config", on_tiny(overrides) if tiny else overrides))


def plan(spec, layer, edit):
    """A plan of one edit at the residual stream after decoder `layer`."""
    from steer.edits.plan import Plan
    from steer.config.schema import TapConf
    from steer.edits.tap import resolve

    p = Plan()
    p.add(resolve(TapConf(layer=layer), spec), edit)
    return p


def sweep_jobs(sweep):
    """The job directories of a sweep, in job order ([] before the sweep has started)."""
    if not sweep.exists():
        return []
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def summary_rows(sweep):
    """The rows of a sweep's summary.csv."""
    with (sweep / "summary.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def cli_env(cache_dir):
    """The environment a CLI subprocess runs in: this checkout first on the path, then what the path held (the GPU
    machine's site folder of vLLM and its dependencies)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "STEER_CACHE": str(cache_dir), "PYTHONPATH": path}


def held_cli(n, args):
    """The command line of `python -m steer args` (on the tiny model) whose job or pack after its first `n` waits
    for a signal before it starts (tests/launcher/hold_after.py): a stop sent once `n` are seen finished lands part
    way through the sweep on any machine."""
    return [sys.executable, str(ROOT / "tests" / "launcher" / "hold_after.py"), str(n), *on_tiny(args)]


def run_cli(args, cwd, cache_dir, timeout=600):
    """Run `python -m steer` in a subprocess from `cwd`; outputs land under cwd/outputs."""
    return run([sys.executable, "-m", "steer", *on_tiny(args), "progress=false"], cwd=cwd, env=cli_env(cache_dir),
               timeout=timeout)


def cli_here(args, cwd, monkeypatch, capsys, module="steer") -> subprocess.CompletedProcess:
    """`python -m steer` run in this process (steer/__main__.py as the command runs it, from `cwd`): its exit code
    (0 if it returned, 1 with the traceback printed if it raised, as the interpreter has it) and what it printed.
    Hydra's logging and its global state are put back afterwards. Where the process boundary is not what a test
    checks, this runs the command without paying a new interpreter's imports of torch and transformers. Another
    `module` (steer.serve) runs with `args` as they are, not on the tiny model's defaults."""
    import logging
    import runpy
    import signal
    import traceback

    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(cwd)
    argv = [*on_tiny(args), "progress=false"] if module == "steer" else list(args)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # as a user's shell has it; run_app sets it while it runs
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    # The command takes SIGTERM as Ctrl-C and a sweep ignores both while its report is written: put back as they
    # were, else every process this test run starts later inherits an ignored Ctrl-C (a server then exits 0 on it)
    stops = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    capsys.readouterr()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # as `python -m steer`: Hydra finds conf/
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        for h in handlers:  # Hydra's logging config replaces the root's handlers (pytest's own among them)
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        GlobalHydra.instance().clear()
        for sig, handler in stops.items():
            signal.signal(sig, handler)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


class _Printed:
    """capsys's readouterr() for cli_here where no capsys is at hand: what was written to sys.stdout and sys.stderr
    while they were redirected into it."""

    def __init__(self):
        import io

        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self):
        from types import SimpleNamespace

        out, err = self.out.getvalue(), self.err.getvalue()
        for f in (self.out, self.err):
            f.seek(0)
            f.truncate()
        return SimpleNamespace(out=out, err=err)


def cli_once(args, cwd) -> subprocess.CompletedProcess:
    """cli_here for a fixture shared by several tests (module- or run-scoped), which cannot take the
    test-scoped monkeypatch and capsys: the command runs in this process as the `cli` fixture runs it."""
    from contextlib import redirect_stderr, redirect_stdout

    import pytest

    printed = _Printed()
    with pytest.MonkeyPatch.context() as monkeypatch, redirect_stdout(printed.out), redirect_stderr(printed.err):
        return cli_here(args, cwd, monkeypatch, printed)


def refused(res: subprocess.CompletedProcess, field: str, says: str = "") -> None:
    """A command refused for bad input: exit 2, its last line `error <field>...` holding `says`, no traceback."""
    assert res.returncode == 2, res.stdout + res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error {field}"), res.stderr
    assert says in last, last
    assert "Traceback" not in res.stderr


# Every process a test starts leads a process group of its own, and the group is ended when the test is done with
# it, whether the test passed, failed or timed out: nothing it started outlives it. The fixture `no_process_left`
# (conftest.py) checks, once every test has run, that none did.
MARK = "STEER_TESTS_PID"  # in the environment of every process the test run starts: the pytest process's pid


def run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw), in a process group of its own
    that is ended whole on return (what the command started and left behind) and on a timeout or an error."""
    with started(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def dies_with_parent(then=None):
    """A preexec_fn: the child gets SIGTERM when the process that started it dies (Linux's PR_SET_PDEATHSIG), so a
    test run killed before its fixtures end their servers (a CI timeout) leaves none behind; then `then()`."""
    def preexec():
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if then is not None:
            then()

    return preexec


@contextmanager
def started(cmd, preexec_fn=None, **kw) -> Iterator[subprocess.Popen]:
    """subprocess.Popen(cmd, **kw) in a process group of its own, ended whole on exit (end_group), and sent
    SIGTERM should this process die first (dies_with_parent); `preexec_fn` runs in the child after that."""
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=dies_with_parent(preexec_fn), **kw)
    try:
        yield proc
    finally:
        end_group(proc)


def end_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to every process of the group `proc` leads, SIGKILL to those left after `grace` seconds; `proc`
    reaped (its pipes closed)."""
    from steer import procgroup

    procgroup.end_group(proc, grace)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def processes_left() -> List[str]:
    """The processes this test run started (MARK names its pid in their environment) that are still running, each
    as "pid: command line"; multiprocessing's own helpers of this process (they end with it) left out."""
    mine, out = os.environ.get(MARK), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if f"{MARK}={mine}".encode() not in env or state in ("Z", "X"):
            continue
        if int(ppid) == os.getpid() and "multiprocessing" in cmd and ("resource_tracker" in cmd or "forkserver" in cmd):
            continue
        out.append(f"{d.name}: {cmd}")
    return out


def end_processes_left(wait: float = 30.0) -> List[str]:
    """processes_left(), after up to `wait` seconds for them to end on their own; those still there are killed."""
    deadline = time.monotonic() + wait
    while (left := processes_left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for line in left:
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


class DiesWhenRun:
    """A sweep job whose group's process is killed (as the OOM killer would) the moment it starts running it;
    importable by a spawned process, as a test's own class is not."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    @property
    def cfg(self):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class DiesLeavingAChild(DiesWhenRun):
    """A sweep job whose group's process starts a child (as vLLM starts its engine core: here forked, so it also
    holds the group's pipe open), writes the child's pid to out_dir/child.pid and is killed."""

    @property
    def cfg(self):
        import signal
        import time

        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        (self.out_dir / "child.pid").write_text(str(pid))
        os.kill(os.getpid(), signal.SIGKILL)


class RaisesWhenRun(DiesWhenRun):
    """A sweep job whose group's process raises the moment it starts running it."""

    @property
    def cfg(self):
        raise ValueError("no config here")
