"""The interleaver contract against a fake recording (fake.py): trimming, in-place landing, replacement
copy-back and its shape error, the clone-on-keep rule, requests parked off the taps, eager steps."""

import nnsight
import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

from fake import H, PAD, Graphed
from interleaver import EditBank, RequestEdits, Span, TapProgram, VLLMInterleaver
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, Tokens

TAP = "model.layers.1.output"


pytestmark = pytest.mark.usefixtures("fake_recording")


def graphed(taps=(TAP,)):
    il = VLLMInterleaver(taps=taps)
    module = Graphed(il)
    model = nnsight.NNsight(module, interleaver=il)
    rec = module.record()
    return model, module, il, rec


def x_of(n, seed=0):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_taps_record_one_break_each_and_no_taps_none():
    _, _, _, rec = graphed()
    assert rec.num_eager_breaks == 1
    _, _, _, rec = graphed(taps=())
    assert rec.num_eager_breaks == 0


def test_replay_without_traces_is_the_plain_model():
    model, module, _, _ = graphed()
    x = x_of(3)
    torch.testing.assert_close(module(x), x * 30)


def test_in_place_edit_lands_in_graph_memory():
    model, module, il, _ = graphed()
    x = x_of(3)
    with model.trace(x):
        model.layers[1].output[:] += 1
    torch.testing.assert_close(module.static_out[:3], (x * 6 + 1) * 5)
    assert module.static_out[3:].eq(1000 * 30).all()  # padding rows untouched: the handoff saw a trimmed view


def test_trace_sees_only_the_real_rows():
    model, _, _, _ = graphed()
    with model.trace(x_of(3)):
        rows = nnsight.save(model.layers[1].output.shape[0])
    assert rows == 3


def test_replacement_is_copied_back():
    model, module, _, _ = graphed()
    x = x_of(3)
    with model.trace(x):
        model.layers[1].output = model.layers[1].output * 0 + 2
    torch.testing.assert_close(module.static_out[:3], torch.full((3, H), 10.0))


def test_replacement_of_wrong_shape_is_a_clear_error():
    model, module, _, _ = graphed()
    with pytest.raises(ValueError, match=r"replacement at model.layers.1.output must keep .* shape \[3, 4\].*\[5, 4\]"):
        with model.trace(x_of(3)):
            model.layers[1].output = torch.zeros(5, H)


def test_wrong_shape_errs_the_request_not_the_engine():
    model, module, il, _ = graphed()
    il.defer_exceptions = True  # as the engine runs: one request's error must not end the others
    seen = []
    replay = il.replay

    def spy(location, live):
        served = list(il.mediators)
        replay(location, live)
        seen.extend(m.exception for m in served)

    il.replay = spy
    x = x_of(3)
    with model.trace(x):
        model.layers[1].output = torch.zeros(5, H)
    [error] = seen
    assert isinstance(error, ValueError) and "must keep the live value's shape [3, 4]" in str(error)
    torch.testing.assert_close(module.static_out[:3], x * 30)  # the graph's memory kept its own values


def test_kept_references_alias_graph_memory_clone_what_you_keep():
    model, module, _, _ = graphed()
    x1, x2 = x_of(3, 1), x_of(3, 2)
    with model.trace(x1):
        aliased = model.layers[1].output.save()
        kept = model.layers[1].output.clone().save()
    module(x2)  # the next step rewrites the buffer
    torch.testing.assert_close(kept, x1 * 6)
    torch.testing.assert_close(aliased, x2 * 6)


def test_request_parked_off_the_taps_is_told_which_taps_exist():
    model, _, _, _ = graphed()
    with pytest.raises(OutOfOrderError, match=r"'model.layers.2.output' is not a tap.*\['model.layers.1.output'\]"):
        with model.trace(x_of(3)):
            model.layers[2].output.save()


def test_eager_step_serves_taps_like_a_replay_and_skips_other_locations():
    model, module, _, _ = graphed()
    long = x_of(PAD + 4)  # longer than the recorded graph: runs eagerly
    with model.trace(long):
        model.layers[1].output[:] += 1
        out = model.layers[1].output.clone().save()
    torch.testing.assert_close(out, long * 6 + 1)
    with pytest.raises(OutOfOrderError, match="is not a tap"):
        with model.trace(long):
            model.layers[0].output.save()  # served on an eager step, never on a replayed one: not at all


def test_source_tap_on_a_missing_op_is_a_load_error():
    il = VLLMInterleaver(taps=["model.layers.1.source.nope.output"])
    with pytest.raises(ValueError, match=r"model.layers.1's forward has no operation 'nope'; its operations are"):
        nnsight.NNsight(Graphed(il), interleaver=il)


def program_setup(edits_by_request, spans_of, taps=(TAP,)):
    """Compiled edits at layer 1 for several requests in one step (no trace, no per-request handoff)."""
    model, module, il, _ = graphed(taps)
    bank = EditBank()
    per_request = [RequestEdits(bank.register(TAP, e)) if e else None for e in edits_by_request]
    il.programs[TAP] = TapProgram(TAP, bank.at(TAP), residual=False)
    spans = [Span(start, count, pos, plen, per_request[i]) for i, (start, count, pos, plen) in enumerate(spans_of)]
    return module, il, bank, spans


def test_per_request_rows_mixed_prefill_and_decode():
    v = torch.randn(1, H)
    d = torch.randn(1, H)
    add2 = compile_edit(EditKind.add, 2.0, v)
    add5 = compile_edit(EditKind.add, 5.0, v)
    ablate_gen = compile_edit(EditKind.ablate, 1.0, d, tokens=Tokens.generated)
    # request 0: a 3-row prefill chunk; 1: one decode row; 2: unsteered decode row; 3: prefill 1 row + decode
    spans_of = [(0, 3, 0, 10), (3, 1, 12, 4), (4, 1, 7, 3), (5, 2, 4, 5)]
    module, il, bank, spans = program_setup([[add2], [add5], None, [ablate_gen]], spans_of)
    assert len(bank.stages) == 2  # the two adds differ only in scale: one stage, one op
    il.step.set(spans, 7, len(bank.stages), "cpu")
    x = x_of(7)
    out = module(x).clone()
    h = x * 6  # the value at layer 1's output
    expected = h.clone()
    expected[0:3] += 2 * v[0]
    expected[3:4] += 5 * v[0]
    u = ablate_gen.basis[0]
    expected[6:7] -= (h[6:7] @ u)[:, None] * u  # row 5 is the last prompt row (position 4 < 5): untouched
    torch.testing.assert_close(out, expected * 5)
    assert torch.equal(out[4], x[4] * 6 * 5)  # the unsteered request, bit for bit


def test_residual_pair_edits_the_sum_and_lands_on_hidden():
    from fake import Residual

    h_in = x_of(5)
    pair = Residual()(h_in)
    d = torch.randn(1, H)
    for kind, kw in [(EditKind.ablate, {}), (EditKind.clamp, {"lo": -0.1, "hi": 0.1}), (EditKind.set, {"value": 2.0}),
                     (EditKind.add, {}), (EditKind.rescale, {})]:
        e = compile_edit(kind, 0.5 if kind == EditKind.rescale else 1.0, None if kind == EditKind.rescale else d, **kw)
        bank = EditBank()
        req = RequestEdits(bank.register(TAP, [e]))
        from interleaver import StepRows

        step = StepRows()
        step.set([Span(0, 3, 0, 10, req), Span(3, 2, 0, 10, None)], 5, len(bank.stages), "cpu")
        hidden, residual = pair[0].clone(), pair[1].clone()
        TapProgram(TAP, bank.stages, residual=True)((hidden, residual), step)
        expected = (pair[0] + pair[1])[:3].clone()
        e.apply_(expected)
        torch.testing.assert_close(hidden[:3] + residual[:3], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(residual, pair[1]) and torch.equal(hidden[3:], pair[0][3:])


def test_warmup_outside_a_step_edits_nothing():
    v = torch.randn(1, H)
    module, il, bank, spans = program_setup([[compile_edit(EditKind.add, 1.0, v)]], [(0, 3, 0, 3)])
    il.step.set(spans, 3, len(bank.stages), "cpu")
    il.step.clear()
    x = x_of(3)
    il.step.num_tokens = None
    module.static_in[:3] = x
    module.recording.replay()  # a dummy run: no step facts, so no edit
    torch.testing.assert_close(module.static_out[:3], x * 30)
