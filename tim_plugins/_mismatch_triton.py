"""The monitor's per-batch pass as one Triton kernel, for CUDA: the whole ``update()`` in one launch.

Why: on a GPU the statistics themselves take microseconds; what costs is launching work and waiting for it.
The torch.compile'd pass launches ~10 kernels plus the histogram and the state update (~0.8 ms per
``update()`` on an H200 for 256×4096, most of it host-side). Here one kernel does everything (~37 µs of GPU
time for 256×4096 on an H200). Same formulas and binning as ``_mismatch_pass`` (the CUDA tests compare them;
the CPU tests run this kernel under ``TRITON_INTERPRET=1``). Host side (launch shape, scratch buffers, the
launch itself): ``_mismatch_launch``. Triton ships with CUDA builds of torch; it is imported only here and there.

One program per (row, segment of BLOCK × ITERS tokens) computes float32 partial sums and maxima and counts its
tokens into the |d| histogram, by one of two methods (constexpr ``BLOCK_HISTOGRAM``):
- global atomics (the default): one integer atomic per token, spread over REPLICAS copies (neighbouring
  threads hit different copies, so the few busy bins near d ≈ 0 are not contended by a whole warp);
- a block histogram: ``tl.histogram`` counts each BLOCK of tokens in shared memory, the counts accumulate in
  registers, and the program adds its non-zero bins to one copy at the end: ~10× fewer global atomics.
It adds its totals to float64 batch accumulators with two vector atomics, each after one reduction of its
columns stacked side by side (one cross-warp exchange, not one per column). The last segment of a row to finish
(a per-row ticket) takes the row's Σd, which gives the sequence statistics. The last program of the launch (a
global ticket, the classic "last block" reduction) folds the batch totals and the histogram copies into the
monitor's float64 state and leaves every scratch buffer ready for the next launch (the histogram copies come in
two sets that alternate between launches: each launch's programs clear the set the previous launch used).
With ``fresh`` it overwrites the state instead of adding to it, so a reset costs no extra launch. With
``DEVICE_METRICS`` it then also derives the final metric vector (means, quantiles, NaN rules of
``MismatchMonitor.compute``) from the new state, into pinned host memory by default, so ``compute()`` only
waits for it and labels it (with ``WAIT_FLAG``, the default, it polls the launch id written after the vector
instead of synchronising the device).
Float atomics make the last bits of the sums depend on the programs' order; counts, histogram and maxima are
exact.
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

from tim_plugins._mismatch_pass import N_BUCKETS, PROB_BUCKET_EDGES

__all__ = ["DEVICE_METRIC_SLOTS", "N_PART_SUMS", "SUM_COLS", "LOG_PROB_EDGES"]

LOG_PROB_EDGES = tuple(math.log(e) for e in PROB_BUCKET_EDGES[1:-1])
# Partial columns. Sums: abs_p, Σd, k3, ρ−1, (ρ−1)², outside, valid, invalid, IS n, Σw, Σw², IS zeros,
# bucket |d| sums ×5, bucket counts ×5. Maxima: d, −d, abs_p, w, −w, and a sequence's |Σd|.
N_PART_SUMS = 12 + 2 * N_BUCKETS
SUM_COLS = 32  # batch sums: the partial columns, then the count of sequences with a valid token
# Histogram copies the last program reads per 2D load (8 × 1024 int32: 64 registers a thread at 4 warps).
FOLD_ROWS = tl.constexpr(8)
# The device metric vector: compute()'s values in its key order (28), the 5 IS metrics, then the IS count.
DEVICE_METRIC_SLOTS = 34
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _expm1_portable(x):
    # Kahan's expm1 from exp and log, for the interpreter (which has no libdevice).
    u = tl.exp(x)
    um1 = u - 1.0
    out = tl.where(u == 1.0, x, um1 * x / tl.log(u))
    out = tl.where(um1 == -1.0, -1.0, out)
    return tl.where(u == float("inf"), float("inf"), out)


@triton.jit
def _log10_portable(x):
    return tl.log(x) * 0.4342944819032518


if _INTERPRET:
    _expm1, _log10 = _expm1_portable, _log10_portable
else:  # libdevice: correctly rounded to ~1 ulp (tl.exp/tl.log are fast approximations on NVIDIA GPUs)
    from triton.language.extra import libdevice

    _expm1, _log10 = libdevice.expm1, libdevice.log10


@triton.jit
def _bit_reverse(i, BITS: tl.constexpr):
    out = tl.zeros_like(i)
    for b in tl.static_range(BITS):
        out |= ((i >> b) & 1) << (BITS - 1 - b)
    return out


@triton.jit
def _stack8(v0, v1, v2, v3, v4, v5, v6, v7):
    """[N] × 8 → [N, 8]. tl.join appends a trailing dimension, so in a tree of joins the first level varies
    slowest: vector k lands in column bit_reverse(k, 3)."""
    s = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    return tl.reshape(s, (v0.shape[0], 8))


@triton.jit
def _stack32(
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, v16, v17, v18, v19, v20, v21, v22,
    v23, v24, v25, v26, v27, v28, v29, v30, v31,
):
    """[N] × 32 → [N, 32]; vector k lands in column bit_reverse(k, 5) (see ``_stack8``)."""
    a = tl.join(
        tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7))),
        tl.join(tl.join(tl.join(v8, v9), tl.join(v10, v11)), tl.join(tl.join(v12, v13), tl.join(v14, v15))),
    )
    b = tl.join(
        tl.join(tl.join(tl.join(v16, v17), tl.join(v18, v19)), tl.join(tl.join(v20, v21), tl.join(v22, v23))),
        tl.join(tl.join(tl.join(v24, v25), tl.join(v26, v27)), tl.join(tl.join(v28, v29), tl.join(v30, v31))),
    )
    return tl.reshape(tl.join(a, b), (v0.shape[0], 32))


@triton.jit
def _fold_into_state(
    sums_ptr, maxes_ptr, hist_ptr, state_ptr, fresh,
    MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr, BUCKET_COUNT_OFFSET: tl.constexpr,
    N_SB: tl.constexpr, N_SB_POW2: tl.constexpr, REPLICAS: tl.constexpr, N_SUMS: tl.constexpr,
    COLS: tl.constexpr, FOLD_ROWS: tl.constexpr,
):
    """Run by the last program only, when every other program's atomics are complete: take the batch totals
    (resetting them for the next launch) and fold them into the float64 state. ``hist_ptr``: the histogram
    copies this launch counted into.

    Every load comes before the first store: the compiler keeps a load behind any store that may alias it, so
    each store → load pair would add one more round trip to L2 to the end of the launch. Loads bypass L1
    (.cg): other SMs wrote these buffers during this launch. With ``fresh`` the state's previous values are
    not loaded at all (masked off): the state is overwritten, a reset without a separate launch."""
    cols = tl.arange(0, COLS)
    acc = tl.load(sums_ptr + cols, cache_modifier=".cg")
    m_cols = tl.arange(0, 8)
    mx = tl.load(maxes_ptr + m_cols, cache_modifier=".cg")
    # The signed d histogram: this launch's copies, FOLD_ROWS at a time as one 2D load each, so that many
    # loads are in flight (a copy at a time cost ~7 µs per 64 copies on the H200). They are not cleared here:
    # the next launch's programs clear them, all in parallel (see the kernel).
    sb = tl.arange(0, N_SB_POW2)
    in_sb = sb < N_SB
    counts = tl.zeros((N_SB_POW2,), tl.int32)
    for k in tl.static_range(0, REPLICAS, FOLD_ROWS):
        copy = k + tl.arange(0, FOLD_ROWS)
        in_block = (copy[:, None] < REPLICAS) & in_sb[None, :]
        block = tl.load(hist_ptr + copy[:, None] * N_SB + sb[None, :], mask=in_block, other=0, cache_modifier=".cg")
        counts += tl.sum(block, axis=0)
    hist_ptrs = state_ptr + HIST_OFFSET + sb
    # (Masks are whole vectors: the interpreter does not broadcast a scalar condition into a load mask.)
    prev_hist = tl.load(hist_ptrs, mask=in_sb & ((sb * 0 + fresh) == 0), other=0.0, cache_modifier=".cg")
    # The state's sum slots: rows 0-14 tokens, invalid, abs_d, abs_p, neg_d, k3, rho_m1, rho_m1_sq, outside,
    # seqs (column N_SUMS), seq_log_ratio, is_tokens, is_w, is_w2, is_masked; rows 16-25 bucket counts ×5, then
    # bucket |d| sums ×5 (contiguous in the state).
    row = tl.arange(0, 32)
    in_slots = (row < 15) | ((row >= 16) & (row <= 25))
    slot_ptrs = state_ptr + tl.where(row < 16, row, BUCKET_COUNT_OFFSET + (row - 16))
    prev_slots = tl.load(slot_ptrs, mask=in_slots & ((row * 0 + fresh) == 0), other=0.0, cache_modifier=".cg")
    in_max = m_cols < 7
    max_ptrs = state_ptr + MAX_OFFSET + m_cols
    prev_max = tl.load(max_ptrs, mask=in_max & ((m_cols * 0 + fresh) == 0), other=-float("inf"), cache_modifier=".cg")

    # The batch totals are taken: reset them for the next launch.
    tl.store(sums_ptr + cols, tl.zeros((COLS,), tl.float64))
    tl.store(maxes_ptr + m_cols, tl.zeros((8,), tl.float64) - float("inf"))
    tl.store(hist_ptrs, prev_hist + counts.to(tl.float64), mask=in_sb)

    # Each sum slot is a sum of batch columns: one masked reduction of a [32, COLS] table (where, not a 0/1
    # product: an inf column would turn every slot into NaN).
    r = row[:, None]
    c = cols[None, :]
    take = ((r == 0) & (c >= 17) & (c <= 21)) | ((r == 1) & (c == 7)) | ((r == 2) & (c >= 12) & (c <= 16))
    take |= ((r == 3) & (c == 0)) | ((r == 4) & (c == 1)) | ((r >= 5) & (r <= 8) & (c == r - 3))
    take |= ((r == 9) & (c == N_SUMS)) | ((r == 10) & (c == 1)) | ((r >= 11) & (r <= 14) & (c == r - 3))
    take |= ((r >= 16) & (r <= 20) & (c == r + 1)) | ((r >= 21) & (r <= 25) & (c == r - 9))
    slots = tl.sum(tl.where(take, acc[None, :], 0.0), axis=1)
    slots = tl.where(row == 4, -slots, slots)  # neg_d = −Σd; seq_log_ratio = Σd (invalid and masked: d = 0)
    tl.store(slot_ptrs, prev_slots + slots, mask=in_slots)

    # Maxima, state order: abs_d_max, abs_p_max, rho_m1_max, neg_rho_m1_min, seq_abs_max, is_w_max,
    # neg_is_w_min, from the batch maxima of d, −d, abs_p, w, −w, |Σd| of a sequence (one reduction).
    mr = m_cols[:, None]
    mc = m_cols[None, :]
    take_max = ((mr == 0) & (mc <= 1)) | ((mr == 1) & (mc == 2)) | ((mr == 2) & (mc == 0))
    take_max |= ((mr == 3) & (mc == 1)) | ((mr == 4) & (mc == 5)) | ((mr >= 5) & (mr <= 6) & (mc == mr - 2))
    new_max = tl.max(tl.where(take_max, mx[None, :], -float("inf")), axis=1)
    # ρ is monotone in d: max ρ − 1 = expm1(max d), and −(min ρ − 1) = −expm1(−max(−d)).
    new_max = tl.where(m_cols == 2, _expm1(new_max), tl.where(m_cols == 3, -_expm1(-new_max), new_max))
    tl.store(max_ptrs, tl.maximum(prev_max, new_max), mask=in_max)


@triton.jit
def _write_metrics(
    state_ptr, edges_ptr, metrics_ptr, launch_id, MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr,
    BUCKET_COUNT_OFFSET: tl.constexpr, N_SB: tl.constexpr, N_EDGES: tl.constexpr, N_ABS_POW2: tl.constexpr,
    N_METRICS: tl.constexpr, WAIT_FLAG: tl.constexpr,
):
    """The final metric vector from the just-folded state, in ``MismatchMonitor.compute``'s value order and
    with its rules (NaN where undefined), so that compute() only reads it. Run by the last program. With
    ``WAIT_FLAG`` the launch's id follows (an int64) in the slot after the vector, once the whole vector is."""
    tl.debug_barrier()  # the fold's stores, by this program's threads, before they are read back
    nan = float("nan")
    n = tl.load(state_ptr + 0, cache_modifier=".cg")
    abs_d = tl.load(state_ptr + 2, cache_modifier=".cg")
    abs_p = tl.load(state_ptr + 3, cache_modifier=".cg")
    neg_d = tl.load(state_ptr + 4, cache_modifier=".cg")
    k3 = tl.load(state_ptr + 5, cache_modifier=".cg")
    rho_m1 = tl.load(state_ptr + 6, cache_modifier=".cg")
    rho_m1_sq = tl.load(state_ptr + 7, cache_modifier=".cg")
    outside = tl.load(state_ptr + 8, cache_modifier=".cg")
    seqs = tl.load(state_ptr + 9, cache_modifier=".cg")
    seq_log_ratio = tl.load(state_ptr + 10, cache_modifier=".cg")
    is_n = tl.load(state_ptr + 11, cache_modifier=".cg")
    is_w = tl.load(state_ptr + 12, cache_modifier=".cg")
    is_w2 = tl.load(state_ptr + 13, cache_modifier=".cg")
    is_masked = tl.load(state_ptr + 14, cache_modifier=".cg")
    abs_d_max = tl.load(state_ptr + MAX_OFFSET, cache_modifier=".cg")
    abs_p_max = tl.load(state_ptr + MAX_OFFSET + 1, cache_modifier=".cg")
    rho_m1_max = tl.load(state_ptr + MAX_OFFSET + 2, cache_modifier=".cg")
    neg_rho_m1_min = tl.load(state_ptr + MAX_OFFSET + 3, cache_modifier=".cg")
    seq_abs_max = tl.load(state_ptr + MAX_OFFSET + 4, cache_modifier=".cg")
    is_w_max = tl.load(state_ptr + MAX_OFFSET + 5, cache_modifier=".cg")
    neg_is_w_min = tl.load(state_ptr + MAX_OFFSET + 6, cache_modifier=".cg")
    abs_d_max = tl.where(abs_d_max == -float("inf"), nan, abs_d_max)

    # |d| quantiles: fold the signed histogram (|d| bin k = centre + k and centre − k), then the first bin
    # whose cumulative count reaches q·N (the count of bins below q·N); its upper edge, capped at the max.
    k = tl.arange(0, N_ABS_POW2)
    centre = (N_SB - 1) // 2
    hist = state_ptr + HIST_OFFSET + centre
    folded = tl.load(hist + k, mask=k <= centre, other=0.0, cache_modifier=".cg")
    folded += tl.load(hist - k, mask=(k >= 1) & (k <= centre), other=0.0, cache_modifier=".cg")
    # All the edges, loaded with the histogram: picking one after the count is known would be another round
    # trip to memory at the end of the launch. Past the last edge: +inf (the overflow bin).
    edges = tl.load(edges_ptr + k, mask=k < N_EDGES, other=float("inf"))
    cum = tl.cumsum(folded, axis=0)
    total = tl.sum(folded, axis=0)  # integer counts: exact in float64, whatever the order
    q99 = _edge_quantile(cum, total, tl.full((), 0.99, tl.float64), edges, k, abs_d_max)
    q999 = _edge_quantile(cum, total, tl.full((), 0.999, tl.float64), edges, k, abs_d_max)

    inv_n = 1.0 / n  # compute() multiplies by 1/n too: the same roundings
    j = tl.arange(0, 64)
    v = tl.zeros((64,), tl.float64)
    v = tl.where(j == 0, n, v)
    v = tl.where(j == 1, tl.load(state_ptr + 1, cache_modifier=".cg"), v)
    v = tl.where(j == 2, abs_d * inv_n, v)
    v = tl.where(j == 3, abs_d_max, v)
    v = tl.where(j == 4, abs_p * inv_n, v)
    v = tl.where(j == 5, tl.where(abs_p_max == -float("inf"), nan, abs_p_max), v)
    v = tl.where(j == 6, neg_d * inv_n, v)
    v = tl.where(j == 7, k3 * inv_n, v)
    v = tl.where(j == 8, (2.0 * rho_m1 + rho_m1_sq) * inv_n, v)  # chi2 = 2 E[ρ − 1] + E[(ρ − 1)²]
    v = tl.where(j == 9, 1.0 + rho_m1 * inv_n, v)
    v = tl.where(j == 10, 1.0 - neg_rho_m1_min, v)
    v = tl.where(j == 11, tl.where(rho_m1_max == -float("inf"), nan, 1.0 + rho_m1_max), v)
    v = tl.where(j == 12, outside * inv_n, v)
    v = tl.where(j == 13, q99, v)
    v = tl.where(j == 14, q999, v)
    token = (j >= 2) & (j <= 14)
    v = tl.where(token, tl.where(n > 0, v, nan), v)  # no valid token: token statistics undefined
    v = tl.where(j == 15, seqs, v)
    v = tl.where(j == 16, tl.where(seqs > 0, seq_log_ratio / seqs, nan), v)
    v = tl.where(j == 17, tl.where(seqs > 0, seq_abs_max, nan), v)
    # by_prob: (count, |d| sum / count) per bucket; the state holds counts ×5, then |d| sums ×5.
    in_prob = (j >= 18) & (j < 28)
    bucket = (j - 18) // 2
    count = tl.load(state_ptr + BUCKET_COUNT_OFFSET + bucket, mask=in_prob, other=0.0, cache_modifier=".cg")
    abs_sum = tl.load(state_ptr + BUCKET_COUNT_OFFSET + 5 + bucket, mask=in_prob, other=0.0, cache_modifier=".cg")
    by_prob = tl.where((j - 18) % 2 == 0, count, tl.where(count > 0, abs_sum / count, nan))
    v = tl.where(in_prob, by_prob, v)
    # IS weights (read by compute() only when the IS count is > 0); ESS = (Σw)² / (N Σw²).
    v = tl.where(j == 28, is_w / is_n, v)
    v = tl.where(j == 29, -neg_is_w_min, v)
    v = tl.where(j == 30, is_w_max, v)
    v = tl.where(j == 31, is_masked / is_n, v)
    v = tl.where(j == 32, tl.where(is_w2 > 0, is_w * is_w / (is_n * is_w2), 0.0), v)
    v = tl.where(j == 33, is_n, v)
    tl.store(metrics_ptr + j, v, mask=j < N_METRICS)
    if WAIT_FLAG:
        # The host polls this slot instead of synchronising the device. Every thread's stores above are
        # ordered before it by the barrier, and the release at system scope makes them visible to the host
        # before the id (the pattern of a CUTLASS semaphore, at system scope for pinned host memory).
        tl.debug_barrier()
        flag_ptr = (metrics_ptr + N_METRICS).to(tl.pointer_type(tl.int64))  # an integer slot
        tl.atomic_xchg(flag_ptr, launch_id.to(tl.int64), sem="release", scope="sys")


@triton.jit
def _edge_quantile(cum, total, q, edges, k, exact_max):
    """``_hist_quantiles`` of ``metrics``: bin i = #(cum < q·N); 0 if i == 0, else min(E_i, max); NaN if
    the histogram is empty. ``edges[k]`` = E_k (+inf past the last edge)."""
    i = tl.sum((cum < q * total).to(tl.int32), axis=0)
    edge = tl.min(tl.where(k == i, edges, float("inf")), axis=0)
    value = tl.where(i == 0, 0.0, tl.minimum(edge, exact_max))
    return tl.where(total > 0, value, float("nan"))


@triton.jit(do_not_specialize=["B", "n_seg", "fresh", "launch_id"])
def _mismatch_kernel(
    rollout_ptr, train_ptr, mask_ptr, w_ptr, sums_ptr, maxes_ptr, row_d_ptr, row_n_ptr, row_ticket_ptr, hist_ptr,
    counter_ptr, edges_ptr, metrics_ptr, state_ptr, log_lo, log_hi, B, T, n_seg, fresh, launch_id,
    # Fixed constants are constexpr; launches skip Triton's argument binding, so runtime ones cost little.
    e1: tl.constexpr, e2: tl.constexpr, e3: tl.constexpr, e4: tl.constexpr, invalid_threshold: tl.constexpr,
    log_lo_edge: tl.constexpr, bins_per_decade: tl.constexpr, N_SB: tl.constexpr, N_SB_POW2: tl.constexpr,
    CENTRE: tl.constexpr, MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr,
    BUCKET_COUNT_OFFSET: tl.constexpr, HAS_W: tl.constexpr, N_SUMS: tl.constexpr, COLS: tl.constexpr,
    N_EDGES: tl.constexpr, REPLICAS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_HISTOGRAM: tl.constexpr, DEVICE_METRICS: tl.constexpr, N_METRICS: tl.constexpr, WAIT_FLAG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_start = row * T  # inputs are contiguous [B, T]
    zero = tl.zeros((BLOCK,), tl.float32)
    s_abs_p = zero
    s_d = zero
    s_k3 = zero
    s_rho = zero
    s_rho2 = zero
    s_out = zero
    s_n = zero
    s_bad = zero
    s_wn = zero
    s_w = zero
    s_w2 = zero
    s_w0 = zero
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    a4 = zero
    c0 = zero
    c1 = zero
    c2 = zero
    c3 = zero
    c4 = zero
    m_d = zero - float("inf")
    m_nd = zero - float("inf")
    m_p = zero - float("inf")
    m_w = zero - float("inf")
    m_nw = zero - float("inf")
    lane = tl.arange(0, BLOCK)
    # Two sets of histogram copies, used by alternate launches: this launch counts into one (its last program
    # folds them and flips the parity) while its programs clear the other, which the previous launch counted
    # into and folded. Clearing its ~4.5 × 10^4 counters is then spread over every program instead of ending the
    # launch with one program's serial pass.
    parity = tl.load(counter_ptr + 1)
    set_size = REPLICAS * N_SB
    hist_set = hist_ptr + parity * set_size
    clear = tl.cdiv(set_size, B * n_seg)  # counters each program clears
    clear_start = (row * n_seg + seg) * clear
    clear_end = tl.minimum(clear_start + clear, set_size)
    other_set = hist_ptr + (1 - parity) * set_size
    for start in range(clear_start, clear_end, BLOCK):
        tl.store(other_set + start + lane, tl.zeros((BLOCK,), tl.int32), mask=start + lane < clear_end)
    # Neighbouring threads hit different histogram copies: a warp's 32 atomics on the few busy bins
    # (d ≈ 0) then go to 32 addresses, not one.
    hist_lane = hist_set + ((lane + row) % REPLICAS) * N_SB + CENTRE
    block_hist = tl.zeros((N_SB_POW2,), tl.int32)
    for i in range(ITERS):
        offs = seg * (BLOCK * ITERS) + i * BLOCK + lane
        inb = offs < T
        r = tl.load(rollout_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
        t = tl.load(train_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
        response = (tl.load(mask_ptr + row_start + offs, mask=inb, other=0) != 0) & inb
        d = t - r  # d = log p_train − log p_rollout
        # Invalid: NaN/±inf in either input (|d| is then NaN or inf) or a placeholder <= -1e3.
        ok = (tl.abs(d) < float("inf")) & (r > invalid_threshold) & (t > invalid_threshold)
        valid = response & ok
        d = tl.where(valid, d, 0.0)
        rr = tl.where(valid, r, 0.0)
        rho_m1 = _expm1(d)  # ρ − 1
        abs_d = tl.abs(d)
        abs_p = tl.exp(rr) * tl.abs(rho_m1)  # |p_train − p_rollout| = p_rollout · |ρ − 1|
        s_abs_p += abs_p
        s_d += d
        s_k3 += rho_m1 - d  # ρ − 1 − log ρ
        s_rho += rho_m1
        s_rho2 += rho_m1 * rho_m1
        s_out += ((d < log_lo) | (d > log_hi)).to(tl.float32)
        s_n += valid.to(tl.float32)
        s_bad += (response & ~ok).to(tl.float32)
        # Bucket of p = exp(rollout): [0, .01), [.01, .1), [.1, .5), [.5, .9), [.9, 1].
        bucket = (rr >= e1).to(tl.int32) + (rr >= e2).to(tl.int32) + (rr >= e3).to(tl.int32)
        bucket += (rr >= e4).to(tl.int32)
        bucket = tl.where(valid, bucket, -1)
        a0 += tl.where(bucket == 0, abs_d, 0.0)
        a1 += tl.where(bucket == 1, abs_d, 0.0)
        a2 += tl.where(bucket == 2, abs_d, 0.0)
        a3 += tl.where(bucket == 3, abs_d, 0.0)
        a4 += tl.where(bucket == 4, abs_d, 0.0)
        c0 += (bucket == 0).to(tl.float32)
        c1 += (bucket == 1).to(tl.float32)
        c2 += (bucket == 2).to(tl.float32)
        c3 += (bucket == 3).to(tl.float32)
        c4 += (bucket == 4).to(tl.float32)
        m_d = tl.maximum(m_d, tl.where(valid, d, -float("inf")))
        m_nd = tl.maximum(m_nd, tl.where(valid, -d, -float("inf")))
        m_p = tl.maximum(m_p, abs_p)
        if HAS_W:
            w = tl.load(w_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
            w_ok = valid & (tl.abs(w) < float("inf"))
            w = tl.where(w_ok, w, 0.0)
            s_wn += w_ok.to(tl.float32)
            s_w += w
            s_w2 += w * w
            s_w0 += (w_ok & (w == 0.0)).to(tl.float32)
            m_w = tl.maximum(m_w, tl.where(w_ok, w, -float("inf")))
            m_nw = tl.maximum(m_nw, tl.where(w_ok, -w, -float("inf")))
        # Signed d bin: |d| bin 0 below 1e-8, else 1 + floor(32 · log10(|d| / 1e-8)), capped at the
        # overflow bin; centre ± |d| bin.
        abs_bin = tl.floor((_log10(abs_d) - log_lo_edge) * bins_per_decade) + 1.0
        abs_bin = tl.minimum(tl.maximum(abs_bin, 0.0), CENTRE).to(tl.int32)
        sign = (d > 0).to(tl.int32) - (d < 0).to(tl.int32)
        if BLOCK_HISTOGRAM:
            block_hist += tl.histogram(CENTRE + sign * abs_bin, N_SB_POW2, mask=valid)
        else:
            tl.atomic_add(hist_lane + sign * abs_bin, tl.full((BLOCK,), 1, tl.int32), mask=valid, sem="relaxed")
    if BLOCK_HISTOGRAM:  # the program's non-zero bins, into one of the copies
        sb = tl.arange(0, N_SB_POW2)
        copy = (row * n_seg + seg) % REPLICAS
        tl.atomic_add(hist_set + copy * N_SB + sb, block_hist, mask=(block_hist > 0) & (sb < N_SB), sem="relaxed")
    # This program's totals, added at L2 by two vector atomics (float64 sums, maxima as ordered integers).
    # One reduction each (one cross-warp exchange, not one per column): the columns are stacked by tl.join.
    zero_col = zero
    part = tl.sum(_stack32(
        s_abs_p, s_d, s_k3, s_rho, s_rho2, s_out, s_n, s_bad, s_wn, s_w, s_w2, s_w0, a0, a1, a2, a3, a4,
        c0, c1, c2, c3, c4, zero_col, zero_col, zero_col, zero_col, zero_col, zero_col, zero_col, zero_col,
        zero_col, zero_col,
    ), axis=0)
    col = _bit_reverse(tl.arange(0, 32), 5)  # the column each stacked position holds
    tl.atomic_add(sums_ptr + col, part.to(tl.float64), mask=col < N_SUMS, sem="relaxed")
    no_max = zero - float("inf")
    part_max = tl.max(_stack8(m_d, m_nd, m_p, m_w, m_nw, no_max, no_max, no_max), axis=0)
    max_col = _bit_reverse(tl.arange(0, 8), 3)
    tl.atomic_max(maxes_ptr + max_col, part_max.to(tl.float64), mask=max_col < 5, sem="relaxed")
    # Sequence statistics: the row's last segment to finish takes the row's totals (and resets them). Its
    # Σd and valid count are columns 1 and 6 of the sums just reduced.
    tl.atomic_add(row_d_ptr + row + col * 0, part.to(tl.float64), mask=col == 1, sem="relaxed")
    tl.atomic_add(row_n_ptr + row + col * 0, part.to(tl.int32), mask=col == 6, sem="relaxed")
    tl.debug_barrier()  # every thread's row atomics before the ticket that publishes them
    if tl.atomic_add(row_ticket_ptr + row, 1, sem="acq_rel", scope="gpu") == n_seg - 1:
        # Every segment of the row has added its totals (before its ticket): read them at L2 (.cg), and
        # reset them for the next launch.
        row_d = tl.load(row_d_ptr + row, cache_modifier=".cg")
        row_n = tl.load(row_n_ptr + row, cache_modifier=".cg")
        tl.store(row_d_ptr + row, 0.0)
        tl.store(row_n_ptr + row, 0)
        tl.store(row_ticket_ptr + row, 0)
        if row_n > 0:  # a sequence counts if it has a valid token
            tl.atomic_add(sums_ptr + N_SUMS, 1.0, sem="relaxed")
            tl.atomic_max(maxes_ptr + 5, tl.abs(row_d), sem="relaxed")
    # "Last block": the barrier orders this program's atomics before its ticket, whose acq_rel atomic
    # publishes them (the pattern of CUDA's cooperative-groups grid sync).
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == B * n_seg - 1:
        _fold_into_state(
            sums_ptr, maxes_ptr, hist_set, state_ptr, fresh, MAX_OFFSET, HIST_OFFSET, BUCKET_COUNT_OFFSET, N_SB,
            N_SB_POW2, REPLICAS, N_SUMS, COLS, FOLD_ROWS,
        )
        if DEVICE_METRICS:
            _write_metrics(
                state_ptr, edges_ptr, metrics_ptr, launch_id, MAX_OFFSET, HIST_OFFSET, BUCKET_COUNT_OFFSET, N_SB,
                N_EDGES, N_SB_POW2 // 2, N_METRICS, WAIT_FLAG,
            )
        tl.store(counter_ptr, 0)
        tl.store(counter_ptr + 1, 1 - parity)
