"""The monitor's per-batch pass in torch (CPU, and CUDA without Triton): one batch → its state vector.

``token_pass`` is the part ``torch.compile`` fuses: every per-token quantity in one loop, without boolean
indexing or data-dependent shapes, so it neither syncs with the host nor recompiles when the batch shape
changes. ``cell_counts`` then counts the histogram cells (no host sync either).
"""

from __future__ import annotations

import functools
import math

import torch

from tim_plugins._mismatch_layout import (
    HISTOGRAM_BINS_PER_DECADE,
    HISTOGRAM_RANGE,
    K3_SERIES,
    K3_SERIES_BOUND,
    N_BUCKETS,
    N_SIGNED_BINS,
    PROB_BUCKET_EDGES,
    pack,
    valid_logprob_pair,
)

__all__ = ["batch_state", "token_pass", "cell_counts"]


def _k3_terms(d: torch.Tensor, abs_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (k3 = ρ − 1 − d, its series part, ρ − 1 less that part) without cancellation (``abs_d`` = |d|;
    ``_mismatch_layout`` argues the accuracy: ~ε). Below ``K3_SERIES_BOUND``: (series, series, d), above it:
    (expm1(d) − d, 0, expm1(d)); ρ − 1 is the sum of the last two. Below the bound ρ − 1 is d + k3 rather than
    expm1(d) also because torch.compile's CPU code computes expm1 as exp(d) − 1, which cancels for small |d|
    (torch 2.13, ``torch/_inductor/codegen/cpp.py``, ``CppVecOverrides.expm1``).

    Few passes over the tokens, for eager mode, where each op is one: a Horner step is one ``addcmul`` into its
    own output, and the series of d clamped to the bound (so finite) is zeroed above it by a multiply rather
    than a second where (comparisons and selections are the slow passes on the CPU)."""
    bound = K3_SERIES_BOUND[d.dtype]
    small = abs_d < bound
    clamped = d.clamp(-bound, bound)
    series = clamped * K3_SERIES[-1] + K3_SERIES[-2]
    for c in reversed(K3_SERIES[:-2]):
        torch.addcmul(torch.full((), c, dtype=d.dtype, device=d.device), series, clamped, out=series)
    series.mul_(clamped).mul_(clamped).mul_(small)
    linear = torch.where(small, d, torch.expm1(d))
    return (linear - d).add_(series), series, linear  # linear − d is exactly 0 below the bound


def token_pass(
    rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None,
    log_lo: float, log_hi: float,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One [B, T] batch → (its state fields, by name, except the counts; the histogram cell of each token).

    A cell is (probability bucket, signed d bin) of a valid token; ``cell_counts`` turns cells into the joint
    histogram, whose margins give the token, bucket and d-bin counts. Inputs may be any float dtype (half
    precision is upcast inside the fused loop, not by a separate copy) and any mask dtype (non-zero = response
    token). Statistics are computed in at least float32 and summed into float64.
    """
    dt = torch.promote_types(torch.promote_types(rollout.dtype, train.dtype), torch.float32)
    rollout, train = rollout.to(dt), train.to(dt)
    response = mask != 0
    d = train - rollout  # d = log p_train − log p_rollout
    ok = valid_logprob_pair(rollout, train, d)  # invalid: NaN/±inf in either input or a placeholder <= -1e3
    valid = response & ok

    zero = torch.zeros((), dtype=dt, device=rollout.device)
    d = torch.where(valid, d, zero)  # masked and invalid tokens contribute d = 0, ρ = 1, k3 = 0
    abs_d = d.abs()
    r = torch.where(valid, rollout, zero)
    k3, k3_series, linear = _k3_terms(d, abs_d)
    rho_m1 = linear + k3_series
    # |p_train − p_rollout| = e^max(r, t) · (1 − e^−|d|): both factors in [0, 1], so an extreme but valid token
    # (e^r underflowing while ρ − 1 overflows) cannot give 0 · inf. 1 − e^−|d| is −(ρ − 1) for d <= 0 and
    # (ρ − 1)/ρ = 1/(1 + 1/(ρ − 1)) for d > 0 (1 once ρ − 1 overflows), from the accurate ρ − 1: expm1(−|d|)
    # would cancel in the compiled CPU code (see _k3_terms).
    up = d > 0
    abs_p = torch.exp(torch.where(up, train, r)).mul_(
        torch.where(up, rho_m1.reciprocal().add_(1.0).reciprocal_(), -rho_m1))
    # Probability bucket of p = exp(rollout): four comparisons rather than torch.bucketize, which does not
    # fuse under torch.compile and is slow in eager mode on the CPU.
    bucket = sum((r >= math.log(e)).to(dt) for e in PROB_BUCKET_EDGES[1:-1])  # small integers, kept in float
    bucket_abs = torch.stack([torch.where(bucket == k, abs_d, zero).sum() for k in range(N_BUCKETS)])
    seq_d = d.sum(dim=-1)  # Σ_t d over valid tokens: the sequence log-ratio
    d_sum = seq_d.sum()
    seq_valid = valid.any(dim=-1)

    inf = torch.full((), math.inf, dtype=dt, device=rollout.device)
    d_max = torch.where(valid, d, -inf).amax() if d.numel() else -inf
    d_min = torch.where(valid, d, inf).amin() if d.numel() else inf
    out = {
        "abs_d": bucket_abs.sum(), "abs_p": abs_p.sum(), "neg_d": -d_sum, "k3": k3.sum(),
        "rho_m1": linear.sum() + k3_series.sum(), "rho_m1_sq": (rho_m1 * rho_m1).sum(),  # see the layout's rho_m1
        "outside": ((d < log_lo) | (d > log_hi)).sum().to(dt),  # d = 0 off the valid tokens: inside the band
        "seqs": seq_valid.sum().to(dt), "seq_log_ratio": d_sum, "bucket_abs": bucket_abs,
        "abs_d_max": torch.maximum(d_max, -d_min), "abs_p_max": abs_p.amax() if abs_p.numel() else -inf,
        "rho_m1_max": torch.expm1(d_max), "neg_d_min": -d_min,  # ρ is monotone in d
        "seq_abs_max": torch.where(seq_valid, seq_d.abs(), -inf).amax() if seq_d.numel() else -inf,
    }
    if is_weights is not None:
        w_ok = valid & torch.isfinite(is_weights)
        w = torch.where(w_ok, is_weights.to(dt), zero)
        out.update(is_tokens=w_ok.sum().to(dt), is_w=w.sum(), is_w2=(w * w).sum(),
                   is_masked=(w_ok & (w == 0)).sum().to(dt),
                   is_w_max=torch.where(w_ok, w, -inf).amax() if w.numel() else -inf,  # amax of nothing raises
                   neg_is_w_min=torch.where(w_ok, -w, -inf).amax() if w.numel() else -inf)
    else:
        out.update(is_tokens=zero, is_w=zero, is_w2=zero, is_masked=zero, is_w_max=-inf, neg_is_w_min=-inf)

    # Signed bin of d: |d| bin 0 below E_0 = 1e-8, else 1 + floor(32 · log10(|d| / E_0)), capped at the
    # overflow bin; signed bin = centre + sign(d) · |d| bin. Invalid tokens go to one extra cell (their count is
    # tim/invalid_tokens); non-response tokens to the cell after it, which cell_counts drops.
    centre = (N_SIGNED_BINS - 1) // 2
    abs_bin = (torch.log10(abs_d) - math.log10(HISTOGRAM_RANGE[0])).mul_(HISTOGRAM_BINS_PER_DECADE)
    abs_bin = abs_bin.floor_().add_(1.0).clamp_(0.0, float(centre))
    # Computed in float (exact: cells < 2^24) and converted once; integer vector ops are slow on AVX2.
    cell = bucket * N_SIGNED_BINS + centre + torch.sign(d) * abs_bin
    spill = torch.where(response, float(N_BUCKETS * N_SIGNED_BINS), float(N_BUCKETS * N_SIGNED_BINS + 1))
    cell = torch.where(valid, cell, spill).to(torch.int64)
    return out, cell.reshape(-1)


@functools.cache
def _compiled_token_pass():
    return torch.compile(token_pass, dynamic=True)


def batch_state(
    rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, is_weights: torch.Tensor | None,
    log_lo: float, log_hi: float, compiled: bool = False,
) -> torch.Tensor:
    """One batch's state vector (layout ``_mismatch_layout.FIELDS``); ``compiled``: ``token_pass`` through
    ``torch.compile``."""
    values, cell = (_compiled_token_pass() if compiled else token_pass)(
        rollout, train, mask, is_weights, log_lo, log_hi
    )
    counts = cell_counts(cell, N_BUCKETS * N_SIGNED_BINS + 1)  # joint (bucket, d bin) cells, then invalid
    joint = counts[:-1].view(N_BUCKETS, N_SIGNED_BINS)
    bucket_count = joint.sum(1)
    values.update(tokens=bucket_count.sum(), invalid=counts[-1], hist=joint.sum(0), bucket_count=bucket_count)
    return pack(values).to(counts.dtype)  # one conversion of the whole vector to the accumulation dtype


def cell_counts(cell: torch.Tensor, n_cells: int) -> torch.Tensor:
    """Counts of cells 0 .. n_cells − 1 (the cell n_cells is dropped), as float64 (float32 on MPS), without a
    host sync.

    CUDA: ``histc`` on the cell index, which counts in per-block shared memory (a global ``index_add_`` would
    serialise its atomics on the few busy cells: every masked-out token hits one cell). CPU: ``bincount``,
    which counts in int64 (exact at any size) and is faster there than ``index_add_``. Elsewhere:
    ``index_add_``.
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
