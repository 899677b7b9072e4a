"""Matplotlib figures of the report. Each function takes aggregates (per setting or run: ``{name: ...}``, drawn
in one colour each: bin counts and sums, per-sequence and per-position sums, quantiles; ``report.tokens`` computes
them over a dump in bounded memory) and returns PNG bytes. Labels are kept apart: few ticks per axis, legends outside the
data where there are many series, horizontal bars for setting names, a constrained layout.

``colors`` ({name: colour}), where a figure takes it, fixes each name's colour: a page that draws several figures of
the same runs, some of them absent from a figure (a run without a per-token dump), passes one map over every run
(``colors_of``), so a run has one colour in all of them; without it, a name's colour is that of its place among the
figure's own names.

The figures must not mislead: log-prob axes carry their unit (nats); an axis that leaves data out says so on
the figure (how many tokens, and the true extremes); values that a log axis cannot show (exactly 0) are named;
per-step panels do not zoom into step-to-step noise (linear axes start at 0, every axis reaches the healthy
limit, the ESS panel is fixed to [0, 1] with verl's warning level marked); printed values stay inside their
panel."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = [
    "pyplot",
    "png_bytes",
    "PROB_EDGES",
    "PROB_MIN_COUNT",
    "RhoSource",
    "rho_panels",
    "abs_diff_bins",
    "abs_diff_histogram",
    "mismatch_by_probability",
    "ratio_distribution",
    "drift_by_position",
    "sequence_log_ratio",
    "comparison_bars",
    "step_series",
    "colors_of",
]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
_OK_BAND = "#d9f0d3"
_WARN = "#d62728"
NATS = "(nats)"
# Ratio histogram: the bulk's window is the 0.5-99.5 % quantile range of log ρ, widened by half its width on each
# side. When every token fits on an axis at most _FULL_RANGE_FACTOR times as wide (in log ρ), one panel shows all;
# otherwise a second panel shows the full range on a log axis next to the zoom (a single full-range axis would
# squeeze the bulk into one bin).
RHO_QUANTILES = (0.005, 0.995)
D_DRAWN = 700.0  # the ratio figure's axes end at ρ = e^±700 (float64 holds e^709.78; its log axis needs > 0)
_FULL_RANGE_FACTOR = 3.0
# Bins of 1 − p (p = the rollout's probability of the sampled token) of ``mismatch_by_probability``, and the tokens
# a bin needs to be drawn.
PROB_EDGES = np.logspace(-7, 0, 29)
PROB_MIN_COUNT = 20


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def _figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 3.8):
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, layout="constrained")
    return fig, axes


def _log_ticks(ax, axis: str = "both") -> None:
    """At most ~6 labelled ticks on a log axis; over less than two decades also 2·10^k and 5·10^k (else a
    narrow axis would carry a single label). Call after the data (and limits) are set."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter

    for name in ("x", "y") if axis == "both" else (axis,):
        a = ax.xaxis if name == "x" else ax.yaxis
        if (ax.get_xscale() if name == "x" else ax.get_yscale()) != "log":
            continue
        lo, hi = ax.get_xlim() if name == "x" else ax.get_ylim()
        decades = math.log10(max(hi, lo) / max(min(hi, lo), 1e-300)) if min(hi, lo) > 0 else 10.0
        if decades < 2:
            a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
            a.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))
        else:
            a.set_major_locator(LogLocator(base=10, numticks=6))
        a.set_minor_formatter(NullFormatter())


def _legend(ax, n: int, below: bool = False) -> None:
    """Many series: a legend outside the axes on the right; ``below``: under the axes (long labels); else the
    best place inside."""
    if n > 3:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    elif n > 0 and below:
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(0.0, -0.2), borderaxespad=0, frameon=False)
    elif n > 0:
        ax.legend(fontsize=8)


def _label(name: str) -> str:
    """A run's name (a folder name, the user's ``--label``) as matplotlib shows it literally: two ``$`` would start
    its math markup (and a label it cannot parse ends the figure)."""
    return str(name).replace("$", r"\$")


def _color(i: int) -> str:
    return _COLORS[i % len(_COLORS)]


def colors_of(names) -> dict[str, str]:
    """{name: colour} of ``names`` in order: the ``colors`` map of the figures of a page that draws these runs."""
    return {name: _color(i) for i, name in enumerate(names)}


def _colors(names, colors: dict | None) -> dict:
    """Each of ``names``' colour: ``colors``' where it has one, else that of its place among ``names``."""
    return {name: (colors or {}).get(name, _color(i)) for i, name in enumerate(names)}


def _short(v: float) -> str:
    return f"{v:.0f}" if 10 <= abs(v) < 1e5 else f"{v:.2g}"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#555")


def abs_diff_bins(lo: float | None, hi: float | None) -> np.ndarray | None:
    """The shared log-spaced bins of ``abs_diff_histogram`` for the smallest |d| > 0 and the largest |d| over
    every setting (None when no |d| > 0): the smallest sits on the first edge, the largest inside the last bin."""
    if lo is None or hi is None or not hi > 0:
        return None
    lo, hi = float(lo), float(hi) * 1.01
    bins = np.geomspace(lo, hi if hi > lo else lo * 10, 50)
    bins[0] = lo  # the smallest |d| sits on the first edge, not just below it
    return bins


def abs_diff_histogram(hists: dict[str, tuple[np.ndarray, int]], bins: np.ndarray | None,
                       colors: dict | None = None) -> bytes:
    """Per setting: histogram of |d| = |log p_train − log p_rollout| > 0 on the shared log-spaced ``bins``
    (``abs_diff_bins``; ``hists``: {name: (counts per bin, tokens at exactly 0)}). A log axis cannot show exact
    zeros: the legend counts them per setting ("+N tokens at exactly 0") and a note under the axis says why they
    are not drawn."""
    fig, axes = _figure(width=_width(len(hists)))
    ax = axes[0, 0]
    any_zero = any(zeros for _, zeros in hists.values())
    color = _colors(hists, colors)
    if bins is not None:
        for name, (counts, zeros) in hists.items():
            counts = np.asarray(counts)
            if counts.sum() > 0:
                label = _label(name) + (f" (+{zeros} tokens at exactly 0)" if zeros else "")
                ax.hist(bins[:-1], bins=bins, weights=counts, histtype="step", lw=1.5, color=color[name], label=label)
            else:
                ax.plot([], [], color=color[name], label=f"{_label(name)}: all {zeros} tokens at exactly 0")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax)
        _legend(ax, len(hists))
    else:
        _empty(ax, "every difference is exactly 0")
    xlabel = f"|log p_train − log p_rollout| of the sampled token {NATS}"
    if any_zero and bins is not None:
        xlabel += "\ntokens at exactly 0 (identical log-probs) have no place on a log axis: the legend counts them"
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel("tokens")
    return png_bytes(fig)


def _width(n: int) -> float:
    """Figure width: room for a legend outside the axes when there are many series."""
    return 8.0 if n > 3 else 6.4


def mismatch_by_probability(sampled: dict[str, dict], profiles: dict[str, dict] | None = None,
                            colors: dict | None = None) -> bytes:
    """Mismatch against the rollout probability p. ``sampled``: {name: {"count", "sum"[, "quantile"]}}, per bin of
    1 − p (``PROB_EDGES``): the sampled tokens, their Σ|d| and the p99 of their |d|; a bin is drawn from
    ``PROB_MIN_COUNT`` tokens on.

    Left, against 1 − p: mean |d| of sampled tokens (markers) and, when ``profiles`` (`VocabProfile.curves`)
    are given, mean |Δ log p| over the whole vocabulary (lines; with one setting also its p99, dashed), plus a
    c·(1 − p) line through the first setting's largest ratio (the tightest envelope of that form).
    Right (with profiles): the same whole-vocabulary mean against p itself, where the tail lives.
    """
    fig, axes = _figure(ncols=2 if profiles else 1, width=11.5 if profiles else 6.4, height=4.0)
    ax = axes[0, 0]
    single = len(sampled) == 1
    edges = PROB_EDGES
    centre = np.sqrt(edges[:-1] * edges[1:])
    envelope = None
    skipped = []
    color = _colors(sampled, colors)
    for name, curve in sampled.items():
        count = np.asarray(curve["count"])
        keep = count >= PROB_MIN_COUNT
        c, m = centre[keep], np.asarray(curve["sum"], dtype=np.float64)[keep] / count[keep]
        if c.size and (m > 0).any():
            ax.plot(c[m > 0], m[m > 0], "o", ms=4, color=color[name], alpha=0.8,
                    label=("sampled tokens: mean |d|" if single else _label(name) if not profiles else None))
            if single and not profiles and curve.get("quantile") is not None:
                p99 = np.asarray(curve["quantile"], dtype=np.float64)[keep]
                ax.plot(c[p99 > 0], p99[p99 > 0], "s", ms=4, mfc="none", color=color[name],
                        label="sampled tokens: p99 |d|")
                m = p99  # the envelope bounds the p99
        prof = (profiles or {}).get(name, {}).get("one_minus_p")
        if prof and prof["centre"]:
            pc, pm = np.array(prof["centre"]), np.array(prof["mean"])
            ok = pm > 0
            if ok.any():
                ax.plot(pc[ok], pm[ok], "-", color=color[name], lw=1.6,
                        label="whole vocabulary: mean |Δ log p|" if single else _label(name))
                if single:
                    pq = np.array(prof["quantile"])
                    ax.plot(pc[pq > 0], pq[pq > 0], "--", color=color[name], lw=1.2,
                            label="whole vocabulary: p99 |Δ log p|")
                if envelope is None:
                    ref = np.array(prof["quantile"]) if single else pm
                    envelope = float(np.max(ref / pc))
            else:
                skipped.append(name)
        elif c.size and envelope is None and (m > 0).any():
            envelope = float(np.max(m / c))
        elif not c.size or not (m > 0).any():
            skipped.append(name)
    if envelope and envelope > 0:
        xs = [x for line in ax.lines for x in line.get_xdata()]
        e = edges[edges >= (min(xs) / 2 if xs else edges[0])]
        ax.plot(e, envelope * e, ":", color="k", lw=1, label=f"{envelope:.2g}·(1 − p) envelope")
    else:
        envelope = 0.0
    ax.set_xscale("log")
    ax.set_yscale("log")
    _log_ticks(ax)
    ax.set_xlabel("1 − p_rollout(token)")
    ax.set_ylabel(f"|Δ log p| {NATS}")
    if skipped:
        ax.text(0.98, 0.02, "exactly 0 (not drawn): " + ", ".join(map(_label, skipped)), transform=ax.transAxes,
                fontsize=7, color="#555", ha="right")
    if not ax.lines:
        _empty(ax, "too few tokens per bin")
    elif single or not profiles:
        ax.legend(fontsize=7, loc="upper left")
    else:  # colours are named in the right panel's legend
        ax.text(0.02, 0.98, f"lines: whole vocabulary, mean\ndots: sampled tokens, mean\ndotted: {envelope:.2g}·(1 − p)",
                transform=ax.transAxes, va="top", fontsize=7, color="#333")
    if profiles:
        ax2 = axes[0, 1]
        for name in sampled:
            prof = profiles.get(name, {}).get("p")
            if not prof or not prof["centre"]:
                continue
            pc, pm = np.array(prof["centre"]), np.array(prof["mean"])
            ok = pm > 0
            if ok.any():
                ax2.plot(pc[ok], pm[ok], "-", color=color[name], lw=1.6, label=_label(name))
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        _log_ticks(ax2)
        ax2.set_xlabel("p_rollout(token), whole vocabulary")
        ax2.set_ylabel(f"mean |Δ log p| {NATS}")
        if ax2.lines:
            _legend(ax2, len(ax2.lines))
        else:
            _empty(ax2, "no non-zero difference")
    return png_bytes(fig)


@dataclass
class RhoSource:
    """What ``ratio_distribution`` draws from: every token's d = log ρ pooled over the settings (``n`` tokens,
    ``dmin``, ``dmax`` and the ``RHO_QUANTILES`` quantiles ``qlo``, ``qhi``) and ``counts(edges, log, lo_d, hi_d)``
    → ({name: counts per bin of ``np.histogram(ρ, edges)`` of the tokens with lo_d <= d <= hi_d}, pooled tokens
    with d below lo_d, above hi_d), names in drawing order. The panel's edges are exp(lo_d) and exp(hi_d): the
    window is decided on d itself, so the extremes are drawn whatever the rounding of exp."""

    n: int
    dmin: float
    dmax: float
    qlo: float
    qhi: float
    counts: Callable[[np.ndarray, bool, float, float], tuple[dict[str, np.ndarray], int, int]]
    names: tuple[str, ...]


def ratio_distribution(src: RhoSource, colors: dict | None = None) -> bytes:
    """Per setting: distribution of ρ = exp(d) = π_train / π_rollout (ρ = 1 marked, and the [0.5, 2] band of
    token-level corrections dashed where it falls inside an axis).

    The bulk's window (`RHO_QUANTILES`, widened) and the full range: one panel with every token when the full
    range is at most ``_FULL_RANGE_FACTOR`` times as wide (in log ρ); else two, the zoom on the bulk (its title
    says how many tokens lie left and right of it) and every token on a log axis with the zoom window shaded
    (its title gives the lowest and highest ρ). No token is piled into an end bin."""
    n_series = len(src.names)
    if not src.n:
        fig, axes = _figure(width=_width(n_series))
        _empty(axes[0, 0], "no tokens")
        return png_bytes(fig)
    dmin, dmax = float(src.dmin), float(src.dmax)
    (lo_d, hi_d), full = _rho_windows(dmin, dmax, src.qlo, src.qhi)
    split = full is not None
    if split:
        full_lo, full_hi = full
    fig, axes = _figure(ncols=2 if split else 1, width=(11.5 if split else 6.4) + (1.6 if n_series > 3 else 0))
    lo, hi, below, above = _rho_panel(axes[0, 0], src, lo_d, hi_d, colors=colors)
    if split:
        note = (f"Zoom on the bulk ({RHO_QUANTILES[0] * 100:g}–{RHO_QUANTILES[1] * 100:g} % quantiles, widened): "
                f"{below} of the {src.n} tokens lie left of it (ρ < {lo:.3g}), {above} right (ρ > {hi:.3g}); "
                "all of them on the right.")
        ax2 = axes[0, 1]
        _, _, beyond_lo, beyond_hi = _rho_panel(ax2, src, full_lo, full_hi, log=True, colors=colors)
        ax2.axvspan(lo, hi, color="#e8e8e8", zorder=0)
        beyond = (f" {beyond_lo + beyond_hi} of them lie beyond e^±{D_DRAWN:g} and are not drawn."
                  if beyond_lo + beyond_hi else "")
        ax2.set_title(_wrap(f"Every token: ρ from {_rho_text(dmin, 3)} to {_rho_text(dmax, 3)} (log axis; grey: "
                            f"the zoom on the left).{beyond}", 60), fontsize=7.5, loc="left", color="#333")
        ax2.set_ylabel("")
        if n_series > 3:
            _legend(ax2, n_series)
        else:
            ax2.legend(fontsize=8)
        axes[0, 0].set_title(_wrap(note, 60), fontsize=7.5, loc="left", color="#333")
    else:
        note = f"Every one of the {src.n} tokens drawn: ρ from {_rho_text(dmin, 4)} to {_rho_text(dmax, 4)}."
        axes[0, 0].set_title(_wrap(note, 90), fontsize=7.5, loc="left", color="#333")
        _legend(axes[0, 0], n_series)
    return png_bytes(fig)


def _rho_windows(dmin: float, dmax: float, qlo: float, qhi: float) -> tuple[tuple[float, float], tuple | None]:
    """The ratio figure's windows on d: (the first panel's (lo_d, hi_d), the full range's second panel or None).
    The bulk's window is the ``RHO_QUANTILES`` range widened by half its width on each side; one panel shows every
    token when the full range is at most ``_FULL_RANGE_FACTOR`` times as wide. No window reaches past
    ±``D_DRAWN`` (ρ = e^d stays a finite, non-zero float64)."""
    pad = 1e-3  # ρ = 1 always inside, with a little room
    dmin, dmax = max(dmin, -D_DRAWN), min(dmax, D_DRAWN)
    qlo, qhi = min(max(qlo, -D_DRAWN), D_DRAWN), min(max(qhi, -D_DRAWN), D_DRAWN)
    half = 0.5 * (qhi - qlo)
    lo_d, hi_d = min(max(qlo - half, dmin), -pad), max(min(qhi + half, dmax), pad)
    full_lo, full_hi = min(dmin, -pad), max(dmax, pad)
    if (full_hi - full_lo) > _FULL_RANGE_FACTOR * (hi_d - lo_d):
        return (lo_d, hi_d), (full_lo, full_hi)
    return (full_lo, full_hi), None


def _rho_text(d: float, digits: int) -> str:
    """ρ = e^d as text, also where float64 cannot hold it (|d| > ``D_DRAWN``: written as a power of e)."""
    return f"e^{d:.0f}" if abs(d) > D_DRAWN else f"{math.exp(d):.{digits}g}"


def _rho_bins(lo_d: float, hi_d: float, log: bool | None) -> tuple[np.ndarray, bool]:
    """A ratio panel's 80 bins on [exp(lo_d), exp(hi_d)] and whether they are log-spaced (``log``, else hi / lo >
    3)."""
    lo, hi = float(np.exp(lo_d)), float(np.exp(hi_d))
    log = hi / lo > 3 if log is None else log
    bins = np.geomspace(lo, hi, 80) if log else np.linspace(lo, hi, 80)
    bins[0], bins[-1] = lo, hi
    return bins, log


def rho_panels(n: int, dmin: float, dmax: float, qlo: float, qhi: float) -> list[tuple[np.ndarray, bool, float,
                                                                                        float]]:
    """The (bins, log, lo_d, hi_d) of each panel ``ratio_distribution`` draws for a ``RhoSource`` with these
    statistics: what it will ask ``counts`` for."""
    if not n:
        return []
    first, full = _rho_windows(float(dmin), float(dmax), qlo, qhi)
    panels = [(first, None)] + ([(full, True)] if full is not None else [])
    return [(*_rho_bins(lo_d, hi_d, log), lo_d, hi_d) for (lo_d, hi_d), log in panels]


def _rho_panel(ax, src: RhoSource, lo_d: float, hi_d: float,
               log: bool | None = None, colors: dict | None = None) -> tuple[float, float, int, int]:
    """Step histograms of ρ on [lo, hi] = [exp(lo_d), exp(hi_d)] (80 bins; a log axis when ``log`` or hi / lo > 3);
    tokens outside are not drawn. Returns (lo, hi, tokens below lo, tokens above hi)."""
    bins, log = _rho_bins(lo_d, hi_d, log)
    lo, hi = float(bins[0]), float(bins[-1])
    counts, below, above = src.counts(bins, log, lo_d, hi_d)
    color = _colors(src.names, colors)
    for name in src.names:
        ax.hist(bins[:-1], bins=bins, weights=np.asarray(counts[name]), histtype="step", lw=1.5, color=color[name],
                label=_label(name))
    ax.axvline(1.0, color="k", lw=0.8)
    for edge in (0.5, 2.0):
        if lo < edge < hi:
            ax.axvline(edge, color=_WARN, lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    if log:
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        # ρ reads best as plain numbers (0.5, 1, 2): 1-2-5 steps per decade, thinned to at most 7 labels
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in (1, 2, 5) if lo <= m * 10.0 ** e <= hi]
        decades = [t for t in ticks if math.log10(t) % 1 == 0]
        if len(ticks) > 14 and len(decades) < len(ticks):
            ticks = decades
        if len(ticks) > 7:  # decades alone can be many (a ρ range of 15 or more of them): every k-th
            ticks = ticks[::math.ceil(len(ticks) / 7)]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.set_xticklabels([f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.set_xlabel("ρ = π_train / π_rollout per sampled token")
    ax.set_ylabel("tokens")
    return lo, hi, below, above


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def drift_by_position(ds: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], colors: dict | None = None) -> bytes:
    """Per setting: mean |d| by response position (bins of equal width, at most 32). ``ds``: {name: (positions,
    tokens at each, Σ|d| at each)}.

    A linear axis with room below 0, so a setting at exactly 0 shows as a line on the frame's inside; a log axis
    when the settings' means span more than two decades (a linear one would flatten the smaller ones onto 0),
    with a setting at exactly 0 everywhere drawn along the bottom edge and named so."""
    fig, axes = _figure(width=_width(len(ds)))
    ax = axes[0, 0]
    top = max((int(np.max(p)) + 1 for p, _, _ in ds.values() if len(p)), default=1)
    n_bins = min(32, top)
    edges = np.linspace(0, top, n_bins + 1)
    centre = 0.5 * (edges[:-1] + edges[1:])
    curves = {}
    for name, (pos, n, abs_sum) in ds.items():
        if not len(pos):
            continue
        idx = np.clip(np.digitize(pos, edges) - 1, 0, n_bins - 1)
        count = np.bincount(idx, np.asarray(n, dtype=np.float64), n_bins)
        mean = np.bincount(idx, np.asarray(abs_sum, dtype=np.float64), n_bins) / np.maximum(count, 1)
        ok = count > 0
        curves[name] = (centre[ok], mean[ok])
    positive = np.concatenate([m[m > 0] for _, m in curves.values()] or [np.zeros(0)])
    log_axis = positive.size > 0 and positive.max() / positive.min() > 100
    color = _colors(ds, colors)
    for name in ds:
        if name not in curves:
            continue
        x, m = curves[name]
        zero = not (m > 0).any()
        if log_axis and zero:
            from matplotlib.transforms import blended_transform_factory

            ax.plot(x, np.full_like(x, 0.02), "--", color=color[name], lw=1.4, zorder=3,
                    transform=blended_transform_factory(ax.transData, ax.transAxes),
                    label=f"{_label(name)}: exactly 0 (drawn on the bottom edge)")
        elif log_axis:
            ax.plot(x, np.where(m > 0, m, np.nan), "-", color=color[name], lw=1.4, label=_label(name))
        else:
            ax.plot(x, m, "-", color=color[name], lw=1.4, zorder=3,
                    label=_label(name) + (" (exactly 0 at every position)" if zero else ""))
    if log_axis:
        ax.set_yscale("log")
        _log_ticks(ax, "y")
    else:
        hi = float(positive.max()) if positive.size else 1.0
        ax.set_ylim(-0.04 * hi, 1.08 * hi)
        ax.axhline(0, color="#999", lw=0.6, zorder=1)
    ax.set_xlabel("response position (token index)")
    ax.set_ylabel(f"mean |Δ log p| {NATS}")
    _legend(ax, len(curves))
    return png_bytes(fig)


def sequence_log_ratio(ds: dict[str, tuple[np.ndarray, np.ndarray]], band: float, colors: dict | None = None) -> bytes:
    """Per sequence: Σ_t d (log of the sequence IS weight) against its length, ±``band`` marked. ``ds``: {name:
    (lengths, Σ_t d) per sequence}."""
    fig, axes = _figure(width=_width(len(ds)))
    ax = axes[0, 0]
    color = _colors(ds, colors)
    for name, (length, sum_d) in ds.items():
        if not len(length):
            continue
        ax.scatter(length, sum_d, s=10, alpha=0.6, color=color[name], label=_label(name))
    ax.axhline(0, color="k", lw=0.5)
    lo, hi = ax.get_ylim()
    if max(abs(lo), abs(hi)) > band / 4:
        ax.axhline(band, color="#d62728", lw=0.8, ls="--", label=f"±log 2 = ±{band:.2f}")
        ax.axhline(-band, color="#d62728", lw=0.8, ls="--")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(8, integer=True))
    ax.set_xlabel("sequence length (scored tokens)")
    ax.set_ylabel(f"Σ_t Δ log p = log ρ_seq {NATS}")
    _legend(ax, len(ds) + 1)
    return png_bytes(fig)


def comparison_bars(names: list[str], panels: list[tuple[str, list[float], tuple | None, bool]]) -> bytes:
    """One panel per metric, one horizontal bar per setting (names on the y axis, values printed at the bars).

    ``panels``: (title, values, healthy (lo, hi) or None, log scale). A healthy range is shaded green. Zero
    values on a log panel are printed as "exactly 0" at the axis. Each panel's x axis is widened until every
    printed value fits inside its frame (measured on the drawn figure).
    """
    n = len(panels)
    fig, axes = _figure(ncols=n, width=max(7.0, 2.9 * n), height=0.42 * len(names) + 1.6)
    y = np.arange(len(names))
    value_labels: list[tuple] = []  # (axes, [texts]) whose printed values must fit inside the frame
    bands = []
    for j, (title, values, healthy, log) in enumerate(panels):
        ax = axes[0, j]
        v = np.array([np.nan if x is None else x for x in values], dtype=float)
        finite = v[np.isfinite(v) & ((v > 0) if log else True)]
        if log and finite.size:
            lo, hi = finite.min() / 3, finite.max() * 3
            if healthy and healthy[1]:
                hi = max(hi, healthy[1] * 1.5)
            base = lo
            ax.set_xscale("log")
            ax.set_xlim(lo, hi)
        else:
            base = 0.0
            hi = (finite.max() * 1.1) if finite.size else 1.0
            ax.set_xlim(0, hi if hi > 0 else 1.0)
        texts = []
        for i, val in enumerate(v):
            color = _color(i)
            if not np.isfinite(val):
                ax.text(ax.get_xlim()[0], i, " n/a", va="center", fontsize=7, color="#555")
            elif log and val <= 0:
                ax.text(ax.get_xlim()[0], i, "  exactly 0", va="center", fontsize=7, color="#222")
            else:
                ax.barh(i, val - base, left=base, color=color, height=0.6)
                texts.append(ax.text(val, i, f" {_short(val)}", va="center", fontsize=7))
        value_labels.append((ax, texts))
        bands.append((ax, healthy, base))
        ax.set_yticks(y)
        ax.set_yticklabels([_label(x) for x in names] if j == 0 else [""] * len(names), fontsize=8)
        ax.set_ylim(len(names) - 0.4, -0.6)  # first setting on top, room for a row without a bar
        ax.set_title(title, fontsize=9)
        if log:
            _log_ticks(ax, "x")
        else:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.tick_params(axis="x", labelsize=7)
    _fit_labels_inside(fig, value_labels)
    for ax, healthy, base in bands:  # after the final limits: the band reaches the right edge
        if healthy is not None:
            hlo, hhi = healthy
            right = ax.get_xlim()[1]
            ax.axvspan(hlo if hlo is not None else base, min(hhi, right) if hhi is not None else right,
                       color=_OK_BAND, zorder=0)
            ax.set_xlim(ax.get_xlim()[0], right)
    return png_bytes(fig)


def _fit_labels_inside(fig, value_labels: list[tuple], margin: float = 0.02, rounds: int = 4) -> None:
    """Widen each panel's x axis (its left end fixed) until the printed values right of the bars end inside
    the frame. A label starting at axes fraction f with width w fits when f + w <= 1 − margin; stretching the
    axis by 1/S moves f to f·S and leaves w (the panel's width in pixels) unchanged, so S = min (1 − margin −
    w) / f. Repeated on the redrawn figure, as the layout can move when the tick labels change."""
    for _ in range(rounds):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        changed = False
        for ax, texts in value_labels:
            box = ax.get_window_extent(renderer)
            log = ax.get_xscale() == "log"
            t = (lambda x: math.log10(x)) if log else (lambda x: x)
            lo, hi = ax.get_xlim()
            span = t(hi) - t(lo)
            scale = 1.0
            for text in texts:
                ext = text.get_window_extent(renderer)
                f = (ext.x0 - box.x0) / box.width
                w = ext.width / box.width
                if f > 0 and f + w > 1 - margin:
                    scale = min(scale, max(1 - margin - w, 0.05) / f)
            if scale < 1.0:
                new_hi = t(lo) + span / scale
                ax.set_xlim(lo, 10 ** new_hi if log else new_hi)
                if log:
                    _log_ticks(ax, "x")
                changed = True
        if not changed:
            return


def step_series(steps, panels: list[tuple], ncols: int = 3, colors: dict | None = None, no_valid=None) -> bytes:
    """Per optimizer step, one panel per metric: (title, values, healthy (lo, hi) or None, log scale[, options]).
    Several runs overlaid: ``steps`` {run: steps} and each panel's values {run: values}, one colour per run (the
    legend on the first panel). A step without a value (NaN: no valid token in it, or nothing logged) breaks its
    line: a gap, not a line drawn across it; a value a log axis cannot show (<= 0) is left out. ``no_valid``: the
    steps without a valid token (as ``steps``: an array, or {run: steps}), each marked on every panel by a dotted
    line (the run's colour) named "no valid token" on the first, so the gap reads as what it is.

    Axes do not zoom into step-to-step noise: a linear axis starts at 0 (or below, for negative values), every
    axis reaches the finite limits of the healthy range, and a log axis spans at least one decade. ``options``:
    ``ylim`` (lo, hi) fixes the axis (widened only if a value falls outside); ``marks`` [(y, label)] draws
    dashed labelled lines (e.g. verl's ESS warning level)."""
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(ncols=ncols, nrows=nrows, width=4.1 * ncols, height=2.9 * nrows)
    from matplotlib.ticker import MaxNLocator

    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_visible(False)
            continue
        title, values, healthy, log, *rest = panels[k]
        options = rest[0] if rest else {}
        runs = values if isinstance(values, dict) else {None: values}
        run_steps = steps if isinstance(steps, dict) else {None: steps}
        shown = []
        color = _colors(runs, colors)
        gaps = no_valid if isinstance(no_valid, dict) else {None: no_valid}
        for run, vals in runs.items():
            v = np.asarray(vals, dtype=float)
            ok = np.isfinite(v)
            if log:
                ok &= v > 0
            if ok.any():
                x = np.asarray(run_steps[run], dtype=float)
                keep = ok | ~np.isfinite(v)  # NaN kept: matplotlib breaks the line there
                ax.plot(x[keep], np.where(ok, v, np.nan)[keep], ".-", lw=1.2, ms=4,
                        **({} if run is None else {"color": color[run], "label": _label(run)}))
                shown.append(v[ok])
        if shown:
            lo, hi = _series_limits(np.concatenate(shown), healthy, log, options.get("ylim"))
            if log:
                ax.set_yscale("log")
            ax.set_ylim(lo, hi)
            if log:
                _log_ticks(ax, "y")
            if healthy is not None:
                hlo = healthy[0] if healthy[0] is not None else lo
                hhi = healthy[1] if healthy[1] is not None else hi
                ax.axhspan(hlo, hhi, color=_OK_BAND, zorder=0)
            for level, label in options.get("marks", ()):
                ax.axhline(level, color=_WARN, lw=0.9, ls="--")
                ax.text(0.02, level, f" {label}", color=_WARN, fontsize=7, va="bottom",
                        transform=ax.get_yaxis_transform())
            named = k != 0
            for run in runs:
                for at in np.asarray(gaps.get(run) if gaps.get(run) is not None else (), dtype=float):
                    ax.axvline(at, color="#888" if run is None else color[run], lw=0.9, ls=":", zorder=1)
                    if not named:
                        ax.text(at, 0.97, " no valid token", rotation=90, va="top", ha="right", fontsize=6.5,
                                color="#555", transform=ax.get_xaxis_transform())
                        named = True
            ax.set_ylim(lo, hi)
            if k == 0 and len(runs) > 1:
                ax.legend(fontsize=7)
        else:
            measured = any(np.isfinite(np.asarray(vals, dtype=float)).any() for vals in runs.values())
            _empty(ax, "all values 0" if measured else "not measured")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        ax.tick_params(labelsize=7)
    return png_bytes(fig)


def _series_limits(v: np.ndarray, healthy: tuple | None, log: bool, fixed: tuple | None) -> tuple[float, float]:
    """y limits of a per-step panel (see `step_series`)."""
    bounds = [b for b in (healthy or ()) if b is not None and (b > 0 or not log)]
    if fixed is not None:
        return min(fixed[0], float(v.min())), max(fixed[1], float(v.max()))
    if log:
        # within 1e±100 (a value past it lies off the panel; the tables give it): matplotlib's log locator steps
        # past the limits by up to two strides of decades, which overflows float64 near its end (a k3 of e^700 / n)
        lo = max(min([float(v.min())] + bounds) / 2, 1e-100)
        hi = min(max([float(v.max())] + bounds) * 2, 1e100)
        if hi / lo < 10:  # at least one decade
            mid = math.sqrt(lo * hi)
            lo, hi = mid / math.sqrt(10), mid * math.sqrt(10)
        return lo, hi
    lo = min([0.0, float(v.min())] + bounds)
    hi = max([0.0, float(v.max())] + bounds)
    if hi == lo:
        hi = lo + 1.0
    pad = 0.06 * (hi - lo)
    return (lo - pad if lo < 0 else lo), hi + pad
