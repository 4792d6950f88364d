"""Tap programs replayed as graphs of their own at the breaks (tap_graphs.py), on the fake recording, with a
capture that records the program's closure and re-runs it: the same edits as the eager replay, one graph per tap
and step size, and the eager path wherever a step needs the host at the tap."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mixed
from fake import H, PAD
from interleaver import EditBank, RequestEdits, Span, vllm_internals
from interleaver.tap_graphs import TapGraphs
from interleaver.tap_worker import TAP_GRAPHS_KEY
from stand_in import tap_worker
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind

TAPS = ["model.layers.0.output", "model.layers.1.output"]


pytestmark = pytest.mark.usefixtures("fake_recording")


class Capture:
    """Runs the program once (the step's edit) and hands back a replay that runs it again: what a CUDA graph
    of it does. Counts captures and replays."""

    def __init__(self, fail: bool = False):
        self.captures = self.replays = 0
        self.fail = fail

    def __call__(self, fn):
        fn()
        self.captures += 1
        if self.fail:
            return None

        def replay():
            self.replays += 1
            fn()

        return replay


def engine(edits, capture=None):
    # one edit: layer 1; two edits: layer 0, so that both taps serve requests
    module, il, bank, reqs = mixed.engine(TAPS, edits, tap_of=lambda e: len(e or []) % 2)
    if capture is not None:
        il.tap_graphs = TapGraphs(capture)
        il.step.use_static(PAD, len(bank.stages), "cpu")
    module.record()
    return module, il, bank, reqs


def edits_and_steps():
    edits, (x5, x3, x2) = mixed.edits_and_inputs()

    def steps(reqs):
        decode, prefill, nobody = mixed.steps(reqs, x5, x3, x2)
        again = ([Span(i, 1, 7, 3, r) for i, r in enumerate(reqs)], x5)  # five decode rows again: replayed graphs
        return [decode, prefill, again, nobody]

    return edits, steps


def test_tap_graphs_edit_like_the_eager_replay():
    edits, steps = edits_and_steps()
    outs = {}
    for graphs in (False, True):
        capture = Capture() if graphs else None
        module, il, bank, reqs = engine(edits, capture)
        outs[graphs] = mixed.run(module, il, bank, steps(reqs))
        if graphs:
            # two taps, one step size (the fake pads every step to PAD rows): captured once, replayed after
            assert (capture.captures, capture.replays, len(il.tap_graphs)) == (2, 4, 2)
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    module, il, bank, _ = engine([None])
    plain = mixed.run(module, il, bank, [(spans[:2], x) for spans, x in steps([None] * 5)])
    assert torch.equal(outs[True][3], plain[3])  # stale weights were cleared: bit for bit the plain model
    assert not torch.allclose(outs[True][0], plain[0])  # and the steered steps did edit


def test_a_step_that_keeps_a_tap_value_runs_that_tap_eagerly():
    edits, steps = edits_and_steps()
    capture = Capture()
    module, il, bank, reqs = engine(edits, capture)
    keeper = RequestEdits(reqs[0].entries, capture=[TAPS[1]], key="k")
    spans, x5 = steps(reqs)[0]
    spans[1] = Span(1, 1, 6, 3, keeper)
    il.step.set(spans, 5, len(bank.stages), "cpu")
    module(x5)
    assert capture.captures == 1  # layer 0's program only: layer 1 kept a value, so ran eagerly
    assert len(il.programs[TAPS[1]].kept["k"]) == 1


def test_a_failed_capture_leaves_that_tap_eager_and_edits_once():
    edits, steps = edits_and_steps()
    eager_module, eager_il, eager_bank, eager_reqs = engine(edits)
    want = mixed.run(eager_module, eager_il, eager_bank, steps(eager_reqs))
    capture = Capture(fail=True)
    module, il, bank, reqs = engine(edits, capture)
    got = mixed.run(module, il, bank, steps(reqs))
    assert capture.captures == 2 and capture.replays == 0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_serve_declines_what_needs_the_eager_path():
    program = SimpleNamespace(groups=[object()], conditional=False)
    live = torch.zeros(PAD, H)
    step = SimpleNamespace(num_tokens=3, static=torch.zeros(PAD, 1), capturing={}, weights=torch.ones(3, 1))
    graphs = TapGraphs(Capture())
    assert not graphs.serve(TAPS[0], None, live, step)  # no program at this tap
    assert not graphs.serve(TAPS[0], SimpleNamespace(groups=[], conditional=False), live, step)  # no edits
    # a program that decides a condition or reads one: the eager path, every step (what it decides is data)
    assert not graphs.serve(TAPS[0], SimpleNamespace(groups=[object()], conditional=True), live, step)
    assert not graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "num_tokens": None}))
    assert not graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "capturing": {TAPS[0]: [1]}}))
    assert graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "weights": None}))  # nothing to do
    assert len(graphs) == 0


def test_worker_rebuilds_its_weight_buffer_and_forgets_graphs_when_stages_change():
    w = tap_worker({TAP_GRAPHS_KEY: True})
    il = w.steer_il
    assert isinstance(il.tap_graphs, TapGraphs) and tuple(il.step.static.shape) == (8, 1)
    il.tap_graphs._graphs[("x", 0, (8, 4))] = lambda: None
    bank = EditBank()
    add = compile_edit(EditKind.add, 1.0, torch.ones(1, 4))
    bank.register(vllm_internals.tap_location("layers.0"), [add] * 3)
    w.steer_set_stages(bank.stage_list())
    assert len(il.tap_graphs) == 0 and tuple(il.step.static.shape) == (8, 3)
    assert np.all(il.step.static.numpy() == 0)
