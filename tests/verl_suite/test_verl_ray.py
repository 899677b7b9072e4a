"""Ray: two local CPU worker processes run ``import verl``; the ``verl.plugins`` entry point loads our plugin
there and its registrations are visible (no explicit import of tim_plugins in the workers)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_two_ray_workers_load_the_entry_point():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "auto", "VERL_PLATFORM": ""}})
    try:
        @ray.remote(num_cpus=1)
        class Probe:
            def look(self):
                import os
                import sys

                assert "tim_plugins" not in sys.modules  # nothing imported it yet: only the entry point will
                import verl  # noqa: F401
                from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
                from verl.workers.engine import EngineRegistry

                eng = EngineRegistry._engines["language_model"]["fsdp2"][("cuda", "nvidia")]
                return os.getpid(), f"{eng.__module__}.{eng.__name__}", sorted(
                    k for k in TRAINER_REGISTRY if k.startswith("tim_")), "tim_plugins.integrations.verl.plugin" \
                    in sys.modules

        actors = [Probe.remote() for _ in range(2)]
        # two fresh workers import torch and verl: ~95 s on a quiet machine, over 4 min beside another suite
        results = ray.get([a.look.remote() for a in actors], timeout=600)
    finally:
        ray.shutdown()
    assert results[0][0] != results[1][0]
    for _pid, engine, modes, loaded in results:
        assert engine == "tim_plugins.integrations.verl.engine.TIMFSDPEngineWithLMHead"
        assert modes == ["tim_colocate_async", "tim_separate_async", "tim_sync"]
        assert loaded


def test_missing_v1_trainer_package_is_named():
    """When verl's V1 trainer cannot be imported, the plugin's message names the package that provides the
    missing module (verl does not declare these dependencies)."""
    from tim_plugins.integrations.verl.plugin import V1_TRAINER_PACKAGES, _missing_package_hint

    err = ModuleNotFoundError("No module named 'transfer_queue'", name="transfer_queue")
    assert "pip install TransferQueue" in _missing_package_hint(err)
    assert "tim-plugins[verl]" in _missing_package_hint(ModuleNotFoundError("x", name="somethingelse"))
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["verl"]
    for dist in V1_TRAINER_PACKAGES.values():
        assert any(req.split(">")[0].split("=")[0] == dist for req in extra), dist
