"""The fused kernel's direction table, on CPU: the kernel's arithmetic in torch stands in for the Triton launch,
so a program that takes the fused path must still equal each request's edits applied one by one; and how a table
launches (through the JIT, then directly), with the GPU tests of both."""

import pytest
import torch

from fake_triton import direction_table, in_torch
from interleaver import kernels
from interleaver.program import TapProgram
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind
from test_program import TAP, _each_alone, _mixed_edits, _run


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
    from interleaver.bank import EditBank, RequestEdits
    from interleaver.rows import Span, StepRows

    bank = EditBank()
    req = RequestEdits(bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))]))
    step = StepRows()
    step.set([Span(0, 2, 0, 4, req)], 2, len(bank.stages), "cpu")
    program = TapProgram(TAP, bank.at(TAP), False)
    program(torch.randn(2, 16), step)
    program._fused = None
    program(torch.randn(2, 16), step)
    assert program.ran == {"fused": 1, "torch": 1}



@pytest.mark.parametrize("residual", [False, True])
def test_after_its_first_launch_a_table_launches_its_compiled_kernel_directly(fake_triton, residual):
    fake, table = fake_triton(), direction_table()
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4, 2, generator=g)
    for _ in range(3):
        h = torch.randn(4, 16, generator=g)
        r = torch.randn(4, 16, generator=g) if residual else None
        want = h.clone()
        in_torch(table, want, r, w)
        assert table(h, r, w) is True
        assert torch.equal(h, want)
    # the first through the JIT, the rest straight to the kernel it compiled, with the same arguments in order,
    # bound to each new set of tensors
    assert len(fake.jit_args) == 1 and len(fake.binds) == 2 and fake.bound_rows == [4, 4]
    assert [type(a) for a in fake.binds[0]] == [type(a) for a in fake.jit_args[0]]
    assert fake.binds[-1][10:] == (3, 16, 16, 16, 2, residual, 16)


def test_a_launch_on_other_terms_than_the_compiled_kernel_s_goes_through_the_jit(fake_triton):
    fake, table = fake_triton(), direction_table()
    w = torch.rand(4, 2)
    table(torch.randn(4, 16), None, w)
    # A view one float in: its pointer is not 16-byte aligned, which the kernel was specialised on
    table(torch.randn(4 * 16 + 1)[1:].view(4, 16), None, w)
    table(torch.randn(4, 16, dtype=torch.bfloat16), None, w)  # another dtype
    table(torch.randn(4, 16), torch.randn(4, 16), w)  # with a residual
    table(torch.randn(4, 16), torch.randn(4, 16, dtype=torch.bfloat16), w)  # a residual of another dtype
    assert len(fake.jit_args) == 5 and fake.binds == []
    table(torch.randn(4 * 16 + 1)[1:].view(4, 16), None, w)
    assert len(fake.jit_args) == 5 and len(fake.binds) == 1
    table.direct = False
    table(torch.randn(4, 16), None, w)
    assert len(fake.jit_args) == 6 and len(fake.binds) == 1


def test_warm_keeps_the_direct_launch_when_it_equals_the_jit_s(fake_triton, recwarn):
    fake, table = fake_triton(), direction_table()
    table.warm()
    assert table.direct and len(fake.jit_args) == 6 and len(fake.bound_rows) == 6  # 3 dtypes x residual or not
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("direct,why", [("nothing", "differs from the JIT launch's"),
                                        ("raise", "TypeError: function takes exactly 26")])
def test_warm_drops_a_direct_launch_that_differs_or_fails_and_says_so(fake_triton, direct, why):
    fake, table = fake_triton(direct), direction_table()
    with pytest.warns(RuntimeWarning, match=f"direct launch is not used .*{why}"):
        table.warm()
    assert not table.direct and table._compiled == {} and table._bound == {}
    n = len(fake.jit_args)
    table(torch.randn(2, 16), None, torch.rand(2, 2))
    assert len(fake.jit_args) == n + 1 and len(fake.bound_rows) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [16, 4096])
def test_the_direct_launch_equals_the_jit_launch_on_the_gpu(dtype, hidden, monkeypatch):
    assert kernels.available("cuda")
    unbound, launch = [], kernels.triton_internals.launch
    monkeypatch.setattr(kernels.triton_internals, "launch", lambda *a: unbound.append(1) or launch(*a))
    table, by_jit = direction_table(hidden, "cuda"), direction_table(hidden, "cuda")
    table.warm()
    assert table.direct  # the installed Triton's compiled kernels launch directly, checked against its JIT
    bound_at_warm = len(table._bound)
    assert bound_at_warm == 6  # and warm checked them bound: 3 dtypes, with a residual or without
    by_jit.direct = False
    launches, jit_launch = [], table._launch
    table._launch = lambda *a: launches.append(1) or jit_launch(*a)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.rand(64, 2, generator=g, device="cuda")
    w[7] = 0

    def twins(offset, with_r):  # the same rows twice, each `offset` elements into a buffer of its own
        base = torch.randn(64 * hidden + offset, generator=g, device="cuda").to(dtype)
        r = torch.randn(64, hidden, generator=g, device="cuda").to(dtype) if with_r else None
        return [(base.clone()[offset:].view(64, hidden), r) for _ in range(2)]

    for offset, with_r, jit_launches in ((0, False, 0), (0, True, 0), (1, False, 1), (1, False, 1)):
        (a, r), (b, _) = twins(offset, with_r)
        before = a.clone()
        table(a, r, w)
        by_jit(b, r, w)
        assert torch.equal(a, b) and not torch.equal(a, before) and torch.equal(a[7], before[7])
        assert len(launches) == jit_launches  # warmed terms launch directly; a misaligned view once through the JIT
        once = a.clone()
        table(a, r, w, rows=9)  # bound to these tensors now: again, over the first 9 rows alone
        by_jit(b, r, w, rows=9)
        assert torch.equal(a, b) and not torch.equal(a[:9], once[:9]) and torch.equal(a[9:], once[9:])
        assert len(launches) == jit_launches
    # every direct launch above was bound: this Triton's launcher takes bound arguments
    assert unbound == [] and len(table._bound) > bound_at_warm


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [16, 4096])
def test_the_edit_norm_kernel_equals_the_edit_then_the_add_and_norm(dtype, hidden):
    assert kernels.available("cuda")
    table = direction_table(hidden, "cuda")
    table.warm()
    table.warm_norm()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.rand(64, 2, generator=g, device="cuda")
    w[7] = 0  # a row that asks for nothing
    h, r = (torch.randn(64, hidden, generator=g, device="cuda").to(dtype) for _ in range(2))
    nw = torch.randn(hidden, generator=g, device="cuda").to(dtype)
    edited = h.clone()
    assert table(edited, r, w)  # the edit on its own, then the add and the norm in torch
    summed = (edited.float() + r.float()).to(dtype)
    z = summed.float()
    normed = ((z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * nw.float()).to(dtype)
    out, res = h.clone(), r.clone()
    assert table.edit_norm(out, res, w, nw, 1e-5)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(res.float(), summed.float(), **tol)
    torch.testing.assert_close(out.float(), normed.float(), **tol)
    assert torch.equal(res[7], (h[7].float() + r[7].float()).to(dtype))  # the plain add, bit for bit
    assert not table.edit_norm(h.clone(), None, w, nw, 1e-5)  # no residual: nothing to fold into
    assert not table.edit_norm(h.clone(), r.clone(), w, nw.double(), 1e-5)  # a weight of another dtype
