"""Garbage collections in the timing process through a pass.

vLLM's engine core freezes its process's heap after start (`gc.freeze()`, so that a full collection does not walk
the weights' and graphs' bookkeeping again), and so does vLLM's API server; the process that times a bench pass, an
offline `vllm.LLM` like a user's script, does not. A full collection of an unfrozen heap of a process that has
imported torch, vLLM and transformers can take tens of milliseconds, a share of a SmolLM2 pass (0.4-0.6 s). So
each pass records how long this process spent collecting (`gc_s`) and how many full collections it ran
(`gc_full`), and the report correlates pass times with them. Where vLLM's engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) this sees its collections too; in its own process, not.
"""

import gc
import time
from typing import Dict, Optional

READINGS = ("gc_s", "gc_full")


class Window:
    """Within its `with` block, this process's garbage collections (any thread's): `summary()` gives their time in
    seconds and how many were full (generation 2)."""

    def __init__(self) -> None:
        self.seconds, self.full = 0.0, 0
        self._began: Optional[float] = None

    def _seen(self, phase: str, info: Dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:  # "stop" of a collection this window saw begin
            self.seconds += time.perf_counter() - self._began
            self.full += info.get("generation") == 2
            self._began = None

    def __enter__(self) -> "Window":
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._seen)

    def summary(self) -> Dict[str, float]:
        return {"gc_s": self.seconds, "gc_full": float(self.full)}
