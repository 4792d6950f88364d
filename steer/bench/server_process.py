"""A server in a subprocess of its own, for the tests and the serving benchmark (a harness, not part of the
product): started on a free localhost port, waited for until /health answers, ended with everything it started
(vLLM's engine core included)."""

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple


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
