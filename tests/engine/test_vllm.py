"""The vLLM engine's host-side helpers, on CPU (the engine itself runs in tests/gpu)."""

from types import SimpleNamespace

import torch

from steer.engine.vllm import _dense, rank_zero


def test_flat_logprobs_become_dense_rows():
    # vLLM's FlatLogprobs: position 0 of a prompt has none; a position lists the scored token first, then every
    # token by rank (so the scored one twice).
    flat = SimpleNamespace(start_indices=[0, 0, 4], end_indices=[0, 4, 8],
                           token_ids=[2, 0, 1, 2, 1, 0, 1, 2],
                           logprobs=[-0.5, -1.5, -2.0, -0.5, -0.1, -3.0, -0.1, -4.0])
    out = _dense(flat, 1, 4)
    inf = float("-inf")
    torch.testing.assert_close(out, torch.tensor([[-1.5, -2.0, -0.5, inf], [-3.0, -0.1, -4.0, inf]]))
    assert _dense(flat, 3, 4).shape == (0, 4)


def test_rank_zeros_captures_stand_for_all():
    ranks = [{"model.layers.1.output": {"k": [[[float(r), 2.0]]]}} for r in range(3)]
    assert rank_zero(ranks) == ranks[0] and rank_zero(ranks[::-1]) == ranks[2] and rank_zero([]) == {}
