"""Each tap's compiled edits replayed at its eager break as a small CUDA graph of their own.

A replayed step breaks at every tap and runs the tap's program there: Python, then a handful of kernel launches,
host time a step pays at every tap, which is most of what steering at many layers costs (docs/perf-log.md). The
program's in-graph form (`TapProgram.in_graph`: every group on every padded row, weights read from
`StepRows.static`, no host decision) can be captured once per tap and step size, on the breakable graph's own tap
tensors (their addresses are fixed per step size), and then costs one graph launch. A step that needs the host at
a tap (a request keeps the tap's value, a trace is served there) takes the eager path, which computes the same
edit.
"""

import warnings
from typing import Any, Callable, Dict, Optional

import torch

from interleaver.rows import StepRows
from interleaver.program import TapProgram

Replay = Callable[[], None]


class TapGraphs:
    """The captured tap programs of one worker, by (tap, tap tensor address, shape)."""

    def __init__(self, capture: Optional[Callable[[Callable[[], None]], Optional[Replay]]] = None) -> None:
        """`capture(fn)` runs `fn` once (this step's edit) and returns a replay of it, or None where it could not
        capture: a CUDA graph by default (CPU tests stand a plain re-run in)."""
        self._capture = capture or _CudaCapture()
        self._graphs: Dict[tuple, Optional[Replay]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Forget every graph: the programs or the weight buffer they read were replaced."""
        if self._graphs and torch.cuda.is_available():
            torch.cuda.synchronize()  # no replay of a graph still in flight when it is destroyed
        self._graphs.clear()
        if isinstance(self._capture, _CudaCapture):
            self._capture.reset()

    def serve(self, location: str, program: Optional[TapProgram], live: Any, step: StepRows) -> bool:
        """Edit `live` (the tap's whole padded value in the replayed graph) as a graph. False when this step
        needs the eager path at this tap; True when served, or when nobody is steered this step."""
        if (program is None or not program.groups or step.num_tokens is None or step.static is None
                or step.capturing.get(location) or program.conditional):
            return False
        if step.weights is None:
            return True
        hidden = live[0] if isinstance(live, (tuple, list)) else live
        key = (location, hidden.data_ptr(), tuple(hidden.shape))
        if key not in self._graphs:
            # Runs this step's edit once either way; None: the capture failed, this tap stays eager at this size.
            self._graphs[key] = self._capture(lambda: program.in_graph(live, step.static))
            return True
        replay = self._graphs[key]
        if replay is None:
            return False
        replay()
        return True


class _CudaCapture:
    """Captures on a side stream into one memory pool shared by every tap graph: they run one at a time on
    the same stream and none keeps a result in the pool (edits land in the model's own tensors)."""

    def __init__(self) -> None:
        self._stream: Optional[torch.cuda.Stream] = None
        self._pool = None

    def reset(self) -> None:
        self._pool = None

    def __call__(self, fn: Callable[[], None]) -> Optional[Replay]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        main, side = torch.cuda.current_stream(), self._stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            # A capture runs nothing: this step's edit is this eager run, which also readies cuBLAS on the stream.
            fn()
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: vLLM's other threads may use CUDA meanwhile; only this thread's calls must be safe.
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
            except RuntimeError as e:
                warnings.warn(f"interleaver: a tap program could not be captured as a CUDA graph, it stays eager: {e}",
                              stacklevel=2)
                graph = None
        main.wait_stream(side)
        return graph.replay if graph is not None else None
