"""engine=hf's process: the app (steer.serve.hf_app) under uvicorn until Ctrl-C or SIGTERM, then a shutdown that
takes a step of the model, not the longest request: every generation running or waiting ends at once (503), and
the engine's thread is waited for before the process exits (a thread left inside torch as the interpreter exits
aborts the process).
"""

import asyncio
import logging
import os
import signal
import sys
import time
from typing import List, Sequence

from steer.serve.hf_app import HFServer, build_app
from steer.serve.worker import EngineWorker

log = logging.getLogger("steer.serve")
SHUTDOWN_S = 5.0  # after Ctrl-C, for responses already cut off to reach their clients before connections close
JOIN_S = 60.0  # for the engine's thread to finish the step it is in


def serve(server: HFServer, host: str, port: int, log_level: str, keep_alive_s: int) -> None:
    """Serve `server` with uvicorn until Ctrl-C or SIGTERM; its engine's thread is stopped before this returns."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            self.signals: List[int] = []

        def handle_exit(self, sig, frame):
            self.signals.append(sig)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            # First: requests still generating end now (503) rather than when their last token comes, so the
            # connections close and shutdown takes a step of the model, not the longest request's length.
            server.worker.close()
            await super().shutdown(sockets)
            # Here, not only after run(): uvicorn raises a SIGTERM again once shut down, which ends the process
            await asyncio.to_thread(_join, server.worker, lambda: self.force_exit, self.signals)

    # No lifespan (the app has none): shutdown above and the `finally` below stop the engine, and a lifespan task
    # still waiting when a second Ctrl-C force-quits is cancelled with a traceback.
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=SHUTDOWN_S)
    try:
        Server(config).run()
    finally:
        if server.worker.thread.is_alive():  # the loop was cut short before its shutdown
            _join(server.worker)


def _join(worker: EngineWorker, forced=lambda: False, signals: Sequence[int] = (), wait_s: float = JOIN_S) -> None:
    """Wait for the engine's thread to finish its step, up to `wait_s` or until a second Ctrl-C (`forced`). A
    thread still inside torch as the interpreter exits aborts the process (SIGABRT), and a step cannot be
    interrupted: past that, the process ends at once (128 + the first signal), without the interpreter's exit."""
    deadline = time.monotonic() + wait_s
    while not worker.close(timeout=0.1):
        if forced() or time.monotonic() > deadline:
            code = 128 + (signals[0] if signals else signal.SIGTERM)
            log.warning("the engine's thread is still inside a step of the model: exiting without it (%d)", code)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    log.info("the engine's thread has stopped")
