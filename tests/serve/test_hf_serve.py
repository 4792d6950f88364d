"""The HF server's process at shutdown (steer/serve/hf_serve.py): an engine thread that cannot finish its step (a
long prompt of a large model) is not waited for past a second Ctrl-C or the limit; the process ends at once, with
the signal's exit code, rather than abort as the interpreter exits around a thread inside torch."""

import sys

import pytest

from helpers import run

STUCK = """
import asyncio, signal, threading
import torch
from steer.config.schema import GenConf
from steer.engine.hf_batch import Bound
from steer.serve.hf_serve import _join
from steer.serve.worker import EngineWorker

entered = threading.Event()

class Step(torch.nn.Module):
    def forward(self, *args, **kwargs):
        entered.set()
        threading.Event().wait()  # a forward that does not end

class Stuck:  # what the worker's batch reads of an engine, around a model whose forward never returns
    model, device, _cache_kw, stop_ids, bound = Step(), "cpu", {}, frozenset(), Bound()

engine = Stuck()
worker = EngineWorker(engine)
async def submit():
    worker.submit([1], None, GenConf(max_new_tokens=4), 0, "a")
asyncio.run(submit())
entered.wait()
_join(worker, FORCED, SIGNALS, wait_s=WAIT)
print("returned")
"""


@pytest.mark.parametrize("forced, signals, wait, code", [
    ("lambda: True", "[signal.SIGINT]", "60.0", 130),  # a second Ctrl-C: now
    ("lambda: False", "[signal.SIGTERM]", "0.5", 143),  # past the limit
    ("lambda: False", "[]", "0.5", 143),
], ids=["second-ctrl-c", "sigterm-past-the-limit", "no-signal"])
def test_a_thread_stuck_in_a_step_is_left_and_the_process_ends_with_the_signals_code(forced, signals, wait, code):
    script = STUCK.replace("FORCED", forced).replace("SIGNALS", signals).replace("WAIT", wait)
    res = run([sys.executable, "-c", script], timeout=120)
    assert res.returncode == code, res.stderr[-2000:]
    assert "returned" not in res.stdout
    assert f"the engine's thread is still inside a step of the model: exiting without it ({code})" in res.stderr
