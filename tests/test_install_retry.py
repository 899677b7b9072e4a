"""The install steps survive a dropped download: scripts/retry re-runs a failing command, and every download in
the Makefile goes through it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RETRY = ROOT / "scripts" / "retry"


def _run_retry(tmp_path, fail_times, attempts, pause="0"):
    """Run scripts/retry on a command that exits 7 on its first `fail_times` calls, then 0."""
    counter = tmp_path / "calls"
    flaky = (
        f'n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}; '
        f"[ $n -gt {fail_times} ] || exit 7"
    )
    env = {**os.environ, "RETRY_ATTEMPTS": str(attempts), "RETRY_PAUSE_S": pause}
    done = subprocess.run(["bash", str(RETRY), "bash", "-c", flaky], env=env, capture_output=True, text=True)
    calls = int(counter.read_text()) if counter.exists() else 0
    return done, calls


@pytest.mark.parametrize(("fail_times", "attempts", "expect_rc", "expect_calls"), [
    (0, 4, 0, 1),   # success first time: no second run
    (2, 4, 0, 3),   # two drops, then through
    (3, 4, 0, 4),   # succeeds on the last allowed attempt
    (9, 4, 7, 4),   # gives up after exactly 4 runs with the command's own exit status
    (9, 1, 7, 1),
])
def test_retry_reruns_until_success_or_the_attempt_limit(tmp_path, fail_times, attempts, expect_rc, expect_calls):
    done, calls = _run_retry(tmp_path, fail_times, attempts)
    assert (done.returncode, calls) == (expect_rc, expect_calls), done.stderr
    assert done.stderr.count("retrying in 0 s") == min(fail_times, attempts - 1)


@pytest.mark.parametrize(("name", "value"), [("RETRY_ATTEMPTS", "0"), ("RETRY_ATTEMPTS", "x"), ("RETRY_PAUSE_S", "-1")])
def test_retry_rejects_a_bad_setting_quoting_it(name, value):
    env = {**os.environ, name: value}
    done = subprocess.run(["bash", str(RETRY), "true"], env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert f"{name}='{value}'" in done.stderr and "e.g." in done.stderr


def test_every_makefile_download_goes_through_retry():
    recipe_lines = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("\t")]
    # pip's own installs and those of scripts/pip_install (uv, else pip)
    installs = [line for line in recipe_lines if re.search(r"\bpip install\b|\$\(PIP_INSTALL\)", line)]
    assert len(installs) >= 7  # the environment (5) and the wheel check (2)
    unguarded = [line for line in installs if not line.startswith("$(RETRY) ")]
    assert unguarded == []
    assert re.search(r"^RETRY := scripts/retry$", (ROOT / "Makefile").read_text(), re.M)


def test_readme_states_the_scripts_own_defaults():
    script = RETRY.read_text()
    attempts = int(re.search(r'attempts="\$\{RETRY_ATTEMPTS:-(\d+)\}"', script).group(1))
    pause = int(re.search(r'pause="\$\{RETRY_PAUSE_S:-(\d+)\}"', script).group(1))
    pauses = ", ".join(f"{pause * k} s" for k in range(1, attempts))
    readme = " ".join((ROOT / "docs" / "install.md").read_text().split())
    assert f"up to {attempts} attempts, pausing {pauses}" in readme
