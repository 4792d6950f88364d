"""Triton as interleaver/kernels.py launches it, on CPU: the kernel's arithmetic written in torch stands in for the
kernel, and a fake JIT, compiled kernel and `bind` stand in for Triton's launches (the fixtures `fused` and
`fake_triton` in conftest.py install them)."""

import torch

from interleaver import kernels


def in_torch(self, hidden, residual, weights, rows=None):
    """The kernel's arithmetic in torch (kernels.folded), landed in `hidden`'s first `rows` rows (None: all)."""
    if rows is not None:
        hidden, residual = hidden[:rows], residual if residual is None else residual[:rows]
    hidden.copy_(kernels.folded(self, hidden, residual, weights))
    return True


class FakeTriton:
    """Triton as a Fused launches it, on CPU: `jit[grid](*args, HAS_R=, BLOCK=, num_warps=)` runs the kernel's
    arithmetic (`in_torch`) on the grid's rows and returns a compiled kernel, launchable as
    `compiled[grid](*args)` with every argument in the signature's order, or bound to its arguments
    (`bind(compiled, device, args)`, triton_internals.bind's stand-in: None where `bindable` is False, a launch
    that declines while `hooked`); `direct` says what a direct or bound launch does ("same", "nothing" or
    "raise")."""

    def __init__(self, direct="same", bindable=True):
        self.direct, self.bindable, self.jit_args, self.direct_args = direct, bindable, [], []
        self.binds, self.bound_rows, self.devices = [], [], []
        self.hooked = False  # launch hooks installed: a bound launch declines (returns False)

    def _apply(self, args, has_r, rows):
        h, r, w, basis, col, kind, slope, offset, lo, hi = args[:10]
        table = type("Table", (), dict(basis=basis, col=col, kind=kind, slope=slope, offset=offset, lo=lo, hi=hi))
        in_torch(table, h, r if has_r else None, w, rows)

    def launched(self, args, rows):
        """A direct or bound launch, doing what `direct` says."""
        if self.direct == "raise":
            raise TypeError("function takes exactly 26 arguments (27 given)")
        if self.direct == "same":
            self._apply(args, args[-2], rows)

    def bind(self, compiled, device, args):
        if not self.bindable:
            return None
        self.binds.append(tuple(args))
        self.devices.append(device)

        def go(rows):
            if self.hooked:
                return False
            self.bound_rows.append(rows)
            self.launched(args, rows)
            return True

        return go

    def __getitem__(self, grid):
        def jit(*args, HAS_R, BLOCK, num_warps):
            self.jit_args.append((*args, HAS_R, BLOCK))
            self._apply(args, HAS_R, grid[0])
            return FakeCompiled(self)

        return jit


class FakeCompiled:
    packed_metadata = b""

    def __init__(self, triton):
        self.triton = triton

    def __getitem__(self, grid):
        assert len(grid) == 3

        def launch(*args):
            self.triton.direct_args.append(args)
            self.triton.launched(args, grid[0])

        return launch


def direction_table(hidden=16, device="cpu"):
    g = torch.Generator().manual_seed(5)
    cols = (torch.randn(3, hidden, generator=g), torch.tensor([0, 1, 1]),
            torch.tensor([kernels.ADD, kernels.PROJECT, kernels.RESCALE]), torch.ones(3) * 0.5, torch.zeros(3),
            torch.full((3,), -1.0), torch.full((3,), 1.0))
    return kernels.Fused(*(c.to(device) for c in cols))
