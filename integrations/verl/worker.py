"""Actor worker that hands the ``tim`` settings to its engine and returns the merged metrics to the driver.

Used by the tim trainer modes (``trainer.v1.trainer_mode=tim_sync`` ...), which copy the top-level ``tim`` node
of the config to ``actor_rollout_ref.tim`` (the only part of the config the workers receive).
"""

from __future__ import annotations

import dataclasses

# VERL_SOURCES verl.single_controller.base.decorator:register
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from .config import ActorContext, TIMVerlConfig
from .features import verl_features

__all__ = ["TIMActorRolloutRefWorker"]


# VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker (self.config, self.actor.engine)
class TIMActorRolloutRefWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        tim = TIMVerlConfig.from_node(self.config.get("tim"))
        if self.actor is not None and tim.worker_side_active:
            context = ActorContext.from_node(self.config.get(ActorContext.NODE))
            engine = self.actor.engine
            if not hasattr(engine, "tim_configure"):
                raise RuntimeError(
                    f"tim-plugins: the actor engine is {type(engine).__name__}, not the tim engine. The tim engine "
                    "is registered for device 'cuda', vendor 'nvidia' (NVIDIA GPUs; VERL_ENGINE_DEVICE / "
                    "VERL_ENGINE_VENDOR override the detected ones), by the tim_plugins verl plugin: check that it "
                    "loads in the Ray workers (VERL_USE_EXTERNAL_PLUGINS, tim-plugins installed where they run).")
            # the features whose upstream hooks moved in this process's verl, and those the driver switched off
            off = tuple(dict.fromkeys((*(s.feature.name for s in verl_features() if not s.available),
                                       *context.features_off)))
            engine.tim_configure(tim, context=dataclasses.replace(context, features_off=off))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tim_begin_step(self, step: int) -> None:
        """The driver's global step, before the step's first actor pass (names the step's dump file and the
        probe's checks)."""
        if self.actor is not None and hasattr(self.actor.engine, "tim_begin_step"):
            self.actor.engine.tim_begin_step(step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tim_pop_metrics(self) -> dict:
        """This rank's ``tim_report``: whether it holds outputs, the metrics merged over DP since the last call and
        the parity probe's decision or None (every holding rank has the same); {} without a tim engine."""
        if self.actor is None or not hasattr(self.actor.engine, "tim_report"):
            return {}
        return self.actor.engine.tim_report()
