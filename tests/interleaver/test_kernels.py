"""The fused kernel's direction table, on CPU: the kernel's arithmetic in torch stands in for the Triton launch,
so a program that takes the fused path must still equal each request's edits applied one by one."""

import pytest
import torch

from interleaver import kernels
from interleaver.program import TapProgram
from steer.edit import compile_edit
from steer.schema import EditKind
from test_program import TAP, _each_alone, _mixed_edits, _run


def _in_torch(self, hidden, residual, weights):
    """The kernel's arithmetic (interleaver/kernels.py), row by row in float32, written with torch."""
    x = hidden.float() + (residual.float() if residual is not None else 0.0)
    w = weights[: hidden.shape[0]][:, self.col]
    p = x @ self.basis.T
    t = torch.minimum(torch.maximum(self.offset + self.slope * p, self.lo), self.hi)
    coef = torch.where(self.kind == kernels.ADD, w, torch.where(self.kind == kernels.SCALE, -w, (t - p) * w))
    on_x = (w * (self.kind == kernels.SCALE)).sum(1, keepdim=True)
    hidden.copy_((hidden.float() + coef @ self.basis + on_x * x).to(hidden.dtype))
    return True


@pytest.fixture
def fused(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels.Fused, "__call__", lambda *a: calls.append(1) or _in_torch(*a))
    monkeypatch.setattr(kernels.Fused, "warm", lambda self: None)  # its launches: the GPU test's
    return calls


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("order", [False, True])
@pytest.mark.parametrize("centred", [True, False])
def test_one_index_programs_take_the_fused_table_and_equal_each_edit_alone(fused, residual, order, centred):
    # Uncentred scales keep a [m, 1] basis of their own; the table widens it (the bench's k8 and k64 have them).
    edits = _mixed_edits(64, torch.Generator().manual_seed(1), centred=centred)
    stepped = _run([[e] for e in edits] + [None], residual, order)
    assert fused == [1]
    _each_alone(edits, residual, *stepped)


def test_programs_of_several_indices_keep_the_torch_form(fused):
    g = torch.Generator().manual_seed(3)
    a, b = (compile_edit(EditKind.add, 1.0, torch.randn(1, 16, generator=g)) for _ in range(2))
    _run([[a, b]], residual=True)  # two edits of one request at one tap: indices 0 and 1
    assert fused == []


def test_a_kernel_that_does_not_build_leaves_the_torch_form_and_says_so(monkeypatch):
    from interleaver.bank import EditBank

    def broken(self):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels.Fused, "warm", broken)
    bank = EditBank()
    bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))])
    with pytest.warns(RuntimeWarning, match="did not build .*PTX assembly failed.*torch form"):
        program = TapProgram(TAP, bank.at(TAP), True)
    assert program._fused is None


def test_without_a_gpu_no_program_is_fused():
    edit = compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))
    from interleaver.bank import EditBank

    bank = EditBank()
    bank.register(TAP, [edit])
    assert TapProgram(TAP, bank.at(TAP), True)._fused is None and not kernels.available("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [16, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("centred", [True, False])
def test_the_triton_kernel_equals_the_torch_form(residual, dtype, hidden, centred, monkeypatch):
    assert kernels.available("cuda")
    launched, call = [], kernels.Fused.__call__
    monkeypatch.setattr(kernels.Fused, "__call__", lambda *a: launched.append(call(*a)) or launched[-1])
    edits = _mixed_edits(64, torch.Generator().manual_seed(1), hidden, centred)
    reqs = [[e] for e in edits] + [None]
    (h0, r0), fused, res = _run(reqs, residual, device="cuda", dtype=dtype, hidden=hidden)
    assert launched[-1] is True  # the step's own launch (after the warm-up's), not a fallback to the torch form
    _, plain, _ = _run(reqs, residual, device="cuda", dtype=dtype, fused=False, hidden=hidden)
    # float32 deltas either way, summed in another order; one rounding into hidden's dtype
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(fused.float(), plain.float(), **tol)
    assert not torch.equal(fused, h0) and torch.equal(fused[-2:], h0[-2:]) and torch.equal(res, r0)


def test_a_program_counts_which_form_edited(fused):
    from interleaver.bank import EditBank, RequestEdits, Span, StepRows

    bank = EditBank()
    req = RequestEdits(bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))]))
    step = StepRows()
    step.set([Span(0, 2, 0, 4, req)], 2, len(bank.stages), "cpu")
    program = TapProgram(TAP, bank.at(TAP), False)
    program(torch.randn(2, 16), step)
    program._fused = None
    program(torch.randn(2, 16), step)
    assert program.ran == {"fused": 1, "torch": 1}
