"""Edits captured into the graph (no eager break) against replay mode, on the fake recording: the same rows
edited the same way, padding untouched, and a later unsteered step left exactly as the plain model."""

import pytest
import torch

import mixed
from fake import PAD
from interleaver import Span

TAP = "model.layers.1.output"


pytestmark = pytest.mark.usefixtures("fake_recording")


def engine(in_graph: bool, edits):
    module, il, bank, reqs = mixed.engine([TAP], edits)
    if in_graph:
        il.in_graph = True
        il.step.use_static(PAD, len(bank.stages), "cpu")
    rec = module.record()
    return module, il, bank, reqs, rec


def test_in_graph_equals_replay_and_leaves_padding_and_later_steps_alone():
    edits, (x5, x3, x2) = mixed.edits_and_inputs()
    outs = {}
    for mode in (False, True):
        module, il, bank, reqs, rec = engine(mode, edits)
        assert rec.num_eager_breaks == (0 if mode else 1)
        outs[mode] = mixed.run(module, il, bank, mixed.steps(reqs, x5, x3, x2))
        if mode:
            assert module.static_out[2:].eq(1000 * 30).all()  # padding rows: no edit reached them
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    module, il, bank, _, _ = engine(False, [None])
    plain = mixed.run(module, il, bank, [([Span(0, 1, 7, 3, None), Span(1, 1, 7, 3, None)], x2)])[0]
    assert torch.equal(outs[True][2], plain)  # stale weights were cleared: bit for bit the plain model
    assert not torch.allclose(outs[True][0][0], x5[0] * 30)  # and the steered step did edit
