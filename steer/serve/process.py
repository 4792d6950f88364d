"""A server in a subprocess of its own, for the tests and the serving benchmark: started on a free localhost port,
waited for until /health answers, ended with everything it started (vLLM's engine core included)."""

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> Optional[str]:
    """Why a server could not listen on host:port now (None: it could), tried as uvicorn binds (SO_REUSEADDR), so
    a port in use is found before a model loads rather than after."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        return f"cannot resolve {host!r}: {e}"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


@contextmanager
def running(cmd: List[str], port: int, log_path: Path, timeout: float = 900, env: Optional[Dict[str, str]] = None,
            cwd: Optional[Path] = None) -> Iterator[str]:
    """Run `cmd` (a server listening on `port`) in a session of its own, its output in `log_path`; yield its base
    URL once /health answers; on exit end the session (SIGTERM, then SIGKILL after 60 s)."""
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
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
