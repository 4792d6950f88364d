"""The one door to Triton's internals (read from Triton 3.6.0, the release torch 2.11 pins): launching a compiled
kernel directly, and what the JIT specialises a kernel on.

A launch through the JIT (`kernel[grid](*args, **constexprs)`, public API) binds, specialises and keys every
argument on each call, then returns the `CompiledKernel` it launched. That object launches again without the JIT
as `compiled[grid](*args)`, with every argument of the kernel's signature in order, constexprs included (what the
JIT hands its launcher). Everything else in the tap layer uses Triton's public API or this file, so a Triton
upgrade touches this file alone; kernels.py checks a direct launch against the JIT's before it relies on one.
"""

from typing import Any, Iterable, Optional, Sequence

import torch


def compiled_of(launched: Any) -> Optional[Any]:
    """The compiled kernel a JIT launch returned, ready to launch directly, or None where it returned none
    (Triton's CPU interpreter)."""
    if callable(getattr(launched, "__getitem__", None)) and hasattr(launched, "packed_metadata"):
        return launched
    return None


def launch(compiled: Any, grid: Sequence[int], args: Sequence[Any]) -> None:
    """Launch a compiled kernel on the current stream: `grid` has all three dimensions, `args` every argument of
    the kernel's signature in order, constexprs included."""
    compiled[tuple(grid)](*args)


def specialization(pointers: Iterable[torch.Tensor], ints: Iterable[int]) -> tuple:
    """What the JIT specialises a kernel on, of pointer arguments and integer arguments marked
    `do_not_specialize`: whether every pointer is 16-byte aligned, and whether every integer fits in 32 bits
    (the argument's type is then i32, else i64). A compiled kernel serves only launches that agree on both."""
    aligned = all(t.data_ptr() % 16 == 0 for t in pointers)
    narrow = max(ints) < 2 ** 31
    return aligned, narrow
