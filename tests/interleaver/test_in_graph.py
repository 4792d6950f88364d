"""Edits captured into the graph (no eager break) against replay mode, on the fake recording: the same rows
edited the same way, padding untouched, and a later unsteered step left exactly as the plain model."""

import nnsight
import pytest
import torch

from fake import H, PAD, FakeRecording, Graphed
from interleaver import EditBank, RequestEdits, Span, TapProgram, VLLMInterleaver, vllm_internals
from interleaver.bank import layout
from steer.edit import compile_edit
from steer.schema import EditKind, Tokens

TAP = "model.layers.1.output"


@pytest.fixture(autouse=True)
def fake_recording(monkeypatch):
    monkeypatch.setattr(vllm_internals, "_recording_class", FakeRecording)


def engine(in_graph: bool, edits):
    il = VLLMInterleaver(taps=[TAP])
    module = Graphed(il)
    nnsight.NNsight(module, interleaver=il)
    bank = EditBank()
    reqs = [RequestEdits(bank.register(TAP, e)) if e else None for e in edits]
    il.step.order = layout(bank.stages)
    columns = {int(s): c for c, s in enumerate(il.step.order)}
    il.programs[TAP] = TapProgram(TAP, bank.at(TAP), residual=False, columns=columns)
    if in_graph:
        il.in_graph = True
        il.step.static = torch.zeros(PAD, len(bank.stages))
    rec = module.record()
    return module, il, bank, reqs, rec


def run(module, il, bank, steps):
    outs = []
    for spans, x in steps:
        il.step.set(spans, x.shape[0], len(bank.stages), "cpu")
        outs.append(module(x).clone())
        il.step.clear()
    return outs


def test_in_graph_equals_replay_and_leaves_padding_and_later_steps_alone():
    g = torch.Generator().manual_seed(0)
    v, d = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
    edits = [[compile_edit(EditKind.add, 2.0, v)], [compile_edit(EditKind.ablate, 1.0, d)],
             [compile_edit(EditKind.clamp, 1.0, d, lo=-0.1, hi=0.1)], None,
             [compile_edit(EditKind.add, 3.0, v, tokens=Tokens.generated), compile_edit(EditKind.set, 1.0, d)]]
    x5, x3, x2 = (torch.randn(n, H, generator=g) for n in (5, 3, 2))
    outs = {}
    for mode in (False, True):
        module, il, bank, reqs, rec = engine(mode, edits)
        assert rec.num_eager_breaks == (0 if mode else 1)
        steps = [([Span(i, 1, 6, 3, r) for i, r in enumerate(reqs)], x5),  # five decode rows
                 ([Span(0, 2, 0, 4, reqs[4]), Span(2, 1, 9, 3, reqs[0])], x3),  # a prefill chunk, a decode row
                 ([Span(0, 1, 7, 3, None), Span(1, 1, 7, 3, None)], x2)]  # nobody steered
        outs[mode] = run(module, il, bank, steps)
        if mode:
            assert module.static_out[2:].eq(1000 * 30).all()  # padding rows: no edit reached them
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    module, il, bank, _, _ = engine(False, [None])
    plain = run(module, il, bank, [([Span(0, 1, 7, 3, None), Span(1, 1, 7, 3, None)], x2)])[0]
    assert torch.equal(outs[True][2], plain)  # stale weights were cleared: bit for bit the plain model
    assert not torch.allclose(outs[True][0][0], x5[0] * 30)  # and the steered step did edit
