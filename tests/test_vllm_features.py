"""The vLLM adapter's capability checks (``integrations/vllm/features.py``): every feature holds on the installed
vLLM, each hook is a named ``VLLM_SOURCES`` entry, and a moved symbol (simulated) switches off only its feature.
Importing the adapter package imports no vLLM module (a moved symbol cannot break the other processors)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

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
    assert not status.available and "process_dict_updates" in status.reason and "Fix: install a vLLM" in status.warning()
    assert check(features.INJECTOR).available and check(features.LIVE_ENGINE_AUDIT).available


def test_importing_the_adapter_package_imports_no_vllm():
    code = ("import sys, tim_plugins.integrations.vllm, tim_plugins.integrations.vllm.features; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
