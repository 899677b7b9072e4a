"""The report's per-token statistics as streaming SQL over a dump's Parquet files (DuckDB), in bounded memory.

A dump holds one row per sampled token (``tim_plugins.dump``): a real run's is far larger than memory (1,000 steps ×
8 ranks × 13 sequences × 2,000 tokens is ~200 M rows). Nothing here reads it whole: every statistic is an
aggregation DuckDB streams over the files (per step, per sequence, per bin), and only aggregates (one row per step,
sequence, position or bin) come back to Python. DuckDB's own memory is capped by ``memory_limit`` (it spills to a
temporary folder beyond it) and its threads by ``threads``.

The rows read are a snapshot taken once per ``Dump``: the complete ``step_*-rank_*.parquet`` files present at that
moment. The writer writes each file under a temporary name and renames it into place (``TokenDumper.write``), so a
file being written is not listed, and one that appears later is not read: every figure of a report describes the
same rows, also while the run goes on.

What the report computes from the rows, and how it matches the in-memory computation it replaces:

- the core monitor's metrics per step and over all steps: the monitor's additive state (``_mismatch_layout``:
  sums, maxima, histogram counts) summed per step in SQL, then ``metrics._derive``, the one place each metric's
  formula lives, exactly as ``mismatch_metrics`` on the same rows would (the same float64 terms; sums in another
  order, so equal to float rounding);
- the figures' data: binned counts and sums, per-sequence and per-position sums, and exact quantiles (order
  statistics found by narrowing a value range over a few scans, ``sql_stats.order_statistics``), never a sample.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tim_plugins._optional import require
from tim_plugins.report.sql_stats import FINE_LOG_BIN, approx_bin, binned, quantiles_of, sql_double

__all__ = ["DEFAULT_MEMORY_LIMIT", "DEFAULT_THREADS", "MEMORY_LIMIT_ENV", "Engine", "Dump", "engine", "snapshot",
           "open_dump", "parse_memory_limit"]

# DuckDB's memory cap for the report's queries, and the env variable that overrides it. A query needing more
# spills to a temporary folder; the report's aggregates are small, so a dump of any size fits under it.
DEFAULT_MEMORY_LIMIT = "1GB"
MEMORY_LIMIT_ENV = "TIM_REPORT_MEMORY_LIMIT"
# None: every core DuckDB sees.
DEFAULT_THREADS: int | None = None

# The complete dump files: the writer's temporary names (``*.parquet.tmp<pid>``) do not match.
_FILE_RE = re.compile(r"step_\d+-rank_\d+\.parquet")
_COLUMNS = ("step", "rank", "sequence", "position", "token_id", "rollout_logprob", "train_logprob")


# the per-step sums the grouped scan returns, in its column order (after step and the histogram bin)
_STEP_SUMS = ("tokens", "abs_d", "abs_p", "seq_log_ratio", "k3", "_lin", "_ser", "rho_m1_sq", "outside", "is_tokens",
              "is_w", "is_w2", "is_masked")

def snapshot(folder: str | os.PathLike) -> list[str]:
    """The complete dump files of ``folder`` now (sorted names; the writer renames a finished file into place)."""
    return sorted(str(p) for p in Path(folder).iterdir() if _FILE_RE.fullmatch(p.name) and p.is_file())


def parse_memory_limit(value) -> str:
    """``value`` (bytes as an int, or DuckDB's "1GB" / "500MB" form) as DuckDB's setting; env / default if None."""
    value = os.environ.get(MEMORY_LIMIT_ENV, DEFAULT_MEMORY_LIMIT) if value is None else value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return f"{int(value)}B"
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)\s*", value, re.I):
        return value.strip()
    raise ValueError(f"memory_limit={value!r} is invalid: it must be a size such as '1GB' or '500MB' (or bytes as "
                     f"an int); set it with --memory-limit or {MEMORY_LIMIT_ENV}.")


class Engine:
    """One DuckDB connection for a report: ``memory_limit`` caps its memory (spilling to a temporary folder
    removed by ``close``), ``threads`` its threads (None: every core)."""

    def __init__(self, memory_limit: str | int | None = None, threads: int | None = DEFAULT_THREADS) -> None:
        require("duckdb", "the report of a per-token dump")
        import duckdb

        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r} is invalid: it must be a positive int (or None for every core).")
        self.memory_limit = parse_memory_limit(memory_limit)
        self._spill = tempfile.mkdtemp(prefix="tim-report-")
        config = {"memory_limit": self.memory_limit, "temp_directory": self._spill,
                  # the same files are scanned by every query: keep their Parquet metadata, not their bytes (a
                  # cache of the files' bytes fills memory_limit on a dump larger than it and saves no CPU: the
                  # queries are bound by per-token expressions, and the OS caches the files anyway)
                  "enable_object_cache": True, "preserve_insertion_order": False,
                  "enable_external_file_cache": False}
        if threads is not None:
            config["threads"] = threads
        self.con = duckdb.connect(":memory:", config=config)
        self._views = 0
        # expm1 without cancellation near 0 (DuckDB has no expm1): 3 terms of the series below 1e-5 (relative
        # error < 1e-21), exp(x) − 1 above (relative error < 1e-16 / 1e-5).
        self.con.execute("CREATE MACRO expm1(x) AS CASE WHEN abs(x) < 1e-5 THEN x * (1 + x * (0.5 + x / 6)) "
                         "ELSE exp(x) - 1 END")

    def setting(self, name: str):
        return self.con.execute(f"SELECT current_setting('{name}')").fetchone()[0]

    def view(self, files: list[str]) -> str:
        """A view of ``files``'s rows (the columns the report reads), under a fresh name."""
        self._views += 1
        name = f"dump_{self._views}"
        listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
        self.con.execute(f"CREATE TEMP VIEW {name} AS SELECT {', '.join(_COLUMNS)} FROM read_parquet({listed})")
        return name

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.con.close()
        shutil.rmtree(self._spill, ignore_errors=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_ACTIVE: contextvars.ContextVar[Engine | None] = contextvars.ContextVar("tim_report_engine", default=None)


@contextlib.contextmanager
def engine(memory_limit: str | int | None = None, threads: int | None = DEFAULT_THREADS):
    """An ``Engine`` that ``open_dump`` uses inside the block (closed at its end)."""
    eng = Engine(memory_limit, threads)
    token = _ACTIVE.set(eng)
    try:
        yield eng
    finally:
        _ACTIVE.reset(token)
        eng.close()


def open_dump(folder: str | os.PathLike) -> "Dump":
    """The ``Dump`` of ``folder`` on the active engine (``engine``), else on an engine of its own (default
    settings)."""
    eng = _ACTIVE.get()
    if eng is not None:
        return Dump(folder, eng)
    eng = Engine()
    try:
        dump = Dump(folder, eng)
    except BaseException:
        eng.close()
        raise
    weakref.finalize(dump, eng.close)  # its own engine lives as long as the dump
    return dump


@dataclass
class Sequences:
    """One row per sequence (ordered by step, rank, sequence): its valid tokens and Σ_t d."""

    step: np.ndarray
    rank: np.ndarray
    sequence: np.ndarray
    length: np.ndarray
    sum_d: np.ndarray


class Dump:
    """The valid rows of a dump folder's snapshot (finite log-probs above the invalid-placeholder threshold), and
    the report's statistics over them as queries.

    Attributes: ``files`` (the snapshot), ``size`` (valid tokens), ``invalid`` (rows left out)."""

    def __init__(self, folder: str | os.PathLike, eng: Engine) -> None:
        from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD

        self.folder = Path(folder)
        self.files = snapshot(self.folder)
        if not self.files:
            raise FileNotFoundError(f"no dump files (step_*-rank_*.parquet) in {str(folder)!r}: point at the folder "
                                    "the dumper wrote.")
        self.engine = eng
        self.con = eng.con
        self.raw = eng.view(self.files)
        th = sql_double(INVALID_LOGPROB_THRESHOLD)
        self.valid = f"{self.raw}_valid"
        self.con.execute(
            f"CREATE TEMP VIEW {self.valid} AS SELECT step, rank, sequence, position, r, t, t - r AS d FROM ("
            f"SELECT step, rank, sequence, position, rollout_logprob::DOUBLE AS r, train_logprob::DOUBLE AS t "
            f"FROM {self.raw}) WHERE isfinite(r) AND isfinite(t) AND r > {th} AND t > {th}")
        self._cache: dict = {}

    @property
    def rows(self) -> int:
        """Rows of the snapshot's files (their Parquet footers)."""
        if "rows" not in self._cache:
            listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in self.files) + "]"
            self._cache["rows"] = int(self.con.execute(
                f"SELECT sum(num_rows) FROM parquet_file_metadata({listed})").fetchone()[0])
        return self._cache["rows"]

    @property
    def size(self) -> int:
        """Valid tokens (from the per-step scan)."""
        return int(sum(s["tokens"] for s in self.step_states()[1]))

    @property
    def invalid(self) -> int:
        return self.rows - self.size

    # ------------------------------------------------------------------------------------------ monitor metrics
    def step_states(self) -> tuple[np.ndarray, list[dict]]:
        """(steps, the monitor's unpacked state per step) over the valid rows, each sequence's tokens laid out as
        one row of a [sequences, positions] batch with ρ = exp(d) as the IS weights: what ``mismatch_metrics`` on
        those tensors accumulates. Two scans (per step; per step, histogram bin and bucket), and the per-
        sequence one."""
        if "states" in self._cache:
            return self._cache["states"]
        from tim_plugins._mismatch_layout import (HISTOGRAM_BINS_PER_DECADE, HISTOGRAM_RANGE, K3_SERIES,
                                                  K3_SERIES_BOUND, N_BUCKETS, N_SIGNED_BINS, PROB_BUCKET_EDGES)
        from tim_plugins.metrics import DEFAULT_RATIO_BAND

        import torch

        bound = K3_SERIES_BOUND[torch.float64]
        cl = "cl"  # d clamped to the series' bound (a column of the inner query: computed once a row)
        horner = f"({cl} * {K3_SERIES[-1]!r} + {K3_SERIES[-2]!r})"
        for c in reversed(K3_SERIES[:-2]):
            horner = f"({c!r} + {horner} * {cl})"
        series = f"(CASE WHEN a < {bound!r} THEN {horner} * {cl} * {cl} ELSE 0.0 END)"
        linear = f"(CASE WHEN a < {bound!r} THEN d ELSE expm1(d) END)"
        bucket = " + ".join(f"(r >= {math.log(e)!r})::INT" for e in PROB_BUCKET_EDGES[1:-1])
        log_lo, log_hi = (math.log(x) for x in DEFAULT_RATIO_BAND)
        centre = (N_SIGNED_BINS - 1) // 2
        abs_bin = (f"(CASE WHEN a = 0 THEN 0 ELSE least(greatest(floor((log10(a) - "
                   f"{math.log10(HISTOGRAM_RANGE[0])!r}) * {HISTOGRAM_BINS_PER_DECADE}) + 1, 0), {centre}) END)")
        # Each per-token term once, in layers (a column of an inner query is computed once a row).
        base = f"SELECT step, d, abs(d) AS a, r, least(greatest(d, {-bound!r}), {bound!r}) AS cl FROM {self.valid}"
        terms = (f"SELECT step, d, a, r, {series} AS ser, {linear} AS lin, ({bucket}) AS bucket, exp(d) AS w, "
                 f"({centre} + sign(d) * {abs_bin})::BIGINT AS hbin FROM ({base})")
        terms = (f"SELECT step, d, a, bucket, hbin, ser, lin, lin + ser AS rm1, (lin - d) + ser AS k3, "
                 f"exp(r) * abs(lin + ser) AS absp, CASE WHEN isfinite(w) THEN w END AS w FROM ({terms})")
        # Two groupings, so that DuckDB's hash tables stay small on a long run (every aggregate per (step, bin,
        # bucket) held ~1 KB a group, hundreds of thousands of groups): the sums and extremes per step, and per
        # (step, bin, bucket) only the counts, Σ|d| and extremes the histograms need.
        cols = self.con.execute(
            f"SELECT step, count(*) AS n, sum(a) AS a, sum(absp) AS abs_p, sum(d) AS sum_d, sum(k3) AS k3, "
            f"sum(lin) AS lin, sum(ser) AS ser, sum(rm1 * rm1) AS rho_m1_sq, count(*) FILTER (WHERE d < {log_lo!r} OR "
            f"d > {log_hi!r}) AS outside, max(d) AS d_max, min(d) AS d_min, max(absp) AS abs_p_max, count(w) AS is_n, "
            f"coalesce(sum(w), 0) AS is_w, coalesce(sum(w * w), 0) AS is_w2, count(*) FILTER (WHERE w = 0) AS "
            f"is_masked, coalesce(max(w), '-inf'::DOUBLE) AS w_max, coalesce(min(w), 'inf'::DOUBLE) AS w_min, "
            f"coalesce(min(a) FILTER (WHERE a > 0), 'inf'::DOUBLE) AS a_min_pos, count(*) FILTER (WHERE a = 0) AS "
            f"zeros FROM ({terms}) GROUP BY step ORDER BY step").fetchnumpy()
        cols = {k: np.asarray(v) for k, v in cols.items()}
        # the bin and bucket alone (the other terms are not computed for this query)
        binned_rows = self.con.execute(
            f"SELECT step, hbin, bucket, count(*) AS n, sum(a) AS a, min(d) AS d_min, max(d) AS d_max FROM ({terms}) "
            f"GROUP BY step, hbin, bucket").fetchnumpy()
        binned_rows = {k: np.asarray(v) for k, v in binned_rows.items()}
        seqs = self.sequences()
        ninf = -math.inf
        overall = {"d_min": math.inf, "d_max": ninf, "abs_min_pos": math.inf, "zeros": 0}
        steps = cols["step"].astype(np.int64)
        states = []
        if steps.size:
            per = {k: cols[k].astype(np.float64) for k in
                   ("n", "a", "abs_p", "sum_d", "k3", "lin", "ser", "rho_m1_sq", "outside", "is_n", "is_w", "is_w2",
                    "is_masked")}
            top = {k: cols[k] for k in ("d_max", "abs_p_max", "w_max")}
            top["neg_w_min"] = -cols["w_min"]
            d_min = cols["d_min"]
            at = np.searchsorted(steps, binned_rows["step"].astype(np.int64))
            n, hbin = binned_rows["n"], binned_rows["hbin"].astype(np.int64)
            hist = np.zeros((steps.size, N_SIGNED_BINS))
            np.add.at(hist, (at, hbin), n)
            bucket_count, bucket_abs = np.zeros((steps.size, N_BUCKETS)), np.zeros((steps.size, N_BUCKETS))
            where = (at, binned_rows["bucket"].astype(np.int64))
            np.add.at(bucket_count, where, n)
            np.add.at(bucket_abs, where, binned_rows["a"])
            overall.update(d_min=float(d_min.min()), d_max=float(cols["d_max"].max()),
                           abs_min_pos=float(cols["a_min_pos"].min()), zeros=int(cols["zeros"].sum()))
            hbins, where = np.unique(hbin, return_inverse=True)
            h_n, h_lo, h_hi = (np.zeros(hbins.size, dtype=np.int64), np.full(hbins.size, math.inf),
                               np.full(hbins.size, ninf))
            np.add.at(h_n, where, n)
            np.minimum.at(h_lo, where, binned_rows["d_min"])
            np.maximum.at(h_hi, where, binned_rows["d_max"])
            overall["hbins"] = {int(b): [int(c), float(lo), float(hi)] for b, c, lo, hi in zip(hbins, h_n, h_lo, h_hi)}
        for i, step in enumerate(steps):
            s = {key: float(per[col][i]) for key, col in zip(_STEP_SUMS, (
                "n", "a", "abs_p", "sum_d", "k3", "lin", "ser", "rho_m1_sq", "outside", "is_n", "is_w", "is_w2",
                "is_masked"))}
            d_max, d_lo = float(top["d_max"][i]), float(d_min[i])
            s["rho_m1"] = s.pop("_lin") + s.pop("_ser")
            s["neg_d"] = -s["seq_log_ratio"]
            sel = seqs.step == step
            s.update(invalid=0.0, hist=hist[i], bucket_count=bucket_count[i], bucket_abs=bucket_abs[i],
                     abs_p_max=float(top["abs_p_max"][i]), is_w_max=float(top["w_max"][i]),
                     neg_is_w_min=float(top["neg_w_min"][i]), seqs=float(sel.sum()), abs_d_max=max(d_max, -d_lo),
                     rho_m1_max=math.expm1(d_max), neg_rho_m1_min=-math.expm1(d_lo),
                     seq_abs_max=float(np.abs(seqs.sum_d[sel]).max()) if sel.any() else ninf)
            states.append(s)
        self._cache["overall"] = overall
        self._cache["states"] = (steps, states)
        return steps, states

    def _overall(self) -> dict:
        """Extremes over every valid row (from the per-step scan): d_min, d_max, abs_min_pos, zeros."""
        self.step_states()
        return self._cache["overall"]

    def sequences(self) -> Sequences:
        """Per sequence (step, rank, sequence order): its valid tokens and Σ_t d."""
        self._profiles()
        return self._cache["seq"]

    def _profiles(self) -> None:
        """One scan, three groupings: per sequence (tokens, Σd), per position (tokens, Σ|d|), and per bin of 1 − p
        (``figures.PROB_EDGES``, its fast bin) × a fine log bin of |d| (tokens, Σ|d|, extremes): the per-probability
        curve and its quantiles' first narrowing."""
        if "seq" in self._cache:
            return
        from tim_plugins.report.figures import PROB_EDGES

        fast = approx_bin("q", PROB_EDGES, True)
        t = self.con.execute(
            f"SELECT GROUPING(step, rank, sequence, position, b, k) AS gid, step, rank, sequence, position, b, k, "
            f"count(*) AS n, sum(d) AS sd, sum(a) AS sa, min(q) AS qlo, max(q) AS qhi, min(a) AS alo, max(a) AS ahi "
            f"FROM (SELECT step, rank, sequence, position, d, a, q, {fast} AS b, {FINE_LOG_BIN} AS k "
            f"FROM (SELECT step, rank, sequence, position, d, abs(d) AS a, "
            f"least(greatest(-expm1(r), 1e-7), 1.0) AS q FROM {self.valid})) "
            f"GROUP BY GROUPING SETS ((step, rank, sequence), (position), (b, k))").fetch_arrow_table()
        gid = t.column("gid").to_numpy()
        col = lambda k, sel: t.column(k).to_numpy(zero_copy_only=False)[sel]  # noqa: E731
        seq = gid == 0b000111
        order = np.lexsort((col("sequence", seq), col("rank", seq), col("step", seq)))
        self._cache["seq"] = Sequences(*(col(k, seq)[order].astype(np.int64) for k in ("step", "rank", "sequence",
                                                                                        "n")),
                                       col("sd", seq)[order].astype(np.float64))
        pos = gid == 0b111011
        order = np.argsort(col("position", pos), kind="stable")
        self._cache["pos"] = (col("position", pos)[order].astype(np.int64), col("n", pos)[order].astype(np.int64),
                              col("sa", pos)[order].astype(np.float64))
        fine = gid == 0b111100
        order = np.lexsort((col("k", fine), col("b", fine)))
        ints, floats = ("b", "k", "n"), ("qlo", "qhi", "sa", "alo", "ahi")
        self._cache["fine"] = list(zip(*[col(k, fine)[order].astype(np.int64).tolist() for k in ints],
                                       *[col(k, fine)[order].astype(np.float64).tolist() for k in floats]))

    # ---------------------------------------------------------------------------------------------- figures
    def prob_curve(self, edges, quantile: float | None = None, min_count: int = 20) -> dict:
        """Per bin of 1 − p (p = the rollout's probability; ``edges`` log-spaced, 1 − p clipped to [1e-7, 1] and
        values beyond the edges in the end bins, as ``np.digitize`` then clip): tokens, Σ|d| and, with
        ``quantile``, that quantile of |d| in each bin of at least ``min_count`` tokens (NaN elsewhere)."""
        nb = len(edges) - 1
        rel = f"SELECT least(greatest(-expm1(r), 1e-7), 1.0) AS q, abs(d) AS a FROM {self.valid}"
        # One scan: per bin, a fine log histogram of |d| too (monotone in |d|, ~1 % wide), the quantile's first
        # narrowing. The bins are checked against the exact edges as ``binned`` does; if a value lies within
        # rounding of an edge, ``binned``'s exact path.
        from tim_plugins.report.figures import PROB_EDGES

        fast = approx_bin("q", edges, True)
        if np.array_equal(np.asarray(edges, dtype=np.float64), PROB_EDGES):
            self._profiles()
            fine = self._cache["fine"]
        else:
            fine = self.con.execute(f"SELECT {fast} AS b, {FINE_LOG_BIN} AS k, count(*), min(q), max(q), sum(a), "
                                    f"min(a), max(a) FROM ({rel}) GROUP BY b, k ORDER BY b, k").fetchall()
        e = [float(x) for x in edges]
        per_bin: dict = {}
        for b, _, n, qlo, qhi, s, lo, hi in fine:
            acc = per_bin.setdefault(b, [0, math.inf, -math.inf, 0.0, []])
            acc[0] += n
            acc[1], acc[2], acc[3] = min(acc[1], qlo), max(acc[2], qhi), acc[3] + s
            acc[4].append((n, lo, hi))
        exact = all((b == 0 or acc[1] >= e[b]) and (b == nb - 1 or acc[2] < e[b + 1]) for b, acc in per_bin.items())
        bin_sql, initial = fast, {b: acc[4] for b, acc in per_bin.items()}
        count, total = np.zeros(nb, dtype=np.int64), np.zeros(nb)
        if exact:
            for b, acc in per_bin.items():
                count[b], total[b] = acc[0], acc[3]
            stats = {b: (acc[0], min(p[1] for p in acc[4]), max(p[2] for p in acc[4])) for b, acc in per_bin.items()}
        else:
            bin_sql, rows = binned(self.con, rel, "q", edges, True, ("sum(a)", "min(a)", "max(a)"), clip=True)
            stats, initial = {}, None
            for b, n, _, _, s, lo, hi in rows:
                count[b], total[b], stats[b] = n, s, (n, lo, hi)
        out = {"count": count, "sum": total}
        if quantile is not None:
            qs = np.full(nb, np.nan)
            wanted = {g: (int(count[g]), (quantile,)) for g in range(nb) if count[g] >= min_count}
            found = quantiles_of(self.con, f"SELECT {bin_sql} AS g, a AS v FROM ({rel})", wanted, stats,
                                 initial and {g: initial[g] for g in wanted})
            for (g, _), v in found.items():
                qs[g] = v
            out["quantile"] = qs
        return out

    def abs_range(self) -> tuple[float | None, float | None, int]:
        """(smallest |d| > 0, largest |d|, tokens with d exactly 0); None without such tokens."""
        o = self._overall()
        hi = max(o["d_max"], -o["d_min"]) if self.size else None
        return (None if math.isinf(o["abs_min_pos"]) else o["abs_min_pos"]), hi, int(o["zeros"])

    def abs_histogram(self, edges) -> np.ndarray:
        """``np.histogram(|d|[|d| > 0], edges)`` counts (log-spaced edges holding every |d| > 0)."""
        _, rows = binned(self.con, f"SELECT abs(d) AS a FROM {self.valid} WHERE d <> 0", "a", edges, True)
        counts = np.zeros(len(edges) - 1, dtype=np.int64)
        for b, n, *_ in rows:
            counts[b] += n
        return counts

    def d_range(self) -> tuple[int, float, float]:
        o = self._overall()
        return (self.size, o["d_min"], o["d_max"]) if self.size else (0, None, None)

    def rho_histogram(self, edges, log: bool, lo_d: float, hi_d: float) -> tuple[np.ndarray, int, int]:
        """(``np.histogram`` counts of ρ = exp(d) on ``edges`` of the tokens with lo_d <= d <= hi_d (ρ held
        inside the edges), tokens with d below lo_d, above hi_d)."""
        lo, hi = sql_double(lo_d), sql_double(hi_d)
        nb = len(edges) - 1
        rho = f"least(greatest(exp(d), {sql_double(edges[0])}), {sql_double(edges[-1])})"
        below, above = 0, 0
        # one scan: the tokens outside the window as two more groups; each bin's extremes checked against the
        # exact edges (else the exact path below)
        rows = self.con.execute(
            f"SELECT CASE WHEN d < {lo} THEN -1 WHEN d > {hi} THEN {nb} ELSE {approx_bin('rho', edges, log)} END "
            f"AS b, count(*), min(rho), max(rho) FROM (SELECT d, {rho} AS rho FROM {self.valid}) GROUP BY b").fetchall()
        e = [float(x) for x in edges]
        inside = [(b, n, x, y) for b, n, x, y in rows if 0 <= b < nb]
        if all(x >= e[b] and (y <= e[b + 1] if b == nb - 1 else y < e[b + 1]) for b, n, x, y in inside):
            counts = np.zeros(nb, dtype=np.int64)
            for b, n, _, _ in inside:
                counts[b] = n
            below = next((n for b, n, _, _ in rows if b < 0), 0)
            above = next((n for b, n, _, _ in rows if b >= nb), 0)
            return counts, int(below), int(above)
        side = f"(CASE WHEN d < {lo} THEN -1 WHEN d > {hi} THEN {nb} ELSE NULL END)"
        _, rows = binned(self.con, f"SELECT {rho} AS rho FROM {self.valid} WHERE d >= {lo} AND d <= {hi}", "rho",
                         edges, log)
        counts = np.zeros(nb, dtype=np.int64)
        for b, n, *_ in rows:
            counts[b] += n
        o = self._overall()
        outside = [] if lo_d <= o["d_min"] and hi_d >= o["d_max"] else self.con.execute(
            f"SELECT {side} AS s, count(*) FROM {self.valid} WHERE d < {lo} OR d > {hi} GROUP BY s").fetchall()
        for b, n in outside:
            if b < 0:
                below = n
            else:
                above = n
        return counts, int(below), int(above)

    def position_profile(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, tokens, Σ|d|) per response position, in position order."""
        self._profiles()
        return self._cache["pos"]

    # ----------------------------------------------------------------------------------- largest disagreements
    def largest_disagreements(self, n: int, context: int) -> list[dict]:
        """``disagreements.largest_disagreements``'s rows over this dump: the ``n`` valid rows with the largest
        |d| (ties in (step, rank, sequence, position) order), each with the token ids of the rows of its sequence
        within ``context`` positions on each side (every row of the dump, valid or not)."""
        picked = self.con.execute(
            f"SELECT step, rank, sequence, position, r, t FROM {self.valid} "
            f"ORDER BY abs(d) DESC, step, rank, sequence, position LIMIT {int(n)}").fetchall()
        if not picked:
            return []
        import pyarrow as pa

        seqs = sorted({p[:3] for p in picked})
        keys = pa.table({"ks": [k[0] for k in seqs], "kr": [k[1] for k in seqs], "kq": [k[2] for k in seqs]})
        self.con.register("_tim_picked", keys)
        try:  # every row of the picked sequences (a few thousand): context and ends from them
            rows_of = self.con.execute(
                f"SELECT step, rank, sequence, position, token_id FROM {self.raw} JOIN _tim_picked ON "
                f"step = ks AND rank = kr AND sequence = kq").fetchall()
        finally:
            self.con.unregister("_tim_picked")
        by_seq: dict = {}
        for step, rank, seq, pos, tok in rows_of:
            by_seq.setdefault((step, rank, seq), []).append((pos, tok))
        rows = []
        for step, rank, seq, pos, r, t in picked:
            every = sorted(by_seq[(step, rank, seq)])
            around = [(p, tok) for p, tok in every if abs(p - pos) <= context]
            lo, hi = every[0][0], every[-1][0]
            rows.append({
                "step": int(step), "rank": int(rank), "sequence": int(seq), "position": int(pos),
                "token_id": int(next(tok for p, tok in around if p == pos)),
                "rollout_logprob": float(r), "train_logprob": float(t), "diff": float(t - r),
                "p_rollout": math.exp(r), "p_train": math.exp(t),
                "before": [int(tok) for p, tok in around if p < pos], "after": [int(tok) for p, tok in around if p > pos],
                "start": pos == lo, "end": pos == hi,
            })
        return rows
