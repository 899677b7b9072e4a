"""The passes the report makes over a dump's Parquet files, in numpy, in bounded memory.

``full_pass`` reads the six columns the report needs once and keeps only aggregates: per sequence run (the
monitor's sums and extremes), per step (the monitor's histogram and probability buckets, its invalid rows), per
position, per (probability bin, fine bin of d) counts, and the rows with the largest |d|. ``narrow_pass`` reads the
two log-prob columns again (and the key columns of a file whose footer does not rule out a null key: ``_read``) and
keeps only the rows of a few fine bins (``report.bins``): the exact quantiles and the histogram bins an edge cuts.
Both read the files in chunks of ``CHUNK_ROWS`` rows (a large file a row group at a time) on ``threads`` threads
(numpy and the Parquet reader release the GIL), so memory is a few chunks whatever the dump's size.

A valid row is one the monitor counts: d = train − rollout finite and neither log-prob a placeholder (<=
``INVALID_LOGPROB_THRESHOLD``); a row that lacks a key (step, rank, sequence, position: null) is invalid too. The
per-token terms are those of the monitor's torch pass (``tim_plugins._mismatch_pass.token_pass``) on float64
inputs, term for term: the k3 series below its bound, expm1 above, ρ = exp(d) as the IS weights, the same histogram
and bucket rules.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tim_plugins.report import bins as B

__all__ = ["CHUNK_ROWS", "TOP_ROWS", "FULL_COLUMNS", "NARROW_COLUMNS", "FullPass", "UnreadableFile", "full_pass",
           "narrow_pass", "available_cores"]

CHUNK_ROWS = 1 << 18
# Rows per numpy step: each of a step's ~20 float64 temporaries then fits a core's L2 cache (256 KB); 8x as many
# rows run ~2.5x slower (measured on 2 cores: 80 against 200 ns a row for the full pass).
SLICE_ROWS = 1 << 15
# Rows with the largest |d| kept by the full pass (the largest disagreements' candidates).
TOP_ROWS = 256
FULL_COLUMNS = ("step", "rank", "sequence", "position", "rollout_logprob", "train_logprob")
NARROW_COLUMNS = ("rollout_logprob", "train_logprob")
_INT_KEYS = ("step", "rank", "sequence", "position")
# The step ``_read`` gives a row whose step is null: no dump step (the file names' steps are >= 0, and a valid row
# never has it: a null key makes the row invalid), so the invalid rows of each step can leave it out.
NO_STEP = int(np.iinfo(np.int64).min)
_LOGPROBS = ("rollout_logprob", "train_logprob")
# Per sequence run: the sums, then the extremes (in this order in ``FullPass.runs``).
RUN_SUMS = ("n", "sum_d", "sum_a", "abs_p", "k3", "lin", "ser", "rho_m1_sq", "outside", "is_n", "is_w", "is_w2",
            "is_masked")
RUN_MAX = ("d_max", "abs_p_max", "w_max")
RUN_MIN = ("d_min", "w_min")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _may_hold_nulls(reader, names) -> bool:
    """Whether any of the columns ``names`` of the open Parquet file ``reader`` may hold a null, from its footer
    alone: a required column never does; else every row group's null count must say 0 (a writer may leave the
    statistics out: then it may)."""
    meta = reader.metadata
    index = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    for name in names:
        j = index.get(name)
        if j is None:
            return True  # not there: the read fails as it would have
        if meta.schema.column(j).max_definition_level == 0:
            continue
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(j).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return True
    return False


def _read(path: str, columns, chunk_rows: int):
    """The file's ``columns`` in chunks of at most ``chunk_rows`` rows ({column: array}), a row group at a time:
    a file larger than memory is never read whole. A row with a null log-prob or a null key is invalid: its
    log-probs read as NaN, in every pass (a pass that asks for the log-probs alone reads the keys as well where the
    file may hold a null one), so that the passes see the same valid rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # pre_buffer off: with it (pyarrow's default) the reader caches every row group's bytes until the file is closed
    reader = pq.ParquetFile(path, pre_buffer=False)
    read = list(columns)
    if any(name in _LOGPROBS for name in columns):
        # the narrow passes read the log-probs alone, to be cheap: the keys only where the footer does not rule out
        # a null one (a writer of ours never leaves one), else they would keep rows the full pass left out
        absent = [name for name in _INT_KEYS if name not in columns]
        if absent and _may_hold_nulls(reader, absent):
            read += absent
    for batch in reader.iter_batches(batch_size=chunk_rows, columns=read, use_threads=False):
        out, keyless = {}, None
        for name in read:
            col = batch.column(name)
            if col.null_count:  # a null log-prob is an invalid row; so is a null key (no sequence to show it in)
                if name in _INT_KEYS:
                    nulls = col.is_null().to_numpy(zero_copy_only=False)
                    keyless = nulls if keyless is None else keyless | nulls
                if name == "step":  # NO_STEP: such a row is in no step's count of invalid rows
                    col = col.cast(pa.int64(), safe=False).fill_null(pa.scalar(NO_STEP, pa.int64()))
                else:
                    col = col.fill_null(pa.scalar(-1 if name in _INT_KEYS else math.nan, col.type))
            if name in columns:  # a key read only for its nulls is not converted
                out[name] = col.to_numpy(zero_copy_only=False)
        if keyless is not None:
            for name in _LOGPROBS:
                if name in out:
                    out[name] = np.where(keyless, math.nan, out[name])
        yield out


class UnreadableFile(Exception):
    """A file whose footer read (``query.readable``) but whose data does not: a copy damaged in its middle. The
    pass that met it is void (it holds part of the file); ``query.Dump.full`` makes it again without the file."""

    def __init__(self, path: str, err: Exception) -> None:
        super().__init__(f"{path}: {err}")
        self.path, self.why = path, str(err).splitlines()[0][:120] if str(err) else type(err).__name__


def _each_chunk(files: list[str], columns, threads: int, make, chunk_rows: int | None = None, per_file=None) -> list:
    """Read ``files`` on ``threads`` threads, each feeding chunks of about ``chunk_rows`` rows ({column: array};
    default ``CHUNK_ROWS``) to its own accumulator (``make()``, with ``add``); returns the accumulators. A file is
    read a chunk at a time, never whole. ``per_file(i, columns)``, if given, sees each chunk of file ``i``'s
    columns as read."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    lock = threading.Lock()
    queue = iter(range(len(files)))

    def work():
        acc, buf, n = make(), [], 0
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                break
            try:
                for cols in _read(files[i], columns, chunk_rows):
                    if per_file is not None:
                        per_file(i, cols)
                    buf.append(cols)
                    n += cols[columns[0]].size
                    if n >= chunk_rows:
                        acc.add(_concat(buf, columns))
                        buf, n = [], 0
            except (OSError, ValueError) as err:  # pyarrow's errors are these: a damaged page
                raise UnreadableFile(files[i], err) from err
        if buf:
            acc.add(_concat(buf, columns))
        return acc

    threads = max(1, min(threads, len(files)))
    if threads == 1:
        return [work()]
    with ThreadPoolExecutor(threads, thread_name_prefix="tim-report") as pool:
        futures = [pool.submit(work) for _ in range(threads)]
        return [f.result() for f in futures]


def _slices(cols: dict):
    """``cols`` in slices of ``SLICE_ROWS`` rows."""
    n = next(iter(cols.values())).size
    if n <= SLICE_ROWS:
        yield cols
        return
    for i in range(0, n, SLICE_ROWS):
        yield {k: v[i:i + SLICE_ROWS] for k, v in cols.items()}


def _concat(buf: list[dict], columns) -> dict[str, np.ndarray]:
    if len(buf) == 1:
        return buf[0]
    return {c: np.concatenate([b[c] for b in buf]) for c in columns}


def _valid(cols: dict, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(rollout, train, d = train − rollout) of the valid rows in float64, and the valid mask (None if every row
    is valid)."""
    r, t = cols["rollout_logprob"].astype(np.float64), cols["train_logprob"].astype(np.float64)
    d = t - r
    ok = np.isfinite(d) & (r > threshold) & (t > threshold)
    if ok.all():
        return r, t, d, None
    return r[ok], t[ok], d[ok], ok


@dataclass
class FullPass:
    """What the full pass keeps of a dump.

    ``rows``: rows read; ``runs``: per sequence (sorted by step, rank, sequence) {"step", "rank", "sequence",
    RUN_SUMS, RUN_MAX, RUN_MIN}; ``steps``: {step: (signed histogram counts, bucket counts, bucket Σ|d|)} of the
    monitor; ``positions``, ``position_n``, ``position_abs``; ``fine``: counts per (probability bin of
    ``figures.PROB_EDGES``, signed fine bin), int64 [bins, ``bins.N_SIGNED``]; ``prob_abs``: Σ|d| per probability
    bin; ``abs_min_pos``: the smallest |d| > 0 (inf if none); ``top``: the ``TOP_ROWS`` valid rows with the
    largest |d| (ties by step, rank, sequence, position) as {"a", "step", "rank", "sequence", "position", "r",
    "t"}; ``file_keys``: per file, (smallest step, largest step, smallest rank, largest rank) of its rows (None
    for a file without rows); ``invalid_steps``: {step: invalid rows} of each step with one (a row without a step
    is in none: ``rows − size − Σ invalid_steps``), the monitor's ``tim/invalid_tokens``."""

    rows: int
    runs: dict
    steps: dict
    positions: np.ndarray
    position_n: np.ndarray
    position_abs: np.ndarray
    fine: np.ndarray
    prob_abs: np.ndarray
    abs_min_pos: float
    top: dict
    file_keys: list = field(default_factory=list)
    invalid_steps: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.runs["n"].sum()) if self.runs["n"].size else 0


@dataclass
class _Terms:
    """The constants of the per-token terms (from the monitor's layout), resolved once."""

    threshold: float
    bound: float
    series: tuple[float, ...]
    log_band: tuple[float, float]
    bucket_logs: np.ndarray
    hist_lo: float
    per_decade: int
    hist_centre: int
    n_hist: int
    n_buckets: int
    prob_edges: np.ndarray


def _terms() -> _Terms:
    from tim_plugins._mismatch_layout import (DEFAULT_RATIO_BAND, HISTOGRAM_BINS_PER_DECADE, HISTOGRAM_RANGE,
                                              INVALID_LOGPROB_THRESHOLD, K3_SERIES, K3_SERIES_BOUNDS, N_BUCKETS,
                                              N_SIGNED_BINS, PROB_BUCKET_EDGES)
    from tim_plugins.report.figures import PROB_EDGES

    return _Terms(INVALID_LOGPROB_THRESHOLD, K3_SERIES_BOUNDS["float64"], K3_SERIES,
                  (math.log(DEFAULT_RATIO_BAND[0]), math.log(DEFAULT_RATIO_BAND[1])),
                  np.array([math.log(e) for e in PROB_BUCKET_EDGES[1:-1]]), math.log10(HISTOGRAM_RANGE[0]),
                  HISTOGRAM_BINS_PER_DECADE, (N_SIGNED_BINS - 1) // 2, N_SIGNED_BINS, N_BUCKETS,
                  np.asarray(PROB_EDGES, dtype=np.float64))


def prob_bin(r: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of 1 − p among ``edges`` (p = exp(r); 1 − p held in [1e-7, 1], values beyond the edges in the end bins):
    ``np.digitize`` then clip, as the figure bins it."""
    q = np.clip(-np.expm1(r), 1e-7, 1.0)
    return np.clip(np.digitize(q, edges) - 1, 0, len(edges) - 2)


def prob_bin_from(p: np.ndarray, r: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``prob_bin`` for many rows, from p = exp(r) already computed: the bin from log10(1 − p) among the
    log-spaced ``edges``, exact but for rows whose estimate lies within 1e-7 of a bin's edge, which take
    ``prob_bin`` (expm1 and a binary search per row cost several times more). 1 − p is within 1.2e-16 / (1 − p)
    relative of −expm1(r) (the rounding of p), so its log-bin index is within 2e-9 over 1 − p >= 1e-7; below that
    1 − p is held at 1e-7 (the first bin) either way."""
    nb = len(edges) - 1
    lo, hi = math.log10(edges[0]), math.log10(edges[-1])
    q = 1.0 - p
    np.maximum(q, edges[0], out=q)
    x = np.log10(q)
    x -= lo
    x *= nb / (hi - lo)
    k = np.floor(x)
    x -= k  # the estimate's distance above its bin's lower edge, in bins
    near = (x < 1e-7) | (x > 1 - 1e-7)
    near &= q > edges[0] * (1 + 1e-7)  # held at the first edge: the first bin, exactly
    np.minimum(k, nb - 1, out=k)
    k = k.astype(np.int64)
    fix = np.flatnonzero(near)
    if fix.size:
        k[fix] = prob_bin(r[fix], edges)
    return k


class _Full:
    """One thread's accumulator of the full pass."""

    def __init__(self, terms: _Terms) -> None:
        self.c = terms
        self.rows = 0
        self.runs: list[dict] = []
        self.steps: dict = {}
        self.pos_n = np.zeros(0, dtype=np.int64)
        self.pos_abs = np.zeros(0)
        self.pos_extra: dict = {}  # positions outside [0, 2^24): {position: [n, Σ|d|]}
        nb = len(terms.prob_edges) - 1
        self.fine = np.zeros(nb * B.N_SIGNED, dtype=np.int64)
        self.prob_abs = np.zeros(nb)
        self.abs_min_pos = math.inf
        self.top: dict | None = None
        self.invalid_steps: dict = {}  # {step: invalid rows}

    def add(self, cols: dict) -> None:
        # the monitor's float semantics: ρ − 1 and its square overflow to inf past d ≈ 354 / 709
        with np.errstate(over="ignore", invalid="ignore"):
            for part in _slices(cols):
                self._add(part)

    def _add(self, cols: dict) -> None:
        c = self.c
        r, t, d, ok = _valid(cols, c.threshold)
        self.rows += cols["rollout_logprob"].size
        if ok is not None:  # counted before the valid rows: a step whose every row is invalid is still a step
            bad = cols["step"][~ok]
            bad = bad[bad != NO_STEP]
            if bad.size:
                at, n = np.unique(bad, return_counts=True)
                for s, k in zip(at.tolist(), n.tolist()):
                    self.invalid_steps[s] = self.invalid_steps.get(s, 0) + k
        if not d.size:
            return
        keys = {k: cols[k] if ok is None else cols[k][ok] for k in _INT_KEYS}
        starts = _run_starts(keys)
        if starts.size > max(64, d.size // 8):  # rows not grouped by sequence: sort them
            order = np.lexsort((keys["sequence"], keys["rank"], keys["step"]))
            r, t, d = r[order], t[order], d[order]
            keys = {k: v[order] for k, v in keys.items()}
            starts = _run_starts(keys)
        step, rank, seq, pos = (keys[k] for k in _INT_KEYS)
        lengths = np.diff(np.append(starts, d.size))
        a = np.abs(d)
        # the monitor's per-token terms (``_mismatch_pass.token_pass``, float64), in place where they can be
        small = a < c.bound
        cl = np.maximum(d, -c.bound)
        np.minimum(cl, c.bound, out=cl)
        ser = cl * c.series[-1]
        ser += c.series[-2]
        for coef in reversed(c.series[:-2]):
            ser *= cl
            ser += coef
        ser *= cl
        ser *= cl
        if small.all():  # linear = d, and k3 = (linear − d) + series = series
            lin, k3 = d, ser
        else:
            ser *= small
            lin = np.where(small, d, np.expm1(d))
            k3 = (lin - d) + ser
        rm1 = lin + ser
        p = np.exp(r)
        # |p_train − p_rollout| = e^max(r, t) · (1 − e^−|d|), as the monitor computes it (``_mismatch_pass``
        # says why): no 0 · inf where e^r underflows and ρ − 1 overflows
        up = d > 0
        with np.errstate(divide="ignore"):  # 1/(ρ − 1) at d = 0, where the other branch is taken
            abs_p = np.where(up, 1.0 / (1.0 + 1.0 / rm1), -rm1)
        abs_p *= np.exp(np.where(up, t, r))
        w = np.exp(d)
        outside = d < c.log_band[0]
        outside |= d > c.log_band[1]
        add = lambda x: np.add.reduceat(x, starts)  # noqa: E731
        run = {"step": step[starts], "rank": rank[starts], "sequence": seq[starts], "n": lengths.astype(np.float64),
               "sum_d": add(d), "sum_a": add(a), "abs_p": add(abs_p), "k3": add(k3), "lin": add(lin),
               "ser": add(ser), "rho_m1_sq": add(rm1 * rm1),
               "outside": np.add.reduceat(outside, starts, dtype=np.float64),
               "d_max": np.maximum.reduceat(d, starts), "d_min": np.minimum.reduceat(d, starts),
               "abs_p_max": np.maximum.reduceat(abs_p, starts)}
        if np.isfinite(w).all() and w.min() > 0:  # ρ = exp(d) is monotone in d: its extremes are those of d
            run.update(is_n=run["n"], is_w=add(w), is_w2=add(w * w), is_masked=np.zeros(starts.size),
                       w_max=np.exp(run["d_max"]), w_min=np.exp(run["d_min"]))
        else:  # ρ overflows (d > ~709.8) or underflows to 0: the monitor skips non-finite weights
            w_ok = np.isfinite(w)
            wz = np.where(w_ok, w, 0.0)
            run.update(is_n=np.add.reduceat(w_ok, starts, dtype=np.float64), is_w=add(wz), is_w2=add(wz * wz),
                       is_masked=np.add.reduceat(w_ok & (wz == 0), starts, dtype=np.float64),
                       w_max=np.maximum.reduceat(np.where(w_ok, w, -math.inf), starts),
                       w_min=np.minimum.reduceat(np.where(w_ok, w, math.inf), starts))
        self.runs.append(run)
        # the monitor's signed |d| histogram (sign(d) · bin of |d|, as copysign) and probability buckets, per step
        with np.errstate(divide="ignore"):
            lg = np.log10(a)  # −inf at d = 0
        hbin = lg - c.hist_lo
        hbin *= c.per_decade
        np.floor(hbin, out=hbin)
        hbin += 1
        np.maximum(hbin, 0, out=hbin)
        np.minimum(hbin, c.hist_centre, out=hbin)
        np.copysign(hbin, d, out=hbin)
        hbin += c.hist_centre
        hbin = hbin.astype(np.int64)
        bucket = (r >= c.bucket_logs[0]).view(np.int8).astype(np.int64)
        for e in c.bucket_logs[1:]:
            bucket += (r >= e).view(np.int8)
        run_steps, step_of_run = np.unique(run["step"], return_inverse=True)
        if run_steps.size > 1:
            sidx = np.repeat(step_of_run, lengths)
            hbin += sidx * c.n_hist
            bucket += sidx * c.n_buckets
        hist = np.bincount(hbin, minlength=run_steps.size * c.n_hist).reshape(run_steps.size, c.n_hist)
        bucket_n = np.bincount(bucket, minlength=run_steps.size * c.n_buckets)
        bucket_a = np.bincount(bucket, a, minlength=run_steps.size * c.n_buckets)
        for i, s in enumerate(run_steps.tolist()):
            sl = slice(i * c.n_buckets, (i + 1) * c.n_buckets)
            acc = self.steps.get(s)
            if acc is None:
                self.steps[s] = [hist[i].copy(), bucket_n[sl].copy(), bucket_a[sl].copy()]
            else:
                acc[0] += hist[i]
                acc[1] += bucket_n[sl]
                acc[2] += bucket_a[sl]
        # per position
        if pos.min() >= 0 and pos.max() < 1 << 24:
            size = int(pos.max()) + 1
            if size > self.pos_n.size:
                self.pos_n = np.concatenate([self.pos_n, np.zeros(size - self.pos_n.size, dtype=np.int64)])
                self.pos_abs = np.concatenate([self.pos_abs, np.zeros(size - self.pos_abs.size)])
            self.pos_n[:size] += np.bincount(pos, minlength=size)
            self.pos_abs[:size] += np.bincount(pos, a, minlength=size)
        else:
            u, inv = np.unique(pos, return_inverse=True)
            for at, k, sa in zip(u.tolist(), np.bincount(inv).tolist(), np.bincount(inv, a).tolist()):
                e = self.pos_extra.setdefault(at, [0, 0.0])
                e[0] += k
                e[1] += sa
        # fine bins per probability bin
        b = prob_bin_from(p, r, c.prob_edges)
        np.add.at(self.fine, b * B.N_SIGNED + B.signed_bin(d, B.magnitude_bin(a, lg)), 1)
        self.prob_abs += np.bincount(b, a, minlength=self.prob_abs.size)
        self.abs_min_pos = min(self.abs_min_pos, float(np.min(a, where=a > 0, initial=math.inf)))
        # largest |d|: only rows that sort before the last one kept can enter
        cand = {"a": a, "step": step, "rank": rank, "sequence": seq, "position": pos, "r": r, "t": t}
        if self.top is not None and self.top["a"].size >= TOP_ROWS:
            pick = _before(cand, {k: v[-1] for k, v in self.top.items()})
        else:
            pick = np.arange(a.size)
        if pick.size:
            if pick.size > 4 * TOP_ROWS:  # a first reduction: the TOP_ROWS-th largest |d| and all rows at or above
                kth = np.partition(a[pick], pick.size - TOP_ROWS)[pick.size - TOP_ROWS]
                pick = pick[a[pick] >= kth]
            cand = {k: v[pick] for k, v in cand.items()}
            self.top = _top(cand if self.top is None else {k: np.concatenate([self.top[k], cand[k]])
                                                            for k in cand})

    def merge(self, other: "_Full") -> None:
        self.rows += other.rows
        self.runs += other.runs
        for s, k in other.invalid_steps.items():
            self.invalid_steps[s] = self.invalid_steps.get(s, 0) + k
        for s, (h, bn, ba) in other.steps.items():
            acc = self.steps.get(s)
            if acc is None:
                self.steps[s] = [h, bn, ba]
            else:
                acc[0] += h
                acc[1] += bn
                acc[2] += ba
        if other.pos_n.size > self.pos_n.size:
            self.pos_n, other.pos_n = other.pos_n, self.pos_n
            self.pos_abs, other.pos_abs = other.pos_abs, self.pos_abs
        self.pos_n[:other.pos_n.size] += other.pos_n
        self.pos_abs[:other.pos_abs.size] += other.pos_abs
        for p, (k, s) in other.pos_extra.items():
            e = self.pos_extra.setdefault(p, [0, 0.0])
            e[0] += k
            e[1] += s
        self.fine += other.fine
        self.prob_abs += other.prob_abs
        self.abs_min_pos = min(self.abs_min_pos, other.abs_min_pos)
        if other.top is not None:
            self.top = other.top if self.top is None else _top({k: np.concatenate([self.top[k], other.top[k]])
                                                                 for k in self.top})

    def result(self) -> FullPass:
        runs = _merge_runs(self.runs)
        pos_n, pos_abs = self.pos_n, self.pos_abs
        positions = np.flatnonzero(pos_n)
        pn, pa = pos_n[positions], pos_abs[positions]
        if self.pos_extra:
            extra = sorted(self.pos_extra.items())
            positions = np.concatenate([positions, [p for p, _ in extra]])
            pn = np.concatenate([pn, [e[0] for _, e in extra]])
            pa = np.concatenate([pa, [e[1] for _, e in extra]])
            order = np.argsort(positions, kind="stable")
            positions, pn, pa = positions[order], pn[order], pa[order]
        nb = self.prob_abs.size
        top = self.top if self.top is not None else {k: np.zeros(0) for k in
                                                      ("a", "step", "rank", "sequence", "position", "r", "t")}
        return FullPass(self.rows, runs, self.steps, positions.astype(np.int64), pn.astype(np.int64),
                        pa.astype(np.float64), self.fine.reshape(nb, B.N_SIGNED), self.prob_abs, self.abs_min_pos,
                        top, invalid_steps=dict(sorted(self.invalid_steps.items())))


def _run_starts(keys: dict) -> np.ndarray:
    """First row of each run of equal (step, rank, sequence)."""
    step, rank, seq = keys["step"], keys["rank"], keys["sequence"]
    change = (seq[1:] != seq[:-1]) | (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
    return np.concatenate([[0], np.flatnonzero(change) + 1])


def _before(c: dict, last: dict) -> np.ndarray:
    """Rows of ``c`` that sort before the row ``last`` (|d| descending, then step, rank, sequence, position)."""
    a0 = last["a"]
    pick = c["a"] > a0
    tie = np.flatnonzero(c["a"] == a0)
    if tie.size:
        less = np.zeros(tie.size, dtype=bool)
        same = np.ones(tie.size, dtype=bool)
        for k in ("step", "rank", "sequence", "position"):
            v = c[k][tie]
            less |= same & (v < last[k])
            same &= v == last[k]
        pick[tie] = less
    return np.flatnonzero(pick)


def _top(c: dict) -> dict:
    """The ``TOP_ROWS`` rows of ``c`` with the largest |d|, ties in (step, rank, sequence, position) order."""
    order = np.lexsort((c["position"], c["sequence"], c["rank"], c["step"], -c["a"]))[:TOP_ROWS]
    return {k: v[order] for k, v in c.items()}


def _merge_runs(parts: list[dict]) -> dict:
    """One record per sequence (sorted by step, rank, sequence) from the runs of every chunk: a sequence split
    across chunks adds its sums and takes its extremes."""
    keys = ("step", "rank", "sequence")
    if not parts:
        return {k: np.zeros(0, dtype=np.int64 if k in keys else np.float64) for k in
                keys + RUN_SUMS + RUN_MAX + RUN_MIN}
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((cat["sequence"], cat["rank"], cat["step"]))
    cat = {k: v[order] for k, v in cat.items()}
    step, rank, seq = cat["step"], cat["rank"], cat["sequence"]
    change = (seq[1:] != seq[:-1]) | (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
    if change.all():
        return {k: (v.astype(np.int64) if k in keys else v) for k, v in cat.items()}
    starts = np.concatenate([[0], np.flatnonzero(change) + 1])
    out = {k: cat[k][starts].astype(np.int64) for k in keys}
    out.update({k: np.add.reduceat(cat[k], starts) for k in RUN_SUMS})
    out.update({k: np.maximum.reduceat(cat[k], starts) for k in RUN_MAX})
    out.update({k: np.minimum.reduceat(cat[k], starts) for k in RUN_MIN})
    return out


def full_pass(files: list[str], threads: int) -> FullPass:
    """The full pass over ``files`` (the dump's snapshot) on ``threads`` threads."""
    terms = _terms()
    keys: list = [None] * len(files)

    def per_file(i, cols):  # each chunk of file i (one thread reads a file)
        step, rank = cols["step"], cols["rank"]
        if (step == NO_STEP).any():  # rows without a step: no step to look the file up by
            step, rank = step[step != NO_STEP], rank[step != NO_STEP]
        if step.size:
            k = (int(step.min()), int(step.max()), int(rank.min()), int(rank.max()))
            had = keys[i]
            keys[i] = k if had is None else (min(had[0], k[0]), max(had[1], k[1]), min(had[2], k[2]),
                                             max(had[3], k[3]))

    accs = _each_chunk(files, FULL_COLUMNS, threads, lambda: _Full(terms), per_file=per_file)
    first = accs[0]
    for other in accs[1:]:
        first.merge(other)
    out = first.result()
    out.file_keys = keys
    return out


class _Narrow:
    """One thread's accumulator of a narrow pass: the rows of the requests' fine bins, each request served."""

    def __init__(self, requests: list, terms: _Terms) -> None:
        self.c = terms
        self.requests = requests
        nb = len(terms.prob_edges) - 1
        # Which requests want a row: bit j % 64 of word j // 64, by signed bin (any probability bin) and by
        # (probability bin, signed bin): one lookup a row whatever the number of requests.
        words = max(1, -(-len(requests) // 64))
        self.by_signed = np.zeros((words, B.N_SIGNED), dtype=np.uint64)
        self.by_pair = np.zeros((words, nb, B.N_SIGNED), dtype=np.uint64)
        for j, req in enumerate(requests):
            bit = np.uint64(1 << (j % 64))
            self.by_signed[j // 64, list(req.rows.signed)] |= bit
            if req.rows.pairs:
                pb, ps = zip(*req.rows.pairs)
                self.by_pair[j // 64, list(pb), list(ps)] |= bit
        self.in_pair = self.by_pair.any(axis=(0, 1))  # signed bins some (probability bin, signed bin) wants
        self.wanted = self.by_signed.any(axis=0) | self.in_pair
        self.coarse = B.coarse_table(self.wanted)
        self.edges = [np.asarray(req.edges, dtype=np.float64) if isinstance(req, B.Histogram) else None
                      for req in requests]
        self.out: list = [self._empty(req) for req in requests]

    @staticmethod
    def _empty(req):
        if isinstance(req, B.Collect):
            return []
        if isinstance(req, B.Count):
            return [np.zeros(req.parts, dtype=np.int64), np.full(req.parts, math.inf), np.full(req.parts, -math.inf)]
        return [np.zeros(len(req.edges) - 1, dtype=np.int64), 0, 0]

    def add(self, cols: dict) -> None:
        for part in _slices(cols):
            self._add(part)

    def _add(self, cols: dict) -> None:
        c = self.c
        r, t = cols["rollout_logprob"].astype(np.float64), cols["train_logprob"].astype(np.float64)
        d = t - r
        # the rows of the wanted bins' coarse cells (a shift and a lookup a row), then their exact bins
        near = np.flatnonzero(self.coarse[B.coarse_key(d)])
        if not near.size:
            return
        r, t, d = r[near], t[near], d[near]
        ok = (r > c.threshold) & (t > c.threshold)  # d is finite in a wanted cell
        if not ok.all():
            r, d = r[ok], d[ok]
        a = np.abs(d)
        with np.errstate(divide="ignore"):
            s = B.signed_bin(d, B.magnitude_bin(a, np.log10(a)))
        pick = np.flatnonzero(self.wanted[s])
        if not pick.size:
            return
        d, a, s = d[pick], a[pick], s[pick]
        bits = self.by_signed[:, s]
        paired = np.flatnonzero(self.in_pair[s])
        if paired.size:
            b = prob_bin(r[pick[paired]], c.prob_edges)
            bits[:, paired] |= self.by_pair[:, b, s[paired]]
        for w, present in enumerate(np.bitwise_or.reduce(bits, axis=1).tolist()):
            while present:
                low = present & -present
                present ^= low
                j = w * 64 + low.bit_length() - 1
                self._serve(j, (bits[w] & np.uint64(low)) != 0, a, d)

    def _serve(self, j: int, mine: np.ndarray, a: np.ndarray, d: np.ndarray) -> None:
        req, out = self.requests[j], self.out[j]
        v = (a if req.rows.value == "a" else d)[mine]
        for lo, hi, parts, part in req.rows.levels:
            v = v[B.sub_bin(v, lo, hi, parts) == part]
        if isinstance(req, B.Collect):
            out.append(v)
        elif isinstance(req, B.Count):
            k = B.sub_bin(v, req.lo, req.hi, req.parts)
            out[0] += np.bincount(k, minlength=req.parts)
            np.minimum.at(out[1], k, v)
            np.maximum.at(out[2], k, v)
        else:
            _histogram_add(req, self.edges[j], v, out)

    def merge(self, other: "_Narrow") -> None:
        for req, out, o in zip(self.requests, self.out, other.out):
            if isinstance(req, B.Collect):
                out += o
            elif isinstance(req, B.Count):
                out[0] += o[0]
                np.minimum(out[1], o[1], out=out[1])
                np.maximum(out[2], o[2], out=out[2])
            else:
                out[0] += o[0]
                out[1] += o[1]
                out[2] += o[2]

    def result(self) -> list:
        res = []
        for req, out in zip(self.requests, self.out):
            if isinstance(req, B.Collect):
                res.append(np.concatenate(out) if out else np.zeros(0))
            else:
                res.append(tuple(out))
        return res


def _histogram_add(req: "B.Histogram", edges: np.ndarray, v: np.ndarray, out: list) -> None:
    nb = len(edges) - 1
    if req.window is not None:
        lo_d, hi_d = req.window
        below, above = v < lo_d, v > hi_d
        out[1] += int(below.sum())
        out[2] += int(above.sum())
        v = np.clip(np.exp(v[~(below | above)]), edges[0], edges[-1])
    idx = B.histogram_index(v, edges)
    out[0] += np.bincount(idx[(idx >= 0) & (idx < nb)], minlength=nb)


def narrow_pass(files: list[str], threads: int, requests: list) -> list:
    """One narrow pass over ``files``: each request's result (``bins.Collect``: the values; ``bins.Count``:
    (counts, minima, maxima); ``bins.Histogram``: (counts, below, above) of the rows asked for)."""
    if not requests:
        return []
    terms = _terms()
    accs = _each_chunk(files, NARROW_COLUMNS, threads, lambda: _Narrow(requests, terms))
    first = accs[0]
    for other in accs[1:]:
        first.merge(other)
    return first.result()
