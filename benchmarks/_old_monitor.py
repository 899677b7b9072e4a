"""The mismatch monitor as an earlier commit had it, importable next to today's, for same-run comparisons.

``load_old_monitor(ref)`` copies that commit's monitor modules (``git show``) into a temporary folder as the
package ``tim_plugins_<ref>`` (their ``tim_plugins.`` imports renamed) and imports its ``metrics`` module. The
default ref, c959215, is the last commit of the multi-module monitor (one Triton kernel launched past Triton's
JIT, and the ``torch.compile`` pass on the CPU).
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["OLD_REF", "load_old_monitor"]

OLD_REF = "c959215"
# The monitor's modules over its history; those a ref lacks are left out (c959215 has no _mismatch_layout, today's
# monitor no _mismatch_launch).
_MODULES = ("__init__", "metrics", "_mismatch_pass", "_mismatch_launch", "_mismatch_triton", "_monitor_cuda",
            "_monitor_inputs", "_mismatch_layout", "_mismatch_kernel", "_optional")
_ROOT = Path(__file__).resolve().parents[1]


def load_old_monitor(ref: str = OLD_REF):
    """The ``metrics`` module of ``ref`` (its ``MismatchMonitor``), or raise RuntimeError saying why not."""
    package = f"tim_plugins_{ref}"
    if package in sys.modules:
        return importlib.import_module(f"{package}.metrics")
    root = tempfile.mkdtemp(prefix="tim_old_monitor_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    folder = Path(root) / package
    folder.mkdir()
    for name in _MODULES:
        if subprocess.run(["git", "cat-file", "-e", f"{ref}:tim_plugins/{name}.py"], cwd=_ROOT,
                          capture_output=True).returncode != 0 and name not in ("__init__", "metrics"):
            continue  # not a module of that ref's monitor
        try:
            source = subprocess.run(["git", "show", f"{ref}:tim_plugins/{name}.py"], cwd=_ROOT, check=True,
                                    capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as err:
            raise RuntimeError(f"cannot read tim_plugins/{name}.py at {ref} from git: {err}") from err
        (folder / f"{name}.py").write_text(source.replace("tim_plugins.", f"{package}."))
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module(f"{package}.metrics")
