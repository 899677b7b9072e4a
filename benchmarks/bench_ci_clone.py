"""What CI's wall time is on this machine: `.ci/run` on a fresh clone, at two commits, alternately.

    python -m benchmarks.bench_ci_clone --base REV [--head REV] [--repeats N] [--work DIR] [--name NAME]

CI runs `.ci/run` on a clean clone of main, so every environment (.venv, the newest and oldest stacks,
.venv-megatron) is built inside the run, the stacks' and Megatron's in the background while the first suites run.
A warm `make test` in a checkout that already has them measures something else. Each run here clones this
repository into DIR (default: a temporary folder beside it), checks out the commit, runs `.ci/run` and removes the
clone (~22 GB while it runs). The download caches (pip's, uv's) are the machine's and stay warm between runs, as
on a warm CI machine; the order of the two commits alternates from one repeat to the next. Recorded per run: the
wall seconds, `make test`'s exit status, each suite's wall and set-up seconds and peak memory
(tim-out/matrix/suites/*.json), when each background environment was ready (its stamp's time after the start) and
a fixed loop's seconds just before the run (the machine's speed: a shared machine's drifts).
Writes ``benchmarks/results/NAME.json`` (default ci_clone): the medians, their spread and head/base.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._common import median_time, spread, write_results

__all__ = ["cpu_probe", "run_once", "main"]

ROOT = Path(__file__).resolve().parents[1]
BACKGROUND_ENVS = (".venv-newest", ".venv-oldest", ".venv-megatron")


def _rev(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def cpu_probe() -> float:
    """Seconds of a fixed single-threaded loop (median of 3): the machine's speed just before a run, since a shared
    machine's can drift between runs an hour apart."""
    def loop() -> None:
        total = 0
        for i in range(3_000_000):
            total += i * i % 7
    return round(median_time(loop, repeats=3, warmup=1), 3)


def run_once(rev: str, work: Path, log: Path, root: Path = ROOT) -> dict:
    """`.ci/run` on a fresh clone of the repository ``root`` at ``rev``; its figures. The clone is removed."""
    clone = work / f"clone-{rev}"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", rev], cwd=clone, check=True)
    try:
        probe = cpu_probe()
        t0 = time.time()
        with open(log, "w") as out:
            rc = subprocess.run([str(clone / ".ci" / "run")], cwd=clone, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "WANDB_MODE": "offline"}).returncode
        wall = time.time() - t0
        suites = {}
        for path in sorted((clone / "tim-out" / "matrix" / "suites").glob("*.json")):
            rec = json.loads(path.read_text())
            suites[rec["suite"]] = {key: rec.get(key) for key in ("wall_s", "setup_s", "rc", "peak_pss_gib", "counts")}
        ready = {}
        for name in BACKGROUND_ENVS:
            stamps = sorted((clone / name).glob(".tim-stack-*"))
            ready[name] = round(stamps[0].stat().st_mtime - t0, 1) if stamps else None
        return {"rev": rev, "wall_s": round(wall, 1), "rc": rc, "suites": suites, "background_ready_s": ready,
                "cpu_probe_s": probe, "log": str(log)}
    finally:
        shutil.rmtree(clone, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the baseline commit")
    parser.add_argument("--head", default="HEAD", help="the commit measured against it (default HEAD)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each commit (default 1: ~1-2 h in all)")
    parser.add_argument("--work", type=Path, default=None, help="where the clones go (~22 GB free needed)")
    parser.add_argument("--name", default="ci_clone", help="results file name (benchmarks/results/NAME.json)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: at least 1 run of each commit is needed")
    base, head = _rev(args.base), _rev(args.head)
    work = args.work or Path(tempfile.mkdtemp(prefix="ci_clone_", dir=ROOT.parent))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.repeats):
        for rev in ((head, base) if i % 2 == 0 else (base, head)):
            print(f"bench_ci_clone: repeat {i + 1}, {rev}", flush=True)
            runs.append(run_once(rev, work, work / f"ci-{rev}-{i + 1}.log"))
            print(f"bench_ci_clone: {rev}: {runs[-1]['wall_s']} s, rc {runs[-1]['rc']}", flush=True)
    walls = {arm: [r["wall_s"] for r in runs if r["rev"] == rev] for arm, rev in (("head", head), ("base", base))}
    summary = {arm: spread(xs) for arm, xs in walls.items()}
    write_results(args.name, {
        "what": "`.ci/run` on a fresh clone (every environment built inside the run), wall seconds per commit",
        "base": base, "head": head, "repeats": args.repeats,
        "wall_s": walls, "spread": summary,
        "ratio_head_to_base": summary["head"]["median"] / summary["base"]["median"],
        "runs": runs,
    })


if __name__ == "__main__":
    main()
