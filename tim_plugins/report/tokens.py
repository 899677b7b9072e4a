"""A dump's tokens as the report reads them: the core monitor's metrics per step and over all steps, and each
per-token figure's data, from streaming queries over the dump's files (``report.query``), never a whole-table read.

The report never re-implements a metric: per-step values are ``tim_plugins.metrics``'s own derivation
(``_derive``) of the monitor's state accumulated over the dump's rows, each sequence laid out as one row of a
[sequences, positions] batch, with the token IS ratios ρ as ``is_weights`` (what ``mismatch_metrics`` on those
tensors gives).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

__all__ = ["has_dump", "load_tokens", "run_tokens", "metrics_by_step", "overall_metrics", "prob_curves",
           "abs_histograms", "rho_source", "position_profiles", "sequence_points"]


def has_dump(folder: Path) -> bool:
    """Whether ``folder`` holds per-token dump files (the names ``tim_plugins.dump`` writes)."""
    return folder.is_dir() and any(folder.glob("step_*-rank_*.parquet"))


def dump_folder(summary: dict | None, run_dir: Path, name: str = "all steps") -> Path:
    """The folder of a run's dump ``name`` (``summary["dumps"]``; a training run's default: ``run_dir/dump``)."""
    return Path(run_dir) / (summary or {}).get("dumps", {}).get(name, "dump" if name == "all steps" else "")


def run_tokens(summary: dict, run_dir: Path, name: str = "all steps"):
    """The ``query.Dump`` of a run's dump ``name`` (its folder from ``summary["dumps"]``), or None without one."""
    folder = dump_folder(summary, run_dir, name)
    return load_tokens(folder) if has_dump(folder) else None


def load_tokens(dump_dir: str | Path):
    """The ``query.Dump`` of a dump folder: a snapshot of its complete files, queried on the active engine."""
    from tim_plugins.report.query import open_dump

    return open_dump(dump_dir)


def metrics_by_step(tokens) -> tuple[np.ndarray, list[dict]]:
    """(steps, one ``mismatch_metrics`` dict per step) over the dump's rows of each step, with the token IS
    ratios ρ passed as ``is_weights`` so ``tim/is/ess`` is the effective sample size of the uncorrected ρ."""
    from tim_plugins.metrics import _derive

    steps, states = tokens.step_states()
    return steps, [_derive(s, "tim") for s in states]


def _merged(states: list[dict]) -> dict:
    """The state of all rows from the per-step states: sums add, maxima (minima stored negated) take the max."""
    from tim_plugins._mismatch_layout import MAX_FIELDS, SUM_FIELDS, empty_state, unpack

    out = unpack(empty_state("cpu").numpy())
    for s in states:
        for name, _ in SUM_FIELDS:
            out[name] = out[name] + s[name]
        for name, _ in MAX_FIELDS:
            out[name] = max(out[name], s[name])
    return out


def overall_metrics(tokens) -> dict:
    """``mismatch_metrics`` over every row of the dump (sequences of all steps), ρ as ``is_weights``."""
    from tim_plugins.metrics import _derive

    return _derive(_merged(tokens.step_states()[1]), "tim")


# ------------------------------------------------------------------------------------------- figures' data
def prob_curves(dumps: dict, quantile: bool = False) -> dict[str, dict]:
    """``figures.mismatch_by_probability``'s data per dump: tokens and Σ|d| per bin of 1 − p, with the p99 of |d|
    per bin when ``quantile``."""
    from tim_plugins.report.figures import PROB_EDGES, PROB_MIN_COUNT

    return {name: t.prob_curve(PROB_EDGES, 0.99 if quantile else None, PROB_MIN_COUNT) for name, t in dumps.items()}


def abs_histograms(dumps: dict) -> tuple[dict[str, tuple[np.ndarray, int]], np.ndarray | None]:
    """``figures.abs_diff_histogram``'s data: ({name: (counts, tokens at exactly 0)}, the shared bins)."""
    from tim_plugins.report.figures import abs_diff_bins

    ranges = {name: t.abs_range() for name, t in dumps.items()}
    los = [lo for lo, _, _ in ranges.values() if lo is not None]
    his = [hi for _, hi, _ in ranges.values() if hi is not None and hi > 0]
    bins = abs_diff_bins(min(los), max(his)) if los else None
    hists = {}
    for name, t in dumps.items():
        zeros = ranges[name][2]
        hists[name] = (t.abs_histogram(bins) if bins is not None else np.zeros(0, dtype=np.int64), zeros)
    return hists, bins


def rho_source(dumps: dict):
    """``figures.ratio_distribution``'s source: the pooled extremes and quantiles of d, and histograms of ρ per
    dump on the bins the figure asks for."""
    from tim_plugins.report.figures import RHO_QUANTILES, RhoSource
    from tim_plugins.report.sql_stats import quantiles_of

    items = [t for t in dumps.values()]
    ranges = [t.d_range() for t in items]
    n = sum(r[0] for r in ranges)
    if not n:
        return RhoSource(0, math.nan, math.nan, math.nan, math.nan, lambda *_: ({}, 0, 0), tuple(dumps))
    con = items[0].con
    if any(t.con is not con for t in items):
        raise ValueError("rho_source: the dumps must be opened on one engine (report.query.engine)")
    pooled = " UNION ALL ".join(f"SELECT 0 AS g, d AS v FROM {t.valid}" for t in items)
    dmin, dmax = min(r[1] for r in ranges if r[0]), max(r[2] for r in ranges if r[0])
    # the monitor's signed log histogram of d (per-step scan) as the first narrowing
    hbins: dict = {}
    for t in items:
        for b, (c, lo, hi) in t._overall().get("hbins", {}).items():
            h = hbins.setdefault(b, [0, math.inf, -math.inf])
            h[0], h[1], h[2] = h[0] + c, min(h[1], lo), max(h[2], hi)
    initial = {0: [tuple(hbins[b]) for b in sorted(hbins)]}
    q = quantiles_of(con, pooled, {0: (n, RHO_QUANTILES)}, {0: (n, dmin, dmax)}, initial)

    def counts(edges, log, lo_d, hi_d):
        out, below, above = {}, 0, 0
        for name, t in dumps.items():
            out[name], b, a = t.rho_histogram(edges, log, lo_d, hi_d)
            below, above = below + b, above + a
        return out, below, above

    return RhoSource(n, dmin, dmax, q[(0, RHO_QUANTILES[0])], q[(0, RHO_QUANTILES[1])], counts, tuple(dumps))


def position_profiles(dumps: dict) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``figures.drift_by_position``'s data: {name: (positions, tokens, Σ|d|)}."""
    return {name: t.position_profile() for name, t in dumps.items()}


def sequence_points(dumps: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``figures.sequence_log_ratio``'s data: {name: (length, Σ_t d) per sequence}."""
    out = {}
    for name, t in dumps.items():
        seq = t.sequences()
        out[name] = (seq.length, seq.sum_d)
    return out
