"""Matplotlib figures of a per-token dump. Each function takes numpy columns and returns PNG bytes."""

from __future__ import annotations

import io

import numpy as np

__all__ = [
    "pyplot",
    "png_bytes",
    "abs_diff_histogram",
    "mismatch_by_probability",
    "ratio_distribution",
    "drift_by_position",
    "cumulative_log_ratio",
    "step_series",
]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def _log_bins(x: np.ndarray, n: int = 60) -> np.ndarray:
    pos = x[x > 0]
    lo = max(pos.min() if pos.size else 1e-8, 1e-8)
    hi = max(pos.max() if pos.size else 1.0, lo * 10)
    return np.logspace(np.log10(lo), np.log10(hi), n)


def abs_diff_histogram(d: np.ndarray) -> bytes:
    """Histogram of |d| = |log p_train − log p_rollout| on log-spaced bins (exact zeros counted apart)."""
    plt = pyplot()
    a = np.abs(d)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if (a > 0).any():
        ax.hist(a[a > 0], bins=_log_bins(a), color="#3366aa")
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "every difference is exactly 0", ha="center", transform=ax.transAxes)
    ax.set_xlabel("|log p_train − log p_rollout|")
    ax.set_ylabel("tokens")
    zeros = int((a == 0).sum())
    ax.set_title(f"|d| per token  (n={a.size}, exactly 0: {zeros})")
    return png_bytes(fig)


def mismatch_by_probability(d: np.ndarray, rollout_logprob: np.ndarray) -> bytes:
    """Mean and p99 of |d| binned by 1 − p (p = rollout probability), with a (1 − p) reference line.

    Theory: if every logit moves by at most ε, |Δ log p| <= 2ε(1 − p) to first order ((e^{2ε} − 1)(1 − p) exactly). The line is c·(1 − p) with c the
    largest observed |d| / (1 − p) over bins with >= 20 tokens, i.e. the tightest envelope of that form.
    """
    plt = pyplot()
    a = np.abs(d)
    q = 1.0 - np.exp(rollout_logprob)
    q = np.clip(q, 1e-7, 1.0)
    edges = np.logspace(-7, 0, 29)
    idx = np.clip(np.digitize(q, edges) - 1, 0, len(edges) - 2)
    centres, means, p99s = [], [], []
    for i in range(len(edges) - 1):
        sel = a[idx == i]
        if sel.size >= 20:
            centres.append(np.sqrt(edges[i] * edges[i + 1]))
            means.append(sel.mean())
            p99s.append(np.quantile(sel, 0.99))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if centres:
        c = np.array(centres)
        ax.plot(c, means, "o-", label="mean |d|")
        ax.plot(c, p99s, "s--", label="p99 |d|")
        scale = max(np.array(p99s) / c)
        if scale > 0:
            ax.plot(edges, scale * edges, "k:", label=f"{scale:.3g}·(1 − p) envelope")
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "too few tokens per bin", ha="center", transform=ax.transAxes)
    ax.set_xlabel("1 − p_rollout(token)")
    ax.set_ylabel("|d|")
    ax.set_title("mismatch by token probability")
    return png_bytes(fig)


def ratio_distribution(d: np.ndarray) -> bytes:
    """Distribution of ρ = exp(d) = π_train / π_rollout (log x axis; ρ = 1 marked)."""
    plt = pyplot()
    rho = np.exp(d)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    lo, hi = np.quantile(rho, [0.0005, 0.9995]) if rho.size else (0.5, 2.0)
    lo, hi = min(lo, 0.99), max(hi, 1.01)
    ax.hist(np.clip(rho, lo, hi), bins=np.geomspace(lo, hi, 80), color="#aa5533")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ρ = π_train / π_rollout (clipped to the 0.05–99.95 % range)")
    ax.set_ylabel("tokens")
    ax.set_title("importance ratio per token")
    return png_bytes(fig)


def drift_by_position(d: np.ndarray, position: np.ndarray) -> bytes:
    """Mean d and mean |d| by response position (bins of equal width)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if position.size:
        n_bins = int(min(50, position.max() + 1))
        edges = np.linspace(0, position.max() + 1, n_bins + 1)
        idx = np.clip(np.digitize(position, edges) - 1, 0, n_bins - 1)
        count = np.bincount(idx, minlength=n_bins)
        ok = count > 0
        centre = 0.5 * (edges[:-1] + edges[1:])
        ax.plot(centre[ok], (np.bincount(idx, np.abs(d), n_bins) / np.maximum(count, 1))[ok], label="mean |d|")
        ax.plot(centre[ok], (np.bincount(idx, d, n_bins) / np.maximum(count, 1))[ok], label="mean d")
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=8)
    ax.set_xlabel("response position")
    ax.set_ylabel("log-prob difference")
    ax.set_title("drift by position")
    return png_bytes(fig)


def cumulative_log_ratio(d: np.ndarray, sequence_key: np.ndarray) -> bytes:
    """Per sequence: Σ_t d (the sequence log-ratio) against its length; the sequence-level IS weight is its
    exponential, so long sequences drift furthest."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if d.size:
        _, inverse = np.unique(sequence_key, return_inverse=True)
        total = np.bincount(inverse, d)
        length = np.bincount(inverse)
        ax.scatter(length, total, s=8, alpha=0.6)
        ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("sequence length (valid tokens)")
    ax.set_ylabel("Σ_t d = log ρ_seq")
    ax.set_title("cumulative log-ratio vs length")
    return png_bytes(fig)


def step_series(steps: np.ndarray, series: dict[str, np.ndarray]) -> bytes:
    """Per-step metrics (one line each, log y where positive)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items()):
        ax.plot(steps, values, ".-")
        if np.all(values[np.isfinite(values)] > 0):
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
    return png_bytes(fig)
