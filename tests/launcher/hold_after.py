"""`python hold_after.py N ARGS` runs `python -m steer ARGS`, but the sweep's job (or pack) after its first N waits
before it starts until a signal stops the run. A test that sends its stop once it sees N jobs' packs finished then
stops the sweep part way whatever the machine's speed: the later jobs cannot all finish before the signal lands."""

import runpy
import sys
import time

from steer.runs import run

_real_start = run._start
_calls = []


def _start(*args, **kwargs):
    _calls.append(None)
    if len(_calls) > HOLD_AFTER:
        time.sleep(600)  # the signal lands here: Ctrl-C's and SIGTERM's handler raise, SIGKILL ends the process
    return _real_start(*args, **kwargs)


if __name__ == "__main__":
    HOLD_AFTER = int(sys.argv.pop(1))
    run._start = _start
    sys.argv[0] = "steer"
    runpy.run_module("steer", run_name="__main__", alter_sys=True)
