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
    "batch_stats",
    "joint_histograms",
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
    """One batch → (scalar sums [len(_SUM_FIELDS)], maxima [len(_MAX_FIELDS)], joint histogram cell per
    token [B·T], |d| per token [B·T]); ``joint_histograms`` turns the last two into the histogram sums.

    Written without boolean indexing or data-dependent shapes, so it neither syncs with the host nor
    recompiles when the batch shape changes (torch.compile with dynamic shapes fuses it into few loops).
    Every elementwise pass over [B, T] counts on the hot path: quantities are derived from each other
    (abs_p from ρ, validity from |d|, ρ extremes from d extremes) and both histograms share one index.
    """
    acc = torch.float64 if rollout.device.type != "mps" else torch.float32
    dt = rollout.dtype
    d = train - rollout  # d = log p_train − log p_rollout
    # Invalid: NaN/±inf in either input (|d| is then NaN or inf) or a placeholder <= -1e3.
    ok = (d.abs() < math.inf) & (rollout > INVALID_LOGPROB_THRESHOLD) & (train > INVALID_LOGPROB_THRESHOLD)
    valid = mask & ok
    n_invalid = (mask & ~ok).sum()
    vf = valid.to(dt)

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

    seq_d = d.sum(dim=-1)  # Σ_t d over valid tokens: the sequence log-ratio
    seq_valid = valid.any(dim=-1)

    inf = torch.full((), math.inf, dtype=dt, device=rollout.device)
    d_max = torch.where(valid, d, -inf).amax() if d.numel() else -inf
    d_min = torch.where(valid, d, inf).amin() if d.numel() else inf
    scalar_sums = [
        vf.sum(),
        n_invalid.to(dt),
        abs_d.sum(),
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
        scalar_sums += [w_ok.sum().to(dt), w.sum(), (w * w).sum(), (w_ok & (w == 0)).sum().to(dt)]
        maxes += [torch.where(w_ok, w, -inf).amax(), torch.where(w_ok, -w, -inf).amax()]
    else:
        scalar_sums += [zero, zero, zero, zero]
        maxes += [-inf, -inf]

    # One joint histogram over (probability bucket of the rollout token, signed log-spaced bin of d), counted
    # with weight 1[valid] and summed with weight |d|: its margins are the d histogram, the bucket counts and
    # the bucket |d| sums. |d| bin: 0 below E_0 = 1e-8, else 1 + floor(32 · log10(|d| / E_0)), capped at the
    # overflow bin; signed bin = centre + sign(d) · |d| bin. Buckets: [0, .01), [.01, .1), [.1, .5), [.5, .9),
    # [.9, 1] on p = exp(rollout log-prob).
    centre = (n_signed_bins - 1) // 2
    log_lo_edge = math.log10(HISTOGRAM_RANGE[0])
    abs_bin = (torch.log10(abs_d) - log_lo_edge).mul_(HISTOGRAM_BINS_PER_DECADE).floor_().add_(1.0)
    abs_bin = abs_bin.clamp_(0.0, float(centre))
    # Four comparisons, not torch.bucketize: they fuse under torch.compile, and eager bucketize on CPU costs
    # milliseconds even for a few hundred tokens.
    bucket = sum((r >= math.log(e)).to(torch.int64) for e in PROB_BUCKET_EDGES[1:-1])
    joint = (bucket * n_signed_bins + centre) + (torch.sign(d) * abs_bin).to(torch.int64)
    joint = torch.where(valid, joint, N_BUCKETS * n_signed_bins)  # invalid tokens go to a spill cell
    return torch.stack(scalar_sums).to(acc), torch.stack(maxes).to(acc), joint.reshape(-1), abs_d.reshape(-1)


def joint_histograms(joint: torch.Tensor, abs_d: torch.Tensor, n_signed_bins: int) -> torch.Tensor:
    """Margins of the joint (bucket, bin) histogram: [d histogram, bucket counts, bucket |d| sums].

    Runs eagerly: a compiled scatter becomes atomic adds that collide on the few busy bins. ``index_add_``
    rather than ``bincount``, which scans its input twice more for min and max.
    """
    cells = N_BUCKETS * n_signed_bins
    acc = torch.float64 if joint.device.type != "mps" else torch.float32
    # fp32 weights count exactly up to 2^24 per cell; larger batches count in fp64.
    w_dtype = abs_d.dtype if joint.numel() < 2**24 else acc
    counts = torch.zeros(cells + 1, dtype=w_dtype, device=joint.device)
    counts.index_add_(0, joint, torch.ones((), dtype=w_dtype, device=joint.device).expand(joint.shape))
    abs_sums = torch.zeros(cells + 1, dtype=w_dtype, device=joint.device)
    abs_sums.index_add_(0, joint, abs_d.to(w_dtype))
    counts = counts[:cells].view(N_BUCKETS, n_signed_bins).to(acc)
    abs_sums = abs_sums[:cells].view(N_BUCKETS, n_signed_bins).to(acc)
    return torch.cat([counts.sum(0), counts.sum(1), abs_sums.sum(1)])


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
