"""Per-run collapse detection and the per-arm summary (pure numpy on the per-step CSV columns)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

__all__ = ["load_run", "moving_average", "collapse_step", "spike_count", "summarize", "KEYS"]

# Per-step series shown in the report (CSV column, label, log-scale y).
KEYS = (
    ("reward", "reward (exact match)", False),
    ("tim/token/kl_k3", "k3 (rollout vs trainer)", True),
    ("tim/token/abs_diff_max", "max |Δ log p|", True),
    ("completions/mean_length", "mean response length", False),
    ("entropy", "entropy", False),
    ("grad_norm", "grad norm (pre-clip)", True),
    ("lr_scale", "LR scale", False),
)


def load_run(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    cols: dict[str, np.ndarray] = {}
    for key in (rows[0].keys() if rows else ()):
        vals = []
        for r in rows:
            try:
                vals.append(float(r[key]) if r[key] not in ("", None) else math.nan)
            except ValueError:
                vals.append(math.nan)
        cols[key] = np.asarray(vals, dtype=float)
    return cols


def moving_average(x: np.ndarray, w: int) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(len(x)):
        seg = x[max(0, i - w + 1): i + 1]
        seg = seg[np.isfinite(seg)]
        out[i] = seg.mean() if seg.size else math.nan
    return out


def collapse_step(steps: np.ndarray, reward: np.ndarray, rule: dict) -> int | None:
    """First step at which the smoothed reward has been below rule['ratio'] × its running max for
    rule['patience'] consecutive steps (running max >= rule['min_peak']); None if never."""
    smooth = moving_average(reward, rule["window"])
    peak, streak = -math.inf, 0
    for s, v in zip(steps, smooth):
        if not math.isfinite(v):
            continue
        peak = max(peak, v)
        streak = streak + 1 if (peak >= rule["min_peak"] and v < rule["ratio"] * peak) else 0
        if streak >= rule["patience"]:
            return int(s)
    return None


def spike_count(x: np.ndarray, factor: float) -> int:
    """Steps where x exceeds `factor` × the running median of the earlier positive values (first 5 steps
    skipped). Zeros are left out of the median: a GRPO step whose groups all have zero reward variance has
    grad norm exactly 0, and a median of zeros would count every ordinary step as a spike."""
    n = 0
    for i in range(5, len(x)):
        prev = x[:i][np.isfinite(x[:i]) & (x[:i] > 0)]
        if prev.size and math.isfinite(x[i]) and x[i] > factor * float(np.median(prev)):
            n += 1
    return n


def _edge_mean(x: np.ndarray, head: bool, n: int = 5) -> float:
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan
    return float(x[:n].mean() if head else x[-n:].mean())


def summarize(arm_runs: dict[str, dict[int, dict[str, np.ndarray]]], seconds: dict[str, list[float]],
              rule: dict, reference_arm: str | None) -> list[dict]:
    """One row per arm: mean ± std across seeds of the final reward (mean of the last 10 steps), collapses,
    k3 at start / end (mean of the first / last 5 steps), cost per step relative to the reference arm."""
    per_step_cost = {}
    for arm, runs in arm_runs.items():
        costs = [np.nanmedian(r["step_time_s"]) for r in runs.values() if "step_time_s" in r]
        per_step_cost[arm] = float(np.mean(costs)) if costs else math.nan
    ref = per_step_cost.get(reference_arm, math.nan) if reference_arm else math.nan
    table = []
    for arm, runs in arm_runs.items():
        finals, collapses, k3_start, k3_end, gspikes, espikes, peaks = [], [], [], [], [], [], []
        for seed, r in sorted(runs.items()):
            steps, reward = r["step"], r["reward"]
            finals.append(float(np.nanmean(reward[-10:])))
            peaks.append(float(np.nanmax(moving_average(reward, rule["window"]))))
            collapses.append(collapse_step(steps, reward, rule))
            k3 = r.get("tim/token/kl_k3", np.full_like(reward, math.nan))
            k3_start.append(_edge_mean(k3, True))
            k3_end.append(_edge_mean(k3, False))
            gspikes.append(spike_count(r.get("grad_norm", np.array([])), rule["grad_spike"]))
            espikes.append(spike_count(r.get("entropy", np.array([])), rule["entropy_spike"]))
        n_coll = sum(c is not None for c in collapses)
        table.append({
            "arm": arm, "seeds": len(runs),
            "final_reward_mean": float(np.mean(finals)), "final_reward_std": float(np.std(finals)),
            "peak_reward_mean": float(np.mean(peaks)),
            "collapsed_runs": n_coll,
            "collapse_steps": ",".join("none" if c is None else str(c) for c in collapses),
            "k3_start": float(np.nanmean(k3_start)), "k3_end": float(np.nanmean(k3_end)),
            "k3_start_max_seed": float(np.nanmax(k3_start)) if runs else math.nan,
            "grad_norm_spikes": int(sum(gspikes)), "entropy_spikes": int(sum(espikes)),
            "seconds_per_step": per_step_cost[arm],
            "cost_vs_reference": per_step_cost[arm] / ref if ref and math.isfinite(ref) else math.nan,
            "run_seconds_mean": float(np.mean(seconds.get(arm, [math.nan]))),
        })
    return table
