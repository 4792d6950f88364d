"""The HF server's engine thread (steer/serve/worker.py), on the tiny model with forwards the test holds: a shutdown
ends the requests waiting on a step in progress at once, then the thread; requests that arrive while others run join
their batch and get what they get alone."""

import asyncio
import threading

import pytest

from steer.config.schema import GenConf
from steer.serve.worker import EngineWorker, ServerClosing


class Held:
    """The engine, each forward of its model waiting until the test lets it through (`step.release()`)."""

    def __init__(self, engine):
        self.step = threading.Semaphore(0)
        self.entered = threading.Event()
        self.forwards = []  # the batch size of each forward

        def hold(module, args, kwargs):
            self.forwards.append(kwargs["input_ids"].shape[0])
            self.entered.set()
            self.step.acquire()

        self.handle = engine.model.register_forward_pre_hook(hold, with_kwargs=True)


@pytest.fixture
def held(hf_engine):
    h = Held(hf_engine)
    yield h
    h.handle.remove()


def test_closing_ends_a_request_at_once_while_its_step_runs_then_the_thread(hf_engine, held):
    engine = held

    async def go():
        worker = EngineWorker(hf_engine)
        first = worker.submit([1], None, GenConf(max_new_tokens=100), 0, "a")
        queued = worker.submit([1], None, GenConf(max_new_tokens=100), 0, "b")
        await asyncio.to_thread(engine.entered.wait)
        engine.entered.clear()
        engine.step.release()
        events = first.events()
        assert (await events.__anext__())[0] == "token"
        await asyncio.to_thread(engine.entered.wait)  # the next step has started and holds
        assert worker.jobs == 2
        assert worker.close() is False  # the thread is still in its step
        kind, error = await asyncio.wait_for(events.__anext__(), 30)
        assert kind == "error" and isinstance(error, ServerClosing)
        assert [e async for e in queued.events()][-1][0] == "error"  # it ran in the same batch: ended too
        late = worker.submit([1], None, GenConf(max_new_tokens=1), 0, "c")  # after close: refused, never queued
        assert [e async for e in late.events()][0][0] == "error"
        engine.step.release()  # the step ends; the thread sees the job ended and stops
        assert await asyncio.to_thread(worker.close, 30) is True
        assert worker.jobs == 0

    asyncio.run(go())


def test_a_request_whose_client_left_is_not_counted_nor_told_the_server_closes(hf_engine, held):
    engine = held

    async def go():
        worker = EngineWorker(hf_engine)
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


def test_requests_join_the_running_batch_and_get_what_they_get_alone(hf_engine, held):
    """A request sent while another generates joins its batch at the next step (a forward of both rows follows),
    and each gets the tokens the engine generates for it alone, greedy and sampled."""
    from helpers import plan as plan_of
    from steer.config.schema import EditKind
    from steer.edits.edit import compile_edit
    import torch

    first_ids = hf_engine.encode("When I opened the letter, I felt")
    second_ids = hf_engine.encode("The")
    plan = plan_of(hf_engine.spec, 1, compile_edit(EditKind.add, 4.0, torch.randn(1, hf_engine.spec.hidden)))
    g1, g2 = GenConf(max_new_tokens=12), GenConf(max_new_tokens=8, temperature=1.0, top_p=0.9)

    async def go():
        worker = EngineWorker(hf_engine)
        first = worker.submit(first_ids, None, g1, 0, "first")
        events = first.events()
        held.step.release()  # its prompt
        held.step.release()  # its first step
        got1 = [(await events.__anext__())[1], (await events.__anext__())[1]]
        second = worker.submit(second_ids, plan, g2, 5, "second")
        for _ in range(40):
            held.step.release()
        got2 = [v async for k, v in second.events() if k == "token"]
        got1 += [v async for k, v in events if k == "token"]
        assert await asyncio.to_thread(worker.close, 30) is True
        return got1, got2

    got1, got2 = asyncio.run(go())
    held.handle.remove()
    assert 2 in held.forwards  # the two requests shared steps
    assert got1 == hf_engine.generate(first_ids, None, g1, 0)
    assert got2 == hf_engine.generate(second_ids, plan, g2, 5)
