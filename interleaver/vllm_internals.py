"""The one door to vLLM's internals (vLLM 0.26): breakable graph recording, weak references, vLLM's Worker class,
its norms (folding), its graph counters and its engine core (shutdown). The tap worker that drives them
lives in tap_worker.py.

Everything else in the tap layer and the application that drives it uses vLLM's public API or this file, so a vLLM
upgrade touches this file alone, and CPU tests can stand a fake recording in its place. vLLM itself is imported
lazily: the module imports without it.
"""

from typing import Any, Dict, Optional

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


def record_into(rec: Any, fn) -> None:
    """Run `fn` so that its tensor ops are recorded into the recording in progress. A CUDA graph capture records
    whatever kernels run; a stand-in recording (the CPU tests') records `fn` itself through its `op`."""
    op = getattr(rec, "op", None)
    if op is not None:
        op(fn)
    else:
        fn()


def weak(t: torch.Tensor) -> torch.Tensor:
    """A reference to a graph tensor that does not pin its pool slot (a strong one makes replay serve stale
    memory). CPU tensors (fake recordings) are returned as they are."""
    if not t.is_cuda:
        return t
    from vllm.utils.torch_utils import weak_ref_tensor

    return weak_ref_tensor(t)


def tap_location(path: str) -> str:
    """The interleaver location of a module's output (nnsight's naming: the root envoy is `model`)."""
    return f"model.{path}.output"


def tap_path(location: str) -> str:
    """`tap_location`'s module path back."""
    if not (location.startswith("model.") and location.endswith(".output")):
        raise ValueError(f"{location!r} is not a tap location (model.<path>.output)")
    return location[len("model."):-len(".output")]


def _worker_base():
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def eager_breaks(worker) -> dict:
    """For `collective_rpc` on any vLLM worker: graphs captured and eager breaks recorded in them."""
    entries = getattr(worker.model_runner.model, "entries", {})
    caps = [e.capture for e in entries.values() if e.capture is not None]
    return {"graphs": len(caps), "eager_breaks": sum(c.num_eager_breaks for c in caps)}


def graphs_captured(worker) -> int:
    """For `collective_rpc` on a compiled engine's worker: CUDA graphs vLLM's compile pipeline captured."""
    from vllm.compilation.counter import compilation_counter

    return int(compilation_counter.num_cudagraph_captured)


def shutdown(llm: Any) -> None:
    """Stop a vllm.LLM's engine core now: its process (or, in process, its executor) and the workers that hold the
    weights, the KV cache and the graphs. vLLM 0.26's LLM has no shutdown of its own; this is the engine core
    client's, which otherwise runs only once the LLM is garbage collected."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


def fold_norms(il, modules: Dict[str, Any], taps) -> Dict[str, str]:
    """Route each residual tap on a decoder layer (`<stack>.<i>`) to the norm that reads its value next, the
    `input_layernorm` of layer i + 1 (after the last layer, the stack owner's `norm`), where that norm is vLLM's
    plain RMSNorm with a weight of the activations' dtype: its forward then runs the tap's pending edit and itself
    as one kernel (VLLMInterleaver.fold_into_norm). Other taps keep their own launch; none folds where vLLM's
    batch-invariant norm is on or the model reads the stream between layers (EAGLE-3). Returns tap location ->
    norm name."""
    from vllm import envs
    from vllm.model_executor.layers.layernorm import RMSNorm

    folds, owners = {}, set()
    if getattr(envs, "VLLM_BATCH_INVARIANT", False):
        return folds
    for path, residual in taps:
        stack, _, index = path.rpartition(".")
        if not residual or not index.isdigit():
            continue
        after = f"{stack}.{int(index) + 1}"
        owner = stack.rpartition(".")[0]
        if getattr(modules.get(owner), "aux_hidden_state_layers", ()):
            continue
        name = f"{after}.input_layernorm" if after in modules else (f"{owner}.norm" if owner else "norm")
        norm = modules.get(name)
        if (type(norm) is not RMSNorm or not norm.has_weight or norm.variance_size_override is not None
                or name in folds.values()):
            continue
        folds[tap_location(path)] = name
        owners.add(owner)
        _fold_into(norm, il, name)
    for owner in owners:
        _flush_after(modules[owner], il)
    return folds


def _fold_into(norm: Any, il, name: str) -> None:
    forward = norm.forward

    def folded(x, residual=None):
        if il.fold_into_norm(name, x, residual, norm.weight, norm.variance_epsilon):
            return x, residual
        return forward(x, residual)

    norm.forward = folded


def _flush_after(owner: Any, il) -> None:
    """End the owner's forward by running the edits no norm took (a pipeline stage returns the stream unnormed).
    On the instance's forward, not a hook: vLLM's compile decorator calls `forward` without nn.Module's hooks."""
    forward = owner.forward

    def flushed(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        finally:
            il.flush_folds()

    owner.forward = flushed
