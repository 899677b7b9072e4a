"""Fine log bins of the per-token log-ratio d, and exact statistics from their counts plus the rows of a few bins.

A full pass over a dump (``report.scan``) counts its tokens per fine bin: the sign of d and a bin of |d| (192 a
decade, each 1.2 % wide, ``magnitude_bin``). What a figure needs then follows exactly from those counts and the
rows of only a few bins, read in a narrow second pass (two columns, only the rows of the bins asked for kept):

- a histogram on any edges: a fine bin that lies inside one histogram bin adds its count whole (``whole_bins``);
  the rows of the fine bins an edge cuts are binned one by one (``Histogram``), as ``np.histogram`` would;
- an order statistic: the cumulative counts name the fine bin holding the rank and how many values lie below it
  (``locate``); the sorted values of that bin's rows give it (``Collect``). A bin with more rows than a fetch
  holds is first cut into equal sub-bins, counted (``Count``), and the one holding the rank read instead
  (``order_statistics``).

A row's bin is the same numpy expression on the same float64 value in every pass, so it falls in the same bin
each time. A bin's value range (``magnitude_bounds``) is its edges widened by ``MARGIN`` (relative), which covers
the rounding of log10 near an edge: a fine bin is counted whole only when it lies inside a histogram bin with
that margin; otherwise its rows are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["PER_DECADE", "N_MAGNITUDE", "CENTRE", "N_SIGNED", "MARGIN", "SUB_BINS", "magnitude_bin", "signed_bin",
           "magnitude_bounds", "signed_bounds", "coarse_key", "coarse_table", "whole_bins", "histogram_index",
           "locate", "quantile_ranks", "lerp", "sub_bin", "Rows", "Collect", "Count", "Histogram", "first_requests",
           "order_statistics"]

PER_DECADE = 192
# |d| below 10^-24 shares the lowest bin, |d| from 10^4 on the highest (valid log-probs are > -1e3: |d| < 2e3).
_LO_DECADE, _HI_DECADE = -24, 4
_K0, _K1 = _LO_DECADE * PER_DECADE, _HI_DECADE * PER_DECADE - 1
# Magnitude bins: 0 holds |d| = 0 exactly, 1 .. N_MAGNITUDE - 1 the decades above.
N_MAGNITUDE = (_HI_DECADE - _LO_DECADE) * PER_DECADE + 1
# Signed bins: CENTRE + sign(d) · magnitude bin, in the order of d.
CENTRE = N_MAGNITUDE - 1
N_SIGNED = 2 * CENTRE + 1
# Relative widening of a bin's edges: log10 is within a few ulps, so a value can fall in the bin next to the
# one its exact logarithm names only within ~1e-15 of the edge.
MARGIN = 1e-9
# Sub-bins a narrowing round cuts a bin into.
SUB_BINS = 4096


def magnitude_bin(a: np.ndarray, log10_a: np.ndarray) -> np.ndarray:
    """Magnitude bin of each |d| = ``a``, from ``log10_a`` = log10(a) (−inf where a = 0); as float64 (whole
    numbers: ``signed_bin`` makes the int64 index)."""
    k = log10_a * PER_DECADE
    np.floor(k, out=k)
    np.maximum(k, _K0, out=k)
    np.minimum(k, _K1, out=k)
    k -= _K0 - 1
    k *= a > 0
    return k


def signed_bin(d: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """Signed bin of each d from its magnitude bin (int64): monotone in d."""
    s = np.copysign(magnitude, d)
    s += CENTRE
    return s.astype(np.int64)


def magnitude_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Per magnitude bin, the smallest and largest |d| it can hold (widened by ``MARGIN``)."""
    f = np.arange(N_MAGNITUDE, dtype=np.float64)
    k = f - 1 + _K0
    lo = 10.0 ** (k / PER_DECADE) * (1 - MARGIN)
    hi = 10.0 ** ((k + 1) / PER_DECADE) * (1 + MARGIN)
    lo[:2], hi[0], hi[-1] = 0.0, 0.0, math.inf
    return lo, hi


def signed_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Per signed bin, the smallest and largest d it can hold."""
    lo, hi = magnitude_bounds()
    return np.concatenate([-hi[:0:-1], lo]), np.concatenate([-lo[:0:-1], hi])


def coarse_key(d: np.ndarray) -> np.ndarray:
    """The top 16 bits of each float64 d (sign, exponent, 4 mantissa bits): cells 1/16 of an octave wide, in the
    order of |d| within each sign."""
    return d.view(np.uint64) >> np.uint64(48)


def coarse_table(wanted: np.ndarray) -> np.ndarray:
    """For each ``coarse_key`` cell, whether it may hold a row of a signed bin in ``wanted`` (bool [N_SIGNED]):
    true for every cell that overlaps a wanted bin (a superset: a narrow pass computes the exact bin of the rows
    of these cells only)."""
    keys = np.arange(1 << 16, dtype=np.uint64)
    lo = np.abs((keys << np.uint64(48)).view(np.float64))
    nxt = keys + np.uint64(1)
    hi = np.abs((nxt << np.uint64(48)).view(np.float64))
    negative = keys >= np.uint64(1 << 15)
    hi[keys == np.uint64((1 << 15) - 1)] = math.inf  # the last positive cell (NaN patterns) and the sign change
    finite = np.isfinite(lo) & np.isfinite(hi)
    lo, hi = np.where(finite, lo, 0.0), np.where(finite, hi, 0.0)  # NaN and inf patterns: never a valid d
    with np.errstate(divide="ignore"):
        f_lo = magnitude_bin(lo, np.log10(lo * (1 - MARGIN)))
        f_hi = magnitude_bin(hi, np.log10(hi * (1 + MARGIN)))
    # signed bins [s1, s2] each cell can reach, and whether any of them is wanted (cumulative counts)
    s1 = np.where(negative, CENTRE - f_hi, CENTRE + f_lo)
    s2 = np.where(negative, CENTRE - f_lo, CENTRE + f_hi)
    s1, s2 = np.clip(s1, 0, N_SIGNED - 1).astype(np.int64), np.clip(s2, 0, N_SIGNED - 1).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(wanted)])
    return finite & (cum[s2 + 1] - cum[s1] > 0)


def whole_bins(lo: np.ndarray, hi: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """For value ranges [lo, hi]: the bin of ``np.histogram(..., edges)`` that holds the whole range, or -1 where an
    edge cuts it (or it reaches outside the edges)."""
    nb = len(edges) - 1
    i_lo, i_hi = histogram_index(np.asarray(lo), edges), histogram_index(np.asarray(hi), edges)
    return np.where((i_lo == i_hi) & (i_lo >= 0) & (i_lo < nb), i_lo, -1)


def histogram_index(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of each value as ``np.histogram(values, edges)`` counts it (edges[i] <= v < edges[i + 1], the last bin
    closed): -1 below the first edge, len(edges) - 1 above the last."""
    nb = len(edges) - 1
    idx = np.searchsorted(edges, values, side="right") - 1
    return np.where(values == edges[-1], nb - 1, idx)


def locate(cumulative: np.ndarray, rank: int) -> tuple[int, int]:
    """(bin holding the 0-based ``rank``, values below that bin) from cumulative counts per bin."""
    i = int(np.searchsorted(cumulative, rank, side="right"))
    return i, int(cumulative[i - 1]) if i else 0


def quantile_ranks(n: int, q: float) -> tuple[int, int, float]:
    """numpy's ``quantile`` (linear method) of n values as (lower rank, upper rank, weight of the upper)."""
    h = q * (n - 1)
    lo = int(math.floor(h))
    return lo, min(lo + 1, n - 1), h - lo


def lerp(a: float, b: float, t: float) -> float:
    """numpy's interpolation between two order statistics (``_lerp``: exact at both ends)."""
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t)


@dataclass(frozen=True)
class Rows:
    """The rows of a few fine bins: of the signed bins ``signed`` (any probability bin) and of the (probability
    bin, signed bin) ``pairs``; their value is d (``value`` "d") or |d| ("a"). ``levels`` narrows them further:
    each (lo, hi, parts, part) keeps the rows whose value falls in sub-bin ``part`` of [lo, hi] cut in ``parts``
    (``sub_bin``)."""

    signed: tuple[int, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    value: str = "d"
    levels: tuple[tuple[float, float, int, int], ...] = ()


def sub_bin(v: np.ndarray, lo: float, hi: float, parts: int) -> np.ndarray:
    """Equal sub-bin of each value of [lo, hi] (values beyond in the end parts; one part: all)."""
    width = (hi - lo) / parts
    if parts == 1 or not (math.isfinite(width) and width > 0):
        return np.zeros(v.shape, dtype=np.int64)
    return np.clip(np.floor((v - lo) / width), 0, parts - 1).astype(np.int64)


@dataclass(frozen=True)
class Collect:
    """The values of ``rows`` (a pass returns them as one float64 array)."""

    rows: Rows


@dataclass(frozen=True)
class Count:
    """Counts of ``rows`` per sub-bin of [lo, hi] cut in ``parts`` (``sub_bin``), with each part's smallest and
    largest value: (counts, minima, maxima)."""

    rows: Rows
    lo: float
    hi: float
    parts: int


@dataclass(frozen=True)
class Histogram:
    """``np.histogram`` counts of ``rows`` on ``edges``: of |d| (``rows.value`` "a"), or (``window`` (lo_d, hi_d))
    of ρ = exp(d) held inside the edges for lo_d <= d <= hi_d, with the rows below lo_d and above hi_d counted
    apart: (counts, below, above)."""

    rows: Rows
    edges: tuple[float, ...]
    window: tuple[float, float] | None = None


def _first_round(groups: dict, fetch: int) -> list:
    """The first round of ``order_statistics``: (group, rows, count, lo, hi, values below, ranks) per bin holding
    a wanted rank."""
    pending = []
    for g, (counts, info, ranks) in groups.items():
        cum = np.cumsum(counts)
        total = int(cum[-1]) if cum.size else 0
        at: dict = {}
        for k in sorted(set(int(x) for x in ranks)):
            if not 0 <= k < total:
                raise ValueError(f"order_statistics: rank {k} outside the {total} values of group {g!r}")
            i, below = locate(cum, k)
            at.setdefault(i, (below, []))[1].append(k)
        for i, (below, ks) in sorted(at.items()):
            rows, lo, hi = info(i)
            pending.append((g, rows, int(counts[i]), lo, hi, below, ks))
    return pending


def _request(rows: Rows, n: int, lo: float, hi: float, fetch: int):
    if n <= fetch:
        return Collect(rows)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # an open-ended bin: its extremes first
        return Count(rows, 0.0, 0.0, 1)
    return Count(rows, lo, hi, SUB_BINS)


def first_requests(groups: dict, fetch: int) -> list:
    """The requests of ``order_statistics``'s first pass on ``groups`` (to run them in a pass made anyway)."""
    return [_request(rows, n, lo, hi, fetch) for _, rows, n, lo, hi, _, _ in _first_round(groups, fetch)
            if lo != hi]


def order_statistics(groups: dict, run: Callable[[list], list], fetch: int) -> dict:
    """Exact order statistics per group from fine-bin counts: ``groups`` {group: (counts, info, ranks)}: the
    counts of the group's fine bins in value order, ``info(i)`` → (``Rows`` of bin i, a lower and an upper bound
    on its values), the 0-based ranks wanted → {(group, rank): value}.

    ``run(requests)`` makes one narrow pass (over every dump of the groups) and returns each request's result.
    Per round, one pass: a bin holding a rank is read whole (``Collect``) when it has at most ``fetch`` rows,
    else cut into ``SUB_BINS`` equal sub-bins and counted (``Count``); the sub-bin holding the rank is the next
    round's bin (its rows: the bin's, narrowed by one more level), until it fits or holds a single value."""
    found: dict = {}
    pending = _first_round(groups, fetch)
    for _ in range(64):
        if not pending:
            return found
        requests, todo = [], []
        for item in pending:
            g, rows, n, lo, hi, below, ks = item
            if lo == hi:
                found.update({(g, k): float(lo) for k in ks})
                continue
            requests.append(_request(rows, n, lo, hi, fetch))
            todo.append(item)
        results = run(requests) if requests else []
        pending = []
        for (g, rows, n, lo, hi, below, ks), req, res in zip(todo, requests, results):
            if isinstance(req, Collect):
                if res.size != n:
                    raise RuntimeError(f"order_statistics: a bin of {n} rows read as {res.size}: the rows changed "
                                       "between passes")
                values = np.sort(res)
                found.update({(g, k): float(values[k - below]) for k in ks})
                continue
            counts, mins, maxs = res
            if int(counts.sum()) != n:
                raise RuntimeError(f"order_statistics: a bin of {n} rows counted as {int(counts.sum())}: the rows "
                                   "changed between passes")
            cum = np.cumsum(counts)
            at: dict = {}
            for k in ks:
                j, b = locate(cum, k - below)
                at.setdefault(j, (below + b, []))[1].append(k)
            for j, (b, kk) in at.items():
                narrowed = Rows(rows.signed, rows.pairs, rows.value, rows.levels + ((req.lo, req.hi, req.parts, j),))
                pending.append((g, narrowed, int(counts[j]), float(mins[j]), float(maxs[j]), b, kk))
    raise RuntimeError("order_statistics did not converge in 64 rounds")
