"""``tim-plugins report DUMP`` against the dump's size: wall time, peak memory (RSS), each phase and the passes over
the files, 1 M to 200 M rows, beside the streaming SQL path it replaced (the package at ``STREAMING_COMMIT``, run
from ``git archive``) at the sizes that finishes in reasonable time; and ``report A B`` of two dumps of one size.

    python -m benchmarks.bench_report [--quick] [--sizes 1e6,1e7,1e8,2e8] [--streaming-sizes 1e6,1e7]
                                      [--phase-sizes 1e6,1e7,1e8] [--compare-size 1e8] [--repeats 2] [--dump DIR]

On an idle 2-core machine the default run takes about 8 minutes (writing the 200 M-row dump ~2 minutes of it;
``--dump`` reuses one) and needs ~3.3 GB of disk under ``--work`` (default: the system's temporary folder), all
deleted at the end. ``--quick``: 1 M and 4 M rows, the streaming path at 1 M, one repeat (~1 minute).
``--fixed-cost``: the small report alone (1 M rows, 3 repeats) into ``report_fixed_cost.json``.

Synthetic dumps in the project's schema (``tim_plugins.dump.DUMP_COLUMNS`` without entropy, the dtypes the writer
uses, one file per step and rank, 64 sequences of 640 tokens per file): rollout log-probs of sampled tokens (most
tokens confident, a long tail: -log p ~ Gamma(0.35, 1.5)), d = train − rollout with the (1 − p) structure of bf16
noise plus rare large outliers. The files are written once, in chunks (bounded memory), for the largest size;
smaller dumps are folders of links to the first files, and the comparison's second dump links to the next ones.

Each measurement is the command as a user runs it, in a subprocess (python start, imports, passes, figures, the
HTML), its peak RSS read by ``/usr/bin/time -v``, with the bytecode of every module cached as after a ``pip
install`` (a warm-up run fills a cache under the work folder; some shells set PYTHONDONTWRITEBYTECODE, under which
every start compiles ~1,600 modules, +4 s). The current path's runs call the CLI's ``main`` with timers around
its phases (``_PHASES``: imports, the full pass, each narrow pass, the largest disagreements' context, drawing the
figures, the rest) and report the passes per dump. The machine may be shared: the load average around each run is
recorded. Results: ``report_scaling.json`` (wall and RSS per size and path, the comparison, the goals) and
``report_phases.json`` (the phases per size, the streaming path's at its sizes).
"""

from __future__ import annotations

import argparse
import json
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
# The streaming SQL path (#47: a DuckDB query per statistic, quantiles by narrowing over several scans).
STREAMING_COMMIT = "3d8dece"  # the last commit of main before the few-scans path (#62)
GOALS = {"wall_s_100m": 60.0, "peak_rss_gb_100m": 1.5, "wall_s_200m": 120.0, "wall_s_1m": 5.0}


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


def linked(source: Path, folder: Path, n_files: int, skip: int = 0) -> Path:
    """``folder`` with links to ``n_files`` files of ``source`` after its first ``skip``."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted(source.glob("step_*-rank_*.parquet"))[skip:skip + n_files]:
        (folder / p.name).symlink_to(p.resolve())
    return folder


def streaming_package(where: Path) -> Path:
    """The package as of ``STREAMING_COMMIT``, unpacked under ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", STREAMING_COMMIT, "tim_plugins"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


# The current path: the CLI's main with timers around its phases. Prints one JSON object: the phases (wall and
# CPU seconds; CPU counts every thread), the passes of each dump, and the load average.
_PHASES = r"""
import json, os, sys, time
t00, c00 = time.perf_counter(), time.process_time()
phases = {}
def timed(name, f):
    def run(*a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return f(*a, **k)
        finally:
            p = phases.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})
            p["wall_s"] += time.perf_counter() - t0
            p["cpu_s"] += time.process_time() - c0
            p["calls"] += 1
    return run
import numpy, pyarrow.parquet, duckdb, matplotlib.pyplot
import tim_plugins.apps.cli as cli, tim_plugins.report.figures as figures, tim_plugins.report.query as query
import tim_plugins.report.scan as scan
phases["imports"] = {"wall_s": time.perf_counter() - t00, "cpu_s": time.process_time() - c00, "calls": 1}
scan.full_pass = timed("full_pass", scan.full_pass)
narrow = scan.narrow_pass
def narrow_pass(files, threads, requests):
    name = f"narrow_pass_{sum(1 for k in phases if k.startswith('narrow_pass')) + 1}"
    return timed(name, narrow)(files, threads, requests)
scan.narrow_pass = narrow_pass
query.Dump.largest_disagreements = timed("disagreements", query.Dump.largest_disagreements)
figures.png_bytes = timed("figures_draw", figures.png_bytes)
opened = []
init = query.Dump.__init__
def dump_init(self, *a, **k):
    init(self, *a, **k)
    opened.append(self)
query.Dump.__init__ = dump_init
rc = cli.main(["report", *sys.argv[1:]])
total = {"wall_s": time.perf_counter() - t00, "cpu_s": time.process_time() - c00}
phases["rest"] = {k: total[k] - sum(p[k] for p in phases.values()) for k in ("wall_s", "cpu_s")}
phases = {k: {m: round(v, 2) for m, v in p.items()} for k, p in phases.items()}
print(json.dumps({"rc": rc, "phases": phases, "total": {k: round(v, 2) for k, v in total.items()},
                  "passes": [d.passes for d in opened], "rows": [d.rows for d in opened],
                  "load": [round(x, 2) for x in os.getloadavg()]}))
"""

# The streaming path's query phases in the order its dump page ran them (its own API, as of STREAMING_COMMIT).
_STREAMING_PHASES = r"""
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
    out[name] = {"wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2)}
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
    tm("disagreements", lambda: d.largest_disagreements(15, 4))
print(json.dumps({"phases": out, "total_s": round(time.perf_counter() - t00, 2),
                  "load": [round(x, 2) for x in os.getloadavg()]}))
"""


def _env(pythonpath: Path | None, pycache: Path) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def run_report(dumps: list[Path], out: Path, pycache: Path, pythonpath: Path | None = None) -> dict:
    """One report of ``dumps`` (several: a comparison) as a subprocess: wall seconds, peak RSS (GB), load average
    before and after; the current path's phases and passes too."""
    if pythonpath is None:
        code = _PHASES
    else:
        code = "import sys; from tim_plugins.apps.cli import main; sys.exit(main(['report', *sys.argv[1:]]))"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", code, *map(str, dumps), "--out", str(out)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(pythonpath, pycache), cwd=out.parent)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    run = {"wall_s": round(wall, 2), "peak_rss_gb": round(rss_kb / 2**20, 3), "load_before": round(load, 2),
           "load_after": round(os.getloadavg()[0], 2)}
    if pythonpath is None:
        detail = json.loads(proc.stdout.strip().splitlines()[-1])
        run.update(phases=detail["phases"], passes=detail["passes"])
    return run


def streaming_phases(dump: Path, package: Path, pycache: Path) -> dict:
    """The streaming path's query phases on ``dump`` (a subprocess): wall / CPU s."""
    proc = subprocess.run([sys.executable, "-c", _STREAMING_PHASES, str(dump)], capture_output=True, text=True,
                          env=_env(package, pycache), cwd=package)  # not ROOT: its tim_plugins would come first
    if proc.returncode != 0:
        raise RuntimeError(f"streaming phases failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sizes(text: str) -> list[int]:
    return sorted(int(float(x)) for x in text.split(",")) if text else []


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 M and 4 M rows, the streaming path at 1 M, one repeat")
    parser.add_argument("--sizes", default="1e6,1e7,1e8,2e8")
    parser.add_argument("--streaming-sizes", default="1e6,1e7",
                        help="sizes for the streaming path (100 M rows took it 348 s)")
    parser.add_argument("--phase-sizes", default="1e6,1e7,1e8", help="sizes whose phases are kept")
    parser.add_argument("--compare-size", default="1e8", help="rows of each dump of the 'report A B' run ('' none)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per size below 50 M rows (one above)")
    parser.add_argument("--dump", default=None,
                        help="a folder of this benchmark's synthetic files (write_dump) to read instead of writing "
                             "them again; it must hold the rows the sizes and the comparison need")
    parser.add_argument("--work", default=None, help="folder for the synthetic dumps (default: a temporary one)")
    parser.add_argument("--fixed-cost", action="store_true",
                        help="only the small report's figure: 1 M rows, 3 repeats, no streaming path and no "
                             "comparison; results in report_fixed_cost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.streaming_sizes, args.phase_sizes, args.compare_size, args.repeats = \
            "1e6,4e6", "1e6", "1e6", "", 1
    if args.fixed_cost:
        args.sizes, args.streaming_sizes, args.phase_sizes, args.compare_size, args.repeats = \
            "1e6", "", "1e6", "", 3
    sizes, streaming_sizes = _sizes(args.sizes), _sizes(args.streaming_sizes)
    phase_sizes = set(_sizes(args.phase_sizes))
    compare = int(float(args.compare_size)) if args.compare_size else 0
    work = Path(tempfile.mkdtemp(prefix="tim-bench-report-", dir=args.work))
    pycache = work / "pycache"
    scaling = {"schema": "step_*-rank_*.parquet, DUMP_COLUMNS without entropy", "seq_len": SEQ_LEN,
               "rows_per_file": ROWS_PER_FILE, "ranks": RANKS, "runs": []}
    phases = {"runs": []}
    try:
        needed = max(sizes + streaming_sizes + [2 * -(-compare // ROWS_PER_FILE) * ROWS_PER_FILE])
        files_needed = -(-needed // ROWS_PER_FILE)
        if args.dump:
            source = Path(args.dump)
            n_files = len(list(source.glob("step_*-rank_*.parquet")))
            if n_files < files_needed:
                raise SystemExit(f"--dump {source}: {n_files} files, fewer than the {files_needed} needed")
            linked(source, work / "all", n_files)
        else:
            t0 = time.perf_counter()
            n_files = write_dump(work / "all", needed)
            scaling["generate_s"] = round(time.perf_counter() - t0, 1)
        streaming = streaming_package(work / "streaming")
        paths = (("passes", sizes, None), ("streaming", streaming_sizes, streaming))
        for kind, _, package in paths:  # warm-up: compile the bytecode of every module once
            run_report([linked(work / "all", work / f"warm_{kind}", 1)], work / f"warm_{kind}.html", pycache, package)
        for kind, kind_sizes, package in paths:
            for rows in kind_sizes:
                files = min(n_files, -(-rows // ROWS_PER_FILE))
                dump = linked(work / "all", work / f"{kind}_{rows}", files)
                disk = sum(p.resolve().stat().st_size for p in dump.iterdir())
                repeats = 1 if rows >= 50_000_000 else args.repeats
                runs = [run_report([dump], work / f"{kind}_{rows}.html", pycache, package) for _ in range(repeats)]
                entry = {"path": kind, "rows": files * ROWS_PER_FILE, "files": files,
                         "parquet_gb": round(disk / 2**30, 3),
                         "runs": [{k: v for k, v in r.items() if k != "phases"} for r in runs],
                         "wall_s": spread([r["wall_s"] for r in runs]),
                         "peak_rss_gb": spread([r["peak_rss_gb"] for r in runs])}
                scaling["runs"].append(entry)
                if rows in phase_sizes:
                    if package is None:
                        phases["runs"].append({"path": kind, "rows": entry["rows"], "phases": runs[-1]["phases"],
                                               "load_before": runs[-1]["load_before"]})
                    else:
                        phases["runs"].append({"path": kind, "rows": entry["rows"],
                                               **streaming_phases(dump, package, pycache)})
                print(f"{kind:9s} {entry['rows']:>11,d} rows ({disk / 2**30:.2f} GB): wall "
                      f"{entry['wall_s']['median']:.1f} s, peak RSS {entry['peak_rss_gb']['median']:.2f} GB, "
                      f"load {runs[-1]['load_before']}", flush=True)
        if compare:
            files = -(-compare // ROWS_PER_FILE)
            a = linked(work / "all", work / "compare_a", files)
            b = linked(work / "all", work / "compare_b", files, skip=files)
            run = run_report([a, b], work / "compare.html", pycache)
            scaling["comparison"] = {"rows_each": files * ROWS_PER_FILE, **{k: v for k, v in run.items()}}
            print(f"report A B of 2 x {files * ROWS_PER_FILE:,d} rows: wall {run['wall_s']:.1f} s, peak RSS "
                  f"{run['peak_rss_gb']:.2f} GB, passes {run['passes']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import duckdb

    by = {(r["path"], r["rows"]): r for r in scaling["runs"]}
    ratios = {}
    for (path, rows), r in by.items():
        s = by.get(("streaming", rows))
        if path == "passes" and s is not None:
            ratios[f"streaming_over_passes_wall_{rows // 1_000_000}m"] = round(
                s["wall_s"]["median"] / r["wall_s"]["median"], 2)
    current = sorted((r for r in scaling["runs"] if r["path"] == "passes"), key=lambda r: r["rows"])
    if len(current) >= 2:
        ratios["rows_ratio"] = round(current[-1]["rows"] / current[0]["rows"], 2)
        ratios["wall_ratio"] = round(current[-1]["wall_s"]["median"] / current[0]["wall_s"]["median"], 2)
    scaling["ratios"] = ratios
    met = {}
    for key, limit in GOALS.items():
        measure, size = key.rsplit("_", 1)
        r = next((x for x in current if x["rows"] // 1_000_000 == int(size[:-1])), None)
        if r is not None:
            value = r[measure]["median"]
            met[key] = {"measured": value, "limit": limit, "met": value <= limit,
                        "load_before": r["runs"][-1]["load_before"]}
    scaling["goals"] = met
    settings = {"threads": "every core", "duckdb": duckdb.__version__, "cores": os.cpu_count(),
                "streaming_path": f"tim_plugins at {STREAMING_COMMIT} (a DuckDB query per statistic)",
                "bytecode": "cached (a warm-up run per path)"}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for results in (scaling, phases):
        results.update(settings=settings, commit=commit, loadavg_end=[round(x, 2) for x in os.getloadavg()])
    scaling["goal"] = ("100 M rows in <= 60 s with peak RSS <= 1.5 GB, 200 M rows in <= 2 min, 1 M rows in <= 5 s, on "
                       "2 cores; report A B of two 100 M-row dumps reads each in one full pass")
    if args.fixed_cost:  # its own figure: the full run's file keeps the sizes it measured
        write_results("report_fixed_cost", {**scaling, "phases": phases["runs"]})
        return scaling
    suffix = "_quick" if args.quick else ""
    write_results(f"report_scaling{suffix}", scaling)
    write_results(f"report_phases{suffix}", phases)
    return scaling


if __name__ == "__main__":
    main()
