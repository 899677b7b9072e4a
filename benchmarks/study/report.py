"""HTML report of a study: curves (mean ± std across seeds, per arm) as inline PNGs and the summary table."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import numpy as np

from tim_plugins.report.figures import png_bytes, pyplot

from .analysis import KEYS, moving_average

__all__ = ["write_report"]

_GROUPS = (
    ("TIM arms (no mitigation)", ("exact", "tim")),
    ("Mitigations on the strongest TIM arm", ("mitigation", "all")),
)


def _png(fig) -> str:
    return base64.b64encode(png_bytes(fig)).decode()


def _stack(runs: dict, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    series = [(r["step"], r[key]) for r in runs.values() if key in r and len(r[key])]
    if not series:
        return None
    n = min(len(s[1]) for s in series)
    return series[0][0][:n], np.vstack([s[1][:n] for s in series])


def _figure(arm_runs: dict, arms: list[str], reference: str | None, smooth: int) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    fig.subplots_adjust(hspace=0.35)
    for ax, (key, label, log) in zip(axes.flat, KEYS):
        for i, arm in enumerate(arms + ([reference] if reference and reference not in arms else [])):
            got = _stack(arm_runs.get(arm, {}), key)
            if got is None:
                continue
            steps, ys = got
            if key == "reward":  # per-step reward is a mean over few groups: show the collapse rule's average
                ys = np.vstack([moving_average(y, smooth) for y in ys])
            if log:
                ys = np.where(ys > 0, ys, np.nan)
            with np.errstate(all="ignore"):
                mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
            style = "--" if arm == reference and arm not in arms else "-"
            (line,) = ax.plot(steps, mean, style, lw=1.3, label=arm)
            ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15, lw=0)
        title = label + (f", {smooth}-step moving average" if key == "reward" else "")
        ax.set_title(title + (" (log; 0 not drawn)" if log else ""), fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[-1].axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=8)
    return _png(fig)


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if v == 0:
            return "0.0"
        return f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}"
    return html.escape(str(v))


def write_report(path: Path, *, arm_runs: dict, arms: list, table: list[dict], rule: dict, config: dict,
                 reference: str | None, env: dict, calibration: dict) -> Path:
    parts = [
        "<!doctype html><meta charset='utf-8'><title>tim-plugins study</title>",
        "<style>body{font:14px sans-serif;margin:24px;max-width:1400px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f0f0f0}"
        "td:first-child{text-align:left}</style>",
        "<h1>TIM study: GRPO (TRL) with the TIM callback, toy sort task</h1>",
        f"<p>Steps per run: {config['steps']}; seeds: {config['seeds']}; device: {html.escape(config['device'])}. "
        "Curves: mean ± std across seeds. Nothing is tuned per arm.</p>",
        f"<p><b>Collapse (the same rule for every arm):</b> the {rule['window']}-step moving average of the "
        "reward stays below "
        f"{rule['ratio']} × its running maximum for {rule['patience']} consecutive steps, once that maximum is "
        f">= {rule['min_peak']}. Spikes: grad norm > {rule['grad_spike']}× and entropy > {rule['entropy_spike']}× "
        "the running median of earlier steps.</p>",
        f"<p>Injection scales (calibrated once on the warm-started policy): {html.escape(str(calibration))}</p>",
        "<h2>Summary</h2><table><tr>",
    ]
    cols = ["arm", "seeds", "final_reward_mean", "final_reward_std", "peak_reward_mean", "collapsed_runs",
            "collapse_steps", "k3_start", "k3_end", "grad_norm_spikes", "entropy_spikes", "seconds_per_step",
            "cost_vs_reference"]
    parts += [f"<th>{c}</th>" for c in cols] + ["</tr>"]
    for row in table:
        parts.append("<tr>" + "".join(f"<td>{_fmt(row[c])}</td>" for c in cols) + "</tr>")
    ref = html.escape(str(reference))
    parts.append(f"</table><p>cost_vs_reference: median seconds per step relative to <code>{ref}"
                 "</code> (the strongest TIM arm, no mitigation). final reward: mean of the last 10 steps.</p>")
    by_group = {}
    for arm in arms:
        by_group.setdefault(arm.group, []).append(arm.name)
    for title, groups in _GROUPS:
        names = [n for g in groups for n in by_group.get(g, [])]
        if not names:
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(f"<img src='data:image/png;base64,{_figure(arm_runs, names, reference, rule['window'])}'>")
    parts.append("<h2>Arms</h2><ul>" + "".join(
        f"<li><b>{html.escape(a.name)}</b>: {html.escape(a.description)}</li>" for a in arms) + "</ul>")
    parts.append(f"<h2>Environment</h2><pre>{html.escape(str(env))}</pre>")
    path.write_text("\n".join(parts))
    return path
