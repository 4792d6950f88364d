"""Child processes that lead a process group of their own, and how they end. An engine's process starts others
(vLLM's engine core) that can outlive it and hold the GPU: ending one means ending its whole group, also once
the process itself has died. A server in a subprocess of its own (the tests' and the serving benchmark's) is
started in a group of its own on a free localhost port, waited for until /health answers, and ended the same way."""

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple


def lead(target, *args) -> None:
    """Run `target(*args)` as the leader of a new process group (the target of a multiprocessing Process)."""
    os.setpgid(0, 0)
    target(*args)


def kill(process) -> bool:
    """SIGKILL every process of the group `process` (a started multiprocessing Process) leads, then reap it;
    whether it was still running."""
    running = _running(process.pid)
    try:  # before the reap: until then its pid, and with it its group's id, cannot name another's group
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # killed before it led its own group, or nothing left of it
        if running:
            process.kill()
    process.join()
    return running


def _running(pid: int) -> bool:
    """Whether the child `pid` has not ended, asked without reaping it (is_alive() would)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already
        return False


# --- a server in a process group of its own ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(cmd: List[str], port: int, log_path: Path, timeout: float = 900, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None, preexec_fn: Optional[Callable[[], None]] = None) -> Iterator[str]:
    """Run `cmd` (a server listening on `port`) in a process group of its own, its output in `log_path`; yield its
    base URL once /health answers; on exit end the group (SIGTERM, then SIGKILL after 60 s)."""
    with started(cmd, port, log_path, timeout, env, cwd, preexec_fn) as (url, _):
        yield url


@contextmanager
def started(cmd: List[str], port: int, log_path: Path, timeout: float = 900, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None, preexec_fn: Optional[Callable[[], None]] = None
            ) -> Iterator[Tuple[str, subprocess.Popen]]:
    """`running`, yielding (base URL, the server's process); `preexec_fn` runs in the child before the command."""
    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec_fn)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{Path(log_path).read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer in {timeout} s:\n{Path(log_path).read_text()[-4000:]}")
            time.sleep(1)
        yield url, proc
    finally:
        end_group(proc)


def end_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to every process of the group `proc` leads, then SIGKILL to those left after `grace` seconds. Also once
    `proc` itself has exited: a server's engine process can outlive its API server and hold the GPU."""
    if not _signal_group(proc, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reaped, the leader no longer counts as a member of its group
        if not _signal_group(proc, 0):
            return
        time.sleep(0.1)
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send `sig` to the process group `proc` leads (0: only ask whether any member is left)."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        proc.poll()
        return False
