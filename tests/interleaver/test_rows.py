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


def test_position_weights_equal_a_row_by_row_reading_of_each_entry():
    """Entries with positions on random batches (prefill chunks and decode steps, several entries a request, columns
    reordered): each row's weight is the sum, over its request's entries, of the strength where the entry's token
    kind and positions take that row."""
    from interleaver import select

    rng = np.random.default_rng(7)
    wheres = [("last_prompt", 3, 0), ("first_generated", 2, 0), ("window", 4, 9), None]
    for step in range(20):
        n, cols = int(rng.integers(1, 12)), int(rng.integers(1, 6))
        edits = [RequestEdits([(int(rng.integers(cols)), float(rng.normal()),
                                select.encode(str(rng.choice(["both", "prompt", "generated"])),
                                              wheres[int(rng.integers(len(wheres)))]))
                               for _ in range(int(rng.integers(1, 4)))]) if rng.random() < 0.8 else None
                 for _ in range(n)]
        plen = rng.integers(1, 12, n)
        order = rng.permutation(cols)
        batch = BatchEdits(edits, plen, cols, order)
        counts = np.ones(n, dtype=np.int64) if step % 2 else rng.integers(1, 8, n)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        positions = rng.integers(0, 16, n)
        rows = StepRows()
        rows.set_rows(starts, counts, positions, batch, int(counts.sum()), "cpu")
        want = np.zeros((int(counts.sum()), cols), dtype=np.float32)
        for i, e in enumerate(edits):
            for r in range(int(counts[i]) if e is not None else 0):
                pos = int(positions[i]) + r
                for stage, strength, code in e.entries:
                    kind, where = select.decode(code)
                    prompt = pos < plen[i]
                    if (kind == "prompt" and not prompt) or (kind == "generated" and prompt):
                        continue
                    if where is None or select.mask(where, pos, int(plen[i])):
                        want[starts[i] + r, int(np.argsort(order)[stage])] += np.float32(strength)
        got = rows.weights.numpy() if rows.weights is not None else np.zeros_like(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
