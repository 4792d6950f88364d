"""The HF server's engine thread (steer/serve/worker.py), on an engine whose steps the test holds: a shutdown ends
the requests waiting on a step in progress at once, then the thread."""

import asyncio
import threading

from steer.config.schema import GenConf
from steer.serve.worker import EngineWorker, ServerClosing


class HeldEngine:
    """Yields token 7 each time the test lets a step through (`step.release()`)."""

    def __init__(self):
        self.step = threading.Semaphore(0)
        self.entered = threading.Event()

    def generate_iter(self, ids, plan, gen, seed):
        for _ in range(gen.max_new_tokens):
            self.entered.set()
            self.step.acquire()
            yield 7


def test_closing_ends_a_request_at_once_while_its_step_runs_then_the_thread():
    engine = HeldEngine()

    async def go():
        worker = EngineWorker(engine)
        first = worker.submit([1], None, GenConf(max_new_tokens=100), 0, "a")
        queued = worker.submit([1], None, GenConf(max_new_tokens=100), 0, "b")
        await asyncio.to_thread(engine.entered.wait)
        engine.entered.clear()
        engine.step.release()
        events = first.events()
        assert await events.__anext__() == ("token", 7)
        await asyncio.to_thread(engine.entered.wait)  # the next step has started and holds
        assert worker.jobs == 2
        assert worker.close() is False  # the thread is still in its step
        kind, error = await asyncio.wait_for(events.__anext__(), 30)
        assert kind == "error" and isinstance(error, ServerClosing)
        assert [e async for e in queued.events()][0][0] == "error"
        late = worker.submit([1], None, GenConf(max_new_tokens=1), 0, "c")  # after close: refused, never queued
        assert [e async for e in late.events()][0][0] == "error"
        engine.step.release()  # the step ends; the thread sees the job ended and stops
        assert await asyncio.to_thread(worker.close, 30) is True
        assert worker.jobs == 0

    asyncio.run(go())


def test_a_request_whose_client_left_is_not_counted_nor_told_the_server_closes():
    engine = HeldEngine()

    async def go():
        worker = EngineWorker(engine)
        worker.submit([1], None, GenConf(max_new_tokens=1), 0, "running")
        gone = worker.submit([1], None, GenConf(max_new_tokens=1), 0, "gone")
        await asyncio.to_thread(engine.entered.wait)
        assert worker.jobs == 2
        gone.cancelled.set()  # its handler saw the client leave
        assert worker.jobs == 1
        worker.close()
        assert gone.refused is None  # it ended because its client left, not because the server closed
        engine.step.release()
        assert await asyncio.to_thread(worker.close, 30) is True

    asyncio.run(go())
