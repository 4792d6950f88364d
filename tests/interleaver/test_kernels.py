"""The fused kernel's direction table, on CPU: the kernel's arithmetic in torch stands in for the Triton launch,
so a program that takes the fused path must still equal each request's edits applied one by one."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mixed
from fake import PAD
from interleaver import kernels
from interleaver.program import TapProgram
from steer.edit import compile_edit
from steer.engine.vllm import stage_edits
from steer.schema import EditKind
from test_program import TAP, _each_alone, _mixed_edits, _run


def _in_torch(self, hidden, residual, weights, rows=None):
    """The kernel's arithmetic (interleaver/kernels.py), row by row in float32, written with torch, on the first
    `rows` rows (None: all)."""
    if rows is not None:
        hidden, residual = hidden[:rows], residual if residual is None else residual[:rows]
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
    bank.register(TAP, stage_edits([compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))]))
    with pytest.warns(RuntimeWarning, match="did not build .*PTX assembly failed.*torch form"):
        program = TapProgram(TAP, bank.at(TAP), True)
    assert program._fused is None


def test_without_a_gpu_no_program_is_fused():
    edit = compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))
    from interleaver.bank import EditBank

    bank = EditBank()
    bank.register(TAP, stage_edits([edit]))
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
    req = RequestEdits(bank.register(TAP, stage_edits([compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))])))
    step = StepRows()
    step.set([Span(0, 2, 0, 4, req)], 2, len(bank.stages), "cpu")
    program = TapProgram(TAP, bank.at(TAP), False)
    program(torch.randn(2, 16), step)
    program._fused = None
    program(torch.randn(2, 16), step)
    assert program.ran == {"fused": 1, "torch": 1}


class _FakeTriton:
    """Triton as a Fused launches it, on CPU: `jit[grid](*args, HAS_R=, BLOCK=, num_warps=)` runs the kernel's
    arithmetic (`_in_torch`) on the grid's rows and returns a compiled kernel, launchable as
    `compiled[grid](*args)` with every argument in the signature's order, or bound to its arguments
    (`bind(compiled, device, args)`, triton_internals.bind's stand-in: None where `bindable` is False); `direct`
    says what a direct or bound launch does ("same", "nothing" or "raise")."""

    def __init__(self, direct="same", bindable=True):
        self.direct, self.bindable, self.jit_args, self.direct_args = direct, bindable, [], []
        self.binds, self.bound_rows = [], []

    def _apply(self, args, has_r, rows):
        h, r, w, basis, col, kind, slope, offset, lo, hi = args[:10]
        table = type("Table", (), dict(basis=basis, col=col, kind=kind, slope=slope, offset=offset, lo=lo, hi=hi))
        _in_torch(table, h, r if has_r else None, w, rows)

    def launched(self, args, rows):
        """A direct or bound launch, doing what `direct` says."""
        if self.direct == "raise":
            raise TypeError("function takes exactly 26 arguments (27 given)")
        if self.direct == "same":
            self._apply(args, args[-2], rows)

    def bind(self, compiled, device, args):
        if not self.bindable:
            return None
        self.binds.append(tuple(args))
        return lambda rows: self.bound_rows.append(rows) or self.launched(args, rows)

    def __getitem__(self, grid):
        def jit(*args, HAS_R, BLOCK, num_warps):
            self.jit_args.append((*args, HAS_R, BLOCK))
            self._apply(args, HAS_R, grid[0])
            return _FakeCompiled(self)

        return jit


class _FakeCompiled:
    packed_metadata = b""

    def __init__(self, triton):
        self.triton = triton

    def __getitem__(self, grid):
        assert len(grid) == 3

        def launch(*args):
            self.triton.direct_args.append(args)
            self.triton.launched(args, grid[0])

        return launch


def _table(hidden=16, device="cpu"):
    g = torch.Generator().manual_seed(5)
    cols = (torch.randn(3, hidden, generator=g), torch.tensor([0, 1, 1]),
            torch.tensor([kernels.ADD, kernels.PROJECT, kernels.SCALE]), torch.ones(3) * 0.5, torch.zeros(3),
            torch.full((3,), -1.0), torch.full((3,), 1.0))
    return kernels.Fused(*(c.to(device) for c in cols))


@pytest.fixture
def fake_triton(monkeypatch):
    def install(direct="same", bindable=True):
        fake = _FakeTriton(direct, bindable)
        monkeypatch.setattr(kernels, "_kernel", lambda: fake)
        # CPU tensors fit (no GPU here); the rows must still be there
        monkeypatch.setattr(kernels, "_fits", lambda h, r, w, basis, rows: 0 < rows <= min(h.shape[0], w.shape[0]))
        monkeypatch.setattr(kernels.triton_internals, "bind", fake.bind)
        return fake

    return install


@pytest.mark.parametrize("residual", [False, True])
def test_after_its_first_launch_a_table_launches_its_compiled_kernel_directly(fake_triton, residual):
    fake, table = fake_triton(), _table()
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4, 2, generator=g)
    for i in range(3):
        h = torch.randn(4, 16, generator=g)
        r = torch.randn(4, 16, generator=g) if residual else None
        want = h.clone()
        _in_torch(table, want, r, w)
        assert table(h, r, w) is True
        assert torch.equal(h, want)
    # the first through the JIT, the rest straight to the kernel it compiled, with the same arguments in order,
    # bound to each new set of tensors
    assert len(fake.jit_args) == 1 and len(fake.binds) == 2 and fake.bound_rows == [4, 4]
    assert [type(a) for a in fake.binds[0]] == [type(a) for a in fake.jit_args[0]]
    assert fake.binds[-1][10:] == (3, 16, 16, 16, 2, residual, 16)


def test_a_launch_on_the_same_tensors_reuses_its_binding_over_any_leading_rows(fake_triton):
    fake, table = fake_triton(), _table()
    g = torch.Generator().manual_seed(1)
    h, r, w = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.rand(8, 2, generator=g)
    table(h.clone(), r, w)  # through the JIT, compiling
    for rows in (8, 5, 1):  # a graph's tap value: the same memory every step, its first `rows` real
        want = h.clone()
        _in_torch(table, want, r, w, rows)
        assert table(h, r, w, rows=rows) is True
        assert torch.equal(h, want)
    assert len(fake.binds) == 1 and fake.bound_rows == [8, 5, 1]
    table(h, r, w[:4].clone(), rows=4)  # the step's weights elsewhere: bound anew
    table(h[:6], r[:6], w, rows=6)  # views at the same addresses: the same binding
    assert len(fake.binds) == 2 and fake.bound_rows == [8, 5, 1, 4, 6]
    assert table(h, r, w, rows=0) is False and table(h[:2], r[:2], w, rows=3) is False  # no rows, or too many
    assert fake.bound_rows == [8, 5, 1, 4, 6]


def test_unbound_or_unbindable_direct_launches_go_through_the_compiled_kernel(fake_triton, monkeypatch):
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(4, 16, generator=g), torch.rand(4, 2, generator=g)
    for bindable, bound in ((False, True), (True, False)):
        fake, table = fake_triton(bindable=bindable), _table()
        table.bound = bound
        want = h.clone()
        _in_torch(table, want, None, w)
        _in_torch(table, want, None, w)
        x = h.clone()
        table(x, None, w)
        table(x, None, w)
        assert torch.equal(x, want) and len(fake.jit_args) == 1 and len(fake.direct_args) == 1
        assert fake.bound_rows == [] and table._bound == {}
    monkeypatch.setattr(kernels, "_BOUND_MAX", 2)
    fake, table = fake_triton(), _table()
    for i in range(4):
        table(torch.randn(4, 16), None, w)
    assert len(fake.binds) == 3 and len(table._bound) == 1  # a full table of bindings starts again


def test_a_launch_on_other_terms_than_the_compiled_kernel_s_goes_through_the_jit(fake_triton):
    fake, table = fake_triton(), _table()
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
    fake, table = fake_triton(), _table()
    table.warm()
    assert table.direct and len(fake.jit_args) == 6 and len(fake.bound_rows) == 6  # 3 dtypes x residual or not
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("direct,why", [("nothing", "differs from the JIT launch's"),
                                        ("raise", "TypeError: function takes exactly 26")])
def test_warm_drops_a_direct_launch_that_differs_or_fails_and_says_so(fake_triton, direct, why):
    fake, table = fake_triton(direct), _table()
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
    table, by_jit = _table(hidden, "cuda"), _table(hidden, "cuda")
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
    table = _table(hidden, "cuda")
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


@pytest.mark.usefixtures("fake_recording")
def test_a_replayed_break_launches_the_fused_kernel_once_over_the_real_rows(monkeypatch):
    rows = []
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels.Fused, "warm", lambda self: None)
    monkeypatch.setattr(kernels.Fused, "__call__",
                        lambda self, h, r, w, n=None: rows.append(n if n is None else (n, h.shape[0]))
                        or _in_torch(self, h, r, w, n))
    edits, inputs = mixed.edits_and_inputs()
    edits[4] = edits[4][:1]  # one edit a request: a table of one index, which the fused kernel takes
    outs = {}
    for fused in (True, False):
        module, il, bank, reqs = mixed.engine(["model.layers.0.output"], edits)
        assert il.programs["model.layers.0.output"].fused
        if not fused:
            il.programs["model.layers.0.output"]._fused = None
        module.record()
        outs[fused] = mixed.run(module, il, bank, mixed.steps(reqs, *inputs))
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # decode, every stage used: one launch over the 5 real rows of the graph's 8; the prefill step, some stages
    # unused: the general path on the trimmed rows; nobody steered: no launch
    assert rows == [(5, PAD), None]


def test_a_break_leaves_to_the_general_path_what_needs_the_host(fused):
    from interleaver.bank import EditBank

    bank = EditBank()
    bank.register(TAP, stage_edits([compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))]))
    program, live = TapProgram(TAP, bank.at(TAP), False), torch.randn(4, 16)
    step = SimpleNamespace(capturing={}, used=None, all_used=False, weights=None)
    assert program.at_break(live, 3, step) and fused == []  # nobody steered this step: nothing to launch
    used = SimpleNamespace(**{**vars(step), "used": np.array([True]), "all_used": True, "weights": torch.ones(3, 1)})
    for needs_host in ({**vars(used), "all_used": False, "used": np.array([False])},  # a group unused
                       {**vars(used), "capturing": {TAP: [object()]}}):  # a request keeps this tap's value
        assert not program.at_break(live, 3, SimpleNamespace(**needs_host))
    assert fused == []
    assert program.at_break(live, 3, SimpleNamespace(**{**vars(used), "capturing": {"elsewhere": [object()]}}))
    assert fused == [1] and program.ran["fused"] == 1
    program._fused = None
    assert not program.at_break(live, 3, used)


def test_a_form_says_how_the_kernel_launches_inside_it_and_no_longer(fused):
    from interleaver.bank import EditBank

    bank = EditBank()
    bank.register(TAP, stage_edits([compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))]))
    program = TapProgram(TAP, bank.at(TAP), False)
    table = program._fused
    for form, launch in (("fused", (True, True)), ("direct", (True, False)), ("jit", (False, False))):
        with program.form(form):
            assert program._fused is table and (table.direct, table.bound) == launch
    with program.form("torch"):
        assert program._fused is None
    assert program._fused is table and (table.direct, table.bound) == (True, True)
