"""interleaver/ is a leaf package: it imports and runs a tap program in a process where steer and Hydra cannot be
imported (as in a vLLM worker, which should not pay for Hydra), and no module of it names them in an import."""

import ast
import os
import sys
from pathlib import Path

from helpers import run

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: `None` in sys.modules makes any later import of that name raise ImportError.
_SCRIPT = r'''
import sys
for name in ("steer", "hydra", "omegaconf"):
    sys.modules[name] = None
try:
    import steer  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("steer imported where it must not be")

import importlib
import importlib.util
import pkgutil

import torch

import interleaver
from interleaver import EditBank, EditKind, RequestEdits, Tokens, Span, Edit, StepRows, TapProgram
from interleaver.bank import layout

has_triton = importlib.util.find_spec("triton") is not None
for m in pkgutil.iter_modules(interleaver.__path__):
    # Triton source: kernels.py and conditions.py import these only where Triton is
    if m.name not in ("tap_kernels", "condition_kernels") or has_triton:
        importlib.import_module(f"interleaver.{m.name}")

H, TAP = 8, "model.layers.0.output"
g = torch.Generator().manual_seed(0)
v, c = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
d = torch.nn.functional.normalize(torch.randn(1, H, generator=g), dim=1)
asks = [Edit(EditKind.add, v, strength=2.0), Edit(EditKind.ablate, d, tokens=Tokens.generated),
        Edit(EditKind.clamp, d, lo=-0.1, hi=0.2, strength=0.5),
        Edit(EditKind.set, d, value=1.5, tokens=Tokens.prompt),
        Edit(EditKind.rescale, c, strength=-0.5), None]


def delta(e, x):
    """The edit's change to float32 rows `x`, computed directly from its definition."""
    if e.kind == EditKind.add:
        return e.strength * e.basis[0].expand_as(x)
    if e.kind == EditKind.rescale:
        return e.strength * (x - e.basis[0])
    p = x @ e.basis.T
    if e.kind == EditKind.ablate:
        return -e.strength * p @ e.basis
    target = p.clamp(e.lo, e.hi) if e.kind == EditKind.clamp else torch.full_like(p, e.value)
    return e.strength * (target - p) * e.basis


bank = EditBank()
reqs = [RequestEdits(bank.register(TAP, [Edit.from_dict(e.to_dict())])) if e else None for e in asks]
step = StepRows()
step.order = layout(bank.stages)
n = 2 * len(reqs)
# Request i owns rows 2i and 2i + 1 at positions 3 and 4 of a 4-token prompt: one prompt row, one generated row.
step.set([Span(2 * i, 2, 3, 4, r) for i, r in enumerate(reqs)], n, len(bank.stages), "cpu")
h, res = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
before = h.clone()
program = TapProgram(TAP, bank.at(TAP), True, {int(s): col for col, s in enumerate(step.order)})
program((h, res), step)

want, x = before.clone(), before + res  # deltas on the summed stream, landed on hidden
for i, e in enumerate(asks):
    if e is not None:
        w = torch.tensor({"both": [1.0, 1.0], "prompt": [1.0, 0.0], "generated": [0.0, 1.0]}[e.tokens.value])
        want[2 * i : 2 * i + 2] += w[:, None] * delta(e, x[2 * i : 2 * i + 2])
torch.testing.assert_close(h, want, atol=1e-5, rtol=1e-5)
assert torch.equal(h[-2:], before[-2:])  # the unsteered request's rows, bit for bit
loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("steer", "hydra"))
assert not loaded, loaded
print("leaf ok")
'''


def test_a_tap_program_runs_where_steer_and_hydra_cannot_be_imported():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    out = run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "leaf ok" in out.stdout


def test_no_interleaver_module_imports_steer_or_hydra():
    for path in sorted((ROOT / "interleaver").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.split(".")[0] in ("steer", "hydra", "omegaconf")]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"
