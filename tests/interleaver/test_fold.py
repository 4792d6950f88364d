"""vllm.fold_norm on CPU: a captured tap leaves its edit for the next layer's RMSNorm, which runs both as one kernel
(VLLMInterleaver.fold_into_norm), and whatever does not fit that runs the edit on its own, never drops it. The
kernel's arithmetic is the GPU tests' (tests/interleaver/test_kernels.py, tests/gpu)."""

import sys
import types

import pytest
import torch
from torch import nn

from interleaver import vllm_internals
from interleaver.interleaver import VLLMInterleaver

TAP, NORM = "model.layers.0.output", "model.layers.1.input_layernorm"


class _Program:
    """A fused residual program as the interleaver calls it: `in_graph` edits on its own (+1 on hidden),
    `in_graph_norm` says whether the one kernel ran (`ok`)."""

    fused, residual = True, True

    def __init__(self, ok=True):
        self.ok, self.calls = ok, []

    def in_graph(self, value, weights):
        self.calls.append("apart")
        value[0].add_(1)

    def in_graph_norm(self, value, weights, norm_weight, eps):
        self.calls.append(("folded", eps))
        return self.ok


@pytest.fixture
def folding(monkeypatch):
    """An in-graph interleaver whose tap at layer 0 folds into layer 1's norm, inside a capture."""
    capture = types.SimpleNamespace()
    monkeypatch.setattr(vllm_internals, "recording", lambda: capture)
    monkeypatch.setattr(vllm_internals, "record_into", lambda rec, fn: fn())

    def make(ok=True):
        il = VLLMInterleaver(taps=[TAP])
        il.in_graph, il.folds = True, {TAP: NORM}
        il.programs[TAP] = _Program(ok)
        return il, il.programs[TAP], (torch.zeros(2, 4), torch.zeros(2, 4))

    return make


def test_a_captured_tap_leaves_its_edit_to_the_norm_that_reads_its_value(folding):
    il, program, (h, r) = folding()
    il.handle(TAP, (h, r))
    assert program.calls == []  # nothing launched at the tap
    assert il.fold_into_norm(NORM, h, r, torch.ones(4), 1e-5) is True
    assert program.calls == [("folded", 1e-5)]
    assert il.fold_into_norm(NORM, h, r, torch.ones(4), 1e-5) is False  # taken once


def test_a_norm_the_fused_kernel_does_not_fit_runs_after_the_edit_alone(folding):
    il, program, (h, r) = folding(ok=False)
    il.handle(TAP, (h, r))
    assert il.fold_into_norm(NORM, h, r, torch.ones(4), 1e-5) is False  # the caller's norm runs
    assert program.calls[-1] == "apart" and h.eq(1).all()  # on the tap's own tensors, before that norm


@pytest.mark.parametrize("handed", ["other tensors", "no residual"])
def test_a_norm_not_handed_the_tap_s_stream_is_an_error_not_a_lost_edit(folding, handed):
    # Granite's or Gemma4's layers, say: their next norm reads a stream derived from the tap's, or one tensor
    il, program, (h, r) = folding()
    il.handle(TAP, (h, r))
    x, res = (h + r, r) if handed == "other tensors" else (h + r, None)
    with pytest.raises(RuntimeError, match=f"{NORM}.*vllm.fold_norm=false"):
        il.fold_into_norm(NORM, x, res, torch.ones(4), 1e-5)
    assert program.calls == [] and il._pending == {}


def test_a_tap_whose_value_is_not_a_pair_keeps_its_own_launch(folding):
    il, program, (h, _) = folding()
    il.handle(TAP, h)
    assert program.calls == ["apart"] and il._pending == {}


def test_edits_left_when_the_forward_ends_run_then(folding):
    il, program, (h, r) = folding()
    il.handle(TAP, (h, r))
    il.flush_folds()
    assert program.calls == ["apart"] and h.eq(1).all()
    il.flush_folds()
    assert program.calls == ["apart"]


def test_a_norm_outside_the_capture_of_its_tap_is_an_error(folding, monkeypatch):
    il, program, (h, r) = folding()
    il.handle(TAP, (h, r))
    monkeypatch.setattr(vllm_internals, "recording", lambda: None)
    with pytest.raises(RuntimeError, match=f"{NORM}.*vllm.fold_norm=false"):
        il.fold_into_norm(NORM, h, r, torch.ones(4), 1e-5)


class _RMSNorm(nn.Module):
    """vLLM's RMSNorm as fold_norms reads it (its class, weight, eps, and the fused add when given a residual)."""

    def __init__(self, has_weight=True):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(4)), 1e-6
        self.has_weight, self.variance_size_override = has_weight, None

    def forward(self, x, residual=None):
        return (x, x + residual) if residual is not None else x


class _Layer(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.input_layernorm = norm


class _Stack(nn.Module):
    def __init__(self, norms):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(n) for n in norms])
        self.norm = _RMSNorm()

    def forward(self, x):
        return x


@pytest.fixture
def vllm_rmsnorm(monkeypatch):
    layernorm = types.ModuleType("vllm.model_executor.layers.layernorm")
    layernorm.RMSNorm = _RMSNorm
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.layernorm", layernorm)
    envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    monkeypatch.setattr(sys.modules["vllm"], "envs", envs, raising=False)
    return envs


def test_taps_fold_into_the_next_layer_s_rmsnorm_or_the_final_one(vllm_rmsnorm):
    other = nn.LayerNorm(4)  # not vLLM's RMSNorm: that tap keeps its own launch
    model = nn.Module()
    model.model = _Stack([_RMSNorm(), _RMSNorm(), other, _RMSNorm()])
    modules = dict(model.named_modules())
    seen = []
    il = types.SimpleNamespace(fold_into_norm=lambda *a: seen.append(a[0]) or a[0].endswith("input_layernorm"),
                               flush_folds=lambda: seen.append("flush"))
    taps = [("model.layers.0", True), ("model.layers.1", True), ("model.layers.2", False), ("model.layers.3", True)]
    folds = vllm_internals.fold_norms(il, modules, taps)
    assert folds == {"model.model.layers.0.output": "model.layers.1.input_layernorm",
                     "model.model.layers.3.output": "model.norm"}
    x, r = torch.ones(1, 4), torch.ones(1, 4)
    out = model.model.layers[1].input_layernorm(x, r)
    assert out[0] is x and out[1] is r  # folded: the norm's own forward did not run
    out = model.model.norm(x, r)  # not folded this time: its own forward runs
    assert torch.equal(out[1], x + r) and seen[-1] == "model.norm"
    assert model.model.layers[2].input_layernorm(x) is not None and seen[-1] == "model.norm"  # left unwrapped
    model.model(x)
    assert seen[-1] == "flush"  # the stack's forward ends by running what no norm took (its instance forward:
    # vLLM's compile decorator calls forward without nn.Module's hooks)


def test_a_model_that_reads_the_stream_between_layers_folds_nothing(vllm_rmsnorm):
    model = nn.Module()
    model.model = _Stack([_RMSNorm(), _RMSNorm()])
    model.model.aux_hidden_state_layers = (1,)  # speculative decoding (EAGLE-3) reads hidden + residual there
    il = types.SimpleNamespace(fold_into_norm=None, flush_folds=None)
    assert vllm_internals.fold_norms(il, dict(model.named_modules()), [("model.layers.0", True)]) == {}


def test_vllm_s_batch_invariant_norm_folds_nothing(vllm_rmsnorm):
    vllm_rmsnorm.VLLM_BATCH_INVARIANT = True
    model = nn.Module()
    model.model = _Stack([_RMSNorm(), _RMSNorm()])
    il = types.SimpleNamespace(fold_into_norm=None, flush_folds=None)
    assert vllm_internals.fold_norms(il, dict(model.named_modules()), [("model.layers.0", True)]) == {}


def test_a_folded_kernel_that_does_not_build_leaves_that_tap_its_own_launch(folding):
    il, program, _ = folding()

    def broken():
        raise RuntimeError("PTX assembly failed")

    program.warm_norm = broken
    with pytest.warns(RuntimeWarning, match="did not build .*PTX assembly failed.*its own kernel"):
        il.warm_folds()
    assert il.folds == {}
