"""engine=hf: the engine's one thread, which runs every request in one continuous batch (steer.engine.hf_batch):
a request joins the running batch at the next step, in the order requests arrived and as the engine's bound allows,
and leaves it when done; each row is edited and sampled as if its request were alone. Tokens go back to the event
loop one by one.

A request stops generating once nobody waits for it (its client left, or a stop string was met: `cancelled`). When
the server shuts down (`close`), every request still generating or waiting ends at once with `ServerClosing`, and
the thread is joined before the interpreter exits: left inside torch, it would abort the process.
"""

import asyncio
import logging
import queue
import threading
from collections import deque
from typing import AsyncIterator, Deque, List, Optional, Tuple

from steer.config.schema import GenConf
from steer.engine.hf_batch import Batch, Row

log = logging.getLogger("steer.serve")


class ServerClosing(RuntimeError):
    """The server is shutting down: the request was cut off (served as 503)."""


class Job:
    """One generation, handed from the event loop to the engine's thread; tokens come back through `events`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: List[int], plan, gen: GenConf, seed: int, name: str):
        self.loop, self.ids, self.plan, self.gen, self.seed, self.name = loop, ids, plan, gen, seed, name
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.refused: Optional[Exception] = None  # why the server ended it (shutting down)
        self.finished = False  # the engine is done with it
        self.row: Optional[Row] = None  # its row in the engine's batch, once it joins

    def post(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()

    def end(self, error: Exception) -> None:
        """Stop generating; whoever waits gets `error` now, not once the engine's step in progress is over (a
        large model's prompt on a CPU: seconds)."""
        if self.finished or self.cancelled.is_set():  # nobody waits for it any more
            return
        self.refused = error
        self.cancelled.set()
        self.post("error", error)

    def finish(self) -> None:
        """The last event: ("done", None), unless the server ended it (its error is already sent)."""
        self.finished = True
        if self.refused is None:
            self.post("done")

    async def events(self) -> AsyncIterator[Tuple[str, object]]:
        """("token", id) as generated, then ("done", None) or ("error", exception)."""
        while True:
            kind, value = await self.queue.get()
            yield kind, value
            if kind != "token":
                return


class Call:
    """Work other than a generation that must run on the engine's thread (reading a direction at a tap): run between
    two steps of the batch, its result or error handed back to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fn):
        self.loop, self.fn = loop, fn
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()  # never set: a call is short and always answered

    def run(self, engine) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as e:  # the caller's to answer (a 400 or a 500)
            result, error = None, e
        self.loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result, error) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def end(self, error: Exception) -> None:
        self.loop.call_soon_threadsafe(self._settle, None, error)


class EngineWorker:
    """The engine's one thread: every request in one running batch, joining in the order they arrived."""

    def __init__(self, engine):
        self.engine = engine
        self._jobs: "queue.Queue[Optional[Job | Call]]" = queue.Queue()
        self._lock = threading.Lock()
        self._live: set = set()  # submitted and not yet finished
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="steer-engine", daemon=True)
        self.thread.start()

    def submit(self, ids: List[int], plan, gen: GenConf, seed: int, name: str = "") -> Job:
        """Queue a generation (`name`: the request's, for the log)."""
        job = Job(asyncio.get_running_loop(), ids, plan, gen, seed, name)
        with self._lock:
            if self.closing:
                job.end(ServerClosing("the server is shutting down"))
                return job
            self._live.add(job)
        self._jobs.put(job)
        return job

    async def call(self, fn):
        """fn(engine) on the engine's thread, between two steps of the running batch; its result."""
        call = Call(asyncio.get_running_loop(), fn)
        with self._lock:
            if self.closing:
                raise ServerClosing("the server is shutting down")
            self._jobs.put(call)
        return await call.future

    @property
    def jobs(self) -> int:
        """Generations running or waiting that someone waits for (one whose client left is skipped when reached)."""
        with self._lock:
            return sum(not job.cancelled.is_set() for job in self._live)

    def close(self, timeout: Optional[float] = None) -> bool:
        """End every job still generating or waiting (ServerClosing), stop the thread and wait up to `timeout`
        for it (None: no wait). Whether the thread has stopped."""
        with self._lock:
            if not self.closing:
                self.closing = True
                for job in self._live:
                    job.end(ServerClosing("the server is shutting down"))
                self._jobs.put(None)
        if timeout is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        batch = Batch(self.engine, self.engine.bound)
        waiting: Deque[Job] = deque()
        while True:
            try:  # block for work only while nothing runs
                job = self._jobs.get(block=not batch.rows and not waiting)
                while True:
                    if job is None:
                        for r in batch.rows:
                            self._done(r.key)
                        self._end_calls()
                        return
                    if isinstance(job, Call):
                        job.run(self.engine)
                    else:
                        waiting.append(job)
                    job = self._jobs.get_nowait()
            except queue.Empty:
                pass
            self._drop_cancelled(batch)
            joining: List[Row] = []
            while waiting and (waiting[0].cancelled.is_set() or batch.fits(_row(waiting[0]), joining)):
                job = waiting.popleft()
                if job.cancelled.is_set():
                    self._done(job)
                else:
                    joining.append(_row(job))
            try:
                for r in batch.join(joining) if joining else []:
                    self._done(r.key)
                for r, tok in batch.pick():  # each token goes out before the next step runs
                    if tok is not None:
                        r.key.post("token", tok)
                    if r.done:
                        self._done(r.key)
                self._drop_cancelled(batch)
                batch.advance()
            except Exception as e:  # the batch's failure is its requests': the engine serves the next ones
                log.exception("generation failed")
                for r in dict.fromkeys(batch.rows + joining):
                    if not r.done:
                        r.key.post("error", e)
                        self._done(r.key, failed=True)
                batch.drop(range(len(batch.rows)))

    def _end_calls(self) -> None:
        """Calls queued behind the stop: answered, so no handler waits for them."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Call):
                item.end(ServerClosing("the server is shutting down"))

    def _drop_cancelled(self, batch: Batch) -> None:
        gone = [i for i, r in enumerate(batch.rows) if r.key.cancelled.is_set()]
        for i in gone:
            self._done(batch.rows[i].key)
        batch.drop(gone)

    def _done(self, job: Job, failed: bool = False) -> None:
        if not failed:
            made = len(job.row.out) if job.row is not None else 0
            if job.cancelled.is_set() and made < job.gen.max_new_tokens:
                why = job.refused or "its answer is complete or its client gone"
                log.info("%s: generation stopped after %d of %d tokens (%s)", job.name, made,
                         job.gen.max_new_tokens, why)
            job.finish()
        with self._lock:
            self._live.discard(job)


def _row(job: Job) -> Row:
    """The job's row in the batch (made once)."""
    if job.row is None:
        job.row = Row(list(job.ids), job.plan, job.gen, job.seed, key=job)
    return job.row
