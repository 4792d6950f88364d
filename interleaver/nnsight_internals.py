"""The one door to nnsight's internals (read from nnsight 0.8.1): the base Interleaver's run state, the workers
(mediators) parked on a location, and throwing into a worker's greenlet.

`VLLMInterleaver` subclasses nnsight's `Interleaver` and reads these private parts of it; everything else in the
tap layer uses nnsight's public API or this file, so an nnsight upgrade touches this file alone.
"""

from typing import Any, List, Optional


# interleaver/__init__.py has loaded anyio before nnsight (nnsight mounts `.save` on `object`)
from nnsight.intervention.interleaver import Interleaver, OutOfOrderError

__all__ = ["Interleaver", "OutOfOrderError", "serving", "parked_here", "defer", "parked_at", "alive", "throw_into",
           "batch_rows", "op_names"]


def serving(il: Interleaver) -> bool:
    """Whether a trace is being run and has workers: only then can one be parked at a tap."""
    return bool(il.interleaving and il.busy)


def parked_here(il: Interleaver, location: str) -> List[Any]:
    """The workers parked on this visit of `location` (those the base `handle` is about to serve)."""
    return il._ready(location)


def defer(il: Interleaver, mediators: List[Any], error: BaseException) -> bool:
    """End only `mediators`' requests with `error` where the interleaver defers workers' errors (the engine's
    other requests go on); False where it does not (the caller raises)."""
    if not il.defer_exceptions:
        return False
    for mediator in mediators:
        mediator.exception = error
    return True


def parked_at(mediator: Any) -> Optional[str]:
    """The location a worker waits on, or None."""
    return getattr(getattr(mediator, "pending", None), "provider", None)


def alive(mediator: Any) -> bool:
    """Whether a worker is parked mid-intervention (started and not finished)."""
    return bool(getattr(mediator, "alive", False))


def throw_into(mediator: Any, error: BaseException) -> Optional[BaseException]:
    """Raise `error` inside the worker's block where it is parked, and return what the block raised while it
    unwound (None: it swallowed the error and finished)."""
    try:
        mediator.worker.throw(error)
    except BaseException as thrown:  # the block's own unwinding: this is the request's error
        return thrown
    return None


def batch_rows(il: Interleaver) -> Optional[int]:
    """The batcher's total row count (nnsight's own vLLM runner keeps a step's token count there), or None."""
    return getattr(il.batcher, "total", None)


def op_names(envoy: Any) -> List[str]:
    """The operations of a module's forward, by name; building them installs the source-instrumented forward."""
    return list(envoy.source.names)
