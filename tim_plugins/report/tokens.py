"""A dump's tokens as the report reads them: the core monitor's metrics per step and over all steps, and each
per-token figure's data, from a few passes over the dump's files (``report.query``), never a whole-table read.

The report never re-implements a metric: per-step values are the monitor's own derivation (``_mismatch_derive``,
which ``MismatchMonitor.compute`` uses too) of the monitor's state accumulated over the dump's rows, each sequence
laid out as one row of a [sequences, positions] batch, with the token IS ratios ρ as ``is_weights`` (what
``mismatch_metrics`` on those tensors gives).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tim_plugins.dump import dump_files

__all__ = ["has_dump", "load_tokens", "run_tokens", "skipped_files_html", "metrics_by_step", "overall_metrics",
           "prob_curves", "abs_histograms", "rho_source", "position_profiles", "sequence_points",
           "order_statistics_of_d"]


def has_dump(folder: Path) -> bool:
    """Whether ``folder`` holds per-token dump files (the names ``tim_plugins.dump`` writes)."""
    return bool(dump_files(folder))


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


def skipped_files_html(tokens) -> str:
    """The page's sentence on the dump files a report left out (``query.Dump.skipped``: torn, empty or not dump
    files, e.g. a crashed run's last), each named with why; "" when it read every file."""
    import html

    skipped = getattr(tokens, "skipped", None) or []
    if not skipped:
        return ""
    listed = "; ".join(f"<code>{html.escape(name)}</code>: {html.escape(why)}" for name, why in skipped)
    return (f"<p>{len(skipped)} file{'' if len(skipped) == 1 else 's'} of the dump folder skipped (its numbers are "
            f"those of the other files): {listed}.</p>")


def metrics_by_step(tokens) -> tuple[np.ndarray, list[dict]]:
    """(steps, one ``mismatch_metrics`` dict per step) over the dump's rows of each step, with the token IS
    ratios ρ passed as ``is_weights`` so ``tim/is/ess`` is the effective sample size of the uncorrected ρ."""
    from tim_plugins._mismatch_derive import _derive

    steps, states = tokens.step_states()
    return steps, [_derive(s, "tim") for s in states]


def _merged(states: list[dict]) -> dict:
    """The state of all rows from the per-step states: sums add, maxima (minima stored negated) take the max."""
    from tim_plugins._mismatch_layout import MAX_FIELDS, N_STATE, N_SUMS, SUM_FIELDS, unpack

    empty = np.full(N_STATE, -math.inf)
    empty[:N_SUMS] = 0.0
    out = unpack(empty)
    for s in states:
        for name, _ in SUM_FIELDS:
            out[name] = out[name] + s[name]
        for name, _ in MAX_FIELDS:
            out[name] = max(out[name], s[name])
    return out


def overall_metrics(tokens) -> dict:
    """``mismatch_metrics`` over every row of the dump (sequences of all steps), ρ as ``is_weights``; its invalid
    tokens are the dump's, a row without a step (in no step's state) included."""
    from tim_plugins._mismatch_derive import _derive

    state = _merged(tokens.step_states()[1])
    state["invalid"] = float(tokens.invalid)
    return _derive(state, "tim")


# ------------------------------------------------------------------------------------------- figures' data
# The quantile of |d| per bin of 1 − p that ``figures.mismatch_by_probability`` draws (with one dump).
PROB_QUANTILE = 0.99
# A page draws the per-token figures of the same dumps one after the other (``prob_curves``, ``abs_histograms``,
# ``rho_source``): the first of them prepares what all three read of the rows (``_prepare``), so that it takes one
# narrow pass per dump; the ρ panels, whose edges depend on the ρ quantiles, take one more.


def _prepare(dumps: dict) -> None:
    """One narrow pass per dump serving the first round of every per-token figure's exact statistics: the p99 of
    |d| per probability bin (each dump), the |Δ| histogram's cut bins (the shared edges), the pooled ρ quantiles.
    Later calls find their results served (``Dump.serve``)."""
    from tim_plugins.report import bins as B
    from tim_plugins.report.figures import PROB_MIN_COUNT
    from tim_plugins.report.query import FETCH_ROWS

    items = list(dumps.values())
    if not items:
        return
    key = tuple(id(t) for t in items)
    if all(key in t.prepared for t in items):
        return
    requests = {id(t): [] for t in items}
    for t in items:
        requests[id(t)] += B.first_requests(t.prob_groups(PROB_QUANTILE, PROB_MIN_COUNT)[0], FETCH_ROWS)
    bins = _abs_bins(dumps)
    if bins is not None:
        for t in items:
            req = t.abs_request(bins)[1]
            if req is not None:
                requests[id(t)].append(req)
    n = sum(t.size for t in items)
    if n:
        pooled = B.first_requests(_d_groups(items, [k for lo, hi, _ in _rho_ranks(n) for k in (lo, hi)]),
                                  FETCH_ROWS)
        for t in items:
            requests[id(t)] += pooled
    for t in items:
        t.serve(requests[id(t)])
        t.prepared.add(key)


def prob_curves(dumps: dict, quantile: bool = False) -> dict[str, dict]:
    """``figures.mismatch_by_probability``'s data per dump: tokens and Σ|d| per bin of 1 − p, with the p99 of |d|
    per bin when ``quantile``."""
    from tim_plugins.report.figures import PROB_MIN_COUNT

    if quantile:
        _prepare(dumps)
    return {name: t.prob_curve(PROB_QUANTILE if quantile else None, PROB_MIN_COUNT) for name, t in dumps.items()}


def _abs_bins(dumps: dict) -> np.ndarray | None:
    from tim_plugins.report.figures import abs_diff_bins

    ranges = [t.abs_range() for t in dumps.values()]
    los = [lo for lo, _, _ in ranges if lo is not None]
    his = [hi for _, hi, _ in ranges if hi is not None and hi > 0]
    return abs_diff_bins(min(los), max(his)) if los else None


def abs_histograms(dumps: dict) -> tuple[dict[str, tuple[np.ndarray, int]], np.ndarray | None]:
    """``figures.abs_diff_histogram``'s data: ({name: (counts, tokens at exactly 0)}, the shared bins)."""
    _prepare(dumps)
    bins = _abs_bins(dumps)
    hists = {}
    for name, t in dumps.items():
        zeros = t.abs_range()[2]
        hists[name] = (t.abs_histogram(bins) if bins is not None else np.zeros(0, dtype=np.int64), zeros)
    return hists, bins


def _d_groups(items: list, ranks) -> dict:
    """``bins.order_statistics``'s group of d pooled over the dumps ``items``: their signed fine bins' counts."""
    from tim_plugins.report import bins as B

    counts = sum(t.signed_counts() for t in items)
    lo_b, hi_b = B.signed_bounds()

    def info(s):
        if s == B.CENTRE:
            return B.Rows(), 0.0, 0.0
        return B.Rows(signed=(int(s),), value="d"), float(lo_b[s]), float(hi_b[s])

    return {0: (counts, info, sorted(set(ranks)))}


def order_statistics_of_d(items: list, ranks) -> dict[int, float]:
    """Exact order statistics of d pooled over the dumps ``items``: {0-based rank: value}."""
    from tim_plugins.report import bins as B
    from tim_plugins.report.query import FETCH_ROWS, combine

    found = B.order_statistics(_d_groups(items, ranks), lambda reqs: combine(reqs, [t.serve(reqs) for t in items]),
                               FETCH_ROWS)
    return {k: v for (_, k), v in found.items()}


def _rho_ranks(n: int) -> list[tuple[int, int, float]]:
    from tim_plugins.report import bins as B
    from tim_plugins.report.figures import RHO_QUANTILES

    return [B.quantile_ranks(n, q) for q in RHO_QUANTILES]


def rho_source(dumps: dict):
    """``figures.ratio_distribution``'s source: the pooled extremes and quantiles of d, and histograms of ρ per
    dump on the bins the figure asks for (its panels' requests served in one narrow pass per dump)."""
    from tim_plugins.report import bins as B
    from tim_plugins.report.figures import RhoSource, rho_panels

    items = list(dumps.values())
    ranges = [t.d_range() for t in items]
    n = sum(r[0] for r in ranges)
    if not n:
        return RhoSource(0, math.nan, math.nan, math.nan, math.nan, lambda *_: ({}, 0, 0), tuple(dumps))
    _prepare(dumps)
    where = _rho_ranks(n)
    found = order_statistics_of_d(items, [k for lo, hi, _ in where for k in (lo, hi)])
    qlo, qhi = (B.lerp(found[lo], found[hi], t) for lo, hi, t in where)
    dmin, dmax = min(r[1] for r in ranges if r[0]), max(r[2] for r in ranges if r[0])
    # the panels' bins, all served in one pass per dump
    for t in items:
        reqs = [t.rho_request(edges, lo_d, hi_d)[3] for edges, _, lo_d, hi_d in rho_panels(n, dmin, dmax, qlo, qhi)]
        t.serve([r for r in reqs if r is not None])

    def counts(edges, log, lo_d, hi_d):
        out, below, above = {}, 0, 0
        for name, t in dumps.items():
            out[name], b, a = t.rho_histogram(edges, log, lo_d, hi_d)
            below, above = below + b, above + a
        return out, below, above

    return RhoSource(n, dmin, dmax, qlo, qhi, counts, tuple(dumps))


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
