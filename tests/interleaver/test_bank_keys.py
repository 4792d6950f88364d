"""EditBank stage keys: requests at one tap whose `set` edits differ only in value, or whose `clamp` edits differ
only in their window, each get a stage of their own, while edits that differ only in scale share one. A mixed
step's rows, run by the tap's program, are checked row by row against steer.edits.edit's eager edit of each request's
rows, and against the target each edit moves the projection to."""

import torch

from interleaver import EditBank, RequestEdits, Span, StepRows, TapProgram
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind

TAP = "model.layers.1.output"
H = 8


def run_step(edits, counts, seed=0):
    """Each request's one edit at TAP over `counts` rows of a prefill step: the program's output, and the eager
    edit of each request's own rows, as an engine that runs one request at a time would give."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), H, generator=g) * 3  # projections well outside the windows below
    bank = EditBank()
    reqs = [RequestEdits(bank.register(TAP, [e])) for e in edits]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    step = StepRows()
    step.set([Span(s, c, 0, c, r) for s, c, r in zip(starts, counts, reqs)], x.shape[0], len(bank.stages), "cpu")
    got = x.clone()
    TapProgram(TAP, bank.at(TAP), residual=False)(got, step)
    want = x.clone()
    for e, s, c in zip(edits, starts, counts):
        rows = want[s : s + c]  # a view: apply_ edits it in place, as an engine's hook does
        e.apply_(rows)
    return bank, starts, got, want


def check_rows(edits, starts, counts, got, want, what):
    for i, (s, c) in enumerate(zip(starts, counts)):
        torch.testing.assert_close(got[s : s + c], want[s : s + c], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, i=i: f"{what}: request {i}'s rows differ from its own eager edit\n{m}")


def test_set_edits_with_different_values_get_their_own_stages():
    d = torch.randn(1, H, generator=torch.Generator().manual_seed(1))
    # Same direction, same tap, same position in the list: only the value (or the scale) tells them apart.
    edits = [compile_edit(EditKind.set, 1.0, d, value=2.0), compile_edit(EditKind.set, 1.0, d, value=-5.0),
             compile_edit(EditKind.set, 0.5, d, value=2.0)]
    counts = [3, 2, 2]
    bank, starts, got, want = run_step(edits, counts)
    check_rows(edits, starts, counts, got, want, "set value=2 / value=-5 / value=2 at half strength")
    u = edits[0].basis[0]  # unit: compile_edit normalised it
    # Independent of steer.edits.edit: a full-strength set lands the projection on its own value.
    assert torch.allclose(got[:3] @ u, torch.full((3,), 2.0), atol=1e-5), got[:3] @ u
    assert torch.allclose(got[3:5] @ u, torch.full((2,), -5.0), atol=1e-5), got[3:5] @ u
    # Scale is a row weight; the value is part of what the stage computes.
    assert len(bank.stages) == 2, [(s.edit.kind.value, s.edit.value) for s in bank.stages]


def test_clamp_edits_with_different_windows_get_their_own_stages():
    d = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    windows = [(1.0, -0.5, 0.5), (1.0, 1.0, 2.0), (1.0, -0.5, None), (2.0, -0.5, 0.5)]  # (scale, lo, hi)
    edits = [compile_edit(EditKind.clamp, scale, d, lo=lo, hi=hi) for scale, lo, hi in windows]
    counts = [2, 3, 2, 1]
    bank, starts, got, want = run_step(edits, counts, seed=3)
    check_rows(edits, starts, counts, got, want, "clamp [-0.5, 0.5] / [1, 2] / [-0.5, inf) / [-0.5, 0.5] at 2x")
    u = edits[0].basis[0]
    for s, c, (_, lo, hi) in zip(starts[:3], counts[:3], windows):  # full strength: each lands in its own window
        p = got[s : s + c] @ u
        hi = float("inf") if hi is None else hi
        assert bool(((p >= lo - 1e-5) & (p <= hi + 1e-5)).all()), f"rows {s}..{s + c - 1}: {p} not in [{lo}, {hi}]"
    assert len(bank.stages) == 3, [(s.edit.lo, s.edit.hi) for s in bank.stages]
