"""A step's weights staged to the device: through one buffer of the ring, expanded on the host or by a gather there."""

import numpy as np
import pytest
import torch

from interleaver.bank import BatchEdits, RequestEdits
from interleaver.rows import StepRows


def test_a_steps_arrays_reach_the_device_whole_through_one_staging_buffer():
    rows = StepRows()
    table = np.arange(15, dtype=np.float32).reshape(5, 3)  # 60 bytes: the index after it starts at 64
    src = np.array([4, 0, 0, 3, 1, 2, 4], dtype=np.int64)
    got = rows._gather(table, src, "cpu")
    assert torch.equal(got, torch.from_numpy(table[src])) and got.is_contiguous()
    w = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    kept = rows._upload(w, "cpu")
    for _ in range(StepRows._RING):  # the ring's buffers come round again: what was handed out is a copy
        rows._upload(np.zeros((3, 2), dtype=np.float32), "cpu")
    assert torch.equal(kept, torch.from_numpy(w))


@pytest.mark.gpu
def test_a_steps_weights_on_the_gpu_equal_those_on_cpu_both_ways_of_expanding_them():
    """Pinned staging, the non-blocking copy, the device views and the gather on CUDA, against the same steps on
    CPU: joins of prompt rows above and below `_GATHER_FROM` values, decode steps, more steps than the ring holds."""
    rng = np.random.default_rng(3)
    gpu, cpu = StepRows(), StepRows()
    for step in range(12):
        n, cols = int(rng.integers(1, 300)), int(rng.integers(2, 80))
        edits = [RequestEdits([(int(c), float(rng.normal()), rows) for c, rows in zip(
            rng.choice(cols, 2, replace=False), rng.choice(["both", "prompt", "generated"], 2))]) for _ in range(n)]
        batch = BatchEdits(edits, rng.integers(1, 40, n), cols, rng.permutation(cols))
        counts = rng.integers(1, 40, n) if step % 3 else np.ones(n, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        positions = rng.integers(0, 60, n)
        for rows in (gpu, cpu):
            rows.set_rows(starts, counts, positions, batch, int(counts.sum()), "cuda" if rows is gpu else "cpu")
        assert gpu.weights.is_cuda and torch.equal(gpu.weights.cpu(), cpu.weights)
        assert np.array_equal(gpu.used, cpu.used)
        torch.cuda.synchronize()  # as each engine step waits for its sampled tokens
