"""Test helper: run a command in its own process group, bounded in time, and leave nothing behind.

A test that starts a server, a browser or a framework's whole trainer must not outlive its bound, nor leave
children (Ray, vLLM's engine core, renderer processes) running: the group is killed on timeout, and again after
a normal exit for whatever the command left behind. A child never inherits the test process's torch.distributed rendezvous (``RANK``, ``MASTER_PORT``, ...): an
in-process TRL run sets them in ``os.environ`` and keeps their port, and a child trainer that read them would
join a process group that is not its own (accelerate takes ``RANK`` as a multi-CPU launch) and fail on the taken
port. Instead the child gets a rendezvous address of its own, ``MASTER_ADDR=127.0.0.1`` and a ``MASTER_PORT`` the OS
gave out: left unset, TRL's vLLM colocate mode takes the first free of 29500, 23456, ... (``trl/trainer/utils.py``
``_find_free_port``), a check-then-bind that two suites side by side (`make test`) lose to each other. A run that can no longer succeed (``abort_on``: e.g. Ray's
OOM monitor killed a worker, and the driver would wait for it until the bound) is killed at the first such line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

from free_port import free_port

__all__ = ["DIST_ENV", "run_bounded"]

DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def run_bounded(cmd: list[str], timeout: float, *, merge_stderr: bool = True, abort_on: re.Pattern | None = None,
                **popen_kwargs) -> tuple[subprocess.CompletedProcess, bool]:
    """(the completed process, whether it ran past ``timeout`` and was killed). Output is text; stderr joins
    stdout unless ``merge_stderr=False``. With ``abort_on`` (merged output only), the group is killed as soon as
    an output line matches it (returncode -9, the output up to the end of the group's last writes)."""
    if abort_on is not None and not merge_stderr:
        raise ValueError("run_bounded: abort_on reads the merged output; it needs merge_stderr=True")
    env = popen_kwargs.pop("env", None)
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in DIST_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True, **popen_kwargs)
    timed_out = False
    try:
        if abort_on is None:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                out, err = proc.communicate()
        else:
            (out, timed_out), err = _read_until(proc, timeout, abort_on), None
    finally:
        _kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_until(proc: subprocess.Popen, timeout: float, abort_on: re.Pattern) -> tuple[str, bool]:
    """(the output, whether ``timeout`` passed): read line by line to the end; the group is killed at the first
    line that matches ``abort_on``, or when ``timeout`` passes."""
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if not done.is_set() and abort_on.search(line):
                done.set()
                _kill_group(proc)
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = not done.wait(timeout)
    if timed_out:
        _kill_group(proc)
    reader.join()
    proc.wait()
    return "".join(lines), timed_out
