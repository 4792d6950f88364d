"""The conditions' Triton kernels (interleaver/condition_kernels.py) against their torch form, over prefill chunks,
decode steps, padding rows and every reduce, score and comparator: the same sums and scores to float32 rounding,
the same decisions, and the same gated weights bit for bit.

On a CUDA device the kernels run there (the GPU suite); elsewhere in Triton's CPU interpreter, in a fresh
interpreter (TRITON_INTERPRET is read when Triton's kernels are defined, and must not reach a GPU test's process).
Both need Triton, which torch's CPU wheels leave out: the test skips, saying so, where it is absent."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from helpers import run

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None

_SCRIPT = r'''
import sys

import numpy as np
import torch

from interleaver.bank import RequestEdits
from interleaver.conditions import Conditions
from interleaver.edit import Condition

device = sys.argv[1]
W, SLOTS, PAD = 24, 4, 16
g = torch.Generator().manual_seed(0)
vectors = [torch.randn(W, generator=g) for _ in range(4)]
conds = [Condition("model.layers.0", vectors[0], "mean", "cast", "above", 0.0),
         Condition("model.layers.0", vectors[1], "last", "cosine", "below", 0.1),
         Condition("model.layers.0", vectors[2], "mean", "cosine", "above", -0.05),
         Condition("model.layers.0", vectors[3], "last", "cast", "below", 0.2)]
forms = {}
for kernels in (False, True):
    c = Conditions(conds, SLOTS, PAD, device)
    c.kernels = kernels
    forms[kernels] = c
stage = lambda arrays: [torch.from_numpy(a).to(device) for a in arrays]  # noqa: E731

# Requests a (prompt 5, in chunks of 3 and 2), b (prompt 4, whole), c (no condition: the scratch slot), d (prompt 1)
plen = {"a": 5, "b": 4, "c": 3, "d": 1}
steps = [[("a", 3, 0), ("b", 4, 0), ("c", 3, 0)],
         [("a", 2, 3), ("b", 1, 4), ("c", 1, 3), ("d", 1, 0)],
         [("a", 1, 5), ("b", 1, 5), ("c", 1, 4), ("d", 1, 1)]]
decides = {"a": True, "b": True, "c": False, "d": True}
gating = forms[True].gating([1, 3, 4], [0, 1, 3])
checked = 0
for dtype in (torch.bfloat16, torch.float32):
    for residual in (False, True):
        for c in forms.values():
            c.__init__(conds, SLOTS, PAD, device)
        forms[True].kernels = True
        for k, step in enumerate(steps):
            ids = [r for r, _, _ in step]
            counts = np.array([n for _, n, _ in step])
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            positions = np.array([p for _, _, p in step])
            plens = np.array([plen[r] for r in ids])
            num = int(counts.sum())
            h = torch.randn(PAD, W, generator=g).to(dtype).to(device)  # rows past `num`: padding
            r = torch.randn(PAD, W, generator=g).to(dtype).to(device) if residual else None
            w = torch.randn(PAD, 6, generator=g).to(device)
            for c in forms.values():
                slots = c.slots_for(ids, [RequestEdits(decide=decides[x]) for x in ids])
                c.set_rows(starts, counts, positions, plens, slots, num, stage)
                c.decide(range(len(conds)), h, r)
            t, f = forms[False], forms[True]
            live = sorted(set(t._slot.values()))
            for i in range(len(conds)):
                torch.testing.assert_close(f.acc[i][live], t.acc[i][live], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f.scores[:, live], t.scores[:, live], rtol=1e-5, atol=1e-6)
            assert torch.equal(f.flags[live], t.flags[live]), (k, f.flags[live], t.flags[live])
            assert torch.equal(f.weigh(w, gating), t.weigh(w, gating)), k
            checked += 1
met = int(forms[True].flags[:SLOTS].sum())

# CAST's score ignores the scale of tanh(P h): where all of P h is small (a long stream nearly orthogonal to v),
# tanh's relative error is the score's, and a score rounded below 0 would flip the decision.
W2 = 4096
v = torch.nn.functional.normalize(torch.randn(W2, generator=g, dtype=torch.float64), dim=0)
u = torch.randn(W2, generator=g, dtype=torch.float64)
u = torch.nn.functional.normalize(u - (u @ v) * v, dim=0)
small = Condition("model.layers.0", v.float(), "last", "cast", "above", 0.0)
for cos in (1e-3, -1e-3, 1e-6, -1e-6):
    h = (10.0 * (cos * v + (1 - cos * cos) ** 0.5 * u)).float()[None].to(device)
    read = {}
    for kernels in (False, True):
        c = Conditions([small], SLOTS, PAD, device)
        c.kernels = kernels
        slots = c.slots_for(["a"], [RequestEdits(decide=True)])
        c.set_rows(np.array([0]), np.array([1]), np.array([0]), np.array([1]), slots, 1, stage)
        c.decide([0], h)
        read[kernels] = (float(c.scores[0, slots[0]]), float(c.flags[slots[0], 0]))
    # cos(h, tanh(P h)) is about |cos(h, v)| (P h and v share a sign or differ in it together): above 0 holds
    assert read[True][1] == read[False][1] == 1.0, (cos, read)
    if abs(cos) > 1e-4:
        assert abs(read[True][0] - read[False][0]) <= 1e-4 * abs(read[False][0]), (cos, read)
print(f"kernels ok: {checked} steps, {met} of {SLOTS * len(conds)} slot decisions met")
'''


def check(device: str, interpret: bool):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = run([sys.executable, "-c", _SCRIPT, device], cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kernels ok: 12 steps" in out.stdout, out.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (torch's CPU wheels leave it out)")
def test_the_condition_kernels_in_tritons_interpreter_equal_the_torch_form():
    check("cpu", interpret=True)


@pytest.mark.gpu
def test_the_condition_kernels_on_a_gpu_equal_the_torch_form():
    check("cuda", interpret=False)
