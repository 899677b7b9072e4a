"""The report's per-token statistics over a dump's Parquet files, in bounded memory and few passes.

A dump holds one row per sampled token (``tim_plugins.dump``): a real run's is far larger than memory (1,000 steps ×
8 ranks × 13 sequences × 2,000 tokens is ~200 M rows). Nothing here reads it whole. A ``Dump`` reads its files in
at most three passes (``report.scan``), each keeping only aggregates:

- one full pass over the six columns the report uses: the monitor's state per sequence and per step, counts and
  Σ|d| per position, counts per (probability bin, fine bin of d), and the rows with the largest |d| (with each
  file's step and rank range, so their context is read from those files alone);
- one narrow pass over the two log-prob columns (and the keys of a file that may lack one: the same valid rows as
  the full pass), keeping only the rows of the few fine bins that hold a quantile or that a histogram edge cuts
  (``report.bins``): the exact p99 per probability bin, the ρ quantiles, the |Δ| histogram;
- one more narrow pass for the ρ panels, whose edges depend on those quantiles.

``Dump.passes`` counts them. The rows read are a snapshot taken once per ``Dump``: the complete
``step_*-rank_*.parquet`` files present at that moment. The writer writes each file under a temporary name and
renames it into place (``TokenDumper.write``), so a file being written is not listed, and one that appears later
is not read; the files listed are read through hard links (``Engine.pin``), so one that a resumed run replaces or
removes meanwhile is read as listed: every figure of a report describes the same rows, also while the run goes on.

What the report computes from the rows, and how it matches the in-memory computation it replaces:

- the core monitor's metrics per step and over all steps: the monitor's additive state (``_mismatch_layout``:
  sums, maxima, histogram counts) per step, then ``_mismatch_derive._derive``, the one place each metric's
  formula lives, exactly as ``mismatch_metrics`` on the same rows would (the same float64 terms; sums in another
  order, so equal to float rounding);
- the figures' data: binned counts and sums, per-sequence and per-position sums, and exact quantiles and
  histogram counts (``report.bins``), never a sample.

The largest disagreements' context comes from a DuckDB query over the few files that hold them (``Engine``: its
memory capped by ``memory_limit``, spilling to a temporary folder beyond it, its threads by ``threads`` up to
``DUCKDB_MAX_THREADS``; ``threads`` also sets the passes' threads).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tim_plugins._optional import require
from tim_plugins.dump import dump_files
from tim_plugins.report import bins as B

__all__ = ["DEFAULT_MEMORY_LIMIT", "DEFAULT_THREADS", "MEMORY_LIMIT_ENV", "FETCH_ROWS", "Engine", "Dump", "engine",
           "snapshot", "readable", "open_dump", "parse_memory_limit", "combine", "exp_or_inf"]

# DuckDB's memory cap for the report's queries, and the env variable that overrides it. A query needing more
# spills to a temporary folder; the report's queries are small, so a dump of any size fits under it.
DEFAULT_MEMORY_LIMIT = "1GB"
MEMORY_LIMIT_ENV = "TIM_REPORT_MEMORY_LIMIT"
# None: every core DuckDB sees.
DEFAULT_THREADS: int | None = None
# Rows a narrow pass reads into memory for one order statistic (16 MB of float64): a fine bin holding more is
# narrowed first (``bins.order_statistics``).
FETCH_ROWS = 1 << 21




def _expm1(d: float) -> float:
    """ρ - 1 of a log-ratio ``d``: inf past float64's range (d > ~709.78) instead of an OverflowError."""
    return math.inf if d > 709.78 else math.expm1(d)

def exp_or_inf(x: float) -> float:
    """e^x, inf past float64's range instead of an OverflowError (a log-prob far above 0 is garbage, e.g. from a
    damaged dump file; the dump's and the tensors' largest disagreements both use it)."""
    return math.inf if x > 709.78 else math.exp(x)


def snapshot(folder: str | os.PathLike) -> list[str]:
    """The complete dump files of ``folder`` now (sorted names; the writer renames a finished file into place)."""
    return [str(p) for p in dump_files(folder)]


# The columns every dump file has (``dump.DUMP_COLUMNS`` but the optional entropy), by kind of type.
_KEY_COLUMNS = ("step", "rank", "sequence", "position", "token_id")
_LOGPROB_COLUMNS = ("rollout_logprob", "train_logprob")


def readable(files: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the files of ``files`` a pass can read, [(name, why) of the others]): a file whose Parquet footer does not
    read (torn or empty: a crashed run's copy, a full disk) or that lacks a dump column is skipped, not read."""
    import pyarrow.parquet as pq
    import pyarrow.types as pt

    ok, skipped = [], []
    for path in files:
        try:
            schema = pq.ParquetFile(path).schema_arrow
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, a vanished file an OSError
            skipped.append((Path(path).name, f"not a readable Parquet file ({str(err).splitlines()[0][:120]})"))
            continue
        bad = [name for name in _KEY_COLUMNS if schema.get_field_index(name) < 0
               or not pt.is_integer(schema.field(name).type)]
        bad += [name for name in _LOGPROB_COLUMNS if schema.get_field_index(name) < 0
                or not pt.is_floating(schema.field(name).type)]
        if bad:
            skipped.append((Path(path).name, "not a dump file: column(s) missing or not numeric: "
                            + ", ".join(bad)))
            continue
        ok.append(path)
    return ok, skipped


# The smallest memory limit: the largest disagreements' context query, reading up to one file per row shown on up to
# DUCKDB_MAX_THREADS threads of 256 KiB blocks, ran out of memory under 4MB on 30 files; 16MB leaves it room.
MIN_MEMORY_LIMIT = 16 * 10**6  # 16MB
# DuckDB's threads: it runs that one query of a few thousand rows, whose memory grows with its threads.
DUCKDB_MAX_THREADS = 8
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30, "tb": 10**12,
          "tib": 2**40}


def parse_memory_limit(value) -> str:
    """``value`` (bytes as an int, or DuckDB's "1GB" / "500MB" form; at least ``MIN_MEMORY_LIMIT``) as DuckDB's
    setting; env / default if None."""
    value = os.environ.get(MEMORY_LIMIT_ENV, DEFAULT_MEMORY_LIMIT) if value is None else value
    size = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size, text = value, f"{int(value)}B"
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)\s*", value, re.I)
        if m:
            size, text = float(m[1]) * _UNITS[m[2].lower()], value.strip()
    if size is not None and size >= MIN_MEMORY_LIMIT:
        return text
    raise ValueError(f"memory_limit={value!r} is invalid: it must be a size of at least 16MB such as '1GB' or '500MB' "
                     f"(or bytes as an int); set it with --memory-limit or {MEMORY_LIMIT_ENV}.")


# The report's own folders: its temporary folder (DuckDB's spill, the snapshot's links) in the system's temporary
# folder, else the snapshot's links in a hidden folder of the dump's. Named <prefix><host>-<pid>-<random>, so a later
# report can tell those of a killed report (SIGKILL: no clean-up ran) from a live one's, and remove them: their hard
# links keep the disk space of every file a resumed run replaced or moved aside since.
SPILL_PREFIX = "tim-report-"
SNAPSHOT_PREFIX = ".tim-report-snapshot-"
# A folder of another host (a shared filesystem), or of the older unnamed form, is left alone until this old: no
# report runs a day.
STALE_AFTER_S = 86400


def _own_prefix(prefix: str) -> str:
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale(parent: str | os.PathLike, prefix: str, *, by_age: bool = True) -> list[Path]:
    """Remove the folders of ``parent`` named ``<prefix><host>-<pid>-<random>`` that a dead report left: this host's
    whose process is gone and, ``by_age``, any other's (or an older report's ``<prefix><random>``) older than
    ``STALE_AFTER_S`` (not in the system's temporary folder: a host's own, where a folder of that age and prefix may
    be someone else's). Returns those removed; never raises (a folder it may not remove stays)."""
    removed: list[Path] = []
    host, now = socket.gethostname(), time.time()
    try:
        entries = [p for p in Path(parent).iterdir() if p.name.startswith(prefix) and p.is_dir()]
    except OSError:
        return removed
    for path in entries:
        parts = path.name[len(prefix):].rsplit("-", 2)  # mkdtemp's random part has no "-"; a host name may
        try:
            owner, pid = (parts[0], int(parts[1])) if len(parts) == 3 else (None, None)
            old = now - path.stat().st_mtime > STALE_AFTER_S
        except (ValueError, OSError):
            continue
        if owner == host and pid is not None and os.name == "posix":
            dead = pid != os.getpid() and not _alive(pid)
        else:
            dead = by_age and old
        if dead:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
    return removed


class Engine:
    """A report's settings and its DuckDB connection: ``memory_limit`` caps DuckDB's memory (spilling to a
    temporary folder removed by ``close``), ``threads`` the passes' threads (None: every core) and DuckDB's, up to
    ``DUCKDB_MAX_THREADS``.

    Results are read whole (``fetchall``), never with ``fetchone``: DuckDB 2.0 refuses other work on a connection
    (``register``) while an ``execute()`` result is unfinished."""

    def __init__(self, memory_limit: str | int | None = None, threads: int | None = DEFAULT_THREADS) -> None:
        require("duckdb", "the report of a per-token dump")
        import duckdb

        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r} is invalid: it must be a positive int (or None for every core).")
        self.memory_limit = parse_memory_limit(memory_limit)
        self.threads = threads
        remove_stale(tempfile.gettempdir(), SPILL_PREFIX, by_age=False)
        self._spill = tempfile.mkdtemp(prefix=_own_prefix(SPILL_PREFIX))
        self._pins: list[Path] = []  # folders of the dumps' snapshot links (``pin``), removed by ``close``
        # DuckDB reads the few files of the largest disagreements once: no cache of their bytes (the OS has them)
        config = {"memory_limit": self.memory_limit, "temp_directory": self._spill,
                  "preserve_insertion_order": False, "enable_external_file_cache": False}
        config["threads"] = min(self.workers, DUCKDB_MAX_THREADS)
        self.con = duckdb.connect(":memory:", config=config)

    @property
    def workers(self) -> int:
        """Threads of the passes over the files: ``threads``, else every core this process may use."""
        from tim_plugins.report.scan import available_cores

        return self.threads if self.threads is not None else available_cores()

    def setting(self, name: str):
        return self.con.execute(f"SELECT current_setting('{name}')").fetchall()[0][0]

    def pin(self, files: list[str], folder: Path) -> tuple[list[str], list[tuple[str, str]]]:
        """(hard links to ``files``, [(name, why)] of those gone before they were linked): a writer that replaces or
        removes a file under its name while the report runs (a resumed run redoing a step) leaves the passes
        reading the rows they listed. The links go in the engine's temporary folder, else (another filesystem) in
        a hidden folder of the dump's own (``folder``), both removed by ``close``; where neither takes links, the
        files themselves. A hidden folder a killed report left there is removed first (``remove_stale``); the
        dump's listing never reads one (``dump.dump_files``: the folder's own files only)."""
        remove_stale(folder, SNAPSHOT_PREFIX)  # whichever place this report's links go
        for parent in (Path(self._spill), Path(folder)):
            try:
                where = Path(tempfile.mkdtemp(prefix=_own_prefix(SNAPSHOT_PREFIX), dir=parent))
            except OSError:
                continue
            self._pins.append(where)
            linked, gone = [], []
            try:
                for path in files:
                    target = where / Path(path).name
                    try:
                        os.link(path, target)
                    except FileNotFoundError:
                        gone.append((Path(path).name, "removed before the report read it"))
                        continue
                    linked.append(str(target))
            except OSError:  # another filesystem, or no hard links there: the next place
                shutil.rmtree(where, ignore_errors=True)
                continue
            return linked, gone
        return files, []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.con.close()
        for where in self._pins:
            shutil.rmtree(where, ignore_errors=True)
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


def _sql_list(values) -> str:
    return "(" + ", ".join(str(int(v)) for v in values) + ")"


@dataclass
class Sequences:
    """One row per sequence (ordered by step, rank, sequence): its valid tokens and Σ_t d."""

    step: np.ndarray
    rank: np.ndarray
    sequence: np.ndarray
    length: np.ndarray
    sum_d: np.ndarray


def combine(requests: list, per_dump: list[list]) -> list:
    """Each request's result over several dumps from its result per dump (``Dump.serve``): counts add, extremes
    take the extreme, values concatenate."""
    out = []
    for req, results in zip(requests, zip(*per_dump)):
        if isinstance(req, B.Collect):
            out.append(np.concatenate(results))
        elif isinstance(req, B.Count):
            out.append((sum(r[0] for r in results), np.minimum.reduce([r[1] for r in results]),
                        np.maximum.reduce([r[2] for r in results])))
        else:
            out.append(tuple(sum(r[i] for r in results) for i in range(3)))
    return out


class Dump:
    """The valid rows of a dump folder's snapshot (finite log-probs above the invalid-placeholder threshold), and
    the report's statistics over them.

    Attributes: ``files`` (the snapshot's readable files), ``skipped`` ([(file name, why)] of the snapshot's files
    left out: ``readable``), ``size`` (valid tokens), ``rows`` (rows of the files), ``invalid``
    (rows left out), ``passes`` (passes made over the files: {"full", "narrow", "context"}), ``prepared`` (the
    sets of dumps, by ids, whose figures' first narrow pass this dump made: ``tokens._prepare``)."""

    def __init__(self, folder: str | os.PathLike, eng: Engine) -> None:
        self.folder = Path(folder)
        files = snapshot(self.folder)
        if not files:
            raise FileNotFoundError(f"no dump files (step_*-rank_*.parquet) in {str(folder)!r}: point at the folder "
                                    "the dumper wrote.")
        # linked, so that a file replaced or removed while the report runs is read as listed (``Engine.pin``); a
        # crashed run's torn or empty files are left out (and named on the page), not read
        files, gone = eng.pin(files, self.folder)
        self.files, self.skipped = readable(files)
        self.skipped = gone + self.skipped
        self.engine = eng
        self.con = eng.con
        self.passes = {"full": 0, "narrow": 0, "context": 0}
        self._full = None
        self.context_unread: list[tuple[str, str]] = []  # files whose token ids do not read (_context_rows)
        self._served: dict = {}
        self._cache: dict = {}
        self.prepared: set = set()

    # ------------------------------------------------------------------------------------------------ passes
    def full(self):
        """The full pass (``scan.FullPass``), made once."""
        if self._full is None:
            from tim_plugins.report.scan import UnreadableFile, full_pass

            while self._full is None:
                try:
                    self._full = full_pass(self.files, self.engine.workers)
                except UnreadableFile as err:  # left out like a torn file, and every figure without it
                    self.skipped.append((Path(err.path).name, f"its data does not read ({err.why})"))
                    self.files = [f for f in self.files if f != err.path]
                self.passes["full"] += 1
        return self._full

    def serve(self, requests: list) -> list:
        """Each request's result (``bins.Collect``, ``Count``, ``Histogram``) over this dump: those not served
        yet in one narrow pass."""
        missing = list(dict.fromkeys(r for r in requests if r not in self._served))
        if missing:
            from tim_plugins.report.scan import narrow_pass

            for req, res in zip(missing, narrow_pass(self.files, self.engine.workers, missing)):
                self._served[req] = res
            self.passes["narrow"] += 1
        return [self._served[r] for r in requests]

    @property
    def rows(self) -> int:
        """Rows of the snapshot's files."""
        return self.full().rows

    @property
    def size(self) -> int:
        """Valid tokens."""
        return self.full().size

    @property
    def invalid(self) -> int:
        return self.rows - self.size

    # ------------------------------------------------------------------------------------------ monitor metrics
    def step_states(self) -> tuple[np.ndarray, list[dict]]:
        """(steps, the monitor's unpacked state per step) over the valid rows, each sequence's tokens laid out as
        one row of a [sequences, positions] batch with ρ = exp(d) as the IS weights: what ``mismatch_metrics`` on
        those tensors accumulates. Every step with a row is there: its invalid rows are its ``invalid`` (the
        monitor's ``tim/invalid_tokens``), and a step whose every row is invalid has the state of no valid token
        (``tokens`` 0: ``_derive`` gives NaN metrics), not no entry (a series would draw a line across it)."""
        if "states" in self._cache:
            return self._cache["states"]
        from tim_plugins._mismatch_layout import N_STATE, N_SUMS, unpack

        f = self.full()
        runs = f.runs
        steps, starts = np.unique(runs["step"], return_index=True)
        states = []
        if steps.size:
            add = lambda k: np.add.reduceat(runs[k], starts)  # noqa: E731
            top = lambda k: np.maximum.reduceat(runs[k], starts)  # noqa: E731
            low = lambda k: np.minimum.reduceat(runs[k], starts)  # noqa: E731
            sums = {k: add(k) for k in ("n", "sum_a", "abs_p", "sum_d", "k3", "lin", "ser", "rho_m1_sq", "outside",
                                        "is_n", "is_w", "is_w2", "is_masked")}
            d_max, d_min, abs_p_max, w_max, w_min = top("d_max"), low("d_min"), top("abs_p_max"), top("w_max"), \
                low("w_min")
            seqs = np.diff(np.append(starts, runs["step"].size))
            seq_abs_max = np.maximum.reduceat(np.abs(runs["sum_d"]), starts)
            for i, step in enumerate(steps.tolist()):
                hist, bucket_count, bucket_abs = f.steps[step]
                lo, hi = float(d_min[i]), float(d_max[i])
                states.append({
                    "tokens": float(sums["n"][i]), "invalid": float(f.invalid_steps.get(step, 0)),
                    "abs_d": float(sums["sum_a"][i]),
                    "abs_p": float(sums["abs_p"][i]), "neg_d": -float(sums["sum_d"][i]), "k3": float(sums["k3"][i]),
                    "rho_m1": float(sums["lin"][i]) + float(sums["ser"][i]),
                    "rho_m1_sq": float(sums["rho_m1_sq"][i]), "outside": float(sums["outside"][i]),
                    "seqs": float(seqs[i]), "seq_log_ratio": float(sums["sum_d"][i]),
                    "is_tokens": float(sums["is_n"][i]), "is_w": float(sums["is_w"][i]),
                    "is_w2": float(sums["is_w2"][i]), "is_masked": float(sums["is_masked"][i]),
                    "hist": hist.astype(np.float64), "bucket_count": bucket_count.astype(np.float64),
                    "bucket_abs": bucket_abs.astype(np.float64), "abs_d_max": max(hi, -lo),
                    "abs_p_max": float(abs_p_max[i]), "rho_m1_max": _expm1(hi), "neg_d_min": -lo,
                    "seq_abs_max": float(seq_abs_max[i]), "is_w_max": float(w_max[i]),
                    "neg_is_w_min": -float(w_min[i])})
        steps = steps.astype(np.int64)
        bare = sorted(set(f.invalid_steps) - set(steps.tolist()))  # steps with rows, none of them valid
        if bare:
            empty = np.full(N_STATE, -math.inf)  # the monitor's state of no token: sums 0, maxima −inf
            empty[:N_SUMS] = 0.0
            for step in bare:
                state = unpack(empty.copy())
                state["invalid"] = float(f.invalid_steps[step])
                states.append(state)
            steps = np.concatenate([steps, np.array(bare, dtype=np.int64)])
            order = np.argsort(steps, kind="stable")
            steps, states = steps[order], [states[i] for i in order]
        self._cache["states"] = (steps, states)
        return self._cache["states"]

    def sequences(self) -> Sequences:
        """Per sequence (step, rank, sequence order): its valid tokens and Σ_t d."""
        runs = self.full().runs
        return Sequences(runs["step"], runs["rank"], runs["sequence"], runs["n"].astype(np.int64), runs["sum_d"])

    def position_profile(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, tokens, Σ|d|) per response position, in position order."""
        f = self.full()
        return f.positions, f.position_n, f.position_abs

    # ---------------------------------------------------------------------------------------------- figures
    def _magnitude_counts(self, prob_bin: int | None = None) -> np.ndarray:
        """Tokens per magnitude bin of |d| (of one probability bin, or all)."""
        fine = self.full().fine
        signed = fine.sum(axis=0) if prob_bin is None else fine[prob_bin]
        out = signed[B.CENTRE:].copy()
        out[1:] += signed[:B.CENTRE][::-1]
        return out

    def prob_groups(self, quantile: float, min_count: int) -> dict:
        """``bins.order_statistics`` groups for ``quantile`` of |d| in each bin of 1 − p (``figures.PROB_EDGES``)
        with at least ``min_count`` tokens: {bin: (counts, info, ranks)}, and {bin: (n, (lower, upper, weight))}."""
        lo_b, hi_b = B.magnitude_bounds()
        groups, where = {}, {}
        fine = self.full().fine
        for g in range(fine.shape[0]):
            counts = self._magnitude_counts(g)
            n = int(counts.sum())
            if n < min_count or n == 0:
                continue
            lo, hi, t = B.quantile_ranks(n, quantile)

            def info(f, g=g):
                pairs = ((g, B.CENTRE + f), (g, B.CENTRE - f)) if f else ()
                return B.Rows(pairs=pairs, value="a"), float(lo_b[f]), float(hi_b[f])

            groups[g] = (counts, info, (lo, hi))
            where[g] = (lo, hi, t)
        return groups, where

    def prob_curve(self, quantile: float | None = None, min_count: int = 20) -> dict:
        """Per bin of 1 − p (``figures.PROB_EDGES``; p = the rollout's probability, 1 − p held in [1e-7, 1],
        values beyond the edges in the end bins, as ``np.digitize`` then clip): tokens, Σ|d| and, with
        ``quantile``, that quantile of |d| in each bin of at least ``min_count`` tokens (NaN elsewhere)."""
        f = self.full()
        count = f.fine.sum(axis=1)
        out = {"count": count, "sum": f.prob_abs.copy()}
        if quantile is not None:
            groups, where = self.prob_groups(quantile, min_count)
            found = B.order_statistics(groups, self.serve, FETCH_ROWS)
            qs = np.full(count.size, np.nan)
            for g, (lo, hi, t) in where.items():
                qs[g] = B.lerp(found[(g, lo)], found[(g, hi)], t)
            out["quantile"] = qs
        return out

    def abs_range(self) -> tuple[float | None, float | None, int]:
        """(smallest |d| > 0, largest |d|, tokens with d exactly 0); None without such tokens."""
        f = self.full()
        runs = f.runs
        hi = max(float(runs["d_max"].max()), -float(runs["d_min"].min())) if self.size else None
        zeros = int(f.fine[:, B.CENTRE].sum())
        return (None if math.isinf(f.abs_min_pos) else f.abs_min_pos), hi, zeros

    def abs_request(self, edges) -> tuple[np.ndarray, "B.Histogram | None"]:
        """(counts of the magnitude bins that lie inside one bin of ``edges``, the request for the rows of those an
        edge cuts, or None)."""
        edges = np.asarray(edges, dtype=np.float64)
        counts = self._magnitude_counts()
        lo, hi = B.magnitude_bounds()
        whole = B.whole_bins(lo, hi, edges)
        out = np.zeros(len(edges) - 1, dtype=np.int64)
        occupied = counts > 0
        occupied[0] = False  # |d| = 0 is not drawn
        inside = occupied & (whole >= 0)
        np.add.at(out, whole[inside], counts[inside])
        cut = np.flatnonzero(occupied & (whole < 0))
        if not cut.size:
            return out, None
        signed = tuple(int(x) for x in np.concatenate([B.CENTRE + cut, B.CENTRE - cut]))
        return out, B.Histogram(B.Rows(signed=signed, value="a"), tuple(float(e) for e in edges))

    def abs_histogram(self, edges) -> np.ndarray:
        """``np.histogram(|d|[|d| > 0], edges)`` counts (log-spaced edges holding every |d| > 0)."""
        counts, req = self.abs_request(edges)
        if req is not None:
            counts = counts + self.serve([req])[0][0]
        return counts

    def d_range(self) -> tuple[int, float, float]:
        runs = self.full().runs
        return (self.size, float(runs["d_min"].min()), float(runs["d_max"].max())) if self.size else (0, None, None)

    def signed_counts(self) -> np.ndarray:
        """Tokens per signed fine bin of d (every probability bin)."""
        return self.full().fine.sum(axis=0)

    def rho_request(self, edges, lo_d: float, hi_d: float) -> tuple[np.ndarray, int, int, "B.Histogram | None"]:
        """(counts of the fine bins of d inside [lo_d, hi_d] whose ρ lies inside one bin of ``edges``, tokens of the
        fine bins wholly below lo_d, above hi_d, the request for the rows of the other fine bins, or None)."""
        edges = np.asarray(edges, dtype=np.float64)
        counts = self.signed_counts()
        lo, hi = B.signed_bounds()
        occupied = counts > 0
        below = occupied & (hi < lo_d)
        above = occupied & (lo > hi_d)
        inside = occupied & (lo >= lo_d) & (hi <= hi_d)
        with np.errstate(over="ignore"):
            rho_lo = np.clip(np.exp(lo) * (1 - B.MARGIN), edges[0], edges[-1])
            rho_hi = np.clip(np.exp(hi) * (1 + B.MARGIN), edges[0], edges[-1])
        whole = np.where(inside, B.whole_bins(rho_lo, rho_hi, edges), -1)
        out = np.zeros(len(edges) - 1, dtype=np.int64)
        ok = whole >= 0
        np.add.at(out, whole[ok], counts[ok])
        cut = np.flatnonzero(occupied & ~below & ~above & ~ok)
        req = None
        if cut.size:
            req = B.Histogram(B.Rows(signed=tuple(int(x) for x in cut), value="d"),
                              tuple(float(e) for e in edges), (float(lo_d), float(hi_d)))
        return out, int(counts[below].sum()), int(counts[above].sum()), req

    def rho_histogram(self, edges, log: bool, lo_d: float, hi_d: float) -> tuple[np.ndarray, int, int]:
        """(``np.histogram`` counts of ρ = exp(d) on ``edges`` of the tokens with lo_d <= d <= hi_d (ρ held
        inside the edges), tokens with d below lo_d, above hi_d). ``log``: how the edges are spaced (any edges
        are counted exactly)."""
        counts, below, above, req = self.rho_request(edges, lo_d, hi_d)
        if req is not None:
            c, b, a = self.serve([req])[0]
            counts, below, above = counts + c, below + b, above + a
        return counts, int(below), int(above)

    # ----------------------------------------------------------------------------------- largest disagreements
    def _context_rows(self, files: list[str], seqs: list[tuple]) -> list[tuple]:
        """(step, rank, sequence, position, token_id) of every row of the sequences ``seqs`` in ``files`` (a few
        thousand): the context and the ends of the largest disagreements. The full pass does not read the token ids,
        so a file damaged in that column alone gets this far: its rows are left out here (their token shows as
        unknown, without context), file by file, and the report goes on (``context_unread`` names them)."""
        import duckdb

        where = (f" WHERE step IN {_sql_list({s for s, _, _ in seqs})} AND rank IN "
                 f"{_sql_list({r for _, r, _ in seqs})} AND sequence IN {_sql_list({q for _, _, q in seqs})}")

        def query(paths):
            listed = "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
            return self.con.execute(f"SELECT step, rank, sequence, position, token_id FROM read_parquet({listed})"
                                    + where).fetchall()

        try:
            return query(files)
        except duckdb.Error:
            rows = []
            for path in files:
                try:
                    rows += query([path])
                except duckdb.Error as err:
                    self.context_unread.append((Path(path).name, str(err).splitlines()[0][:120]))
            return rows

    def largest_disagreements(self, n: int, context: int) -> list[dict]:
        """``disagreements.largest_disagreements``'s rows over this dump: the ``n`` valid rows with the largest
        |d| (ties in (step, rank, sequence, position) order), each with the token ids of the rows of its sequence
        within ``context`` positions on each side (every row of the dump, valid or not)."""
        from tim_plugins.report.scan import TOP_ROWS

        f = self.full()
        if n > TOP_ROWS:
            raise ValueError(f"largest_disagreements: n={n} is more than the {TOP_ROWS} rows the pass keeps")
        top = {k: v[:n] for k, v in f.top.items()}
        picked = list(zip(*(top[k].tolist() for k in ("step", "rank", "sequence", "position", "r", "t"))))
        if not picked:
            return []
        seqs = sorted({p[:3] for p in picked})
        wanted = {(s, r) for s, r, _ in seqs}
        files = [path for path, keys in zip(self.files, f.file_keys) if keys is not None and any(
            keys[0] <= s <= keys[1] and keys[2] <= r <= keys[3] for s, r in wanted)]
        rows_of = self._context_rows(files, seqs)
        self.passes["context"] += 1
        by_seq: dict = {}
        for step, rank, seq, pos, tok in rows_of:
            if pos is not None:  # a row without a position has no place in the context (the passes skip it)
                by_seq.setdefault((step, rank, seq), []).append((pos, tok))
        rows = []
        for step, rank, seq, pos, r, t in picked:
            every = sorted(by_seq.get((step, rank, seq), [(pos, None)]), key=lambda x: x[0])
            around = [(p, tok) for p, tok in every if abs(p - pos) <= context]
            lo, hi = every[0][0], every[-1][0]
            tok = next((tok for p, tok in around if p == pos), None)
            rows.append({
                "step": int(step), "rank": int(rank), "sequence": int(seq), "position": int(pos),
                "token_id": None if tok is None else int(tok),  # None: the file holds no token id there
                "rollout_logprob": float(r), "train_logprob": float(t), "diff": float(t - r),
                "p_rollout": exp_or_inf(r), "p_train": exp_or_inf(t),
                "before": [int(tok) for p, tok in around if p < pos and tok is not None],
                "after": [int(tok) for p, tok in around if p > pos and tok is not None],
                "start": pos == lo, "end": pos == hi,
            })
        return rows
