"""VLLMInterleaver: an nnsight Interleaver whose handoff is recorded into breakable CUDA graphs at taps.

What belongs here: the tap contract (taps, instrument, handle, replay, and what a request parked off the taps is
told). A replayed graph runs no Python, so a tap is a callable recorded into the graph at a break; the value there
lives at an address the graph rewrites every step, and only its first `rows()` rows are real. What does not belong
here: vLLM's internals (vllm_internals.py), nnsight's (nnsight_internals.py), row bookkeeping (bank.py), the edit
math (program.py). Compiled edit programs are served at the same taps as nnsight traces, with one vectorised op per
group per step and no per-request Python; an in-graph engine (`in_graph`) captures them into the graph instead of
breaking it, and serves no traces at its taps.
"""

import time
import warnings
from typing import Any, Dict, Iterable, Optional

import torch

from interleaver import nnsight_internals, vllm_internals
from interleaver.rows import StepRows
from interleaver.nnsight_internals import Interleaver, OutOfOrderError
from interleaver.program import TapProgram

_MODULE_SUFFIXES = ("input", "output", "skip")


class VLLMInterleaver(Interleaver):
    """An Interleaver that records its handoff into CUDA graphs at `taps`.

    Attributes:
        taps: full locations ("model.model.layers.3.output") a replayed step serves; empty on an eager engine,
            where this class behaves exactly as its base.
        programs: compiled edit programs by tap location, run at every visit of their tap.
        step: the current step's rows (how many are real, who owns them, each stage's weights).
    """

    def __init__(self, taps: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.taps = frozenset(taps)
        self.programs: Dict[str, TapProgram] = {}
        self.step = StepRows()
        self.clock = None  # an interleaver.clock.Clock when profiling
        self.fresh_step = False  # profiling: the worker has filled a step and no tap has broken in it yet
        # Edits captured into the graphs (no eager break at the taps): programs read `step.static`.
        self.in_graph = False
        # A tap_graphs.TapGraphs: at a break, a tap's program is replayed as a graph of its own where it can be.
        self.tap_graphs = None
        # In-graph taps whose edits ride the next layer's residual add and RMSNorm: location -> that norm's name
        # (vllm_internals.fold_norms). While a graph is captured, such a tap leaves its edit pending for the norm.
        self.folds: Dict[str, str] = {}
        self._pending: Dict[str, tuple] = {}  # norm name -> (program, the tap's value)

    def instrument(self, envoy: Any) -> None:
        """Route the module through this interleaver and, for taps on an operation inside its forward
        (`{path}.source.{op}.output`), install the source-instrumented forward now, while the tree is built:
        graph recording runs before any trace could ask for it. An op that does not exist is a load error."""
        super().instrument(envoy)
        prefix = f"{envoy.path}.source."
        wanted = sorted({t[len(prefix):].rsplit(".", 1)[0] for t in self.taps if t.startswith(prefix)})
        if not wanted:
            return
        names = nnsight_internals.op_names(envoy)
        for op in wanted:
            if op not in names:
                raise ValueError(f"tap {prefix}{op}: {envoy.path}'s forward has no operation {op!r}; "
                                 f"its operations are {names}")

    def rows(self) -> Optional[int]:
        """How many leading rows of a tap's value are real this step (the rest is graph padding): the step's
        token count where a runner set it, else the batcher's total (nnsight's own runner keeps it there)."""
        if self.step.num_tokens is not None:
            return self.step.num_tokens
        return nnsight_internals.batch_rows(self)

    def handle(self, provider: str, value: Any) -> Any:
        if provider in self.taps and self.in_graph:
            self._in_graph(provider, value)
            return value
        if provider in self.taps:
            rec = vllm_internals.recording()
            if rec is not None:
                live = _apply(value, vllm_internals.weak)
                rec.add_eager(lambda: self._timed_replay(provider, live))
                return value
            # An eager step (enforce_eager, or a prompt longer than any graph) is served exactly as a replay.
            self.replay(provider, value)
            return value
        if self.taps and provider.rsplit(".", 1)[-1] in _MODULE_SUFFIXES:
            # Not a tap: a replayed step never reaches it, so an eager step must not serve it either, or what a
            # request sees would depend on whether its step happened to fit a graph.
            return value
        return super().handle(provider, value)

    def _in_graph(self, location: str, value: Any) -> None:
        """Run the tap's program as part of a breakable graph: while recording, its ops are captured on the
        recording's tensors; on an eager step it runs on the real rows."""
        if location not in self.programs:
            return
        rec = vllm_internals.recording()
        if rec is not None:
            vllm_internals.record_into(rec, lambda: self.serve_in_graph(location, value, True))
            return
        self.serve_in_graph(location, value, False)

    def serve_in_graph(self, location: str, value: Any, capturing: bool) -> None:
        """The tap's program in its in-graph form: while a graph is captured, on every (padded) row, the weights
        read from the fixed buffer at replay; outside a capture, on the step's real rows; outside a step (a
        warm-up or dummy run), not at all. (interleaver/compiled.py's op calls this too.)"""
        program = self.programs.get(location)
        if program is None:
            return
        if capturing:
            if (location in self.folds and program.fused and program.residual and type(value) is tuple
                    and len(value) == 2 and all(type(t) is torch.Tensor for t in value)):
                self._pending[self.folds[location]] = (program, value)
                return
            program.in_graph(value, self.step.static)
            return
        n = self.rows()
        if n is None:
            return
        program.in_graph(_trim(value, n), self.step.static)

    def fold_into_norm(self, norm: str, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float) -> bool:
        """The residual add and RMSNorm named `norm`, run with the pending edit of the tap before it, in one launch
        and in place (`x` becomes the normed sum, `residual` the sum): True when done so; False when nothing is
        pending for it (the norm runs as it is). A pending edit the norm cannot take (not handed the tap's own two
        tensors, or outside the capture) is an error: by then the stream may have been read without it."""
        pending = self._pending.pop(norm, None)
        if pending is None:
            return False
        program, value = pending
        if vllm_internals.recording() is None or value[0] is not x or value[1] is not residual:
            self._pending.clear()
            raise RuntimeError(f"{norm}: the tap before it left its edit for this norm (vllm.fold_norm), but the "
                               "norm was not handed that tap's (hidden, residual) inside the same graph capture: "
                               "this model's layers do not feed the stream to the next norm as Llama's do; start "
                               "the engine with vllm.fold_norm=false")
        if not program.in_graph_norm(value, self.step.static, weight, eps):
            program.in_graph(value, self.step.static)  # the fused kernel does not apply: the edit, then the norm
            return False
        return True

    def flush_folds(self) -> None:
        """Run, each on its own, the edits still pending for a norm that did not run (a forward that ended first,
        as a pipeline stage's does before the final norm)."""
        pending, self._pending = self._pending, {}
        for program, value in pending.values():
            program.in_graph(value, self.step.static)

    def warm_folds(self) -> None:
        """Compile the folded kernel of every folded tap now, outside any capture; a tap whose kernel does not
        build keeps its own launch (and says so)."""
        for location in list(self.folds):
            try:
                self.programs[location].warm_norm()
            except Exception as e:
                warnings.warn(f"{location}: the folded edit + add + RMSNorm kernel did not build "
                              f"({type(e).__name__}: {e}); this tap launches its own kernel", RuntimeWarning,
                              stacklevel=2)
                del self.folds[location]

    def _timed_replay(self, location: str, live: Any) -> None:
        if self.clock is None:
            return self._break(location, live)
        t0 = time.perf_counter()
        self._break(location, live)
        dt = time.perf_counter() - t0
        self.clock.add("replay", dt)
        if self.fresh_step:  # a step's first break, apart: it may pay for what the step's others find warm
            self.fresh_step = False
            self.clock.add("replay:first", dt)
        else:
            self.clock.add("replay:rest", dt)

    def _break(self, location: str, live: Any) -> None:
        """Serve a tap at a replayed graph's eager break (`live`: its whole padded value). Every step and tap
        pays this host path (docs/perf-log.md): where no trace is served, a tap graph or one bound kernel launch on
        the untrimmed value does it, before the general path (views, groups asked for, traces)."""
        if not nnsight_internals.serving(self):
            program = self.programs.get(location)
            if self.tap_graphs is not None and self.tap_graphs.serve(location, program, live, self.step):
                return
            n = self.rows()
            if program is not None and n is not None and program.at_break(live, n, self.step):
                return
        self.replay(location, live)

    def replay(self, location: str, live: Any) -> None:
        """Serve `location` from a replayed graph: trim to the step's rows (a view), run the compiled program,
        hand off to parked traces, and land any replacement in place."""
        n = self.rows()
        if n is None:  # a warm-up or dummy run outside any step: nothing to serve
            return
        live = _trim(live, n)
        program = self.programs.get(location)
        if program is not None:
            program(live, self.step)
        if nnsight_internals.serving(self):
            served = nnsight_internals.parked_here(self, location)
            edited = super().handle(location, live)
            try:
                _copy_into(location, live, edited)
            except ValueError as e:
                # The engine's other requests go on: the error ends the request(s) whose block replaced it.
                if not (served and nnsight_internals.defer(self, served, e)):
                    raise

    def off_tap_error(self, mediator: Any) -> Optional[OutOfOrderError]:
        """The error for a request still parked on a module location no replayed step reaches, or None."""
        provider = nnsight_internals.parked_at(mediator)
        if not self.taps or provider is None or provider in self.taps:
            return None
        if provider.rsplit(".", 1)[-1] not in _MODULE_SUFFIXES:
            return None
        return OutOfOrderError(f"'{provider}' is not a tap on this engine, so no replayed CUDA graph step reaches "
                               f"it; the taps are {sorted(self.taps)}. Declare it as a tap, or use an eager engine.")

    def finish_dangling(self, mediator: Any) -> Optional[BaseException]:
        """Tell a request that ended while parked off the taps why, and return what its block raised."""
        error = self.off_tap_error(mediator) if nnsight_internals.alive(mediator) else None
        if error is None:
            return None
        thrown = nnsight_internals.throw_into(mediator, error)  # the block's own unwinding: the request's error
        return error if thrown is None else thrown

    def check_dangling_mediators(self) -> None:
        for mediator in self.mediators:
            error = self.off_tap_error(mediator) if nnsight_internals.alive(mediator) else None
            if error is not None:
                raise self.finish_dangling(mediator) or error
        super().check_dangling_mediators()


def _trim(value: Any, n: int) -> Any:
    """Views of the first `n` rows (the step's real ones; a graph's value is padded past them): new views even
    where nothing is cut, so that trace code never holds a graph's own tensors (kernels.Fused knows those by
    identity)."""
    def cut(t):
        return t[:n] if t.dim() else t

    if type(value) is tuple and all(type(t) is torch.Tensor for t in value):  # a layer's (hidden, residual)
        return tuple(cut(t) for t in value)
    return _apply(value, cut)


def _apply(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_apply(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _apply(v, fn) for k, v in value.items()}
    return value


def _copy_into(location: str, live: Any, edited: Any) -> None:
    """Land `edited` in `live`'s memory (the graph reads from there), tensor by tensor, shape-checked."""
    if edited is live:
        return
    if isinstance(live, torch.Tensor):
        if not isinstance(edited, torch.Tensor) or edited.shape != live.shape:
            got = list(edited.shape) if isinstance(edited, torch.Tensor) else type(edited).__name__
            raise ValueError(f"replacement at {location} must keep the live value's shape {list(live.shape)} "
                             f"(a replayed graph reads that memory), got {got}")
        if edited.data_ptr() != live.data_ptr():
            live.copy_(edited)
    elif isinstance(live, (tuple, list)):
        if not isinstance(edited, (tuple, list)) or len(edited) != len(live):
            raise ValueError(f"replacement at {location} must be a {type(live).__name__} of {len(live)} values")
        for a, b in zip(live, edited):
            _copy_into(location, a, b)
    elif isinstance(live, dict):
        for k, v in live.items():
            _copy_into(location, v, edited[k])
