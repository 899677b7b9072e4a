"""The monitor's per-batch pass as two Triton kernels, for CUDA: the whole ``update()`` in two launches.

Why: on a GPU the statistics themselves take microseconds; what costs is launching work. The torch.compile'd
pass still launches ~10 kernels plus the histogram and the state update: ``update()`` took ~0.65 ms on an
H200 for 256×4096, most of it host-side; with these kernels ~0.15 ms, of which ~55 µs run on the GPU. Kernel 1
computes every per-token quantity and the histogram, kernel 2 folds the partials into the monitor's float64
state. Same formulas and binning as ``_mismatch_pass`` (the CUDA tests
compare them; the CPU tests run these kernels under ``TRITON_INTERPRET=1``). Triton ships with CUDA builds
of torch; it is imported only here.

Kernel 1, one program per (row, segment of ``SEGMENT`` tokens): float32 partial sums and maxima, and the |d|
histogram by integer atomics (order-independent) into ``_REPLICAS`` copies, so that the few busy bins
(d ≈ 0) are contended R times less. Kernel 2, one program: sums the partials in float64 (row by row, which
gives the sequence statistics), adds the histogram copies, updates the state, and zeroes the copies for the
next call.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tim_plugins._mismatch_pass import (
    HISTOGRAM_BINS_PER_DECADE,
    HISTOGRAM_RANGE,
    INVALID_LOGPROB_THRESHOLD,
    N_BUCKETS,
    PROB_BUCKET_EDGES,
)

__all__ = ["triton_update", "SEGMENT"]

BLOCK = 1024
SEGMENT = 4 * BLOCK  # tokens per program of kernel 1
_REPLICAS = 16
_LOG_EDGES = [math.log(e) for e in PROB_BUCKET_EDGES[1:-1]]
_LOG_LO_EDGE = math.log10(HISTOGRAM_RANGE[0])
# Partial columns. Sums: abs_p, Σd, k3, ρ−1, (ρ−1)², outside, valid, invalid, IS n, Σw, Σw², IS zeros,
# bucket |d| sums ×5, bucket counts ×5. Maxima: d, −d, abs_p, w, −w.
_N_PART_SUMS = 12 + 2 * N_BUCKETS
_N_PART_MAXES = 5


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


if os.environ.get("TRITON_INTERPRET") == "1":
    _expm1, _log10 = _expm1_portable, _log10_portable
else:  # libdevice: correctly rounded to ~1 ulp (tl.exp/tl.log are fast approximations on NVIDIA GPUs)
    from triton.language.extra import libdevice

    _expm1, _log10 = libdevice.expm1, libdevice.log10


@triton.jit
def _partials_kernel(
    rollout_ptr, train_ptr, mask_ptr, w_ptr, partial_ptr, hist_ptr, T, n_seg,
    # Constants as constexpr: each runtime argument costs host time at every launch.
    log_lo: tl.constexpr, log_hi: tl.constexpr, e1: tl.constexpr, e2: tl.constexpr, e3: tl.constexpr,
    e4: tl.constexpr, invalid_threshold: tl.constexpr, log_lo_edge: tl.constexpr, bins_per_decade: tl.constexpr,
    N_SB: tl.constexpr, CENTRE: tl.constexpr, REPLICAS: tl.constexpr, HAS_W: tl.constexpr,
    WIDTH: tl.constexpr, N_SUMS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
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
    hist_row = hist_ptr + (row % REPLICAS) * N_SB
    for i in tl.static_range(ITERS):
        offs = seg * (BLOCK * ITERS) + i * BLOCK + tl.arange(0, BLOCK)
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
        tl.atomic_add(hist_row + CENTRE + sign * abs_bin, tl.full((BLOCK,), 1, tl.int32), mask=valid)
    base = partial_ptr + (row * n_seg + seg) * WIDTH
    tl.store(base + 0, tl.sum(s_abs_p, axis=0))
    tl.store(base + 1, tl.sum(s_d, axis=0))
    tl.store(base + 2, tl.sum(s_k3, axis=0))
    tl.store(base + 3, tl.sum(s_rho, axis=0))
    tl.store(base + 4, tl.sum(s_rho2, axis=0))
    tl.store(base + 5, tl.sum(s_out, axis=0))
    tl.store(base + 6, tl.sum(s_n, axis=0))
    tl.store(base + 7, tl.sum(s_bad, axis=0))
    tl.store(base + 8, tl.sum(s_wn, axis=0))
    tl.store(base + 9, tl.sum(s_w, axis=0))
    tl.store(base + 10, tl.sum(s_w2, axis=0))
    tl.store(base + 11, tl.sum(s_w0, axis=0))
    tl.store(base + 12, tl.sum(a0, axis=0))
    tl.store(base + 13, tl.sum(a1, axis=0))
    tl.store(base + 14, tl.sum(a2, axis=0))
    tl.store(base + 15, tl.sum(a3, axis=0))
    tl.store(base + 16, tl.sum(a4, axis=0))
    tl.store(base + 17, tl.sum(c0, axis=0))
    tl.store(base + 18, tl.sum(c1, axis=0))
    tl.store(base + 19, tl.sum(c2, axis=0))
    tl.store(base + 20, tl.sum(c3, axis=0))
    tl.store(base + 21, tl.sum(c4, axis=0))
    tl.store(base + N_SUMS + 0, tl.max(m_d, axis=0))
    tl.store(base + N_SUMS + 1, tl.max(m_nd, axis=0))
    tl.store(base + N_SUMS + 2, tl.max(m_p, axis=0))
    tl.store(base + N_SUMS + 3, tl.max(m_w, axis=0))
    tl.store(base + N_SUMS + 4, tl.max(m_nw, axis=0))


@triton.jit
def _col(tile, cols, i):
    """Column i of a [ROWS, COLS] tile, as [ROWS]."""
    return tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)


@triton.jit
def _pick(vec, cols, i):
    return tl.sum(tl.where(cols == i, vec, 0.0), axis=0)


@triton.jit
def _pick_max(vec, cols, i):
    return tl.max(tl.where(cols == i, vec, -float("inf")), axis=0)


@triton.jit
def _add(ptr, value):
    tl.store(ptr, tl.load(ptr) + value)


@triton.jit
def _raise_max(ptr, value):
    tl.store(ptr, tl.maximum(tl.load(ptr), value))


@triton.jit
def _finalize_kernel(
    partial_ptr, hist_ptr, state_ptr, B, n_seg,
    MAX_OFFSET: tl.constexpr, HIST_OFFSET: tl.constexpr, BUCKET_COUNT_OFFSET: tl.constexpr,
    BUCKET_ABS_OFFSET: tl.constexpr, N_SB: tl.constexpr, N_SB_POW2: tl.constexpr, REPLICAS: tl.constexpr,
    WIDTH: tl.constexpr, N_SUMS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
):
    cols = tl.arange(0, COLS)
    is_sum = cols < N_SUMS
    is_max = (cols >= N_SUMS) & (cols < WIDTH)
    acc = tl.zeros((COLS,), tl.float64)
    mx = tl.zeros((COLS,), tl.float64) - float("inf")
    seqs = tl.sum(tl.zeros((ROWS,), tl.float64), axis=0)  # float64 scalars: loop-carried types must not change
    seq_abs_max = tl.max(tl.zeros((ROWS,), tl.float64), axis=0) - float("inf")
    for start in range(0, B, ROWS):
        rows = start + tl.arange(0, ROWS)
        in_rows = rows < B
        row_acc = tl.zeros((ROWS, COLS), tl.float64)
        row_max = tl.zeros((ROWS, COLS), tl.float64) - float("inf")
        for seg in range(0, n_seg):
            ptrs = partial_ptr + (rows[:, None].to(tl.int64) * n_seg + seg) * WIDTH + cols[None, :]
            v = tl.load(ptrs, mask=in_rows[:, None] & (cols[None, :] < WIDTH), other=0.0).to(tl.float64)
            row_acc += tl.where(is_sum[None, :], v, 0.0)
            row_max = tl.maximum(row_max, tl.where(in_rows[:, None] & is_max[None, :], v, -float("inf")))
        acc += tl.sum(row_acc, axis=0)
        mx = tl.maximum(mx, tl.max(row_max, axis=0))
        # Sequence statistics: a row is a sequence; it counts if it has a valid token.
        row_valid = (_col(row_acc, cols, 6) > 0) & in_rows
        row_d = _col(row_acc, cols, 1)
        seqs += tl.sum(row_valid.to(tl.float64), axis=0)
        seq_abs_max = tl.maximum(seq_abs_max, tl.max(tl.where(row_valid, tl.abs(row_d), -float("inf")), axis=0))

    # The signed d histogram: sum the copies into the state, then clear them for the next call.
    sb = tl.arange(0, N_SB_POW2)
    in_sb = sb < N_SB
    d_hist = tl.zeros((N_SB_POW2,), tl.float64)
    for k in range(0, REPLICAS):
        d_hist += tl.load(hist_ptr + k * N_SB + sb, mask=in_sb, other=0).to(tl.float64)
        tl.store(hist_ptr + k * N_SB + sb, tl.zeros((N_SB_POW2,), tl.int32), mask=in_sb)
    hist_ptrs = state_ptr + HIST_OFFSET + sb
    tl.store(hist_ptrs, tl.load(hist_ptrs, mask=in_sb, other=0.0) + d_hist, mask=in_sb)

    # State order: tokens, invalid, abs_d, abs_p, neg_d, k3, rho_m1, rho_m1_sq, outside, seqs,
    # seq_log_ratio, is_tokens, is_w, is_w2, is_masked | hist | bucket counts | bucket |d| sums.
    abs_d = 0.0
    tokens = 0.0
    for k in tl.static_range(5):
        b_abs = _pick(acc, cols, 12 + k)
        b_count = _pick(acc, cols, 17 + k)
        abs_d += b_abs
        tokens += b_count
        _add(state_ptr + BUCKET_ABS_OFFSET + k, b_abs)
        _add(state_ptr + BUCKET_COUNT_OFFSET + k, b_count)
    sum_d = _pick(acc, cols, 1)
    _add(state_ptr + 0, tokens)
    _add(state_ptr + 1, _pick(acc, cols, 7))
    _add(state_ptr + 2, abs_d)
    _add(state_ptr + 3, _pick(acc, cols, 0))
    _add(state_ptr + 4, -sum_d)
    _add(state_ptr + 5, _pick(acc, cols, 2))
    _add(state_ptr + 6, _pick(acc, cols, 3))
    _add(state_ptr + 7, _pick(acc, cols, 4))
    _add(state_ptr + 8, _pick(acc, cols, 5))
    _add(state_ptr + 9, seqs)
    _add(state_ptr + 10, sum_d)  # Σ over sequences of Σ_t d: invalid and masked tokens have d = 0
    _add(state_ptr + 11, _pick(acc, cols, 8))
    _add(state_ptr + 12, _pick(acc, cols, 9))
    _add(state_ptr + 13, _pick(acc, cols, 10))
    _add(state_ptr + 14, _pick(acc, cols, 11))
    # Max order: abs_d_max, abs_p_max, rho_m1_max, neg_rho_m1_min, seq_abs_max, is_w_max, neg_is_w_min.
    d_max = _pick_max(mx, cols, N_SUMS + 0)
    neg_d_min = _pick_max(mx, cols, N_SUMS + 1)
    _raise_max(state_ptr + MAX_OFFSET + 0, tl.maximum(d_max, neg_d_min))
    _raise_max(state_ptr + MAX_OFFSET + 1, _pick_max(mx, cols, N_SUMS + 2))
    _raise_max(state_ptr + MAX_OFFSET + 2, _expm1(d_max))  # ρ is monotone in d
    _raise_max(state_ptr + MAX_OFFSET + 3, -_expm1(-neg_d_min))
    _raise_max(state_ptr + MAX_OFFSET + 4, seq_abs_max)
    _raise_max(state_ptr + MAX_OFFSET + 5, _pick_max(mx, cols, N_SUMS + 3))
    _raise_max(state_ptr + MAX_OFFSET + 6, _pick_max(mx, cols, N_SUMS + 4))


def _scratch(store: dict, device: torch.device, parts: int, n_sb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch owned by one monitor (two monitors on two streams must not share the histogram copies):
    partials, grown as needed, and the int32 histogram copies, which kernel 2 leaves zeroed."""
    partial, hist = store.get((device, n_sb), (None, None))
    if partial is None or partial.shape[0] < parts:
        partial = torch.empty((max(parts, 256), _N_PART_SUMS + _N_PART_MAXES), dtype=torch.float32, device=device)
        hist = hist if hist is not None else torch.zeros(_REPLICAS * n_sb, dtype=torch.int32, device=device)
        store[(device, n_sb)] = (partial, hist)
    return partial, hist


def triton_update(
    state: torch.Tensor, max_offset: int, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, log_lo: float, log_hi: float, n_signed_bins: int, hist_offset: int,
    bucket_count_offset: int, bucket_abs_offset: int, scratch: dict,
) -> None:
    """Add one [B, T] batch to the monitor's float64 ``state`` (sums, then maxima from ``max_offset``, in
    the layout of ``metrics``). ``scratch`` is a dict the caller keeps between calls."""
    B, T = rollout.shape
    if B == 0:
        return
    rollout, train, mask = rollout.contiguous(), train.contiguous(), mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    w = is_weights.contiguous() if is_weights is not None else rollout
    n_seg = max(1, triton.cdiv(T, SEGMENT))
    partial, hist = _scratch(scratch, rollout.device, B * n_seg, n_signed_bins)
    width = _N_PART_SUMS + _N_PART_MAXES
    e1, e2, e3, e4 = _LOG_EDGES
    _partials_kernel[(B, n_seg)](
        rollout, train, mask, w, partial, hist, T, n_seg,
        log_lo=log_lo, log_hi=log_hi, e1=e1, e2=e2, e3=e3, e4=e4, invalid_threshold=INVALID_LOGPROB_THRESHOLD,
        log_lo_edge=_LOG_LO_EDGE, bins_per_decade=float(HISTOGRAM_BINS_PER_DECADE),
        N_SB=n_signed_bins, CENTRE=(n_signed_bins - 1) // 2, REPLICAS=_REPLICAS, HAS_W=is_weights is not None,
        WIDTH=width, N_SUMS=_N_PART_SUMS, BLOCK=BLOCK, ITERS=SEGMENT // BLOCK, num_warps=8,
    )
    _finalize_kernel[(1,)](
        partial, hist, state, B, n_seg,
        MAX_OFFSET=max_offset, HIST_OFFSET=hist_offset, BUCKET_COUNT_OFFSET=bucket_count_offset,
        BUCKET_ABS_OFFSET=bucket_abs_offset, N_SB=n_signed_bins, N_SB_POW2=triton.next_power_of_2(n_signed_bins),
        REPLICAS=_REPLICAS, WIDTH=width, N_SUMS=_N_PART_SUMS, COLS=triton.next_power_of_2(width), ROWS=32,
        num_warps=4,
    )
