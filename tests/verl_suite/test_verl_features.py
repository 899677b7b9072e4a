"""The verl adapter's capability checks (``integrations/verl/features.py``): every feature holds on the installed
verl; a hook that moved (simulated: a changed signature) switches off that feature alone, and the plugin then
leaves it unregistered with one line on stderr while registering the rest (run in a fresh process, as verl loads
the plugin: ``import verl`` with the entry point switched off, the hook changed, then ``register()``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")

from tim_plugins.capabilities import check  # noqa: E402
from tim_plugins.integrations.verl import features  # noqa: E402
from tim_plugins.integrations.verl.sources import VERL_SOURCES  # noqa: E402

TI = "verl.workers.engine.fsdp.transformer_impl"


def test_every_feature_holds_and_checks_only_named_sources():
    for status in features.verl_features():
        assert status.available, status.warning()
    for feature in features.FEATURES:
        assert feature.hooks and all((h.module, h.qualname) in VERL_SOURCES for h in feature.hooks)


def test_a_changed_signature_switches_off_its_feature(monkeypatch):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    def prepare_model_outputs(self, output, micro_batch):  # one parameter fewer than the hook binds
        raise AssertionError("never called")

    monkeypatch.setattr(FSDPEngineWithLMHead, "prepare_model_outputs", prepare_model_outputs)
    status = check(features.ENGINE)
    assert not status.available
    assert "FSDPEngineWithLMHead.prepare_model_outputs(self, output, micro_batch) takes no output_args" in status.reason
    version = importlib.metadata.version("verl")
    assert f"(verl {version})" in status.warning() and "tim/diag/feature_off/verl_engine" in status.warning()
    assert check(features.TRAINER_MODES).available and check(features.LR_DECAY).available


@pytest.mark.slow
def test_plugin_registers_the_features_that_hold():
    code = textwrap.dedent("""
        import verl
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        def prepare_model_outputs(self, output, micro_batch):
            pass
        FSDPEngineWithLMHead.prepare_model_outputs = prepare_model_outputs
        from tim_plugins.integrations.verl import plugin
        r = plugin.REGISTERED
        print("RESULT", r["engine"], r["features_off"], r["trainer_modes"])
    """)
    # the entry point off (register() by hand after the change); verl's own platform (importing the engine
    # modules needs no device), not this suite's CPU platform, which loads through an entry point too
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert result.startswith("RESULT None ['verl_engine'] [") and "tim_sync" in result
    lines = [x for x in proc.stderr.splitlines() if "tim_plugins:" in x and "is off" in x]
    assert len(lines) == 1 and "monitor + safe vocabulary in verl's FSDP actor engine is off" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["engine_mixin", "engine"])
def test_a_script_that_imports_an_engine_module_before_verl_still_registers_it(module):
    """A script that imports the engine's module before verl (to subclass the engine, say): that import's own verl
    imports load verl's plugins, this one, while the module is half-imported. The plugin waits for the import to end
    (``plugin.register_deferred``) and registers everything then; before, it failed with a circular import and verl
    picked its own engine."""
    code = textwrap.dedent(f"""
        import tim_plugins.integrations.verl.{module}
        from verl.workers.engine import EngineRegistry
        from tim_plugins.integrations.verl import plugin
        from tim_plugins.integrations.verl.engine import TIMFSDPEngineWithLMHead
        picked = EngineRegistry.get_engine_cls("language_model", "fsdp2")
        print("RESULT", picked is TIMFSDPEngineWithLMHead, plugin.REGISTERED["engine"] is picked,
              sorted(plugin.REGISTERED["trainer_modes"]))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}  # verl's entry-point loading, as users
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert result.startswith("RESULT True True [") and "'tim_sync'" in result, result
    assert "loading the verl plugin" not in proc.stderr and "circular import" not in proc.stderr
