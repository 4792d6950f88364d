"""Child processes that lead a process group of their own, and how they end. An engine's process starts others
(vLLM's engine core) that can outlive it and hold the GPU: ending one means ending its whole group, also once
the process itself has died."""

import os
import signal


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
