"""tests/bounded.py: a bounded run is killed, with its whole process group, at its bound or at the first output
line that says it can no longer succeed (``abort_on``)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from bounded import run_bounded

# Prints a line, starts a child in the same process group, prints its pid and a marker, then waits for the child.
SCRIPT = "echo start; sleep 30 & echo child $!; echo {marker}; wait; echo finished"


def _gone(pid: int, within: float = 10.0) -> bool:
    """The process no longer runs (gone, or a zombie left for its new parent to reap) within ``within`` seconds: a
    SIGKILL to the group is delivered at once, but a member's exit completes asynchronously (a loaded machine showed
    the orphaned ``sleep`` still running right after ``run_bounded`` returned)."""
    import time

    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _child(output: str) -> int:
    return int(re.search(r"^child (\d+)$", output, re.M).group(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_abort_on_kills_the_group_at_the_first_matching_line():
    proc, timed_out = run_bounded(["sh", "-c", SCRIPT.format(marker="FATAL: worker killed")], 120,
                                  abort_on=re.compile(r"^FATAL"))
    assert not timed_out
    assert proc.returncode == -9  # killed: left alone, the shell exits 0 after its child
    assert "FATAL: worker killed" in proc.stdout and "finished" not in proc.stdout
    assert _gone(_child(proc.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_abort_on_without_a_match_runs_to_the_end_or_the_bound():
    proc, timed_out = run_bounded(["sh", "-c", "echo one; echo two"], 120, abort_on=re.compile("FATAL"))
    assert (proc.returncode, timed_out, proc.stdout) == (0, False, "one\ntwo\n")
    proc, timed_out = run_bounded(["sh", "-c", SCRIPT.format(marker="no marker")], 5, abort_on=re.compile("FATAL"))
    assert timed_out and proc.returncode == -9
    assert proc.stdout.startswith("start\n") and "finished" not in proc.stdout
    assert _gone(_child(proc.stdout))


def test_abort_on_needs_the_merged_output():
    with pytest.raises(ValueError, match="merge_stderr=True"):
        run_bounded(["true"], 10, merge_stderr=False, abort_on=re.compile("x"))


def test_a_child_does_not_inherit_the_parents_distributed_rendezvous(monkeypatch):
    # What an in-process TRL colocate run leaves in os.environ (and accelerate reads as a multi-CPU launch).
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TIM_KEEP_ME", "kept")
    show = 'echo "${RANK-unset} ${WORLD_SIZE-unset} ${TIM_KEEP_ME-unset} ${MASTER_ADDR-unset} ${MASTER_PORT-unset}"'
    proc, _ = run_bounded(["sh", "-c", show], 60)
    *rest, addr, port = proc.stdout.split()
    assert rest == ["unset", "unset", "kept"]
    # A rendezvous of its own: not the parent's port, nor one of the fixed ports TRL tries first.
    assert addr == "127.0.0.1" and port.isdigit() and int(port) not in (29500, 23456, 12355, 12345), port
    proc, _ = run_bounded(["sh", "-c", show], 60, env={**os.environ, "TIM_KEEP_ME": "given"})
    assert proc.stdout.split()[:3] == ["unset", "unset", "given"]
