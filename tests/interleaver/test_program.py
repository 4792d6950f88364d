"""Tap programs against a direct computation: batched groups equal each request's edits applied one by one."""

import numpy as np
import torch

from interleaver.bank import EditBank, RequestEdits, layout
from interleaver.rows import Span, StepRows
from interleaver.program import TapProgram
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, Tokens

H = 16
TAP = "model.layers.1.output"


def _mixed_edits(k, g, hidden=H, centred=True):
    """k edits, the kinds in turn; `centred=False`: the scales have no centre (they scale about 0)."""
    kinds = [EditKind.add, EditKind.ablate, EditKind.clamp, EditKind.set, EditKind.rescale]
    out = []
    for i in range(k):
        kind = kinds[i % len(kinds)]
        v = torch.randn(2 if kind == EditKind.ablate and i % 2 else 1, hidden, generator=g)
        kw = {"lo": -0.2, "hi": 0.3} if kind == EditKind.clamp else {"value": 1.5} if kind == EditKind.set else {}
        if kind == EditKind.rescale and not centred:
            v = None
        out.append(compile_edit(kind, 0.5 + i / k, v, **kw))
    return out


def _run(program_edits, residual, order=True, device="cpu", dtype=torch.float32, fused=True, hidden=H):
    """One step of rows: request i owns 2 rows and asks for program_edits[i] (a list, in order) or nothing.
    `fused=False` keeps a GPU program on its torch form."""
    g = torch.Generator().manual_seed(0)
    bank = EditBank()
    reqs = [RequestEdits(bank.register(TAP, e)) if e else None for e in program_edits]
    n = 2 * len(reqs)
    spans = [Span(2 * i, 2, 0, 4, r) for i, r in enumerate(reqs)]
    step = StepRows()
    columns = None
    if order:
        step.order = layout(bank.stages)
        columns = {int(s): c for c, s in enumerate(step.order)}
    step.set(spans, n, len(bank.stages), device)
    h, res = (torch.randn(n, hidden, generator=g).to(device, dtype) for _ in range(2))
    before = (h.clone(), res.clone())
    program = TapProgram(TAP, bank.at(TAP), residual, columns, device=device)
    if not fused:
        program._fused = None
    program((h, res) if residual else h, step)
    return before, h, res


def test_many_distinct_configs_in_one_step_equal_each_applied_alone():
    edits = _mixed_edits(64, torch.Generator().manual_seed(1))
    for residual in (False, True):
        _each_alone(edits, residual, *_run([[e] for e in edits] + [None], residual))


def _each_alone(edits, residual, before, hidden, res):
    """Request i's two rows (the step of `_run`) equal edits[i] applied alone; the last request's, unsteered, are
    bit for bit as they were, and so is `residual`."""
    h0, r0 = before
    for i, e in enumerate(edits):
        rows = slice(2 * i, 2 * i + 2)
        expected = (h0[rows] + r0[rows]) if residual else h0[rows].clone()
        e.apply_(expected)
        got = hidden[rows] + res[rows] if residual else hidden[rows]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(hidden[-2:], h0[-2:]) and torch.equal(res, r0)


def test_a_requests_edits_at_one_tap_run_in_its_own_order():
    g = torch.Generator().manual_seed(2)
    v, w, d = (torch.randn(1, H, generator=g) for _ in range(3))
    add_v, add_w = compile_edit(EditKind.add, 1.0, v), compile_edit(EditKind.add, 1.0, w)
    ablate = compile_edit(EditKind.ablate, 1.0, d)
    # B's ablate is registered (by A) before B's add: B must still add first, then ablate.
    for order in (True, False):
        (h0, _), hidden, _ = _run([[add_v, ablate], [add_w, ablate]], residual=False, order=order)
        for i, first in enumerate((add_v, add_w)):
            expected = h0[2 * i : 2 * i + 2].clone()
            first.apply_(expected)
            ablate.apply_(expected)
            torch.testing.assert_close(hidden[2 * i : 2 * i + 2], expected, atol=1e-5, rtol=1e-5)


def test_step_weights_follow_prompt_and_generated_rows():
    bank = EditBank()
    v = torch.ones(1, H)
    gen = RequestEdits(bank.register(TAP, [compile_edit(EditKind.add, 2.0, v, tokens=Tokens.generated)]))
    both = RequestEdits(bank.register(TAP, [compile_edit(EditKind.add, 3.0, v)]))
    scored = RequestEdits(gen.entries, prompt_len=6)  # a scoring pass: its prompt ends at 6, not at its own end
    step = StepRows()
    # a 4-row prefill chunk from position 2 of a 5-token prompt; one decode row; a scoring pass of 8 rows
    step.set([Span(0, 4, 2, 5, gen), Span(4, 1, 9, 5, both), Span(5, 8, 0, 8, scored)], 13, 1, "cpu")
    w = step.weights[:, 0].numpy()
    np.testing.assert_array_equal(w, [0, 0, 0, 2, 3] + [0] * 6 + [2, 2])



def test_step_weights_of_many_requests_equal_each_rows_own():
    """Requests with distinct edits on mixed prefill and decode spans, padding rows between: each row's weight per
    stage is its request's strength there, on every row, prompt rows or generated rows (a loop over rows)."""
    rng = np.random.default_rng(0)
    bank, requests, spans, start = EditBank(), [], [], 0
    for i in range(40):
        tokens = [Tokens.both, Tokens.prompt, Tokens.generated][i % 3]
        v = torch.randn(1, H)
        entries = bank.register(TAP, [compile_edit(EditKind.add, float(i + 1), v, tokens=tokens)])
        requests.append(RequestEdits(entries) if i % 5 else None)  # every fifth unsteered
        count, plen = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        spans.append(Span(start, count, int(rng.integers(0, 14)), plen, requests[-1]))
        start += count + int(rng.integers(0, 2))
    step = StepRows()
    step.set(spans, start + 3, len(bank.stages), "cpu")
    expected = np.zeros((start + 3, len(bank.stages)), dtype=np.float32)
    for s in spans:
        for row in range(s.count):
            for stage, strength, rows in (s.edits.entries if s.edits else []):
                prompt = s.position + row < s.prompt_len
                if rows == "both" or (rows == "prompt") == prompt:
                    expected[s.start + row, stage] += strength
    np.testing.assert_array_equal(step.weights.numpy(), expected)

def test_a_bank_forgets_refused_stages():
    bank = EditBank()
    v = torch.ones(1, H)
    first = bank.register(TAP, [compile_edit(EditKind.add, 1.0, v)])
    bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, v)])
    bank.truncate(1)
    assert len(bank.stages) == 1
    assert bank.register(TAP, [compile_edit(EditKind.add, 2.0, v)])[0][0] == first[0][0]
    assert bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, v)])[0][0] == 1
