"""The mismatch monitor's accumulator, defined once: the binning, the k3 term's series, and the state vector's
named fields.

The state is one float64 vector: additive fields (merged by SUM), then maxima (merged by MAX; a minimum is kept
as the maximum of its negation). Every producer derives its positions from ``FIELDS``: the torch pass packs
its named values with ``pack``, the Triton kernel reads each field's offset as a module-level constexpr of the
same name (upper case), and ``MismatchMonitor.compute`` reads the vector back with ``unpack``.

Importing it does not import torch (the report reads dumps without it): the functions that make tensors import
it, and ``K3_SERIES_BOUND`` (keyed by torch dtype) is built from ``K3_SERIES_BOUNDS`` on first use.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROB_BUCKET_EDGES", "DEFAULT_RATIO_BAND", "HISTOGRAM_RANGE", "HISTOGRAM_BINS_PER_DECADE",
    "INVALID_LOGPROB_THRESHOLD", "N_BUCKETS", "K3_SERIES_BOUND", "K3_SERIES_BOUNDS", "K3_SERIES",
    "N_ABS_BINS", "N_SIGNED_BINS", "FIELDS", "SUM_FIELDS", "MAX_FIELDS", "OFFSETS", "N_SUMS", "N_STATE",
    "abs_diff_bin_edges", "abs_diff_bin_edge_values", "empty_state", "pack", "unpack", "valid_logprob_pair",
]

# Token-probability buckets (p = exp(rollout log-prob)) for the (1 − p) structure of the mismatch.
PROB_BUCKET_EDGES: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
# Log-spaced histogram of |d|: 32 bins per decade between 1e-8 and 1e3 (bin width ×1.075, so a quantile read
# from it is within 7.5 % above the true value; values below 1e-8, exact zeros included, share one bin).
HISTOGRAM_RANGE: tuple[float, float] = (1e-8, 1e3)
HISTOGRAM_BINS_PER_DECADE = 32
# The monitor's default ratio band: ρ outside it counts in ``outside`` (tim/token/ratio_outside_frac).
DEFAULT_RATIO_BAND: tuple[float, float] = (0.5, 2.0)
# Log-probs at or below this are placeholders (e.g. -9999 for "not reported"), not probabilities.
INVALID_LOGPROB_THRESHOLD = -1e3
N_BUCKETS = len(PROB_BUCKET_EDGES) - 1
# |d| bins: bin 0 holds |d| < E_0, bin i holds E_{i-1} <= |d| < E_i, the last one |d| >= E_K (K + 1 edges).
N_ABS_BINS = round(math.log10(HISTOGRAM_RANGE[1] / HISTOGRAM_RANGE[0])) * HISTOGRAM_BINS_PER_DECADE + 2
# The signed d histogram: negative bins, the shared "|d| < E_0" bin in the centre, positive bins.
N_SIGNED_BINS = 2 * N_ABS_BINS - 1
# The per-token k3 term k3(d) = e^d − 1 − d, in float32 (ε = 2⁻²³): the Taylor series d²/2! + d³/3! + ... + d¹⁰/10!
# (these coefficients, Horner's rule) for |d| < K3_SERIES_BOUND, expm1(d) − d from there on. Why: expm1(d) is
# rounded by up to ~ε|d|/2, and subtracting d leaves ~d²/2, so the direct formula's relative error is ~ε/|d|:
# 12 % per token at |d| = 1e-6 (fp32 noise). For |d| >= 1 that error is
# (ε/2)·|expm1(d)|/k3(d) + ε/2 <= 1.7ε (at d = 1, 1.4ε at d = −1, less beyond) with a correctly rounded expm1.
# Below the bound the series is well conditioned (its terms shrink by |d|/k; for d < 0 they alternate, but their
# sum is at least half the sum of their magnitudes), so Horner's rounding stays ~ε, and stopping after d¹⁰ leaves
# 2|d|⁹/11! <= 5.0e-8 = 0.42ε at |d| = 1. A lower bound would need fewer terms but moves the direct formula's
# error up (4.7ε at |d| = 0.25); a higher one needs more terms. Measured against a 40-digit reference: at most 1.3ε
# (series) and 1.5ε (torch's expm1, |d| >= 1); the Triton kernel's own expm1 reaches 1.9ε at 1 <= |d| < 3 on an
# H100 (2.7ε in NumPy, as Triton's interpreter runs it). tests/test_metrics.py asserts 4ε per token.
# In float64 (float64 inputs) the same terms are used only below 0.1, where they stop at 2·0.1⁹/11! = 5e-17 relative,
# and the direct formula's error above, ~1.1e-16/|d|, stays below 1.2e-15.
K3_SERIES_BOUNDS: dict[str, float] = {"float32": 1.0, "float64": 0.1}  # by torch dtype name
K3_SERIES_BOUND: dict[torch.dtype, float]  # the same by torch dtype: made by __getattr__ on first use


def __getattr__(name: str):
    # K3_SERIES_BOUND: K3_SERIES_BOUNDS keyed by torch dtype (the torch pass and the kernel look up d.dtype)
    if name == "K3_SERIES_BOUND":
        import torch

        value = {getattr(torch, dtype): bound for dtype, bound in K3_SERIES_BOUNDS.items()}
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


K3_SERIES: tuple[float, ...] = tuple(1.0 / math.factorial(k) for k in range(2, 11))  # 1/2!, ..., 1/10!

# (name, size). The sums, in their merge order; sums of an empty set are 0.
SUM_FIELDS: tuple[tuple[str, int], ...] = (
    ("tokens", 1), ("invalid", 1), ("abs_d", 1), ("abs_p", 1), ("neg_d", 1), ("k3", 1),
    # Σ(ρ − 1), for chi2 and the ratio mean (no n to cancel for ρ ≈ 1). Below the k3 series' bound a token adds
    # d and k3 to it as two terms (Σd + Σk3 over those tokens), not ρ − 1 rounded to float32: the sum cancels
    # across tokens where the d's do (on policy E[ρ − 1] = 0), and the rounding of ρ − 1, ~ε|d|/2 a token, would
    # then be left against a sum of ~d²/2 a token. d is exact (the difference of two inputs; sums of a few float32
    # ulps of the log-probs add exactly) and k3 is accurate. Above the bound a token adds expm1(d).
    ("rho_m1", 1),
    ("rho_m1_sq", 1), ("outside", 1), ("seqs", 1), ("seq_log_ratio", 1),
    ("is_tokens", 1), ("is_w", 1), ("is_w2", 1), ("is_masked", 1),
    ("hist", N_SIGNED_BINS),  # counts of the signed d histogram
    # per probability bucket: tokens, Σ|d|: ``by_key.KEYINGS["prob"]``'s fields ``by_key.PROB_BLOCK``, which
    # ``by_key.keyed_metrics`` turns into tim/by_prob/* as it does every other bucketing's
    ("bucket_count", N_BUCKETS), ("bucket_abs", N_BUCKETS),
)
# The maxima; the maximum of an empty set is −inf. The ratio's minimum is kept as −min d, not 1 − min ρ: that
# difference cancels in float32 (wrong in the 4th digit at ρ = 1e-4, exactly 0 below ρ ≈ 6e-8), exp(min d) on the
# host does not.
MAX_FIELDS: tuple[tuple[str, int], ...] = (
    ("abs_d_max", 1), ("abs_p_max", 1), ("rho_m1_max", 1), ("neg_d_min", 1), ("seq_abs_max", 1),
    ("is_w_max", 1), ("neg_is_w_min", 1),
)
FIELDS = SUM_FIELDS + MAX_FIELDS


def _offsets() -> dict[str, int]:
    out, at = {}, 0
    for name, size in FIELDS:
        out[name] = at
        at += size
    return out


OFFSETS: dict[str, int] = _offsets()
N_SUMS = sum(size for _, size in SUM_FIELDS)
N_STATE = N_SUMS + sum(size for _, size in MAX_FIELDS)


def valid_logprob_pair(rollout: torch.Tensor, train: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
    """Where both log-probs of a token are log-probs: finite and above ``INVALID_LOGPROB_THRESHOLD`` (NaN, ±inf and
    a placeholder such as -9999 are not). ``d``: ``train − rollout`` if the caller has it already (one pass fewer).
    The rule of every statistic that compares two sides (the monitor, by-key, corrections, the staleness split, the
    causes, the lag-0 probe); the Triton kernel (``_mismatch_kernel``) writes the same three comparisons."""
    if d is None:
        d = train - rollout
    # |d| < inf: both finite once both are above the threshold (NaN fails every comparison)
    return (d.abs() < math.inf) & (rollout > INVALID_LOGPROB_THRESHOLD) & (train > INVALID_LOGPROB_THRESHOLD)


def abs_diff_bin_edges(device: torch.device | str = "cpu") -> torch.Tensor:
    """The |d| histogram's inner edges E_0 < ... < E_K (float64). Bin i holds E_{i-1} <= |d| < E_i."""
    import torch

    lo, hi = HISTOGRAM_RANGE
    return torch.logspace(math.log10(lo), math.log10(hi), N_ABS_BINS - 1, dtype=torch.float64, device=device)


@functools.cache
def abs_diff_bin_edge_values() -> tuple[float, ...]:
    """``abs_diff_bin_edges()`` as floats, without torch: torch.logspace's own arithmetic (10^(lo + i·step) over
    the first half, 10^(hi − (K − i)·step) over the second), so the values are the same bits (a test compares)."""
    lo, hi = (math.log10(x) for x in HISTOGRAM_RANGE)
    n = N_ABS_BINS - 1
    step = (hi - lo) / (n - 1)
    return tuple(10.0 ** (lo + step * i) if i < n // 2 else 10.0 ** (hi - step * (n - 1 - i)) for i in range(n))


def empty_state(device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The state of no token: zeros, then −inf (a copy of one kept per device: one operation, not two); float64
    unless ``dtype``."""
    import torch

    return _empty_template(torch.device(device), torch.float64 if dtype is None else dtype).clone()


@functools.lru_cache(maxsize=16)
def _empty_template(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    import torch

    state = torch.full((N_STATE,), -math.inf, dtype=dtype, device=device)
    state[:N_SUMS] = 0.0
    return state


def pack(values: dict[str, torch.Tensor]) -> torch.Tensor:
    """One state vector from a tensor per field (0-d for a field of size 1), in ``FIELDS`` order."""
    import torch

    return torch.cat([values[name].reshape(size) for name, size in FIELDS])


def unpack(state) -> dict:
    """A host state vector (numpy) → {field: float, or a numpy array for a field of several slots}."""
    out = {}
    for name, size in FIELDS:
        at = OFFSETS[name]
        out[name] = float(state[at]) if size == 1 else state[at : at + size]
    return out
