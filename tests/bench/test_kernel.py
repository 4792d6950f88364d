"""The kernel micro-benchmark's harness: its tap program and step weights steer each row as its request asks."""

import pytest
import torch

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
    assert [o["form"] for o in out] == ["floor", "fused", "jit", "torch"]
    assert all(0 < o["graph_us"] < 1e4 and 0 < o["eager_us"] < 1e4 for o in out)
