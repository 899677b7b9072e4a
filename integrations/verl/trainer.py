"""Driver side: verl V1 trainer modes ``tim_<mode>`` (``trainer.v1.trainer_mode=tim_sync``).

Each is verl's own registered trainer class with this mixin in front. Before any worker starts it validates the
``tim`` node against the composed config, runs the parity audit and prints its table (``tim.parity.strict``
stops here on an error-level finding), copies the settings to ``actor_rollout_ref.tim`` for the workers and swaps
in ``TIMActorRolloutRefWorker``. Each step it collects the workers' DP-merged metrics after the old-log-prob pass
and after the actor update, adds them to verl's step metrics under their exact ``tim/...`` keys (logged by
verl's ``Tracking``), and lets the live probe act on them.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import open_dict

from .config import TRAINER_MODE_PREFIX, TIMVerlConfig, check_composed_config

__all__ = ["TIMTrainerMixin", "register_tim_trainers", "run_startup_audit"]

logger = logging.getLogger(__name__)


def run_startup_audit(config, tim: TIMVerlConfig, out=None):
    """Audit rollout vs trainer numerics on the composed config; print the table. Returns the findings. Raises ``ParityError`` when ``tim.parity.strict`` and an error is found."""
    out = out or sys.stdout
    from tim_plugins.parity.audit import audit, has_errors
    from tim_plugins.parity.findings import ParityError
    from tim_plugins.parity.table import findings_table

    from .parity_spec import specs_from_config

    rollout, trainer = specs_from_config(config)
    findings = audit(rollout, trainer)
    print(findings_table(findings, framework="verl"), file=out)
    if tim.parity.strict and has_errors(findings):
        raise ParityError("tim.parity.strict=true and the audit found error-level mismatches (table above); "
                          "fix them or set +tim.parity.strict=false", findings=findings)
    return findings


class TIMTrainerMixin:
    """Put in front of a verl ``PPOTrainer`` subclass."""

    def __init__(self, config):
        tim, problems, notes = check_composed_config(config)
        for note in notes:
            logger.warning("tim-plugins: %s", note)
        if problems:
            raise ValueError("tim-plugins: the config cannot work as composed:\n  - " + "\n  - ".join(problems))
        if tim.parity.audit:
            run_startup_audit(config, tim)
        self.tim = tim
        self._tim_probe = None
        if tim.probe.enabled:
            from tim_plugins.parity.probe import ParityProbe, ParityProbeConfig

            self._tim_probe = ParityProbe(ParityProbeConfig(
                kl_k3_max=tim.probe.kl_k3, abs_diff_max=tim.probe.abs_diff_max,
                seq_log_ratio_abs_max=tim.probe.seq_log_ratio_abs_max, action=tim.probe.action))
        with open_dict(config):
            config.actor_rollout_ref.tim = tim.to_dict()
            config.actor_rollout_ref.tim_rollout_correction = {
                "bypass_mode": bool((config.algorithm.get("rollout_correction") or {}).get("bypass_mode", False))}
        super().__init__(config)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        import ray

        from .worker import TIMActorRolloutRefWorker

        for role in list(self.role_worker_mapping):
            if "Actor" in str(role) or "Rollout" in str(role):
                self.role_worker_mapping[role] = ray.remote(TIMActorRolloutRefWorker)

    def _tim_collect(self, metrics: dict) -> None:
        if not self.tim.worker_side_active:
            return
        results = self.actor_rollout_wg.tim_pop_metrics()
        found = next((r for r in results if r), {})
        metrics.update(found)
        if self._tim_probe is not None and "tim/tokens" in found:
            decision = self._tim_probe.check(self.global_steps, found)  # raises for action=raise
            metrics.update(decision.metrics())
            if decision.stop:
                # verl saves a checkpoint on the last step: make this step the last one
                logger.warning("tim-plugins: parity probe asked to stop at step %s", self.global_steps)
                self.total_training_steps = self.global_steps

    def _compute_old_log_prob(self, batch, metrics):
        batch = super()._compute_old_log_prob(batch, metrics)
        self._tim_collect(metrics)
        return batch

    def _update_actor(self, batch, metrics):
        batch = super()._update_actor(batch, metrics)
        self._tim_collect(metrics)
        return batch


def register_tim_trainers() -> list[str]:
    """Register ``tim_<name>`` for every trainer mode verl has registered; returns the new names."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    added = []
    for name, cls in list(TRAINER_REGISTRY.items()):
        if name.startswith(TRAINER_MODE_PREFIX):
            continue
        tim_name = TRAINER_MODE_PREFIX + name
        if tim_name in TRAINER_REGISTRY:
            continue
        register_trainer(tim_name)(type(f"TIM{cls.__name__}", (TIMTrainerMixin, cls), {"__module__": __name__}))
        added.append(tim_name)
    return added
