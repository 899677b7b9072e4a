"""What ``scripts/pip_install`` saves the CI run: pip against uv installing the built wheel with its
``[hf,report,trl,verl]`` extras (the wheel check's environment) into a fresh virtualenv holding torch.

    python -m benchmarks.bench_install [--repeats N] [--quick]

Each repeat, for each tool in turn: a fresh ``python -m venv``, torch with pip (not timed: both arms start from it),
then the timed install. One untimed warm-up install per tool first, so both read their own download cache (as on a
CI machine that ran before). Writes ``benchmarks/results/install_tools.json``: seconds per tool (median, spread) and
the ratio uv / pip of the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import spread, write_results

ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("TORCH", "torch==2.13.0")
EXTRAS = "hf,report,trl,verl"
TOOLS = ("pip", "uv")


def _install_cmd(tool: str, venv: Path, spec: str) -> list[str]:
    if tool == "pip":
        return [str(venv / "bin" / "pip"), "install", "-q", spec]
    return [str(ROOT / "scripts" / "pip_install"), str(venv), "-q", spec]


def _one(tool: str, wheel: Path, work: Path) -> float:
    venv = work / f"venv-{tool}"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", TORCH], check=True,
                   capture_output=True)
    t0 = time.perf_counter()
    subprocess.run(_install_cmd(tool, venv, f"{wheel}[{EXTRAS}]"), check=True, capture_output=True,
                   env={**os.environ, **({"UV": "none"} if tool == "pip" else {})})
    seconds = time.perf_counter() - t0
    shutil.rmtree(venv, ignore_errors=True)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    if not (ROOT / ".venv" / "bin" / "uv").exists() and shutil.which("uv") is None:
        raise SystemExit("benchmarks.bench_install: no uv (.venv/bin/uv or on PATH); fix: make setup")
    with tempfile.TemporaryDirectory(prefix="tim-bench-install-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"), str(ROOT)],
                       check=True, capture_output=True)
        wheel = next((work / "dist").glob("*.whl"))
        for tool in TOOLS:  # warm each tool's download cache
            _one(tool, wheel, work)
        seconds = {tool: [] for tool in TOOLS}
        for _ in range(repeats):
            for tool in TOOLS:
                seconds[tool].append(_one(tool, wheel, work))
    stats = {tool: spread(xs) for tool, xs in seconds.items()}
    results = {"what": f"install of the wheel[{EXTRAS}] into a fresh venv with torch", "repeats": repeats,
               "seconds": seconds, "spread": stats,
               "ratio_uv_over_pip": stats["uv"]["median"] / stats["pip"]["median"]}
    path = write_results("install_tools", results)
    print(f"pip {stats['pip']['median']:.1f} s, uv {stats['uv']['median']:.1f} s (median of {repeats}); "
          f"uv/pip {results['ratio_uv_over_pip']:.3f}; {path}")
    return results


if __name__ == "__main__":
    main()
