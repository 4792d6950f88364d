"""A scenario's faint twin (`<name>@eps`): every stage, row and kernel of the full edit, the unsteered data."""

import pytest
import torch

from interleaver.bank import EditBank, RequestEdits, layout
from interleaver.program import TapProgram
from interleaver.rows import Span, StepRows
from steer.bench import workload
from steer.edits.edit import scale_of
from steer.config.schema import EditKind

EPS = 1e-6


def _program(scen: str, rows: int, hidden: int, device) -> tuple:
    """One tap's program for `rows` decode rows steered by scenario `scen`, as f runs it, and the step's weights."""
    bank = EditBank()  # registers each distinct edit once, however many requests ask for it
    spans = [Span(i, 1, 40, 32, RequestEdits(bank.register("layers.0", [e])))
             for i, e in enumerate(workload.scenario(scen, hidden, 1, rows, 0).edits)]
    step = StepRows()
    step.order = layout(bank.stages)
    step.set(spans, rows, len(bank.stages), device)
    columns = {int(s): c for c, s in enumerate(step.order)}
    return TapProgram("layers.0", bank.at("layers.0"), True, columns, device=device), step.weights


@pytest.mark.parametrize("scen", ["add", "ablate_all", "k8"])
def test_the_faint_twin_is_each_edit_at_epsilon_of_its_strength(scen):
    full = workload.scenario(scen, 32, 4, 20, 0)
    faint = workload.scenario(scen + "@eps", 32, 4, 20, 0, epsilon=EPS)
    assert faint.name == scen + "@eps" and faint.layers == full.layers
    for e, f in zip(full.edits, faint.edits):
        assert (f.kind, f.lo, f.hi, f.value, f.tokens) == (e.kind, e.lo, e.hi, e.value, e.tokens)
        assert (f.basis is None and e.basis is None) or torch.equal(f.basis, e.basis)
        assert f.strength == pytest.approx(EPS * e.strength, rel=1e-6) and not f.is_noop
    # requests that shared an edit share its faint twin (the engines register an edit once)
    assert len({id(e) for e in faint.edits}) == len({id(e) for e in full.edits})
    if scen == "k8":  # rescale's strength is its factor minus 1: the faint factor is 1 + epsilon (factor - 1)
        e, f = next((e, f) for e, f in zip(full.edits, faint.edits) if e.kind == EditKind.rescale)
        assert scale_of(e) == 0.85 and scale_of(f) == pytest.approx(1 - EPS * 0.15, abs=1e-15)


@pytest.mark.parametrize("scen", ["add", "ablate_all", "k8"])
def test_the_faint_twin_runs_every_row_and_stage_the_full_edit_runs(scen):
    # The fused kernel skips a row's direction only where its weight is exactly 0, and a replayed step runs a
    # group only where some row's weight in it is not: the same nonzero weights mean the same work.
    full_program, full_w = _program(scen, 16, 32, "cpu")
    faint_program, faint_w = _program(scen + "@eps", 16, 32, "cpu")
    assert torch.equal(faint_w != 0, full_w != 0) and (full_w != 0).any()
    assert [(g.family, g.index) for g in faint_program.groups] == [(g.family, g.index) for g in full_program.groups]
    assert all(torch.equal(a.basis, b.basis) for a, b in zip(faint_program.groups, full_program.groups))
    nonzero = full_w != 0
    torch.testing.assert_close(faint_w[nonzero], EPS * full_w[nonzero], rtol=1e-5, atol=0)


@pytest.mark.parametrize("scen", ["add", "ablate_all", "k8"])
def test_the_faint_twin_leaves_the_data_as_it_was(scen):
    rows, hidden = 16, 64
    g = torch.Generator().manual_seed(0)
    h0, r = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)

    def edited(name, dtype):
        program, weights = _program(name, rows, hidden, "cpu")
        h = h0.to(dtype, copy=True)
        # the torch form, as f runs it without the fused kernel; float64 rows (float32 residual, so the stream and
        # the deltas are float32) only keep the deltas from rounding into them
        program.in_graph((h, r.to(torch.float32 if dtype == torch.float64 else dtype)), weights)
        return h.double() - h0.to(dtype).double()

    for dtype in (torch.bfloat16, torch.float32):
        moved = edited(scen + "@eps", dtype)
        assert moved.norm() / h0.norm() < 1e-6  # the unsteered data, to 1e-6
        assert edited(scen, dtype).norm() / h0.norm() > 1e-2  # where the full edit moves it
    # ... and the edit is there: epsilon of the full edit's change, seen on float64 rows (the deltas are float32)
    full, faint = edited(scen, torch.float64), edited(scen + "@eps", torch.float64)
    assert faint.norm() > 0 and (faint - EPS * full).norm() < 1e-3 * (EPS * full).norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scen", ["add", "ablate_all", "k64"])
def test_the_fused_kernel_runs_the_faint_twin_and_leaves_bf16_rows_as_they_were_on_the_gpu(scen):
    rows, hidden = 256, 4096  # the 8B shape's stream at the bench's larger batch
    g = torch.Generator(device="cuda").manual_seed(0)
    h0, r = (torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    moved = {}
    for name in (scen, scen + "@eps"):
        program, weights = _program(name, rows, hidden, "cuda")
        h = h0.clone()
        program.in_graph((h, r), weights)
        assert program.fused and program.ran == {"fused": 1, "torch": 0}
        moved[name] = ((h.float() - h0.float()).norm() / h0.float().norm()).item()
    assert moved[scen + "@eps"] < 1e-6 and moved[scen] > 1e-3, moved
