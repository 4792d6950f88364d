"""Fixtures of the interleaver tests: the fake recording (fake.py) in place of vLLM's, and a tap worker on the
stand-in runner (stand_in.py)."""

import pytest

from fake import FakeRecording
from interleaver import vllm_internals
from stand_in import tap_worker


@pytest.fixture
def fake_recording(monkeypatch):
    """Graphs are recorded by the fake, on CPU (use it with pytest.mark.usefixtures)."""
    monkeypatch.setattr(vllm_internals, "_recording_class", FakeRecording)


@pytest.fixture
def worker():
    """A tap worker with one tap, the residual stream after layer 0."""
    return tap_worker()
