"""The one door to vLLM's breakable CUDA graphs (vllm.compilation.breakable_cudagraph, vLLM 0.26).

Everything else in the tap layer asks here for the active recording and for weak references, so a vLLM upgrade
that moves these touches this file alone, and CPU tests can stand a fake recording in its place.
"""

from typing import Any, Optional

import torch

# Tests replace this with a fake recording class exposing `current()`, `_capturing` and `add_eager(fn)`.
_recording_class: Any = None


def _capture_class() -> Any:
    if _recording_class is not None:
        return _recording_class
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    except ImportError:  # no vLLM: nothing is ever being recorded
        return None
    return BreakableCUDAGraphCapture


def recording() -> Optional[Any]:
    """The breakable graph recording in progress on this thread, or None (also when a segment is closed)."""
    cls = _capture_class()
    rec = cls.current() if cls is not None else None
    return rec if rec is not None and rec._capturing else None


def weak(t: torch.Tensor) -> torch.Tensor:
    """A reference to a graph tensor that does not pin its pool slot (a strong one makes replay serve stale
    memory). CPU tensors (fake recordings) are returned as they are."""
    if not t.is_cuda:
        return t
    from vllm.utils.torch_utils import weak_ref_tensor

    return weak_ref_tensor(t)
