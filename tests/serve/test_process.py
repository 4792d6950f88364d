"""steer.procgroup: everything a server started ends with it."""

import os

import pytest

from steer.procgroup import free_port, running


def test_a_server_that_exits_takes_the_processes_it_started_with_it(tmp_path):
    # As vLLM's API server can die and leave its engine process holding the GPU.
    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3"]
    with pytest.raises(RuntimeError, match=r"the server exited \(3\)"):
        with running(cmd, free_port(), tmp_path / "server.log", timeout=30):
            pass
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
