"""HTML report of a study: per-scenario curves (mean ± std across seeds), the harm curve (paired Δ of the
held-out reward vs k3, per cell, with 95 % intervals), and the tables of summary.json."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import numpy as np

from tim_plugins.report.figures import png_bytes, pyplot

from .analysis import KEYS, moving_average, zero_control

__all__ = ["write_report", "markdown_tables"]

_SCENARIO_TITLES = {
    "main": "Main cell: engines and injected magnitudes (L = budget)",
    "length": "Length axis: other completion budgets",
    "update": "Update axis: larger LR, no gradient clipping",
    "surge": "Length surge: the reward comes to favour length; with and without LR decay",
    "mitigation": "Mitigations on the strongest harm",
}
_EVAL_KEYS = (("eval/sample/reward", "held-out reward, T = 1 (trained policy)"),
              ("eval/greedy/reward", "held-out reward, greedy (trained policy)"))


def _png(fig) -> str:
    return base64.b64encode(png_bytes(fig)).decode()


def _stack(runs: dict, key: str):
    series = [(r["step"], r[key]) for r in runs.values() if key in r and len(r[key])]
    if not series:
        return None
    n = min(len(s[1]) for s in series)
    return series[0][0][:n], np.vstack([s[1][:n] for s in series])


def _curves(ax, data: dict, names: list[str], key: str, log: bool = False, smooth: int = 0) -> None:
    for name in names:
        got = _stack(data.get(name, {}), key)
        if got is None:
            continue
        steps, ys = got
        if smooth:
            ys = np.vstack([moving_average(y, smooth) for y in ys])
        if log:
            ys = np.where(ys > 0, ys, np.nan)
        with np.errstate(all="ignore"), __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            mean, std = np.nanmean(ys, 0), np.nanstd(ys, 0)
        (line,) = ax.plot(steps, mean, lw=1.2, label=name)
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.12, lw=0)
    if log:
        ax.set_yscale("log")
    ax.tick_params(labelsize=7)
    ax.set_xlabel("step", fontsize=8)


def _scenario_figure(runs: dict, evals: dict, names: list[str]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(3, 3, figsize=(16, 11))
    fig.subplots_adjust(hspace=0.4)
    panels = [("eval", k, t, False) for k, t in _EVAL_KEYS] + [("run", k, t, log) for k, t, log in KEYS]
    for ax, (src, key, title, log) in zip(axes.flat, panels):
        data = evals if src == "eval" else runs
        _curves(ax, data, names, key, log=log, smooth=10 if key == "reward" else 0)
        ax.set_title(title + (", 10-step average" if key == "reward" else "") + (" (log)" if log else ""),
                     fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8)
    return _png(fig)


def _harm_figure(curve: list[dict]) -> str | None:
    """Paired Δ (95 % interval) against the per-token k3 and against k3 summed over a response, per cell."""
    def ok(p, key):
        return p[key] is not None and math.isfinite(p[key]) and p[key] > 0

    if not any(ok(p, "k3_mean") for c in curve for p in c["points"]):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, key, label in zip(axes, ("k3_mean", "seq_k3_mean"),
                              ("k3 per token (mean over the run)", "k3 × response length (mean over the run)")):
        for c in curve:
            pts = [p for p in c["points"] if ok(p, key)]
            if not pts:
                continue
            x = np.array([p[key] for p in pts])
            y = np.array([p["delta_mean"] for p in pts])
            lo = np.array([p["ci95_low"] for p in pts])
            hi = np.array([p["ci95_high"] for p in pts])
            err = np.vstack([np.where(np.isfinite(lo), y - lo, 0), np.where(np.isfinite(hi), hi - y, 0)])
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, lw=1.2,
                        label=f"{c['cell']} (L={c['budget']}, LR {c['learning_rate']:g})")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("Δ held-out T=1 reward vs control (paired)")
        ax.legend(fontsize=8)
    return _png(fig)


def _fmt(v, markdown: bool = False) -> str:
    """A table cell: 3 significant digits, scientific below 1e-3, NaN as a dash; HTML-escaped or Markdown."""
    if isinstance(v, bool):
        return ("**yes**" if markdown else "yes") if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if v == 0:
            return "0"
        return f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}"
    return str(v) if markdown else html.escape(str(v))


def _table(rows: list[dict], cols: list[str]) -> str:
    parts = ["<table><tr>"] + [f"<th>{html.escape(c)}</th>" for c in cols] + ["</tr>"]
    for row in rows:
        parts.append("<tr>" + "".join(f"<td>{_fmt(row.get(c, ''))}</td>" for c in cols) + "</tr>")
    return "".join(parts) + "</table>"


def write_report(path: Path, *, arms: list, runs: dict, evals: dict, summary: dict, config: dict,
                 env: dict) -> Path:
    rule = summary["degradation_rule"]
    parts = [
        "<!doctype html><meta charset='utf-8'><title>tim-plugins study</title>",
        "<style>body{font:14px sans-serif;margin:24px;max-width:1500px}table{border-collapse:collapse;"
        "margin-bottom:12px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f0f0f0}"
        "td:first-child{text-align:left}</style>",
        "<h1>TIM study: GRPO (TRL) with the TIM callback, long letter chains</h1>",
        f"<p>Steps per run: {config['steps']}; seeds: {config['seeds']}; device: {html.escape(config['device'])}. "
        "Curves: mean ± std across seeds. Nothing is tuned per arm.</p>",
        f"<p><b>Degradation rule (fixed before the runs):</b> endpoint = <code>{rule['endpoint']}</code> "
        f"averaged over the last {rule['final_evals']} evaluations; paired by seed against the control "
        f"(Δ<sub>s</sub>); degraded when mean Δ ≤ −{rule['min_drop']} and every seed's Δ &lt; 0. A mitigation "
        f"helps (against its unmitigated arm) when mean Δ ≥ +{rule['min_drop']} and every seed's Δ &gt; 0.</p>",
    ]
    harm = _harm_figure(summary.get("harm_curve", []))
    if harm:
        parts += ["<h2>Harm curve</h2>", f"<img src='data:image/png;base64,{harm}'>",
                  _table([{"cell": c["cell"], "budget": c["budget"], "learning_rate": c["learning_rate"],
                           "onset_arm": c["onset_arm"] or "none", "onset_k3": c["onset_k3"]
                           if c["onset_k3"] is not None else math.nan} for c in summary["harm_curve"]],
                         ["cell", "budget", "learning_rate", "onset_arm", "onset_k3"])]
    parts.append("<h2>Paired comparisons</h2>")
    parts.append(_table(summary["comparisons"], ["arm", "vs", "n", "delta_mean", "delta_std", "ci95_low",
                                                 "ci95_high", "degraded", "helps"]))
    parts.append("<h2>Summary</h2>")
    parts.append(_table(summary["rows"], ["arm", "seeds", "eval_sample_reward", "eval_sample_reward_std",
                                          "eval_greedy_reward", "eval_sample_reward_start", "train_reward_start",
                                          "train_reward_end", "k3_mean", "k3_start", "k3_end", "seq_k3_mean",
                                          "seq_log_ratio_abs_max", "length_end", "entropy_end",
                                          "grad_norm_spikes", "collapsed_runs", "lr_scale_end",
                                          "seconds_per_step"]))
    by_scenario: dict[str, list[str]] = {}
    for arm in arms:
        by_scenario.setdefault(arm.scenario, []).append(arm.name)
    for scenario, names in by_scenario.items():
        if scenario == "mitigation":  # shown with the arm they try to fix and its zero-mismatch control
            mits = [a for a in arms if a.scenario == "mitigation"]
            names = list(dict.fromkeys([zero_control(mits[0]), mits[0].control] + names))
        parts.append(f"<h2>{html.escape(_SCENARIO_TITLES.get(scenario, scenario))}</h2>")
        parts.append(f"<img src='data:image/png;base64,{_scenario_figure(runs, evals, names)}'>")
    parts.append("<h2>Arms</h2><ul>" + "".join(
        f"<li><b>{html.escape(a.name)}</b>: {html.escape(a.description)}</li>" for a in arms) + "</ul>")
    parts.append(f"<h2>Environment</h2><pre>{html.escape(str(env))}</pre>")
    path.write_text("\n".join(parts))
    return path


def markdown_tables(summary: dict) -> str:
    """The tables of summary.json as Markdown (``summary.md``, pasted into FINDINGS.md)."""
    def md(v) -> str:
        return _fmt(v, markdown=True)

    out = ["| arm | vs | Δ mean ± std | 95 % interval | per seed | degraded | helps |",
           "|---|---|---|---|---|---|---|"]
    for c in summary["comparisons"]:
        out.append(f"| {c['arm']} | {c['vs']} | {c['delta_mean']:+.3f} ± {c['delta_std']:.3f} | "
                   f"[{c['ci95_low']:+.3f}, {c['ci95_high']:+.3f}] | "
                   f"{' '.join(f'{d:+.3f}' for d in c['deltas'])} | {md(c['degraded'])} | {md(c['helps'])} |")
    out += ["", "| arm | held-out T=1 (endpoint) | greedy | train reward start → end | k3 (mean) | k3 × length | "
            "entropy end | length end | grad spikes | LR scale end | s/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        out.append(f"| {r['arm']} | {r['eval_sample_reward']:.3f} ± {r['eval_sample_reward_std']:.3f} | "
                   f"{r['eval_greedy_reward']:.3f} | {r['train_reward_start']:.3f} → {r['train_reward_end']:.3f} | "
                   f"{md(r['k3_mean'])} | {md(r['seq_k3_mean'])} | {r['entropy_end']:.2f} | "
                   f"{r['length_end']:.1f} | {r['grad_norm_spikes']} | {md(r['lr_scale_end'])} | "
                   f"{r['seconds_per_step']:.2f} |")
    if summary.get("harm_curve"):
        out += ["", "| cell | L | LR | harm starts at (arm) | its k3 |", "|---|---|---|---|---|"]
        for c in summary["harm_curve"]:
            onset_k3 = md(c["onset_k3"]) if c["onset_k3"] is not None else "–"
            out.append(f"| {c['cell']} | {c['budget']} | {c['learning_rate']:g} | {c['onset_arm'] or 'none'} | "
                       f"{onset_k3} |")
    return "\n".join(out) + "\n"
