"""The one door to Triton's internals (read from Triton 3.6.0, the release torch 2.11 pins): launching a compiled
kernel directly, binding such a launch once for arguments that do not change, and what the JIT specialises a
kernel on.

A launch through the JIT (`kernel[grid](*args, **constexprs)`, public API) binds, specialises and keys every
argument on each call, then returns the `CompiledKernel` it launched. That object launches again without the JIT
as `compiled[grid](*args)`, with every argument of the kernel's signature in order, constexprs included (what the
JIT hands its launcher). Each such launch still resolves on the host what does not change between a tap's calls:
the device and stream, a dict of launch metadata for the (empty) launch hooks, two calls of those hooks, and for
each pointer argument a `data_ptr()` call and a `cuPointerGetAttribute` check. `bind` resolves them once and leaves
one call of the generated C launcher per launch, pointers passed as integers (which it takes as they are).
Everything else in the tap layer uses Triton's public API or this file, so a Triton upgrade touches this file
alone; kernels.py checks a direct launch against the JIT's before it relies on one.
"""

from functools import lru_cache
from typing import Any, Callable, Iterable, Optional, Sequence

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


def bind(compiled: Any, device: int, args: Sequence[Any]) -> Optional[Callable[[int], bool]]:
    """`go(rows)`: `compiled` launched on a grid of `rows` programs on `device`'s current stream with `args`
    (every argument of the signature in order, constexprs included), each tensor's address taken now: valid while
    those tensors stay where they are. `go` returns False, launching nothing, while launch hooks are installed (a
    profiler's): launch through `launch` then, which calls them. None where this Triton launches otherwise
    (another launcher, scratch memory per launch)."""
    found = _runtime()
    if found is None:
        return None
    knobs, driver = found
    try:
        run = compiled.run
        c_launch, stream_of = run.launch, driver.active.get_current_stream
        enter, leave = knobs.runtime.launch_enter_hook.calls, knobs.runtime.launch_exit_hook.calls
        scratch = run.global_scratch_size or run.profile_scratch_size
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata)
    except AttributeError:
        return None
    if scratch or not isinstance(compiled.function, int) or not isinstance(enter, list):
        return None
    # The C launcher's own arguments after the stream: launch metadata and both hooks None (none are installed)
    tail = (*head, None, None, None, *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))

    def go(rows: int) -> bool:
        if enter or leave:
            return False
        c_launch(rows, 1, 1, stream_of(device), *tail)
        return True

    return go


@lru_cache(maxsize=1)
def _runtime() -> Optional[tuple]:
    """Triton's knobs and active driver (None without Triton)."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver
    except ImportError:
        return None
    return knobs, driver


def specialization(pointers: Iterable[torch.Tensor], ints: Iterable[int]) -> tuple:
    """What the JIT specialises a kernel on, of pointer arguments and integer arguments marked
    `do_not_specialize`: whether every pointer is 16-byte aligned, and whether every integer fits in 32 bits
    (the argument's type is then i32, else i64). A compiled kernel serves only launches that agree on both."""
    aligned = all(t.data_ptr() % 16 == 0 for t in pointers)
    narrow = max(ints) < 2 ** 31
    return aligned, narrow
