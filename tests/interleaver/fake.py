"""A fake breakable-graph recording that behaves like a replayed CUDA graph, on CPU.

Modules write into fixed buffers; while recording, each module's op is recorded into the open segment (as a
kernel is captured) and `add_eager` closes the segment, as vLLM's does. Replay runs the segments in order
against the same buffers and runs no module forward, so only taps are reached. The graph is recorded for
`PAD` rows; a step fills the first n and leaves garbage in the rest, as padding does.
"""

import torch
from torch import nn

PAD, H = 8, 4


class FakeRecording:
    _active = None

    @classmethod
    def current(cls):
        return cls._active

    def __init__(self):
        self.segments, self._ops, self._capturing, self.num_eager_breaks = [], [], False, 0

    def __enter__(self):
        FakeRecording._active, self._capturing = self, True
        return self

    def __exit__(self, *exc):
        self._close()
        FakeRecording._active = None

    def op(self, fn):
        fn()
        self._ops.append(fn)

    def _close(self):
        ops, self._ops = self._ops, []
        if ops:
            self.segments.append(lambda: [f() for f in ops])
        self._capturing = False

    def add_eager(self, fn):
        self._close()
        result = fn()
        self.segments.append(fn)
        self.num_eager_breaks += 1
        self._capturing = True
        return result

    def replay(self):
        for s in self.segments:
            s()


class Layer(nn.Module):
    """out = x * k, into a fixed buffer while recording (a fresh tensor when run eagerly)."""

    def __init__(self, k):
        super().__init__()
        self.k = k
        self.buf = torch.zeros(PAD, H)

    def forward(self, x):
        rec = FakeRecording.current()
        if rec is None:
            return x * self.k
        rec.op(lambda: torch.mul(x, self.k, out=self.buf))
        return self.buf


class Residual(nn.Module):
    """Returns (hidden, residual) like vLLM's decoder layers: the stream is their sum."""

    def __init__(self):
        super().__init__()
        self.h, self.r = torch.zeros(PAD, H), torch.zeros(PAD, H)

    def forward(self, x):
        rec = FakeRecording.current()
        if rec is None:
            return x * 0.25, x * 0.75
        rec.op(lambda: (torch.mul(x, 0.25, out=self.h), torch.mul(x, 0.75, out=self.r)))
        return self.h, self.r


class Graphed(nn.Module):
    """Three layers; runs eagerly until `record()`, then replays for batches of up to PAD rows."""

    def __init__(self, interleaver=None):
        super().__init__()
        self.layers = nn.ModuleList([Layer(2.0), Layer(3.0), Layer(5.0)])
        self.static_in = torch.zeros(PAD, H)
        self.recording = None
        self.interleaver = interleaver

    def body(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def record(self):
        """Capture, with the interleaver open and no workers (as the runner's capture_model does)."""
        il = self.interleaver
        with il:
            il.busy = True
            with FakeRecording() as rec:
                self.static_out = self.body(self.static_in)
        self.recording = rec
        return rec

    def forward(self, x):
        n = x.shape[0]
        self.interleaver.step.num_tokens = n
        if self.recording is None or n > PAD:  # an eager step: a prompt longer than any graph
            return self.body(x)
        self.static_in[:n] = x
        self.static_in[n:] = 1000.0  # padding no request owns
        self.recording.replay()
        return self.static_out[:n]
