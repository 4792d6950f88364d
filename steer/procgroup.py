"""Child processes that lead a process group of their own, and how they end. An engine's process starts others
(vLLM's engine core) that can outlive it and hold the GPU: ending one means ending its whole group, also once
the process itself has died."""

import os
import signal


def lead(target, *args) -> None:
    """Run `target(*args)` as the leader of a new process group (the target of a multiprocessing Process)."""
    os.setpgid(0, 0)
    target(*args)


def kill(process) -> None:
    """SIGKILL every process of the group `process` (a started multiprocessing Process) leads, then reap it."""
    try:  # first: is_alive() reaps an ended leader, and its pid could then name another's group
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # killed before it led its own group, or nothing left of it
        if process.is_alive():
            process.kill()
    process.join()
