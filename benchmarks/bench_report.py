"""``tim-plugins report DUMP`` against the dump's size: wall time and peak memory (RSS) of the command, 1 M to
100 M rows, the streaming queries (``tim_plugins.report.query``) beside the in-memory path they replaced (the
package as of the commit before them, run from ``git archive``) up to the size it can hold.

    python -m benchmarks.bench_report [--quick] [--sizes 1e6,1e7,1e8] [--old-sizes 1e6,8e6] [--repeats 2]
                                      [--dump DIR] [--phase-sizes 1e7,1e8]

Synthetic dumps in the project's schema (``tim_plugins.dump.DUMP_COLUMNS`` without entropy, the dtypes the
writer uses, one file per step and rank, 64 sequences of 640 tokens per file): rollout log-probs of sampled tokens
(most tokens confident, a long tail: -log p ~ Gamma(0.35, 1.5)), d = train − rollout with the (1 − p) structure of
bf16 noise plus rare large outliers. The files are written once, in chunks (bounded memory), for the largest
size; smaller dumps are folders of links to the first files. Everything is deleted at the end.

Each measurement is the command as a user runs it (a subprocess: python start, imports, queries, figures, the
HTML), its peak RSS read by ``/usr/bin/time -v`` (the query engine runs in-process). The machine is shared: the
load average around each run is recorded. ``--phase-sizes``: per size, one more run of the report's queries
alone (``phase_times``, a subprocess) with each phase's wall and CPU seconds and the peak RSS after it. Results: ``benchmarks/results/report_scaling.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import spread, write_results

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 640
SEQS_PER_FILE = 64
RANKS = 8
ROWS_PER_FILE = SEQ_LEN * SEQS_PER_FILE
# The commit whose report read the whole dump (the parent of the streaming queries).
OLD_COMMIT = "d28c1dc~1"


def write_dump(folder: Path, rows: int, seed: int = 0) -> int:
    """Files of ``ROWS_PER_FILE`` rows (step, rank in writer order) until ``rows``; returns the files written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_files = -(-rows // ROWS_PER_FILE)
    seq = np.repeat(np.arange(SEQS_PER_FILE, dtype=np.int64), SEQ_LEN)
    pos = np.tile(np.arange(SEQ_LEN, dtype=np.int32), SEQS_PER_FILE)
    for f in range(n_files):
        step, rank = f // RANKS, f % RANKS
        nll = rng.gamma(0.35, 1.5, ROWS_PER_FILE)  # -log p of the sampled token
        rollout = (-nll).astype(np.float32)
        one_minus_p = -np.expm1(-nll)
        d = rng.standard_normal(ROWS_PER_FILE) * (2e-3 + 3e-2 * one_minus_p)
        outlier = rng.random(ROWS_PER_FILE) < 1e-4
        d[outlier] = rng.standard_normal(outlier.sum()) * 2.0
        train = (rollout.astype(np.float64) + d).astype(np.float32)
        table = pa.table({
            "step": pa.array(np.full(ROWS_PER_FILE, step, dtype=np.int64)),
            "rank": pa.array(np.full(ROWS_PER_FILE, rank, dtype=np.int32)),
            "sequence": pa.array(seq), "position": pa.array(pos),
            "token_id": pa.array(rng.integers(0, 50_000, ROWS_PER_FILE, dtype=np.int64)),
            "rollout_logprob": pa.array(rollout), "train_logprob": pa.array(train),
        })
        pq.write_table(table, folder / f"step_{step:08d}-rank_{rank:04d}.parquet")
    return n_files


def linked(source: Path, folder: Path, n_files: int) -> Path:
    """``folder`` with links to the first ``n_files`` files of ``source``."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted(source.glob("step_*-rank_*.parquet"))[:n_files]:
        (folder / p.name).symlink_to(p)
    return folder


def old_package(where: Path) -> Path:
    """The package as of ``OLD_COMMIT`` (the in-memory report), unpacked under ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT, "tim_plugins"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def run_report(dump: Path, out: Path, pythonpath: Path | None = None, extra=()) -> dict:
    """One ``tim-plugins report`` as a subprocess: wall seconds, peak RSS (GB), load average before and after."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    code = "import sys; from tim_plugins.apps.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", code, "report", str(dump), "--out", str(out), *extra]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return {"wall_s": round(wall, 2), "peak_rss_gb": round(rss_kb / 2**20, 3), "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2)}


# The report's queries in the order the dump page runs them, each phase timed (wall s, CPU s of the process and
# its DuckDB threads, peak RSS GB after it); printed as one JSON object.
_PHASES = r"""
import json, os, resource, sys, time
t00 = time.perf_counter()
from pathlib import Path
from tim_plugins.report import tokens as T
from tim_plugins.report.figures import ratio_distribution
from tim_plugins.report.query import engine
out = {}
def tm(name, f):
    t0, c0 = time.perf_counter(), time.process_time()
    r = f()
    out[name] = {"wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
                 "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    return r
with engine():
    d = tm("open", lambda: T.load_tokens(Path(sys.argv[1])))
    dumps = {"run": d}
    tm("sequences_positions_probability", d._profiles)
    tm("step_states", d.step_states)
    tm("prob_curve_quantiles", lambda: T.prob_curves(dumps, quantile=True))
    tm("abs_histogram", lambda: T.abs_histograms(dumps))
    src = tm("rho_quantiles", lambda: T.rho_source(dumps))
    tm("rho_panels", lambda: ratio_distribution(src))
    tm("disagreements", lambda: d.largest_disagreements(20, 8))
out["total_s"] = round(time.perf_counter() - t00, 2)
out["load"] = [round(x, 2) for x in os.getloadavg()]
print(json.dumps(out))
"""


def phase_times(dump: Path) -> dict:
    """The report's query phases on ``dump`` (a subprocess, default engine settings): wall / CPU s, peak RSS."""
    import json

    proc = subprocess.run([sys.executable, "-c", _PHASES, str(dump)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"phase_times failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 M and 4 M rows, old path at 1 M, one repeat")
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--old-sizes", default="1e6,2e6,8e6")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dump", default=None,
                        help="a folder of this benchmark's synthetic files (write_dump) to read instead of writing "
                             "them again; it must hold the largest size")
    parser.add_argument("--phase-sizes", default="", help="sizes to time per query phase too (phase_times)")
    parser.add_argument("--work", default=None, help="folder for the synthetic dumps (default: a temporary one)")
    parser.add_argument("--keep-in-memory", action="store_true",
                        help="keep the in-memory path's runs of the existing results file (measured earlier, on the "
                             "same dumps) instead of measuring them again; the streaming runs there are kept as "
                             "'earlier_streaming'")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.old_sizes, args.repeats = "1e6,4e6", "1e6", 1
    sizes = sorted(int(float(x)) for x in args.sizes.split(","))
    old_sizes = sorted(int(float(x)) for x in args.old_sizes.split(",")) if args.old_sizes else []
    phase_sizes = {int(float(x)) for x in args.phase_sizes.split(",")} if args.phase_sizes else set()
    work = Path(tempfile.mkdtemp(prefix="tim-bench-report-", dir=args.work))
    results = {"schema": "step_*-rank_*.parquet, DUMP_COLUMNS without entropy", "seq_len": SEQ_LEN,
               "rows_per_file": ROWS_PER_FILE, "ranks": RANKS, "runs": []}
    try:
        t0 = time.perf_counter()
        biggest = max(sizes + old_sizes)
        if args.dump:
            source = Path(args.dump)
            n_files = len(list(source.glob("step_*-rank_*.parquet")))
            if n_files < -(-biggest // ROWS_PER_FILE):
                raise SystemExit(f"--dump {source}: {n_files} files, fewer than {biggest} rows need")
            linked(source, work / "all", n_files)
        else:
            n_files = write_dump(work / "all", biggest)
            results["generate_s"] = round(time.perf_counter() - t0, 1)
        old = old_package(work / "old")
        for kind, kind_sizes, path in (("streaming", sizes, None), ("in_memory", old_sizes, old)):
            for rows in kind_sizes:
                files = min(n_files, -(-rows // ROWS_PER_FILE))
                dump = linked(work / "all", work / f"{kind}_{rows}", files)
                disk = sum(p.resolve().stat().st_size for p in dump.iterdir())
                repeats = 1 if rows >= 50_000_000 else args.repeats  # the largest once: minutes on a shared machine
                runs = [run_report(dump, work / f"{kind}_{rows}.html", path) for _ in range(repeats)]
                entry = {"path": kind, "rows": files * ROWS_PER_FILE, "files": files,
                         "parquet_gb": round(disk / 2**30, 3), "runs": runs,
                         "wall_s": spread([r["wall_s"] for r in runs]),
                         "peak_rss_gb": spread([r["peak_rss_gb"] for r in runs])}
                if kind == "streaming" and rows in phase_sizes:
                    entry["phases"] = phase_times(dump)
                results["runs"].append(entry)
                print(f"{kind:9s} {entry['rows']:>11,d} rows ({disk / 2**30:.2f} GB): wall "
                      f"{entry['wall_s']['median']:.1f} s, peak RSS {entry['peak_rss_gb']['median']:.2f} GB, "
                      f"load {runs[-1]['load_before']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.keep_in_memory:
        import json

        from benchmarks._common import RESULTS_DIR

        before = json.loads((RESULTS_DIR / "report_scaling.json").read_text())
        kept = [dict(r, measured=before["environment"]["when"]) for r in before["runs"] if r["path"] == "in_memory"]
        results["runs"] += kept
        results["earlier_streaming"] = {"measured": before["environment"]["when"],
                                        "commit": before.get("commit"),
                                        "runs": [r for r in before["runs"] if r["path"] == "streaming"]}
    from tim_plugins.report.query import DEFAULT_MEMORY_LIMIT

    import duckdb

    stream = [r for r in results["runs"] if r["path"] == "streaming"]
    if len(stream) >= 2:
        a, b = stream[0], stream[-1]
        results["ratios"] = {
            "rows_ratio": round(b["rows"] / a["rows"], 2),
            "wall_ratio": round(b["wall_s"]["median"] / a["wall_s"]["median"], 2),
            "peak_rss_ratio": round(b["peak_rss_gb"]["median"] / a["peak_rss_gb"]["median"], 2),
        }
    results["settings"] = {"memory_limit": DEFAULT_MEMORY_LIMIT, "threads": "every core", "duckdb": duckdb.__version__,
                           "old_path": f"tim_plugins at {OLD_COMMIT} (read_dump + numpy)"}
    results["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    results["goal"] = "100 M rows in <= 60 s with peak RSS <= 1.5 GB on 2 cores; memory flat from 1 M to 100 M"
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results("report_scaling_quick" if args.quick else "report_scaling", results)
    return results


if __name__ == "__main__":
    main()
