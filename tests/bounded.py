"""Test helper: run a command in its own process group, bounded in time, and leave nothing behind.

A test that starts a server, a browser or a framework's whole trainer must not outlive its bound, nor leave
children (Ray, vLLM's engine core, renderer processes) running: the group is killed on timeout, and again after
a normal exit for whatever the command left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["run_bounded"]


def run_bounded(cmd: list[str], timeout: float, *, merge_stderr: bool = True,
                **popen_kwargs) -> tuple[subprocess.CompletedProcess, bool]:
    """(the completed process, whether it ran past ``timeout`` and was killed). Output is text; stderr joins
    stdout unless ``merge_stderr=False``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True, **popen_kwargs)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), timed_out
