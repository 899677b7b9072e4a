"""``tim-plugins report DIR``: a self-contained HTML report (inline PNG figures) from a per-token dump."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

__all__ = ["build_report", "register"]


def _img(png: bytes, caption: str) -> str:
    data = base64.b64encode(png).decode()
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return html.escape(str(v))


def _table(rows: list[tuple[str, object]], header=("key", "value")) -> str:
    body = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>" for k, v in rows)
    return f"<table><tr><th>{header[0]}</th><th>{header[1]}</th></tr>{body}</table>"


def _multi_table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


_CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
figure{display:inline-block;margin:.5em;vertical-align:top}figcaption{font-size:.85em;color:#555;max-width:620px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:.9em;text-align:left}
.note{background:#f4f4f8;padding:.6em 1em;border-left:3px solid #668}"""


def build_report(dump_dir: str | Path, out: str | Path | None = None, *, summary: dict | None = None,
                 title: str = "Training-inference mismatch report") -> Path:
    """Write ``report.html`` (or ``out``) for the dump in ``dump_dir``; returns its path.

    ``summary`` (or ``dump_dir/summary.json`` when present) adds the run settings and the monitor's metric
    table. Figures: |d| histogram, mismatch by token probability with the (1 − p) envelope, ρ distribution,
    drift by position, cumulative log-ratio vs length, and per-step series when the dump has several steps.
    """
    import numpy as np

    from tim_plugins.dump import read_dump
    from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD
    from tim_plugins.report import figures

    dump_dir = Path(dump_dir)
    table = read_dump(dump_dir)
    col = lambda name: table.column(name).to_numpy()
    rollout, train = col("rollout_logprob").astype(np.float64), col("train_logprob").astype(np.float64)
    ok = (np.isfinite(rollout) & np.isfinite(train) & (rollout > INVALID_LOGPROB_THRESHOLD)
          & (train > INVALID_LOGPROB_THRESHOLD))
    d = (train - rollout)[ok]
    step, rank, seq, pos = col("step")[ok], col("rank")[ok], col("sequence")[ok], col("position")[ok]
    seq_key = (step.astype(np.int64) << 40) + (rank.astype(np.int64) << 32) + seq.astype(np.int64)

    if summary is None and (dump_dir / "summary.json").exists():
        summary = json.loads((dump_dir / "summary.json").read_text())

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts.append(
        "<p class='note'>d = log p_train − log p_rollout per sampled token, ρ = e<sup>d</sup>. "
        f"{int(ok.sum())} tokens from {len(np.unique(seq_key))} sequences in the dump"
        f"{'' if ok.all() else f' ({int((~ok).sum())} invalid rows skipped)'}.</p>"
    )
    if summary:
        settings = summary.get("settings", {})
        if settings:
            parts.append("<h2>Settings</h2>" + _table(sorted(settings.items())))
        for note in summary.get("notes", []):
            parts.append(f"<p class='note'>{html.escape(note)}</p>")
        comps = summary.get("comparisons")
        if comps:
            names = list(comps)
            keys = [k for k in comps[names[0]] if not k.startswith("tim/by_prob")]
            rows = [[k] + [comps[n].get(k, float("nan")) for n in names] for k in keys]
            parts.append("<h2>Metrics</h2>" + _multi_table(["metric"] + names, rows))
        elif summary.get("metrics"):
            parts.append("<h2>Metrics</h2>" + _table(sorted(summary["metrics"].items())))
    parts.append("<h2>Figures</h2>")
    parts.append(_img(figures.abs_diff_histogram(d), "|d| per token, log-spaced bins"))
    parts.append(_img(figures.mismatch_by_probability(d, rollout[ok]),
                      "mismatch by token probability: to first order theory bounds |Δlog p| by 2ε(1 − p)"))
    parts.append(_img(figures.ratio_distribution(d), "ρ = π_train/π_rollout per token"))
    parts.append(_img(figures.drift_by_position(d, pos), "drift by response position"))
    parts.append(_img(figures.cumulative_log_ratio(d, seq_key),
                      "sequence log-ratio Σd vs length: the sequence IS weight is its exponential"))
    steps = np.unique(step)
    if steps.size > 1:
        idx = np.searchsorted(steps, step)
        count = np.bincount(idx)
        k3 = np.bincount(idx, np.expm1(d) - d) / count
        mean_abs = np.bincount(idx, np.abs(d)) / count
        max_abs = np.array([np.abs(d[idx == i]).max() for i in range(steps.size)])
        parts.append(_img(figures.step_series(steps, {"k3": k3, "mean |d|": mean_abs, "max |d|": max_abs}),
                          "per-step mismatch (sampled sequences of the dump)"))
    parts.append("</body></html>")
    out_path = Path(out) if out is not None else dump_dir / "report.html"
    out_path.write_text("".join(parts), encoding="utf-8")
    return out_path


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="Turn a per-token dump folder into a self-contained HTML report.")
    p.add_argument("dump_dir", help="folder with step_*-rank_*.parquet files (and optionally summary.json)")
    p.add_argument("--out", default=None, help="output HTML file (default: DUMP_DIR/report.html)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    path = build_report(args.dump_dir, args.out)
    print(f"report written to {path}")
    return 0
