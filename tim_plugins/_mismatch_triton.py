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
It adds its totals to float64 batch accumulators with two vector atomics. The last segment of a row to finish
(a per-row ticket) takes the row's Σd, which gives the sequence statistics. The last program of the launch (a
global ticket, the classic "last block" reduction) folds the batch totals and the histogram copies into the
monitor's float64 state and leaves every scratch buffer reset for the next launch. With ``fresh`` it
overwrites the state instead of adding to it, so a reset costs no extra launch. With ``DEVICE_METRICS`` it
then also derives the final metric vector (means, quantiles, NaN rules of ``MismatchMonitor.compute``) from
the new state, so ``compute()`` only copies and labels it. Float atomics make the last bits of the sums
depend on the programs' order; counts, histogram and maxima are exact.
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
def _pick(vec, cols, i):
    return tl.sum(tl.where(cols == i, vec, 0.0), axis=0)


@triton.jit
def _pick_max(vec, cols, i):
    return tl.max(tl.where(cols == i, vec, -float("inf")), axis=0)


@triton.jit
def _fold_into_state(
    sums_ptr, maxes_ptr, hist_ptr, state_ptr, fresh,
    MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr, BUCKET_COUNT_OFFSET: tl.constexpr,
    N_SB: tl.constexpr, N_SB_POW2: tl.constexpr, REPLICAS: tl.constexpr, COLS: tl.constexpr,
):
    """Run by the last program only, when every other program's atomics are complete: take the batch totals
    (resetting them for the next launch) and fold them into the float64 state."""
    cols = tl.arange(0, COLS)
    acc = tl.load(sums_ptr + cols, cache_modifier=".cg")  # read at L2, where the atomics happened
    tl.store(sums_ptr + cols, tl.zeros((COLS,), tl.float64))
    m_cols = tl.arange(0, 8)
    mx = tl.load(maxes_ptr + m_cols, cache_modifier=".cg")
    tl.store(maxes_ptr + m_cols, tl.zeros((8,), tl.float64) - float("inf"))
    keep = fresh == 0  # fresh: the state is overwritten (a reset without a separate launch)

    # The signed d histogram: sum the copies into the state, then clear them for the next launch. Loads
    # bypass L1 (.cg): other SMs wrote the copies during this launch.
    reps = tl.arange(0, 4)  # four copies at a time: all of them at once would spill registers
    sb = tl.arange(0, N_SB_POW2)
    in_sb = sb < N_SB
    counts = tl.zeros((N_SB_POW2,), tl.int32)
    for k in tl.static_range(0, REPLICAS, 4):
        copy_ptrs = hist_ptr + (k + reps[:, None]) * N_SB + sb[None, :]
        counts += tl.sum(tl.load(copy_ptrs, mask=in_sb[None, :], other=0, cache_modifier=".cg"), axis=0)
        tl.store(copy_ptrs, tl.zeros((4, N_SB_POW2), tl.int32), mask=in_sb[None, :])
    hist_ptrs = state_ptr + HIST_OFFSET + sb
    prev = tl.where(keep, tl.load(hist_ptrs, mask=in_sb, other=0.0, cache_modifier=".cg"), 0.0)
    tl.store(hist_ptrs, prev + counts.to(tl.float64), mask=in_sb)

    # Scalar slots: tokens, invalid, abs_d, abs_p, neg_d, k3, rho_m1, rho_m1_sq, outside, seqs,
    # seq_log_ratio, is_tokens, is_w, is_w2, is_masked. One vector read-modify-write, not 15 scalar ones.
    slot = tl.arange(0, 16)
    abs_d = _pick(acc, cols, 12) + _pick(acc, cols, 13) + _pick(acc, cols, 14) + _pick(acc, cols, 15)
    abs_d += _pick(acc, cols, 16)
    tokens = _pick(acc, cols, 17) + _pick(acc, cols, 18) + _pick(acc, cols, 19) + _pick(acc, cols, 20)
    tokens += _pick(acc, cols, 21)
    sum_d = _pick(acc, cols, 1)
    upd = tl.zeros((16,), tl.float64)
    upd = tl.where(slot == 0, tokens, upd)
    upd = tl.where(slot == 1, _pick(acc, cols, 7), upd)
    upd = tl.where(slot == 2, abs_d, upd)
    upd = tl.where(slot == 3, _pick(acc, cols, 0), upd)
    upd = tl.where(slot == 4, -sum_d, upd)
    upd = tl.where(slot == 5, _pick(acc, cols, 2), upd)
    upd = tl.where(slot == 6, _pick(acc, cols, 3), upd)
    upd = tl.where(slot == 7, _pick(acc, cols, 4), upd)
    upd = tl.where(slot == 8, _pick(acc, cols, 5), upd)
    upd = tl.where(slot == 9, _pick(acc, cols, 22), upd)  # sequences with a valid token
    upd = tl.where(slot == 10, sum_d, upd)  # Σ over sequences of Σ_t d: invalid and masked tokens have d = 0
    upd = tl.where(slot == 11, _pick(acc, cols, 8), upd)
    upd = tl.where(slot == 12, _pick(acc, cols, 9), upd)
    upd = tl.where(slot == 13, _pick(acc, cols, 10), upd)
    upd = tl.where(slot == 14, _pick(acc, cols, 11), upd)
    in_slots = slot < 15
    prev = tl.where(keep, tl.load(state_ptr + slot, mask=in_slots, other=0.0, cache_modifier=".cg"), 0.0)
    tl.store(state_ptr + slot, prev + upd, mask=in_slots)

    # Bucket counts ×5 then bucket |d| sums ×5 (contiguous in the state).
    bucket = tl.zeros((16,), tl.float64)
    for k in tl.static_range(5):
        bucket = tl.where(slot == k, _pick(acc, cols, 17 + k), bucket)
        bucket = tl.where(slot == 5 + k, _pick(acc, cols, 12 + k), bucket)
    in_buckets = slot < 10
    bucket_ptrs = state_ptr + BUCKET_COUNT_OFFSET + slot
    prev = tl.where(keep, tl.load(bucket_ptrs, mask=in_buckets, other=0.0, cache_modifier=".cg"), 0.0)
    tl.store(bucket_ptrs, prev + bucket, mask=in_buckets)

    # Maxima, state order: abs_d_max, abs_p_max, rho_m1_max, neg_rho_m1_min, seq_abs_max, is_w_max,
    # neg_is_w_min. The batch maxima are ordered d, −d, abs_p, w, −w, |Σd| of a sequence.
    d_max = _pick_max(mx, m_cols, 0)
    neg_d_min = _pick_max(mx, m_cols, 1)
    new_max = tl.zeros((8,), tl.float64) - float("inf")
    new_max = tl.where(m_cols == 0, tl.maximum(d_max, neg_d_min), new_max)
    new_max = tl.where(m_cols == 1, _pick_max(mx, m_cols, 2), new_max)
    new_max = tl.where(m_cols == 2, _expm1(d_max), new_max)  # ρ is monotone in d
    new_max = tl.where(m_cols == 3, -_expm1(-neg_d_min), new_max)
    new_max = tl.where(m_cols == 4, _pick_max(mx, m_cols, 5), new_max)
    new_max = tl.where(m_cols == 5, _pick_max(mx, m_cols, 3), new_max)
    new_max = tl.where(m_cols == 6, _pick_max(mx, m_cols, 4), new_max)
    in_max = m_cols < 7
    max_ptrs = state_ptr + MAX_OFFSET + m_cols
    prev = tl.where(keep, tl.load(max_ptrs, mask=in_max, other=0.0, cache_modifier=".cg"), -float("inf"))
    tl.store(max_ptrs, tl.maximum(prev, new_max), mask=in_max)


@triton.jit
def _write_metrics(
    state_ptr, edges_ptr, metrics_ptr, MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr,
    BUCKET_COUNT_OFFSET: tl.constexpr, N_SB: tl.constexpr, N_EDGES: tl.constexpr, N_ABS_POW2: tl.constexpr,
    N_METRICS: tl.constexpr,
):
    """The final metric vector from the just-folded state, in ``MismatchMonitor.compute``'s value order and
    with its rules (NaN where undefined), so that compute() only copies it. Run by the last program."""
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
    cum = tl.cumsum(folded, axis=0)
    total = tl.sum(folded, axis=0)  # integer counts: exact in float64, whatever the order
    q99 = _edge_quantile(cum, total, tl.full((), 0.99, tl.float64), edges_ptr, abs_d_max, N_EDGES)
    q999 = _edge_quantile(cum, total, tl.full((), 0.999, tl.float64), edges_ptr, abs_d_max, N_EDGES)

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


@triton.jit
def _edge_quantile(cum, total, q, edges_ptr, exact_max, N_EDGES: tl.constexpr):
    """``_hist_quantiles`` of ``metrics``: bin i = #(cum < q·N); 0 if i == 0, else min(E_i, max); NaN if
    the histogram is empty."""
    i = tl.sum((cum < q * total).to(tl.int32), axis=0)
    edge = tl.load(edges_ptr + tl.minimum(i, N_EDGES - 1))
    edge = tl.where(i < N_EDGES, edge, float("inf"))
    value = tl.where(i == 0, 0.0, tl.minimum(edge, exact_max))
    return tl.where(total > 0, value, float("nan"))


@triton.jit(do_not_specialize=["B", "n_seg", "fresh"])
def _mismatch_kernel(
    rollout_ptr, train_ptr, mask_ptr, w_ptr, sums_ptr, maxes_ptr, row_d_ptr, row_n_ptr, row_ticket_ptr, hist_ptr,
    counter_ptr, edges_ptr, metrics_ptr, state_ptr, log_lo, log_hi, B, T, n_seg, fresh,
    # Fixed constants are constexpr; launches skip Triton's argument binding, so runtime ones cost little.
    e1: tl.constexpr, e2: tl.constexpr, e3: tl.constexpr, e4: tl.constexpr, invalid_threshold: tl.constexpr,
    log_lo_edge: tl.constexpr, bins_per_decade: tl.constexpr, N_SB: tl.constexpr, N_SB_POW2: tl.constexpr,
    CENTRE: tl.constexpr, MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr,
    BUCKET_COUNT_OFFSET: tl.constexpr, HAS_W: tl.constexpr, N_SUMS: tl.constexpr, COLS: tl.constexpr,
    N_EDGES: tl.constexpr, REPLICAS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_HISTOGRAM: tl.constexpr, DEVICE_METRICS: tl.constexpr, N_METRICS: tl.constexpr,
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
    # Neighbouring threads hit different histogram copies: a warp's 32 atomics on the few busy bins
    # (d ≈ 0) then go to 32 addresses, not one.
    hist_lane = hist_ptr + ((lane + row) % REPLICAS) * N_SB + CENTRE
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
        tl.atomic_add(hist_ptr + copy * N_SB + sb, block_hist, mask=(block_hist > 0) & (sb < N_SB), sem="relaxed")
    # This program's totals, added at L2 by two vector atomics (float64 sums, maxima as ordered integers).
    cols = tl.arange(0, COLS)
    part = tl.zeros((COLS,), tl.float32)
    part = tl.where(cols == 0, tl.sum(s_abs_p, axis=0), part)
    part = tl.where(cols == 1, tl.sum(s_d, axis=0), part)
    part = tl.where(cols == 2, tl.sum(s_k3, axis=0), part)
    part = tl.where(cols == 3, tl.sum(s_rho, axis=0), part)
    part = tl.where(cols == 4, tl.sum(s_rho2, axis=0), part)
    part = tl.where(cols == 5, tl.sum(s_out, axis=0), part)
    part = tl.where(cols == 6, tl.sum(s_n, axis=0), part)
    part = tl.where(cols == 7, tl.sum(s_bad, axis=0), part)
    part = tl.where(cols == 8, tl.sum(s_wn, axis=0), part)
    part = tl.where(cols == 9, tl.sum(s_w, axis=0), part)
    part = tl.where(cols == 10, tl.sum(s_w2, axis=0), part)
    part = tl.where(cols == 11, tl.sum(s_w0, axis=0), part)
    part = tl.where(cols == 12, tl.sum(a0, axis=0), part)
    part = tl.where(cols == 13, tl.sum(a1, axis=0), part)
    part = tl.where(cols == 14, tl.sum(a2, axis=0), part)
    part = tl.where(cols == 15, tl.sum(a3, axis=0), part)
    part = tl.where(cols == 16, tl.sum(a4, axis=0), part)
    part = tl.where(cols == 17, tl.sum(c0, axis=0), part)
    part = tl.where(cols == 18, tl.sum(c1, axis=0), part)
    part = tl.where(cols == 19, tl.sum(c2, axis=0), part)
    part = tl.where(cols == 20, tl.sum(c3, axis=0), part)
    part = tl.where(cols == 21, tl.sum(c4, axis=0), part)
    tl.atomic_add(sums_ptr + cols, part.to(tl.float64), mask=cols < N_SUMS, sem="relaxed")
    m_cols = tl.arange(0, 8)
    part_max = tl.zeros((8,), tl.float32) - float("inf")
    part_max = tl.where(m_cols == 0, tl.max(m_d, axis=0), part_max)
    part_max = tl.where(m_cols == 1, tl.max(m_nd, axis=0), part_max)
    part_max = tl.where(m_cols == 2, tl.max(m_p, axis=0), part_max)
    part_max = tl.where(m_cols == 3, tl.max(m_w, axis=0), part_max)
    part_max = tl.where(m_cols == 4, tl.max(m_nw, axis=0), part_max)
    tl.atomic_max(maxes_ptr + m_cols, part_max.to(tl.float64), mask=m_cols < 5, sem="relaxed")
    # Sequence statistics: the row's last segment to finish takes the row's totals (and resets them).
    tl.atomic_add(row_d_ptr + row, tl.sum(s_d, axis=0).to(tl.float64), sem="relaxed")
    tl.atomic_add(row_n_ptr + row, tl.sum(s_n, axis=0).to(tl.int32), sem="relaxed")
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
            sums_ptr, maxes_ptr, hist_ptr, state_ptr, fresh, MAX_OFFSET, HIST_OFFSET, BUCKET_COUNT_OFFSET, N_SB,
            N_SB_POW2, REPLICAS, COLS,
        )
        if DEVICE_METRICS:
            _write_metrics(
                state_ptr, edges_ptr, metrics_ptr, MAX_OFFSET, HIST_OFFSET, BUCKET_COUNT_OFFSET, N_SB, N_EDGES,
                N_SB_POW2 // 2, N_METRICS,
            )
        tl.store(counter_ptr, 0)
