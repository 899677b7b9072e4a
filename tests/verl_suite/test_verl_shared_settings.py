"""The settings verl shares with TRL (``tim_plugins.options``), through verl's own Hydra ``ppo_trainer`` config and the
trainer class main_ppo's TaskRunner builds: ``tim.probe.enable`` switches on the probe TRL's ``parity_probe=True``
runs, ``tim.safe_vocab.min_p`` takes TRL's range, and a combination TRL refuses stops the driver with the fix."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import harness  # noqa: E402,F401  (CPU platform before verl)
from test_verl_config import compose, recipe_overrides  # noqa: E402

from tim_plugins.options import DEPENDENCY_RULES, MIN_P_RULE  # noqa: E402
from tim_plugins.parity.probe import ParityProbeConfig  # noqa: E402


def _recipe_without(toy_model_path, *prefixes):
    return [o for o in recipe_overrides(toy_model_path) if not o.startswith(prefixes)]


@pytest.mark.parametrize("extra, expected", [
    ([], ParityProbeConfig(action="stop")),  # the core's limits: kl_k3_max 1e-3
    (["+tim.probe.abs_diff_max=0.5"], ParityProbeConfig(abs_diff_max=0.5, action="stop")),
    (["+tim.probe.kl_k3=null", "+tim.probe.abs_diff_max=0.5"],
     ParityProbeConfig(kl_k3_max=None, abs_diff_max=0.5, action="stop")),
])
def test_probe_enable_is_trl_s_parity_probe_through_the_composed_config(toy_model_path, extra, expected):
    from omegaconf import OmegaConf

    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    cfg = compose(_recipe_without(toy_model_path, "+tim.probe.kl_k3") + ["+tim.probe.enable=true", *extra])
    tim, problems, _ = check_composed_config(cfg)
    assert problems == [] and tim.probe.config() == expected
    # what the driver hands the workers (actor_rollout_ref.tim) reads back as the same probe
    assert TIMVerlConfig.from_node(OmegaConf.create(tim.to_dict())).probe.config() == expected


def test_probe_enable_false_is_off_whatever_limits_are_set(toy_model_path):
    from omegaconf import OmegaConf

    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    cfg = compose(recipe_overrides(toy_model_path) + ["+tim.probe.enable=false"])
    assert cfg.tim.probe.kl_k3 == 1e-2  # the recipe's limit is still there
    tim, problems, _ = check_composed_config(cfg)
    assert problems == [] and not tim.probe.enabled and tim.probe.config() is None
    assert TIMVerlConfig.from_node(OmegaConf.create(tim.to_dict())).probe.config() is None
    # the recipe as it is (a limit without enable) keeps its meaning: only that limit
    tim, _, _ = check_composed_config(compose(recipe_overrides(toy_model_path)))
    assert tim.probe.config() == ParityProbeConfig(kl_k3_max=1e-2, action="stop")


@pytest.mark.parametrize("override, quoted, rule, fix", [
    (["+tim.parity.audit=false"], "tim.parity.strict=True", DEPENDENCY_RULES["strict_needs_audit"],
     "Fix: ++tim.parity.audit=true"),
    (["+tim.monitor.enable=false"], "tim.probe=", DEPENDENCY_RULES["probe_needs_monitor"],
     "Fix: ++tim.monitor.enable=true"),
    (["+tim.safe_vocab.min_p=1.0"], "tim.safe_vocab.min_p=1.0", MIN_P_RULE, "Fix: ++tim.safe_vocab.min_p="),
])
def test_what_trl_refuses_stops_the_driver(toy_model_path, override, quoted, rule, fix):
    """Through the trainer class main_ppo builds for the run's mode, before any worker starts."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    key = override[0].split("=", 1)[0]
    cfg = compose(_recipe_without(toy_model_path, key) + override)
    with pytest.raises(ValueError) as err:
        get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
    assert quoted in str(err.value) and rule in str(err.value) and fix in str(err.value), str(err.value)


def test_min_p_zero_is_no_pruning(toy_model_path):
    from tim_plugins.integrations.verl.composed import check_composed_config

    overrides = _recipe_without(toy_model_path, "+tim.safe_vocab.min_p", "'+actor_rollout_ref.rollout.engine_kwargs",
                                "+actor_rollout_ref.rollout.engine_kwargs")
    tim, problems, _ = check_composed_config(compose(overrides + ["+tim.safe_vocab.min_p=0"]))
    assert problems == [] and not tim.safe_vocab.enabled and tim.safe_vocab.min_p == 0.0
