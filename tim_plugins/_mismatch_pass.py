"""The fused per-batch pass of the mismatch monitor: every per-token quantity in as few passes as possible.

Split from ``metrics.py`` (accumulation, exact merge, reporting) because this is the hot path, run on every
training step, and the part ``torch.compile`` fuses; it is also where the binning is defined.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "PROB_BUCKET_EDGES",
    "HISTOGRAM_RANGE",
    "HISTOGRAM_BINS_PER_DECADE",
    "INVALID_LOGPROB_THRESHOLD",
    "N_BUCKETS",
    "N_PASS_SUMS",
    "N_PASS_MAXES",
    "batch_stats",
    "cell_counts",
    "compiled_batch_stats",
    "want_compile",
]

# Token-probability buckets (p = exp(rollout log-prob)) for the (1 − p) structure of the mismatch.
PROB_BUCKET_EDGES: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
# Log-spaced histogram of |d|: 32 bins per decade between 1e-8 and 1e3 (bin width ×1.075, so a quantile read
# from it is within 7.5 % above the true value; values below 1e-8, exact zeros included, share one bin).
HISTOGRAM_RANGE: tuple[float, float] = (1e-8, 1e3)
HISTOGRAM_BINS_PER_DECADE = 32
# Log-probs at or below this are placeholders (e.g. -9999 for "not reported"), not probabilities.
INVALID_LOGPROB_THRESHOLD = -1e3
N_BUCKETS = len(PROB_BUCKET_EDGES) - 1


def batch_stats(
    rollout: torch.Tensor,
    train: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    log_lo: float,
    log_hi: float,
    n_signed_bins: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch → (sums [N_PASS_SUMS], bucket |d| sums [N_BUCKETS], maxima [N_PASS_MAXES], histogram cell
    per token [B·T]); ``cell_counts`` turns the cells into the joint (probability bucket, d bin) histogram,
    whose margins give the token, invalid and bucket counts, so the pass itself sums as little as it can.

    Inputs may be any float dtype (half precision is upcast here, inside the fused loop, not by a separate
    copy) and any mask dtype (non-zero = response token). Written without boolean indexing or data-dependent
    shapes, so it neither syncs with the host nor recompiles when the batch shape changes.
    """
    acc = torch.float64 if rollout.device.type != "mps" else torch.float32
    dt = torch.promote_types(torch.promote_types(rollout.dtype, train.dtype), torch.float32)
    rollout, train = rollout.to(dt), train.to(dt)
    response = mask != 0
    d = train - rollout  # d = log p_train − log p_rollout
    # Invalid: NaN/±inf in either input (|d| is then NaN or inf) or a placeholder <= -1e3.
    ok = (d.abs() < math.inf) & (rollout > INVALID_LOGPROB_THRESHOLD) & (train > INVALID_LOGPROB_THRESHOLD)
    valid = response & ok

    zero = torch.zeros((), dtype=dt, device=rollout.device)
    d = torch.where(valid, d, zero)  # masked and invalid tokens contribute d = 0, ρ = 1, k3 = 0
    abs_d = d.abs()
    r = torch.where(valid, rollout, zero)
    # ρ − 1 via expm1: chi2 and k3 are small differences of O(1) numbers, so keep them in ρ − 1 form
    # (Σρ = n + Σ(ρ−1), Σρ² = n + Σ(2(ρ−1) + (ρ−1)²)) instead of cancelling n out of fp32 sums.
    rho_m1 = torch.expm1(d)  # ρ − 1, ρ = π_train / π_rollout
    abs_p = torch.exp(r) * rho_m1.abs()  # |p_train − p_rollout| = p_rollout · |ρ − 1|
    k3 = rho_m1 - d  # k3 estimator of KL(π_rollout ‖ π_train) on rollout samples: E[ρ − 1 − log ρ]
    outside = (d < log_lo) | (d > log_hi)  # d = 0 on invalid tokens, inside any band around ρ = 1
    # Probability bucket of the rollout token: [0, .01), [.01, .1), [.1, .5), [.5, .9), [.9, 1] on
    # p = exp(rollout log-prob). Four comparisons, not torch.bucketize: they fuse under torch.compile, and
    # eager bucketize on CPU costs milliseconds even for a few hundred tokens.
    bucket = sum((r >= math.log(e)).to(dt) for e in PROB_BUCKET_EDGES[1:-1])  # small integers, kept in float
    # Σ|d| per bucket; their total is Σ|d|. Counts are not summed here: the histogram has them.
    bucket_abs = torch.stack([torch.where(bucket == k, abs_d, zero).sum() for k in range(N_BUCKETS)])

    seq_d = d.sum(dim=-1)  # Σ_t d over valid tokens: the sequence log-ratio
    seq_valid = valid.any(dim=-1)

    inf = torch.full((), math.inf, dtype=dt, device=rollout.device)
    d_max = torch.where(valid, d, -inf).amax() if d.numel() else -inf
    d_min = torch.where(valid, d, inf).amin() if d.numel() else inf
    sums = [
        bucket_abs.sum(),
        abs_p.sum(),
        -d.sum(),
        k3.sum(),
        rho_m1.sum(),  # Σ(ρ − 1); ρ − 1 = 0 on the other tokens
        (rho_m1 * rho_m1).sum(),  # Σ(ρ − 1)²
        outside.sum().to(dt),
        seq_valid.sum().to(dt),
        seq_d.sum(),
    ]
    maxes = [
        torch.maximum(d_max, -d_min),  # max |d|
        abs_p.amax() if abs_p.numel() else -inf,
        torch.expm1(d_max),  # max ρ − 1 (ρ is monotone in d)
        -torch.expm1(d_min),  # −(min ρ − 1)
        torch.where(seq_valid, seq_d.abs(), -inf).amax() if seq_d.numel() else -inf,
    ]
    if is_weights is not None:
        w_ok = valid & torch.isfinite(is_weights)
        w = torch.where(w_ok, is_weights.to(dt), zero)
        sums += [w_ok.sum().to(dt), w.sum(), (w * w).sum(), (w_ok & (w == 0)).sum().to(dt)]
        maxes += [torch.where(w_ok, w, -inf).amax(), torch.where(w_ok, -w, -inf).amax()]
    else:
        sums += [zero, zero, zero, zero]
        maxes += [-inf, -inf]

    # Joint histogram cell: (probability bucket, signed log-spaced bin of d). |d| bin: 0 below E_0 = 1e-8,
    # else 1 + floor(32 · log10(|d| / E_0)), capped at the overflow bin; signed bin = centre + sign(d) · |d|
    # bin. Invalid tokens go to one extra cell (their count is tim/invalid_tokens); non-response tokens to
    # the cell after it, which cell_counts drops.
    centre = (n_signed_bins - 1) // 2
    log_lo_edge = math.log10(HISTOGRAM_RANGE[0])
    abs_bin = (torch.log10(abs_d) - log_lo_edge).mul_(HISTOGRAM_BINS_PER_DECADE).floor_().add_(1.0)
    abs_bin = abs_bin.clamp_(0.0, float(centre))
    # Computed in float (exact: cells < 2^24) and converted once; integer vector ops are slow on AVX2.
    cell = bucket * n_signed_bins + centre + torch.sign(d) * abs_bin
    spill = torch.where(response, float(N_BUCKETS * n_signed_bins), float(N_BUCKETS * n_signed_bins + 1))
    cell = torch.where(valid, cell, spill).to(torch.int64)
    return torch.stack(sums).to(acc), bucket_abs.to(acc), torch.stack(maxes).to(acc), cell.reshape(-1)


N_PASS_SUMS = 13  # len(batch_stats(...)[0])
N_PASS_MAXES = 7  # len(batch_stats(...)[2])


def cell_counts(cell: torch.Tensor, n_cells: int) -> torch.Tensor:
    """Counts of cells 0 .. n_cells − 1 (the cell n_cells is dropped), as float64 (float32 on MPS), without a
    host sync.

    CUDA: ``histc`` on the cell index, which counts in per-block shared memory; a global ``index_add_`` would
    serialise its atomics on the few busy cells (every masked-out token hits one cell). CPU: ``bincount``,
    which counts in int64 (exact at any size) and, on 2 cores for 1M tokens, took 1.0–2.4 ms where
    ``index_add_`` took 1.6–4.3 ms (``histc`` is slower still). Elsewhere: ``index_add_``.
    """
    acc = torch.float64 if cell.device.type != "mps" else torch.float32
    if cell.device.type == "cuda":
        # Cell i is the value i; bin edges at half-integers. histc counts in float32, exact to 2^24 per call.
        counts = torch.zeros(n_cells, dtype=acc, device=cell.device)
        for chunk in cell.split(2**24):
            counts += torch.histc(chunk.to(torch.float32), bins=n_cells, min=-0.5, max=n_cells - 0.5).to(acc)
        return counts
    if cell.device.type == "cpu":  # cells lie in 0 .. n_cells, so the result has exactly n_cells + 1 bins
        return torch.bincount(cell, minlength=n_cells + 1)[:n_cells].to(acc)
    # fp32 weights count exactly up to 2^24 per cell; larger batches count in fp64.
    w_dtype = torch.float32 if cell.numel() < 2**24 else acc
    counts = torch.zeros(n_cells + 1, dtype=w_dtype, device=cell.device)
    counts.index_add_(0, cell, torch.ones((), dtype=w_dtype, device=cell.device).expand(cell.shape))
    return counts[:n_cells].to(acc)


_COMPILED = None


def compiled_batch_stats():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(batch_stats, dynamic=True)
    return _COMPILED


def want_compile(option: bool | str, device: torch.device) -> bool:
    if option == "auto":
        env = os.environ.get("TIM_PLUGINS_COMPILE")
        if env is not None:
            return env == "1"
        # CUDA: fused kernel, negligible compile time. CPU: inductor needs a C++ compiler and ~10 s once.
        return device.type == "cuda"
    return bool(option)
