"""The kernel micro-benchmark's harness: its tap program and step weights steer each row as its request asks."""

import pytest
import torch

from interleaver import kernels
from steer.bench import kernel
from steer.bench.workload import scenario


@pytest.mark.parametrize("scen", ["ablate_all", "add", "k8"])
def test_the_timed_program_edits_each_row_as_its_request_asks(scen):
    rows, hidden = 16, 32
    program, weights = kernel._program(scen, rows, hidden, "cpu")
    assert weights.shape[0] == rows and program.groups
    g = torch.Generator().manual_seed(0)
    h, r = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    h0 = h.clone()
    program.in_graph((h, r), weights)
    for i, e in enumerate(scenario(scen, hidden, 1, rows, 0).edits):
        expected = h0[i : i + 1] + r[i : i + 1]
        e.apply_(expected)
        torch.testing.assert_close(h[i : i + 1] + r[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_bench_times_every_form_on_a_gpu():
    out = kernel.measure(64, 4096, "ablate_all", taps=4, replays=3)
    assert [o["form"] for o in out] == ["floor", "fused", "direct", "jit", "torch"]
    assert all(0 < o["graph_us"] < 1e4 and 0 < o["eager_us"] < 1e4 for o in out)


@pytest.mark.parametrize("scen", ["ablate_all", "add", "k8"])
def test_the_folded_form_equals_the_program_and_leaves_unsteered_rows(scen):
    rows, hidden = 16, 32
    program, weights = kernel._program(scen, rows, hidden, "cpu")
    weights[3] = 0  # a row that asks for nothing
    g = torch.Generator().manual_seed(1)
    h, r = (torch.randn(rows, hidden, generator=g).to(torch.bfloat16) for _ in range(2))
    nw = torch.rand(hidden, generator=g).to(torch.bfloat16)
    got = kernels.folded(program.table(), h, r, weights)
    assert torch.equal(got[3], h[3])
    forms = kernel.fold_forms(program, weights, h.clone(), r, nw, compile_fn=lambda fn: fn)
    folded, (normed, residual) = forms["folded"](), forms["norm"]()
    expected = h.clone()
    program.in_graph((expected, r), weights)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(folded[1].float(), kernel.next_norm(expected, r, nw)[1].float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(folded[0].float(), kernel.next_norm(expected, r, nw)[0].float(), atol=0.05, rtol=0.02)
    after_edit = forms["fused+norm"]()  # the program's own form on its copy of h, then the step
    assert all(torch.equal(a, b) for a, b in zip(after_edit, kernel.next_norm(expected, r, nw)))
    assert not torch.equal(normed, folded[0])  # the edit moved the normed input
    assert torch.equal(folded[0][3], normed[3]) and torch.equal(residual[3], folded[1][3])


def test_the_folded_form_is_the_kernels_arithmetic():
    """A table of each kind, a centred scale among them, against the kernel's formulas written out row by row."""
    hidden, g = 8, torch.Generator().manual_seed(2)
    basis = torch.randn(3, hidden, generator=g)
    basis[2] /= basis[2].norm()
    table = kernels.Fused(basis, torch.tensor([2, 0, 1]), torch.tensor([kernels.ADD, kernels.SCALE, kernels.PROJECT]),
                          slope=torch.tensor([0.0, 0.0, 1.0]), offset=torch.tensor([0.0, 0.0, 0.0]),
                          lo=torch.tensor([0.0, 0.0, -0.5]), hi=torch.tensor([0.0, 0.0, 0.5]))
    h, r, w = torch.randn(4, hidden, generator=g), torch.randn(4, hidden, generator=g), torch.rand(4, 3, generator=g)
    w[1, 0] = 0  # this row scales by nothing
    w[3] = 0  # and this one asks for nothing
    got = kernels.folded(table, h, r, w)
    assert torch.equal(got[3], h[3])
    for i in range(4):
        x = h[i] + r[i]
        p = x @ basis[2]
        delta = w[i, 2] * basis[0] + w[i, 0] * (x - basis[1]) + (p.clamp(-0.5, 0.5) - p) * w[i, 1] * basis[2]
        torch.testing.assert_close(got[i], h[i] + delta, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scen", ["ablate_all", "k8"])
def test_the_folded_form_equals_the_triton_kernel_on_a_gpu(scen):
    program, weights = kernel._program(scen, 64, 4096, "cuda")
    assert program.fused
    weights[5] = 0
    g = torch.Generator(device="cuda").manual_seed(3)
    h, r = (torch.randn(64, 4096, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    by_kernel = h.clone()
    program.in_graph((by_kernel, r), weights)
    got = kernels.folded(program.table(), h, r, weights)
    assert torch.equal(got[5], h[5]) and torch.equal(by_kernel[5], h[5])
    torch.testing.assert_close(got.float(), by_kernel.float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_bench_times_the_folded_candidate_on_a_gpu():
    out = kernel.measure_fold(64, 4096, "ablate_all", taps=4, replays=3)
    assert [o["form"] for o in out] == ["norm", "fused+norm", "folded", "edit_norm"]
    assert all(0 < o["graph_us"] < 1e4 and 0 < o["eager_us"] < 1e4 for o in out) and out[0]["over_norm_us"] == 0
