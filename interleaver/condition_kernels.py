"""The conditions' Triton source (interleaver/conditions.py launches it; imported only where Triton is).

A condition's torch form is some twenty small kernels a step (the float cast, the sums, the gathers, the score's
norms and products, the scatters of scores and decisions) and its gate's a handful more, each on every row of the
step; inside an in-graph or compiled engine's CUDA graphs they all run at every decode step, where no row decides
anything. Here a condition is two launches a step and its gate one, and a row with nothing to do reads one index
and stops:

    condition_sum    each prompt row still to be summed adds its stream into its slot (reduce=mean), or the
                     prompt's last row stores it there (reduce=last)
    condition_score  each prompt's last row scores its slot's reduced vector and writes its score and decision
    condition_gate   each row's weights, the gated columns times the row's decision on their condition

`condition_score` must see every row's sum, so it is its own launch after `condition_sum`'s. The arithmetic is
interleaver/select.py's (a cosine, each side divided by its norm clamped at eps, as torch's cosine_similarity).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["scratch", "stride_h", "stride_r", "stride_t"])
def condition_sum(h_ptr, r_ptr, rows_ptr, acc_ptr, scratch, width: tl.constexpr, stride_h, stride_r, stride_t,
                  HAS_R: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # rows[1]: the slot a prompt row sums into until its request decides; rows[2]: the slot its last row decides
    if LAST:
        slot = tl.load(rows_ptr + 2 * stride_t + row)
    else:
        slot = tl.load(rows_ptr + stride_t + row)
    if slot != scratch:
        offs = tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_R:
            x = x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        if LAST:
            tl.store(acc_ptr + slot * width + offs, x, mask=mask)
        else:
            tl.atomic_add(acc_ptr + slot * width + offs, x, mask=mask)


@triton.jit
def _cosine(h, y, eps):
    """cos(h, y) over a row, each side divided by its norm clamped at eps."""
    nh = tl.maximum(tl.sqrt(tl.sum(h * h, axis=0)), eps)
    ny = tl.maximum(tl.sqrt(tl.sum(y * y, axis=0)), eps)
    return tl.sum((h / nh) * (y / ny), axis=0)


@triton.jit
def _tanh(y):
    """tanh, to float32's relative precision at every size: the cosine with h ignores the scale of tanh(P h), so
    where all of P h is small its relative error is the score's. Small |y|: the series to y^7 (the next term is
    below 4e-9 of y under 1/8); above: through exp of a non-positive argument, which cannot overflow."""
    a = tl.abs(y)
    y2 = y * y
    series = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.125, series, tl.where(y < 0, -t, t))


@triton.jit(do_not_specialize=["scratch", "stride_t", "stride_s", "n_flags", "i", "threshold"])
def condition_score(rows_ptr, acc_ptr, v_ptr, scores_ptr, flags_ptr, scratch, stride_t, stride_s, n_flags, i,
                    threshold, width: tl.constexpr, MEAN: tl.constexpr, CAST: tl.constexpr, ABOVE: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(rows_ptr + 2 * stride_t + row)
    if slot != scratch:
        offs = tl.arange(0, BLOCK)
        mask = offs < width
        h = tl.load(acc_ptr + slot * width + offs, mask=mask, other=0.0)
        if MEAN:
            h = h / tl.load(rows_ptr + 3 * stride_t + row).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if CAST:  # cos(h, tanh(P h)), P = v v^T / (v^T v)
            y = (tl.sum(h * v, axis=0) / tl.sum(v * v, axis=0)) * v
            s = _cosine(h, _tanh(y), 1e-30)
        else:
            s = _cosine(h, v, 1e-8)
        tl.store(scores_ptr + i * stride_s + slot, s)
        if ABOVE:
            met = s > threshold
        else:
            met = s < threshold
        tl.store(flags_ptr + slot * n_flags + i, met.to(tl.float32))


@triton.jit(do_not_specialize=["scratch", "n_cols", "n_gated", "n_flags", "stride_w", "stride_o"])
def condition_gate(w_ptr, out_ptr, rows_ptr, flags_ptr, cond_ptr, scratch, n_cols, n_gated, n_flags, stride_w,
                   stride_o, BLOCK: tl.constexpr):
    # A program per row and block of columns: one compiled kernel serves every width of the weights
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    slot = tl.load(rows_ptr + row)
    w = tl.load(w_ptr + row * stride_w + offs, mask=mask, other=0.0)
    # cond[c]: the condition weighing column c, -1 for none (columns past the table's are never gated)
    cond = tl.load(cond_ptr + offs, mask=offs < n_gated, other=-1)
    gated = cond >= 0
    # A row of no deciding request (the scratch slot) reads 0, whatever the scratch slot holds
    flag = tl.load(flags_ptr + slot * n_flags + cond, mask=mask & gated & (slot != scratch), other=0.0)
    tl.store(out_ptr + row * stride_o + offs, tl.where(gated, w * flag, w), mask=mask)
