"""Exact statistics of a column as SQL over DuckDB, in bounded memory: histogram bins, order statistics and
numpy's quantiles, without reading the column into Python.

The report's queries (``tim_plugins.report.query``) use these over a dump far larger than memory. Each function
gives numpy's answer on the same values (``np.histogram`` / ``np.digitize`` bins, ``np.quantile``'s linear method),
exactly: a fast estimate first, then a check against the exact edges or a narrowing over a few scans where the
estimate could be off.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["FINE_LOG_BIN", "approx_bin", "binned", "count_le", "order_statistics", "quantiles_of", "sql_double"]


def sql_double(x: float) -> str:
    """A float as an exact SQL DOUBLE literal."""
    if math.isinf(x):
        return "'inf'::DOUBLE" if x > 0 else "'-inf'::DOUBLE"
    return f"{float(x)!r}::DOUBLE"


def _edges_list(edges) -> str:
    """The edges padded with −inf and +inf, as a DuckDB list (1-based: element i + 2 is edge i)."""
    return "[" + ", ".join(sql_double(e) for e in [-math.inf, *map(float, edges), math.inf]) + "]"


def count_le(x: str, edges, approx: str) -> str:
    """SQL: how many of ``edges`` (sorted) are <= ``x`` (numpy ``searchsorted(edges, x, 'right')``), from ``approx``,
    an estimate of the fractional index of x among the edges that is off by less than one, corrected by
    comparing with the exact edges."""
    n = len(edges)
    e = _edges_list(edges)
    c0 = f"least(greatest(floor({approx}) + 1, 0), {n})::BIGINT"
    return f"({c0} + ({x} >= {e}[{c0} + 2])::BIGINT - ({x} < {e}[{c0} + 1])::BIGINT)"


def _log_index(x: str, edges) -> str:
    """Fractional index of ``x`` among log-spaced ``edges`` (x > 0)."""
    lo, hi, n = math.log(edges[0]), math.log(edges[-1]), len(edges) - 1
    return f"((ln({x}) - {lo!r}) * {n / (hi - lo)!r})" if hi > lo else "0"


def _lin_index(x: str, edges) -> str:
    lo, hi, n = float(edges[0]), float(edges[-1]), len(edges) - 1
    return f"(({x} - {lo!r}) * {n / (hi - lo)!r})" if hi > lo else "0"


# SQL: a fine log bin of the column ``a`` (>= 0), monotone in a, ~1 % wide (64 a factor of 2); 0 for a = 0.
FINE_LOG_BIN = "(CASE WHEN a = 0 THEN 0 ELSE 70000 + floor(log2(a) * 64) END)::BIGINT"


def approx_bin(x: str, edges, log: bool) -> str:
    """SQL: the bin of ``x`` among ``edges`` from its fractional index alone (exact but at the edges' rounding)."""
    nb = len(edges) - 1
    return f"least(greatest(floor({(_log_index if log else _lin_index)(x, edges)}), 0), {nb - 1})::BIGINT"


def binned(con, relation: str, x: str, edges, log: bool, aggregates: tuple[str, ...] = (), clip: bool = False):
    """Per bin of ``x`` among ``edges``, over ``relation``: (bin SQL, rows [(bin, count, min x, max x,
    *aggregates)]). Bins are those of ``np.histogram`` (edges[i] <= x < edges[i + 1], the last bin closed; x
    outside the edges: filter it first) or, with ``clip``, of ``np.digitize`` clipped to the bins (values beyond
    the edges in the end bins).

    Fast path: the bin from x's fractional index among the edges (log or linear spacing); each bin's min and max
    then prove every value of it on the right side of the exact edges. Where one is not (a value within rounding
    of an edge), the same query with the exact count of edges <= x (``count_le``)."""
    nb = len(edges) - 1
    extra = "".join(f", {a}" for a in aggregates)

    def run(bin_sql):
        return con.execute(f"SELECT {bin_sql} AS b, count(*), min({x}), max({x}){extra} FROM ({relation}) "
                           "GROUP BY b ORDER BY b").fetchall()

    fast = approx_bin(x, edges, log)
    rows = run(fast)
    e = [float(v) for v in edges]

    def exact(b, lo, hi):
        above_first = clip and b == 0 or lo >= e[b]
        below_next = clip and b == nb - 1 or (hi <= e[b + 1] if b == nb - 1 else hi < e[b + 1])
        return above_first and below_next

    if all(exact(b, lo, hi) for b, _, lo, hi, *_ in rows):
        return fast, rows
    c = count_le(x, edges, (_log_index if log else _lin_index)(x, edges))
    slow = (f"least(greatest({c} - 1, 0), {nb - 1})" if clip
            else f"(CASE WHEN {x} = {sql_double(edges[-1])} THEN {nb - 1} ELSE {c} - 1 END)")
    return slow, run(slow)


def _descend(g, ranks: list[int], below: int, parts, where: dict) -> int:
    """Put each rank into the part (n, lo, hi) of ``parts`` (in value order, ``below`` values before them) that
    holds it: ``where`` {(key): [g, lo, hi, below, n, ranks]}. Returns the values counted."""
    for i, (n, lo, hi) in enumerate(parts):
        for k in ranks:
            if below <= k < below + n:
                where.setdefault((g, i, lo), [g, lo, hi, below, n, []])[5].append(k)
        below += n
    return below


def order_statistics(con, relation: str, wanted: dict, *, stats: dict | None = None, initial: dict | None = None,
                     bins: int = 8192, fetch: int = 1 << 21) -> dict:
    """Exact order statistics of the column ``v`` of ``relation`` (SQL with columns ``g``, a group, and ``v``,
    finite), per group: ``wanted`` {group: [0-based ranks]} → {(group, rank): value}.

    Bounded memory and a few scans: each range of values holding a wanted rank is cut into ``bins`` equal bins
    (one GROUP BY: count, min, max per bin); the bin holding the rank becomes the next range (its values from its
    min to its max), until a range holds at most ``fetch`` values (read and sorted here) or a single value.
    ``stats`` {group: (count, min, max)}, when the caller knows them, saves the first scan; ``initial`` {group:
    [(count, min, max) of consecutive value ranges, in value order, covering the group]} (a histogram the caller
    already has) saves the first narrowing."""
    import pyarrow as pa

    found: dict = {}
    groups = list(wanted)
    if not groups:
        return found
    if stats is None:
        rows = con.execute(f"SELECT g, count(*), min(v), max(v) FROM ({relation}) GROUP BY g").fetchall()
        stats = {g: (n, lo, hi) for g, n, lo, hi in rows}
    by_group = stats
    # A range: [g, lo, hi, below (values of g under lo), count, ranks]
    ranges = []
    first: dict = {}
    for g in groups:
        n, lo, hi = by_group.get(g, (0, None, None))
        ranks = sorted({int(k) for k in wanted[g]})
        if not n or any(not 0 <= k < n for k in ranks):
            raise ValueError(f"order_statistics: ranks {ranks} outside the {n} values of group {g!r}")
        if initial is not None and g in initial:
            if _descend(g, ranks, 0, initial[g], first) != n:
                raise ValueError(f"order_statistics: the initial ranges of group {g!r} do not hold its {n} values")
        else:
            ranges.append([g, lo, hi, 0, n, ranks])
    ranges += list(first.values())
    for _ in range(64):
        if not ranges:
            return found
        todo = []
        for r in ranges:
            if r[1] == r[2]:
                found.update({(r[0], k): float(r[1]) for k in r[5]})
            else:
                todo.append(r)
        small = [r for r in todo if r[4] <= fetch]
        big = [r for r in todo if r[4] > fetch]
        if small:
            table = pa.table({"rid": list(range(len(small))), "rg": [r[0] for r in small],
                              "lo": [float(r[1]) for r in small], "hi": [float(r[2]) for r in small]})
            con.register("_tim_ranges", table)
            rows = con.execute(f"SELECT rid, v FROM ({relation}) JOIN _tim_ranges ON g = rg AND v >= lo AND v <= hi"
                               ).fetch_arrow_table()
            con.unregister("_tim_ranges")
            rid, v = rows.column("rid").to_numpy(), rows.column("v").to_numpy()
            for i, r in enumerate(small):
                values = np.sort(v[rid == i])
                found.update({(r[0], k): float(values[k - r[3]]) for k in r[5]})
        if not big:
            return found
        table = pa.table({"rid": list(range(len(big))), "rg": [r[0] for r in big], "lo": [float(r[1]) for r in big],
                          "hi": [float(r[2]) for r in big], "w": [(float(r[2]) - float(r[1])) / bins for r in big]})
        con.register("_tim_ranges", table)
        rows = con.execute(
            f"SELECT rid, least(floor((v - lo) / w), {bins - 1})::BIGINT AS b, count(*), min(v), max(v) "
            f"FROM ({relation}) JOIN _tim_ranges ON g = rg AND v >= lo AND v <= hi GROUP BY rid, b ORDER BY rid, b"
        ).fetchall()
        con.unregister("_tim_ranges")
        per: dict = {}
        for rid, _b, n, lo, hi in rows:
            per.setdefault(rid, []).append((n, lo, hi))
        nxt: dict = {}
        for i, r in enumerate(big):
            below = _descend((r[0], i), r[5], r[3], per.get(i, []), nxt)
            if below != r[3] + r[4]:
                raise RuntimeError(f"order_statistics: a range of {r[4]} values rescanned as {below - r[3]}: the "
                                   "rows changed between scans")
        ranges = [[key[0][0], *rest] for key, (_, *rest) in nxt.items()]
    raise RuntimeError("order_statistics did not converge in 64 rounds")


def quantiles_of(con, relation: str, wanted: dict[object, tuple[int, tuple[float, ...]]],
                 stats: dict | None = None, initial: dict | None = None) -> dict:
    """numpy's ``quantile`` (linear method) of ``v`` per group: ``wanted`` {group: (n values, qs)} →
    {(group, q): value}; ``stats`` as ``order_statistics``'s."""
    ranks, where = {}, {}
    for g, (n, qs) in wanted.items():
        for q in qs:
            h = q * (n - 1)
            lo = int(math.floor(h))
            hi = min(lo + 1, n - 1)
            where[(g, q)] = (lo, hi, h - lo)
            ranks.setdefault(g, set()).update((lo, hi))
    found = order_statistics(con, relation, ranks, stats=stats, initial=initial)
    out = {}
    for (g, q), (lo, hi, t) in where.items():
        a, b = found[(g, lo)], found[(g, hi)]
        out[(g, q)] = a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t)  # numpy's _lerp
    return out
