"""engine=hf: the engine's one thread. Its hooks and row masks belong to the model, so requests run one after the
other, in the order they arrived, each exactly as if it were alone; tokens go back to the event loop one by one.

A request stops generating once nobody waits for it (its client left, or a stop string was met: `cancelled`). When
the server shuts down (`close`), every request still generating or waiting ends at once with `ServerClosing`, and
the thread is joined before the interpreter exits: left inside torch, it would abort the process.
"""

import asyncio
import logging
import queue
import threading
from contextlib import closing
from typing import AsyncIterator, List, Optional, Tuple

from steer.config.schema import GenConf

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


class EngineWorker:
    """The engine's one thread: jobs run one after the other, in the order they arrived."""

    def __init__(self, engine):
        self.engine = engine
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
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
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                made = 0
                if not job.cancelled.is_set():
                    with closing(self.engine.generate_iter(job.ids, job.plan, job.gen, job.seed)) as tokens:
                        for tok in tokens:
                            job.post("token", tok)
                            made += 1
                            if job.cancelled.is_set():
                                break
                if job.cancelled.is_set() and made < job.gen.max_new_tokens:
                    why = job.refused or "its answer is complete or its client gone"
                    log.info("%s: generation stopped after %d of %d tokens (%s)", job.name, made,
                             job.gen.max_new_tokens, why)
                job.finish()
            except Exception as e:  # one request's failure is its own: the engine serves the next
                log.exception("generation failed")
                job.post("error", e)
            finally:
                with self._lock:
                    self._live.discard(job)
