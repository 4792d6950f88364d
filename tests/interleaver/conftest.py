"""Fixtures of the interleaver tests: the fake recording (fake.py) in place of vLLM's, a tap worker on the
stand-in runner (stand_in.py), and Triton's kernel and launches in torch on CPU (fake_triton.py)."""

import pytest

from fake import FakeRecording
from fake_triton import FakeTriton, in_torch
from interleaver import kernels, vllm_internals
from stand_in import tap_worker


@pytest.fixture
def fake_recording(monkeypatch):
    """Graphs are recorded by the fake, on CPU (use it with pytest.mark.usefixtures)."""
    monkeypatch.setattr(vllm_internals, "_recording_class", FakeRecording)


@pytest.fixture
def worker():
    """A tap worker with one tap, the residual stream after layer 0."""
    return tap_worker()


@pytest.fixture
def fused(monkeypatch):
    """Programs take the fused table, its calls run `in_torch` (the list returned counts them)."""
    calls = []
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels.Fused, "__call__", lambda *a: calls.append(1) or in_torch(*a))
    monkeypatch.setattr(kernels.Fused, "warm", lambda self: None)  # its launches: the GPU test's
    return calls


@pytest.fixture
def fake_triton(monkeypatch):
    """`install(direct, bindable)`: a FakeTriton in Triton's place, returned."""
    def install(direct="same", bindable=True):
        fake = FakeTriton(direct, bindable)
        monkeypatch.setattr(kernels, "_kernel", lambda: fake)
        monkeypatch.setattr(kernels, "_fits", kernels._shaped)  # CPU tensors fit: no GPU here
        monkeypatch.setattr(kernels.triton_internals, "bind", fake.bind)
        return fake

    return install
