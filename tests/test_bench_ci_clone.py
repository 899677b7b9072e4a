"""benchmarks/bench_ci_clone: one `.ci/run` on a fresh clone, on a throw-away git repository whose `.ci/run` writes
what `make test` leaves (a suite record, a background environment's stamp) and exits with a known status."""

from __future__ import annotations

import json
import subprocess

from benchmarks.bench_ci_clone import run_once

CI_RUN = """#!/usr/bin/env bash
set -eu
mkdir -p tim-out/matrix/suites .venv-newest
sleep 1
touch .venv-newest/.tim-stack-abc
printf '%s' '{"suite": "main", "wall_s": 12.5, "setup_s": null, "rc": 1, "peak_pss_gib": 0.5,
 "counts": {"passed": 3, "failed": 1, "skipped": 0, "errors": 0}, "what": "tests/"}' > tim-out/matrix/suites/main.json
echo "ran at $(git rev-parse --short HEAD)"
exit 2
"""


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_one_run_records_the_status_the_suites_and_the_background_envs_then_removes_the_clone(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "run").write_text(CI_RUN)
    (repo / ".ci" / "run").chmod(0o755)
    _git(repo, "init", "-q")
    _git(repo, "add", ".ci/run")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "ci")
    rev = _git(repo, "rev-parse", "--short", "HEAD")
    work, log = tmp_path / "work", tmp_path / "ci.log"
    work.mkdir()
    run = run_once(rev, work, log, root=repo)
    assert run["rc"] == 2 and run["rev"] == rev
    assert run["wall_s"] >= 1.0
    assert run["suites"] == {"main": {"wall_s": 12.5, "setup_s": None, "rc": 1, "peak_pss_gib": 0.5,
                                      "counts": {"passed": 3, "failed": 1, "skipped": 0, "errors": 0}}}
    ready = run["background_ready_s"]
    assert ready[".venv-oldest"] is None and ready[".venv-megatron"] is None
    assert 0.9 <= ready[".venv-newest"] <= run["wall_s"] + 0.1
    assert log.read_text().strip() == f"ran at {rev}"
    assert list(work.iterdir()) == []
    assert run["cpu_probe_s"] > 0
    json.dumps(run)  # what the results file takes
