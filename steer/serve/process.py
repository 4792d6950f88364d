"""A server in a subprocess of its own, for the tests and the serving benchmark: started on a free localhost port,
waited for until /health answers, ended with everything it started (vLLM's engine core included)."""

import errno
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> Optional[Tuple[str, str]]:
    """(field, why) where a server could not listen on host:port now, None where it could: tried as uvicorn binds
    (SO_REUSEADDR; "" is every IPv4 interface; any of the host's addresses will do), so a port in use is found
    before a model loads rather than after."""
    try:
        addrs = [(socket.AF_INET, ("", port))] if host == "" else \
            [(i[0], i[4]) for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError as e:
        return "serve.host", f"cannot resolve {host!r}: {e}"
    err: OSError = OSError(f"no address for {host!r}")
    for family, addr in addrs:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
            return None
        except OSError as e:
            err = e
    if err.errno == errno.EADDRINUSE:
        return "serve.port", (f"cannot listen on {host}:{port}: {err.strerror}; is another server there? Pick a free "
                              "port with serve.port=N")
    return "serve.host", f"cannot listen on {host}:{port}: {err.strerror or err}"


@contextmanager
def running(cmd: List[str], port: int, log_path: Path, timeout: float = 900, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None) -> Iterator[str]:
    """Run `cmd` (a server listening on `port`) in a session of its own, its output in `log_path`; yield its base
    URL once /health answers; on exit end the session (SIGTERM, then SIGKILL after 60 s)."""
    with started(cmd, port, log_path, timeout, env, cwd) as (url, _):
        yield url


@contextmanager
def started(cmd: List[str], port: int, log_path: Path, timeout: float = 900, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None) -> Iterator[Tuple[str, subprocess.Popen]]:
    """`running`, yielding (base URL, the server's process)."""
    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        end_session(proc)


def end_session(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to every process of `proc`'s session, then SIGKILL to those left after `grace` seconds. Also once
    `proc` itself has exited: a server's engine process can outlive its API server and hold the GPU."""
    if not _signal_session(proc, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reaped, the leader no longer counts as a member of its session
        if not _signal_session(proc, 0):
            return
        time.sleep(0.1)
    _signal_session(proc, signal.SIGKILL)
    proc.wait()


def _signal_session(proc: subprocess.Popen, sig: int) -> bool:
    """Send `sig` to the process group `proc` leads (0: only ask whether any member is left)."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        proc.poll()
        return False
