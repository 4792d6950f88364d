"""Tap programs replayed as graphs of their own at the breaks (tap_graphs.py), on the fake recording, with a
capture that records the program's closure and re-runs it: the same edits as the eager replay, one graph per tap
and step size, and the eager path wherever a step needs the host at the tap."""

from types import SimpleNamespace

import nnsight
import numpy as np
import pytest
import torch

from fake import H, PAD, FakeRecording, Graphed
from interleaver import EditBank, RequestEdits, Span, TapProgram, VLLMInterleaver, vllm_internals
from interleaver.bank import layout
from interleaver.tap_graphs import TapGraphs
from steer.edit import compile_edit
from steer.schema import EditKind, Tokens

TAPS = ["model.layers.0.output", "model.layers.1.output"]


@pytest.fixture(autouse=True)
def fake_recording(monkeypatch):
    monkeypatch.setattr(vllm_internals, "_recording_class", FakeRecording)


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
    il = VLLMInterleaver(taps=TAPS)
    module = Graphed(il)
    nnsight.NNsight(module, interleaver=il)
    bank = EditBank()
    reqs = [RequestEdits(bank.register(loc, e)) if e else None for e in edits for loc in [TAPS[len(e or []) % 2]]]
    il.step.order = layout(bank.stages)
    columns = {int(s): c for c, s in enumerate(il.step.order)}
    il.programs = {t: TapProgram(t, bank.at(t), residual=False, columns=columns) for t in TAPS}
    if capture is not None:
        il.tap_graphs = TapGraphs(capture)
        il.step.use_static(PAD, len(bank.stages), "cpu")
    module.record()
    return module, il, bank, reqs


def run(module, il, bank, steps):
    outs = []
    for spans, x in steps:
        il.step.set(spans, x.shape[0], len(bank.stages), "cpu")
        outs.append(module(x).clone())
        il.step.clear()
    return outs


def edits_and_steps():
    g = torch.Generator().manual_seed(0)
    v, d = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
    # one edit: layer 1; two edits: layer 0 (engine() spreads requests over both taps)
    edits = [[compile_edit(EditKind.add, 2.0, v)], [compile_edit(EditKind.ablate, 1.0, d)],
             [compile_edit(EditKind.clamp, 1.0, d, lo=-0.1, hi=0.1)], None,
             [compile_edit(EditKind.add, 3.0, v, tokens=Tokens.generated), compile_edit(EditKind.set, 1.0, d)]]
    x5, x3, x2 = (torch.randn(n, H, generator=g) for n in (5, 3, 2))
    return edits, lambda reqs: [
        ([Span(i, 1, 6, 3, r) for i, r in enumerate(reqs)], x5),  # five decode rows
        ([Span(0, 2, 0, 4, reqs[4]), Span(2, 1, 9, 3, reqs[0])], x3),  # a prefill chunk and a decode row
        ([Span(i, 1, 7, 3, r) for i, r in enumerate(reqs)], x5),  # five decode rows again: replayed graphs
        ([Span(0, 1, 7, 3, None), Span(1, 1, 7, 3, None)], x2),  # nobody steered
    ]


def test_tap_graphs_edit_like_the_eager_replay():
    edits, steps = edits_and_steps()
    outs = {}
    for graphs in (False, True):
        capture = Capture() if graphs else None
        module, il, bank, reqs = engine(edits, capture)
        outs[graphs] = run(module, il, bank, steps(reqs))
        if graphs:
            # two taps, one step size (the fake pads every step to PAD rows): captured once, replayed after
            assert (capture.captures, capture.replays, len(il.tap_graphs)) == (2, 4, 2)
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    module, il, bank, _ = engine([None])
    plain = run(module, il, bank, [(spans[:2], x) for spans, x in steps([None] * 5)])
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
    want = run(eager_module, eager_il, eager_bank, steps(eager_reqs))
    capture = Capture(fail=True)
    module, il, bank, reqs = engine(edits, capture)
    got = run(module, il, bank, steps(reqs))
    assert capture.captures == 2 and capture.replays == 0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_serve_declines_what_needs_the_eager_path():
    program = SimpleNamespace(groups=[object()])
    live = torch.zeros(PAD, H)
    step = SimpleNamespace(num_tokens=3, static=torch.zeros(PAD, 1), capturing={}, weights=torch.ones(3, 1))
    graphs = TapGraphs(Capture())
    assert not graphs.serve(TAPS[0], None, live, step)  # no program at this tap
    assert not graphs.serve(TAPS[0], SimpleNamespace(groups=[]), live, step)  # a program with no edits
    assert not graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "num_tokens": None}))
    assert not graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "capturing": {TAPS[0]: [1]}}))
    assert graphs.serve(TAPS[0], program, live, SimpleNamespace(**{**vars(step), "weights": None}))  # nothing to do
    assert len(graphs) == 0


def test_worker_rebuilds_its_weight_buffer_and_forgets_graphs_when_stages_change():
    from test_vllm_internals import Runner, Worker

    w = Worker()
    w.vllm_config = SimpleNamespace(additional_config={vllm_internals.TAPS_KEY: [["layers.0", True]],
                                                       vllm_internals.TAP_GRAPHS_KEY: True})
    w.model_runner = Runner()
    w.load_model()
    il = w.steer_il
    assert isinstance(il.tap_graphs, TapGraphs) and tuple(il.step.static.shape) == (8, 1)
    il.tap_graphs._graphs[("x", 0, (8, 4))] = lambda: None
    bank = EditBank()
    bank.register(vllm_internals.tap_location("layers.0"), [compile_edit(EditKind.add, 1.0, torch.ones(1, 4))] * 3)
    w.steer_set_stages([(s.id, s.location, s.index, s.edit) for s in bank.stages])
    assert len(il.tap_graphs) == 0 and tuple(il.step.static.shape) == (8, 3)
    assert np.all(il.step.static.numpy() == 0)
