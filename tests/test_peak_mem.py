"""scripts/peak_mem: the peak PSS of a whole process tree (children included), the largest processes named at the
peak, the command's exit status passed through."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PEAK_MEM = Path(__file__).resolve().parents[1] / "scripts" / "peak_mem"
MIB = 2**20

# A child that touches `n` MiB (bytearray zero-fills: every page is resident) and holds it for 4 s: longer than
# peak_mem's longest gap between two PSS reads (PSS_EVERY_S, 2 s) plus its tick, so a read falls after the fill even
# when the sampler is starved of CPU (with a 1.5 s hold, two loaded runs saw the 600 MiB child at 0.45 and 0.49 GiB).
CHILD = "import sys, time; b = bytearray({n} * 2**20); time.sleep(4.0); sys.exit({rc})"
# Two children side by side, each holding its memory until both hold theirs (each touches a file once filled and
# waits, up to 60 s, for the other's), then 4 s more: on a loaded machine one interpreter can start seconds after the
# other, and their holds must overlap for the tree's peak to be both (a CI run under a background install saw 0.6).
PAIRED = ("b = bytearray({n} * 2**20); import os, time; open(os.path.join({d!r}, str({n})), 'w').close(); "
          "t = time.time() + 60\nwhile len(os.listdir({d!r})) < 2 and time.time() < t: time.sleep(0.05)\n"
          "time.sleep(4.0)")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float, list[tuple[str, float]]]:
    proc = subprocess.run([sys.executable, str(PEAK_MEM), *args], capture_output=True, text=True, timeout=120)
    tree = float(re.search(r"process tree PSS ([\d.]+) GiB", proc.stdout).group(1))
    top = re.search(r"largest at the peak: (.*)$", proc.stdout, re.M).group(1)
    return proc, tree, [(m.group(1), float(m.group(2))) for m in re.finditer(r"(.+?) ([\d.]+) GiB(?:; |$)", top)]


def test_counts_grandchildren_and_names_the_largest(tmp_path, monkeypatch):
    # The measured command is a shell; the memory sits in its children, started in the background, side by side.
    for name, n in (("CHILD_A", 600), ("CHILD_B", 200)):
        monkeypatch.setenv(name, PAIRED.format(n=n, d=str(tmp_path)))
    script = f'{sys.executable} -c "$CHILD_A" & {sys.executable} -c "$CHILD_B" & wait'
    proc, tree, top = _run("t", "sh", "-c", script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 800 MiB touched, plus two interpreters (~10 MiB each) and the shell: 0.78-0.9 GiB, printed to 0.1 GiB.
    assert 0.7 <= tree <= 1.0, proc.stdout
    assert "600" in top[0][0] and 0.55 <= top[0][1] <= 0.7, top
    assert "200" in top[1][0] and 0.17 <= top[1][1] <= 0.3, top


def test_passes_the_exit_status_through():
    proc, tree, _ = _run("t", sys.executable, "-c", CHILD.format(n=50, rc=3))
    assert proc.returncode == 3 and "(rc 3)" in proc.stdout
    assert 0.0 <= tree <= 0.2


def test_usage():
    proc = subprocess.run([sys.executable, str(PEAK_MEM), "only-a-label"], capture_output=True, text=True)
    assert proc.returncode == 2 and "peak_mem LABEL COMMAND" in proc.stderr
