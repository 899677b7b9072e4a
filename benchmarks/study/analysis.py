"""Per-arm summary, paired comparisons by seed, the degradation verdict and the harm curve (numpy on the
per-step and per-evaluation CSV columns)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

__all__ = ["load_run", "moving_average", "collapse_step", "spike_count", "endpoint", "summarize", "paired",
           "t_quantile", "harm_curve", "KEYS", "zero_control"]

# Per-step series shown in the report (CSV column, label, log-scale y).
KEYS = (
    ("reward", "training reward (rollout engine's samples)", False),
    ("tim/token/kl_k3", "k3 (rollout vs trainer)", True),
    ("tim/seq/log_ratio_abs_max", "max |sequence log-ratio|", True),
    ("completions/mean_length", "mean response length", False),
    ("entropy", "entropy (trainer)", False),
    ("grad_norm", "grad norm (pre-clip)", True),
    ("lr_scale", "LR scale", False),
)
# Two-sided 95 % Student t quantiles by degrees of freedom (1 .. 10); beyond, the normal 1.96 is within 5 %.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_quantile(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


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


def endpoint(evals: dict[str, np.ndarray], key: str, last: int) -> float:
    """Mean of ``key`` over the last ``last`` evaluations of a run."""
    x = evals.get(key, np.array([]))
    x = x[np.isfinite(x)]
    return float(x[-last:].mean()) if x.size else math.nan


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _edge(x: np.ndarray, head: bool, n: int = 5) -> float:
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan
    return float(x[:n].mean() if head else x[-n:].mean())


def zero_control(arm) -> str:
    """The zero-mismatch control of an arm's cell."""
    return "control" + (f"@{arm.cell}" if arm.cell != "main" else "")


def summarize(arms: list, runs: dict, evals: dict, seconds: dict, rule: dict, crule: dict) -> list[dict]:
    """One row per arm: means over seeds of the endpoint (and the greedy one), training reward, k3, length,
    entropy, grad-norm spikes, collapses (training reward), LR decay, cost."""
    table = []
    for arm in arms:
        rs, es = runs.get(arm.name, {}), evals.get(arm.name, {})
        if not rs:
            continue
        per_seed = {s: endpoint(es.get(s, {}), rule["endpoint"], rule["final_evals"]) for s in rs}
        row = {
            "arm": arm.name, "scenario": arm.scenario, "cell": arm.cell, "rollout": arm.rollout,
            "magnitude": arm.magnitude, "budget": arm.budget, "learning_rate": arm.learning_rate,
            "control": arm.control or "", "seeds": len(rs),
            "eval_sample_reward": _mean(per_seed.values()),
            "eval_sample_reward_std": float(np.std(list(per_seed.values()))) if per_seed else math.nan,
            "eval_greedy_reward": _mean(endpoint(es.get(s, {}), "eval/greedy/reward", rule["final_evals"])
                                        for s in rs),
            "eval_sample_reward_start": _mean(endpoint({k: v[:1] for k, v in es.get(s, {}).items()},
                                                       "eval/sample/reward", 1) for s in rs),
            "eval_sample_error_frac": _mean(endpoint(es.get(s, {}), "eval/sample/error_frac", rule["final_evals"])
                                            for s in rs),
            "eval_sample_length": _mean(endpoint(es.get(s, {}), "eval/sample/length", rule["final_evals"])
                                        for s in rs),
            "eval_sample_entropy": _mean(endpoint(es.get(s, {}), "eval/sample/entropy", rule["final_evals"])
                                         for s in rs),
            "train_reward_start": _mean(_edge(r["reward"], True) for r in rs.values()),
            "train_reward_end": _mean(float(np.nanmean(r["reward"][-10:])) for r in rs.values()),
            "k3_mean": _mean(float(np.nanmean(r["tim/token/kl_k3"])) for r in rs.values() if "tim/token/kl_k3" in r),
            "k3_start": _mean(_edge(r["tim/token/kl_k3"], True) for r in rs.values() if "tim/token/kl_k3" in r),
            "k3_end": _mean(_edge(r["tim/token/kl_k3"], False) for r in rs.values() if "tim/token/kl_k3" in r),
            # k3 summed over a response (per-token k3 × mean length, per step): the sequence-level drift
            "seq_k3_mean": _mean(float(np.nanmean(r["tim/token/kl_k3"] * r["completions/mean_length"]))
                                 for r in rs.values() if "tim/token/kl_k3" in r),
            "seq_log_ratio_abs_max": _mean(float(np.nanmax(r["tim/seq/log_ratio_abs_max"])) for r in rs.values()
                                           if "tim/seq/log_ratio_abs_max" in r),
            "length_start": _mean(_edge(r["completions/mean_length"], True) for r in rs.values()),
            "length_end": _mean(_edge(r["completions/mean_length"], False) for r in rs.values()),
            "entropy_end": _mean(_edge(r["entropy"], False) for r in rs.values() if "entropy" in r),
            "grad_norm_spikes": int(sum(spike_count(r.get("grad_norm", np.array([])), crule["grad_spike"])
                                        for r in rs.values())),
            "collapsed_runs": sum(collapse_step(r["step"], r["reward"], crule) is not None for r in rs.values()),
            "lr_scale_end": _mean(_edge(r["lr_scale"], False, 1) for r in rs.values() if "lr_scale" in r),
            "seconds_per_step": _mean(float(np.nanmedian(r["step_time_s"])) for r in rs.values()),
            "run_seconds": _mean(seconds.get(arm.name, [])),
        }
        row["endpoint_by_seed"] = {str(s): v for s, v in sorted(per_seed.items())}
        table.append(row)
    return table


def paired(table: list[dict], arm_name: str, control: str, rule: dict) -> dict | None:
    """Δ_s = endpoint(arm) − endpoint(control) for the seeds both ran; mean, std, 95 % t interval, verdict."""
    rows = {r["arm"]: r for r in table}
    if arm_name not in rows or control not in rows:
        return None
    a, c = rows[arm_name]["endpoint_by_seed"], rows[control]["endpoint_by_seed"]
    seeds = sorted(set(a) & set(c), key=int)
    d = np.asarray([a[s] - c[s] for s in seeds], dtype=float)
    d = d[np.isfinite(d)]
    if not d.size:
        return None
    mean = float(d.mean())
    std = float(d.std(ddof=1)) if d.size > 1 else math.nan
    half = t_quantile(d.size - 1) * std / math.sqrt(d.size) if d.size > 1 else math.nan
    degraded = mean <= -rule["min_drop"] and (not rule["all_seeds_negative"] or bool((d < 0).all()))
    # The mirror rule, for a mitigation against its unmitigated arm: mean Δ >= +min_drop, every seed above 0.
    helps = mean >= rule["min_drop"] and (not rule["all_seeds_negative"] or bool((d > 0).all()))
    return {"arm": arm_name, "vs": control, "n": int(d.size), "delta_mean": mean, "delta_std": std,
            "ci95_low": mean - half, "ci95_high": mean + half, "deltas": [float(x) for x in d],
            "degraded": bool(degraded), "helps": bool(helps)}


def harm_curve(table: list[dict], comparisons: list[dict]) -> list[dict]:
    """Per cell (budget, LR): Δ vs k3 for every mismatched arm (no mitigation) against the cell's control,
    and where harm starts: the smallest mismatch (by k3) the rule calls degraded."""
    rows = {r["arm"]: r for r in table}
    cells: dict[str, list[dict]] = {}
    for comp in comparisons:
        r = rows[comp["arm"]]
        if r["scenario"] in ("mitigation",) or "+" in r["arm"] or not comp["vs"].startswith("control"):
            continue
        cells.setdefault(r["cell"], []).append({
            "arm": r["arm"], "rollout": r["rollout"], "magnitude": r["magnitude"], "k3_mean": r["k3_mean"],
            "seq_k3_mean": r["seq_k3_mean"],
            "budget": r["budget"], "learning_rate": r["learning_rate"], "delta_mean": comp["delta_mean"],
            "ci95_low": comp["ci95_low"], "ci95_high": comp["ci95_high"], "degraded": comp["degraded"]})
    out = []
    for cell, pts in cells.items():
        pts.sort(key=lambda p: (p["k3_mean"] if math.isfinite(p["k3_mean"]) else 0.0))
        onset = next((p for p in pts if p["degraded"]), None)
        out.append({"cell": cell, "budget": pts[0]["budget"], "learning_rate": pts[0]["learning_rate"],
                    "points": pts, "onset_arm": onset["arm"] if onset else None,
                    "onset_k3": onset["k3_mean"] if onset else None})
    return out
