"""The monitor's per-batch pass as one Triton kernel, for CUDA: an ``update()`` is one plain launch.

Why a kernel: on a GPU the statistics take microseconds, while the torch pass launches a dozen kernels plus
the histogram and the state update, so its cost is mostly launching. Here one program per row reads the row
once, keeps float32 partial sums, maxima and a ``tl.histogram`` of its d bins, and adds them to the monitor's
float64 state with atomics (a row's own Σd gives the sequence statistics, so no program waits for another).
Same formulas and binning as ``_mismatch_pass`` (the tests compare both with a float64 reference, this one
under ``TRITON_INTERPRET=1`` on the CPU). Float atomics make the last bits of the sums depend on the programs'
order; counts, histogram and maxima are exact. Triton ships with CUDA builds of torch; the monitor imports
this module only for a CUDA batch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tim_plugins._mismatch_layout import (
    HISTOGRAM_BINS_PER_DECADE,
    HISTOGRAM_RANGE,
    INVALID_LOGPROB_THRESHOLD,
    K3_SERIES,
    K3_SERIES_BOUND,
    N_SIGNED_BINS,
    OFFSETS,
    PROB_BUCKET_EDGES,
)

__all__ = ["add_batch", "launch_arguments", "LAUNCH"]

# Tokens per loop step and warps per program. tl.histogram has a cost per call that does not depend on the
# block (its 1024 bins are cleared and read back each time), so fewer, larger blocks win: on an H200 at 256×4096,
# 1024 × 8 warps took 2.4× less GPU time than 256 × 8 (both in ``benchmarks/results/
# monitor_kernel_profile_cuda.json``).
LAUNCH = {"BLOCK": 1024, "num_warps": 8}

# Everything else the kernel reads is a module-level constexpr, not an argument: Triton's launch binds and keys
# every argument in Python on each call, and with these ~45 as arguments a launch took 48 µs of host time on an
# H200's machine (the same file), a cost paid on every update().
# The state's field offsets (``_mismatch_layout.OFFSETS``), by upper-case name:
TOKENS = tl.constexpr(OFFSETS["tokens"])
INVALID = tl.constexpr(OFFSETS["invalid"])
ABS_D = tl.constexpr(OFFSETS["abs_d"])
ABS_P = tl.constexpr(OFFSETS["abs_p"])
NEG_D = tl.constexpr(OFFSETS["neg_d"])
K3 = tl.constexpr(OFFSETS["k3"])
RHO_M1 = tl.constexpr(OFFSETS["rho_m1"])
RHO_M1_SQ = tl.constexpr(OFFSETS["rho_m1_sq"])
OUTSIDE = tl.constexpr(OFFSETS["outside"])
SEQS = tl.constexpr(OFFSETS["seqs"])
SEQ_LOG_RATIO = tl.constexpr(OFFSETS["seq_log_ratio"])
IS_TOKENS = tl.constexpr(OFFSETS["is_tokens"])
IS_W = tl.constexpr(OFFSETS["is_w"])
IS_W2 = tl.constexpr(OFFSETS["is_w2"])
IS_MASKED = tl.constexpr(OFFSETS["is_masked"])
HIST = tl.constexpr(OFFSETS["hist"])
BUCKET_COUNT = tl.constexpr(OFFSETS["bucket_count"])
BUCKET_ABS = tl.constexpr(OFFSETS["bucket_abs"])
ABS_D_MAX = tl.constexpr(OFFSETS["abs_d_max"])
ABS_P_MAX = tl.constexpr(OFFSETS["abs_p_max"])
RHO_M1_MAX = tl.constexpr(OFFSETS["rho_m1_max"])
NEG_D_MIN = tl.constexpr(OFFSETS["neg_d_min"])
SEQ_ABS_MAX = tl.constexpr(OFFSETS["seq_abs_max"])
IS_W_MAX = tl.constexpr(OFFSETS["is_w_max"])
NEG_IS_W_MIN = tl.constexpr(OFFSETS["neg_is_w_min"])
# The binning (``_mismatch_layout``): the probability-bucket edges as log-probs, the invalid threshold, the |d| bins.
E1, E2, E3, E4 = (tl.constexpr(math.log(e)) for e in PROB_BUCKET_EDGES[1:-1])
INVALID_AT = tl.constexpr(INVALID_LOGPROB_THRESHOLD)
LOG10_E0 = tl.constexpr(math.log10(HISTOGRAM_RANGE[0]))
BINS_PER_DECADE = tl.constexpr(float(HISTOGRAM_BINS_PER_DECADE))
N_SB = tl.constexpr(N_SIGNED_BINS)
N_SB_POW2 = tl.constexpr(triton.next_power_of_2(N_SIGNED_BINS))
# The k3 term's Taylor coefficients 1/2!, ..., 1/10! and the |d| below which they are used (float32).
K3_C2, K3_C3, K3_C4, K3_C5, K3_C6, K3_C7, K3_C8, K3_C9, K3_C10 = (tl.constexpr(c) for c in K3_SERIES)
K3_BOUND = tl.constexpr(K3_SERIES_BOUND[torch.float32])


@triton.jit
def _expm1(x):
    # Kahan's expm1 from exp and log: accurate to float32 rounding near 0, where exp(x) − 1 cancels, even
    # with a fast approximate exp (the error of u cancels between u − 1 and log(u); log is accurate).
    u = tl.exp(x)
    um1 = u - 1.0
    out = tl.where(u == 1.0, x, um1 * x / tl.log(u))
    out = tl.where(um1 == -1.0, -1.0, out)
    return tl.where(u == float("inf"), float("inf"), out)


@triton.jit
def _k3_terms(d):
    # (k3 = ρ − 1 − d, its part below the series bound, ρ − 1 less that part), as the torch pass computes them
    # (``_mismatch_pass._k3_terms``): below K3_BOUND (series, series, d), above (expm1(d) − d, 0, expm1(d)).
    p = K3_C10 * d + K3_C9
    p = p * d + K3_C8
    p = p * d + K3_C7
    p = p * d + K3_C6
    p = p * d + K3_C5
    p = p * d + K3_C4
    p = p * d + K3_C3
    p = p * d + K3_C2
    small = tl.abs(d) < K3_BOUND
    k3_small = tl.where(small, p * d * d, 0.0)
    linear = tl.where(small, d, _expm1(d))
    return k3_small + (linear - d), k3_small, linear


@triton.jit
def _add(ptr, value):
    tl.atomic_add(ptr, value.to(tl.float64), sem="relaxed")


@triton.jit
def _max(ptr, value):
    tl.atomic_max(ptr, value.to(tl.float64), sem="relaxed")


@triton.jit
def _mismatch_kernel(rollout_ptr, train_ptr, mask_ptr, w_ptr, state_ptr, T, log_lo, log_hi, HAS_W: tl.constexpr,
                     BLOCK: tl.constexpr):
    # The state's field offsets and the binning are the module's constexpr globals above.
    row_start = tl.program_id(0).to(tl.int64) * T  # inputs are contiguous [B, T]
    lane = tl.arange(0, BLOCK)
    f0 = tl.zeros((BLOCK,), tl.float32)
    i0 = tl.zeros((BLOCK,), tl.int32)
    # Per-lane partial sums, Σ(ρ − 1) in two parts (see _k3_terms). Summing those two over each block as it goes
    # instead would spare their registers but took 16 % more GPU time on an H100 (71 -> 82 us at 256x4096).
    s_p, s_d, s_k3, s_k3_small, s_lin, s_rho2, s_w, s_w2 = f0, f0, f0, f0, f0, f0, f0, f0
    n_ok, n_bad, n_out, n_w, n_w0 = i0, i0, i0, i0, i0
    m_d, m_nd, m_p, m_w, m_nw = f0 - float("inf"), f0 - float("inf"), f0, f0 - float("inf"), f0 - float("inf")
    k = tl.arange(0, 8)  # probability buckets (5 of 8 columns): Σ|d| and token counts
    bucket_abs = tl.zeros((BLOCK, 8), tl.float32)
    bucket_count = tl.zeros((BLOCK, 8), tl.int32)
    hist = tl.zeros((N_SB_POW2,), tl.int32)
    centre = (N_SB - 1) // 2
    for start in range(0, T, BLOCK):
        offs = start + lane
        inb = offs < T
        r = tl.load(rollout_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
        t = tl.load(train_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
        response = (tl.load(mask_ptr + row_start + offs, mask=inb, other=0) != 0) & inb
        d = t - r  # d = log p_train − log p_rollout
        # Invalid: NaN/±inf in either input (|d| is then NaN or inf) or a placeholder <= -1e3
        # (``_mismatch_layout.valid_logprob_pair``).
        ok = (tl.abs(d) < float("inf")) & (r > INVALID_AT) & (t > INVALID_AT)
        valid = response & ok
        d = tl.where(valid, d, 0.0)  # masked and invalid tokens contribute d = 0, ρ = 1, k3 = 0
        r = tl.where(valid, r, 0.0)
        k3, k3_small, linear = _k3_terms(d)
        rho_m1 = linear + k3_small
        abs_d = tl.abs(d)
        # |p_train − p_rollout| = e^max(r, t) · (1 − e^−|d|), as the torch pass (``_mismatch_pass.token_pass``
        # says why): no 0 · inf for an extreme but valid token.
        up = d > 0
        abs_p = tl.exp(tl.where(up, t, r)) * tl.where(up, 1.0 / (1.0 + 1.0 / rho_m1), -rho_m1)
        s_p += abs_p
        s_d += d
        s_k3 += k3
        s_k3_small += k3_small
        s_lin += linear
        s_rho2 += rho_m1 * rho_m1
        n_out += ((d < log_lo) | (d > log_hi)).to(tl.int32)
        n_ok += valid.to(tl.int32)
        n_bad += (response & ~ok).to(tl.int32)
        m_d = tl.maximum(m_d, tl.where(valid, d, -float("inf")))
        m_nd = tl.maximum(m_nd, tl.where(valid, -d, -float("inf")))
        m_p = tl.maximum(m_p, abs_p)
        bucket = (r >= E1).to(tl.int32) + (r >= E2).to(tl.int32) + (r >= E3).to(tl.int32) + (r >= E4).to(tl.int32)
        in_bucket = (bucket[:, None] == k[None, :]) & valid[:, None]
        bucket_abs += tl.where(in_bucket, abs_d[:, None], 0.0)
        bucket_count += in_bucket.to(tl.int32)
        if HAS_W:
            w = tl.load(w_ptr + row_start + offs, mask=inb, other=0.0).to(tl.float32)
            w_ok = valid & (tl.abs(w) < float("inf"))
            w = tl.where(w_ok, w, 0.0)
            s_w += w
            s_w2 += w * w
            n_w += w_ok.to(tl.int32)
            n_w0 += (w_ok & (w == 0.0)).to(tl.int32)
            m_w = tl.maximum(m_w, tl.where(w_ok, w, -float("inf")))
            m_nw = tl.maximum(m_nw, tl.where(w_ok, -w, -float("inf")))
        # Signed bin of d: |d| bin 0 below E_0, else 1 + floor(32 · log10(|d| / E_0)), capped at the overflow
        # bin; centre ± |d| bin.
        abs_bin = tl.floor((tl.log(abs_d) * 0.4342944819032518 - LOG10_E0) * BINS_PER_DECADE) + 1.0
        abs_bin = tl.minimum(tl.maximum(abs_bin, 0.0), centre).to(tl.int32)
        sign = (d > 0).to(tl.int32) - (d < 0).to(tl.int32)
        hist += tl.histogram(centre + sign * abs_bin, N_SB_POW2, mask=valid)

    # This row's totals into the float64 state (relaxed atomics: the launch's end publishes them).
    abs_sums = tl.sum(bucket_abs, axis=0)
    tl.atomic_add(state_ptr + BUCKET_ABS + k, abs_sums.to(tl.float64), mask=k < 5, sem="relaxed")
    tl.atomic_add(state_ptr + BUCKET_COUNT + k, tl.sum(bucket_count, axis=0).to(tl.float64), mask=k < 5,
                  sem="relaxed")
    bins = tl.arange(0, N_SB_POW2)
    tl.atomic_add(state_ptr + HIST + bins, hist.to(tl.float64), mask=(bins < N_SB) & (hist > 0), sem="relaxed")
    row_d = tl.sum(s_d)
    _add(state_ptr + TOKENS, tl.sum(n_ok))
    _add(state_ptr + INVALID, tl.sum(n_bad))
    _add(state_ptr + ABS_D, tl.sum(abs_sums))
    _add(state_ptr + ABS_P, tl.sum(s_p))
    _add(state_ptr + NEG_D, -row_d)
    _add(state_ptr + K3, tl.sum(s_k3))
    _add(state_ptr + RHO_M1, tl.sum(s_lin).to(tl.float64) + tl.sum(s_k3_small).to(tl.float64))  # see the layout
    _add(state_ptr + RHO_M1_SQ, tl.sum(s_rho2))
    _add(state_ptr + OUTSIDE, tl.sum(n_out))
    d_max = tl.max(m_d)
    d_min = -tl.max(m_nd)
    _max(state_ptr + ABS_D_MAX, tl.maximum(d_max, -d_min))
    _max(state_ptr + ABS_P_MAX, tl.max(m_p))
    _max(state_ptr + RHO_M1_MAX, _expm1(d_max))  # ρ is monotone in d
    _max(state_ptr + NEG_D_MIN, -d_min)
    if HAS_W:
        _add(state_ptr + IS_TOKENS, tl.sum(n_w))
        _add(state_ptr + IS_W, tl.sum(s_w))
        _add(state_ptr + IS_W2, tl.sum(s_w2))
        _add(state_ptr + IS_MASKED, tl.sum(n_w0))
        _max(state_ptr + IS_W_MAX, tl.max(m_w))
        _max(state_ptr + NEG_IS_W_MIN, tl.max(m_nw))
    if tl.sum(n_ok) > 0:  # a sequence counts if it has a valid token
        _add(state_ptr + SEQS, tl.full((), 1, tl.int32))
        _add(state_ptr + SEQ_LOG_RATIO, row_d)
        _max(state_ptr + SEQ_ABS_MAX, tl.abs(row_d))


def launch_arguments(
    state: torch.Tensor, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, log_lo: float, log_hi: float,
) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional arguments, keyword arguments) of the launch that adds a [B, T] batch to ``state``."""
    rollout, train, mask = rollout.contiguous(), train.contiguous(), mask.contiguous()
    if mask.dtype == torch.bool:  # Triton loads bytes, not bools
        mask = mask.view(torch.uint8)
    weights = rollout if is_weights is None else is_weights.contiguous()
    args = (rollout, train, mask, weights, state, rollout.shape[1], log_lo, log_hi)
    options = dict(HAS_W=is_weights is not None, BLOCK=LAUNCH["BLOCK"], num_warps=LAUNCH["num_warps"])
    return (rollout.shape[0],), args, options


def add_batch(
    state: torch.Tensor, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor,
    is_weights: torch.Tensor | None, log_lo: float, log_hi: float,
) -> None:
    """Add one [B, T] batch (B·T > 0) to ``state`` (float64, layout ``_mismatch_layout``, on the inputs'
    device) with one launch."""
    grid, args, options = launch_arguments(state, rollout, train, mask, is_weights, log_lo, log_hi)
    if rollout.is_cuda and rollout.device.index != torch.cuda.current_device():
        with torch.cuda.device(rollout.device):  # a kernel runs on the current device
            _mismatch_kernel[grid](*args, **options)
    else:
        _mismatch_kernel[grid](*args, **options)
