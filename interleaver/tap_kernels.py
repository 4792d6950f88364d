"""The fused tap kernels' Triton source (interleaver/kernels.py launches them; imported only where Triton is).

`tap_edit` edits a row of the stream in place (kernels.py's docstring gives the arithmetic); `tap_edit_norm` does
the same and then the next layer's residual add and RMSNorm in the same pass over the row. Both take the row's
delta from `delta_of`, so the two cannot drift apart.
"""

import triton
import triton.language as tl


@triton.jit
def delta_of(x, row, w_ptr, basis_ptr, col_ptr, kind_ptr, slope_ptr, offset_ptr, lo_ptr, hi_ptr, n_dirs,
             hidden_size: tl.constexpr, stride_w, offs, mask, BLOCK: tl.constexpr):
    """A row's float32 delta on its stream `x` (the module docstring's sum over directions)."""
    delta = tl.zeros([BLOCK], dtype=tl.float32)
    on_x = tl.sum(delta, axis=0)  # 0: the scale weights' sum, their delta's term in x
    for j in range(n_dirs):
        # A direction's scalars are loaded before its weight is known and its weight's two loads issued
        # together with them: a tap at a decode step is a few microseconds of dependent loads, not of arithmetic.
        kind = tl.load(kind_ptr + j)
        slope, offset = tl.load(slope_ptr + j), tl.load(offset_ptr + j)
        lo, hi = tl.load(lo_ptr + j), tl.load(hi_ptr + j)
        w = tl.load(w_ptr + row * stride_w + tl.load(col_ptr + j))
        # A row asks for few of the table's directions (one of k distinct edits; an in-graph engine's table
        # holds every edit it declared): the others cost it a few scalar loads, not a row of the basis and a
        # reduction. Their delta would be exactly 0 (or NaN, where a direction is not finite).
        if w != 0.0:
            b = tl.load(basis_ptr + j * hidden_size + offs, mask=mask, other=0.0)
            coef = w
            if kind == 1:
                on_x += w
                coef = -w
            elif kind == 2:
                p = tl.sum(x * b, axis=0)
                t = tl.minimum(tl.maximum(offset + slope * p, lo), hi)
                coef = (t - p) * w
            delta += coef * b
    return delta + on_x * x


# Strides and sizes vary with the step's rows only through the grid; not specialising on them keeps one
# compiled kernel per (dtype, residual, block), compiled on the first eager call, never inside a capture.
@triton.jit(do_not_specialize=["n_dirs", "stride_h", "stride_r", "stride_w"])
def tap_edit(h_ptr, r_ptr, w_ptr, basis_ptr, col_ptr, kind_ptr, slope_ptr, offset_ptr, lo_ptr, hi_ptr,
             n_dirs, hidden_size: tl.constexpr, stride_h, stride_r, stride_w,
             HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    x = h.to(tl.float32)
    if HAS_R:
        x = x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    delta = delta_of(x, row, w_ptr, basis_ptr, col_ptr, kind_ptr, slope_ptr, offset_ptr, lo_ptr, hi_ptr, n_dirs,
                     hidden_size, stride_w, offs, mask, BLOCK)
    tl.store(h_ptr + row * stride_h + offs, (h.to(tl.float32) + delta).to(h.dtype), mask=mask)


# The same edit, then the next layer's residual add and RMSNorm in the same pass over the row: `residual`
# becomes the edited stream's sum (rounded to its dtype, as the add leaves it) and `hidden` that sum normed
# and scaled by the norm's weight, in place, as vLLM's fused add + RMSNorm leaves its two inputs.
@triton.jit(do_not_specialize=["n_dirs", "stride_h", "stride_r", "stride_w"])
def tap_edit_norm(h_ptr, r_ptr, w_ptr, basis_ptr, col_ptr, kind_ptr, slope_ptr, offset_ptr, lo_ptr, hi_ptr,
                  norm_ptr, eps, n_dirs, hidden_size: tl.constexpr, stride_h, stride_r, stride_w,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
    x = h.to(tl.float32) + r.to(tl.float32)
    delta = delta_of(x, row, w_ptr, basis_ptr, col_ptr, kind_ptr, slope_ptr, offset_ptr, lo_ptr, hi_ptr, n_dirs,
                     hidden_size, stride_w, offs, mask, BLOCK)
    edited = (h.to(tl.float32) + delta).to(h.dtype)  # what tap_edit leaves in hidden
    summed = (edited.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(r_ptr + row * stride_r + offs, summed, mask=mask)
    z = summed.to(tl.float32)
    scale = tl.rsqrt(tl.sum(z * z, axis=0) / hidden_size + eps)
    weight = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded, then weighted and rounded again: vLLM's CUDA fused add + RMSNorm does it so
    tl.store(h_ptr + row * stride_h + offs, ((z * scale).to(h.dtype).to(tl.float32) * weight).to(h.dtype), mask=mask)
