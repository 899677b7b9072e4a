"""Actor worker that hands the ``tim`` settings to its engine, returns the merged metrics to the driver, and drives the
weight-sync check around verl's ``update_weights`` (``sync_check.py``).

Used by the tim trainer modes (``trainer.v1.trainer_mode=tim_sync`` ...), which copy the top-level ``tim`` node
of the config to ``actor_rollout_ref.tim`` (the only part of the config the workers receive).
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

# VERL_SOURCES verl.single_controller.base.decorator:register
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from .composed import BACKEND_FIX, TIM_ENGINE_BACKENDS
from .config import ActorContext, TIMVerlConfig
from .features import verl_features

__all__ = ["TIMActorRolloutRefWorker", "tim_worker_class"]


# VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker (self.config, self.actor.engine)
class TIMActorRolloutRefWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        tim = TIMVerlConfig.from_node(self.config.get("tim"))
        if self.actor is not None and tim.worker_side_active:
            context = ActorContext.from_node(self.config.get(ActorContext.NODE))
            engine = self.actor.engine
            # the backend verl built the engine for (VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker)
            backend = getattr(getattr(self.actor, "engine_config", None), "strategy", None)
            if not hasattr(engine, "tim_configure") and backend not in TIM_ENGINE_BACKENDS:
                # no registration problem: the tim engine does not exist for this backend (the driver's
                # check_composed_config refuses it first; this is for a config that did not pass there)
                raise RuntimeError(
                    f"tim-plugins: the actor engine is {type(engine).__name__}, for the actor backend {backend!r} "
                    "(actor_rollout_ref.actor.strategy, or model_engine): this strategy has no tim engine, which is "
                    f"registered for the backends {', '.join(TIM_ENGINE_BACKENDS)} only. Fix: {BACKEND_FIX}")
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
    def tim_begin_step(self, step: int, part: int = 0, parts: int = 1) -> None:
        """The driver's global step, before each actor update's first pass (names the step's dump file and the
        probe's checks; ``part`` of ``parts``: the update among the step's ``parameter_sync_step``)."""
        if self.actor is not None and hasattr(self.actor.engine, "tim_begin_step"):
            self.actor.engine.tim_begin_step(step, part, parts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tim_pop_metrics(self) -> dict:
        """This rank's ``tim_report``: whether it holds outputs, the metrics merged over DP since the last call and
        the parity probe's decision or None (every holding rank has the same); {} without a tim engine."""
        if self.actor is None or not hasattr(self.actor.engine, "tim_report"):
            return {}
        return self.actor.engine.tim_report()

    # VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker.update_weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        """verl's weight sync, unchanged; with the sync check on, the engine's stream is sampled as it goes
        (``TIMEngineMixin.get_per_tensor_param``) and, once verl has returned, this rank's replica is read and
        compared, and every rank's report reaches the pipeline of the first rank that holds outputs."""
        watch = self._tim_watch()
        verl_sync = super().update_weights
        if watch is None:
            return await verl_sync(global_steps=global_steps, mode=mode)
        if self._tim_replica_reads and self._tim_sync_mode(mode) not in ("naive", "delta_sharded"):
            # the disaggregated sync: sent here, read once every replica has loaded (tim_read_replicas)
            return await watch.sent(global_steps, lambda: verl_sync(global_steps=global_steps, mode=mode),
                                    reads_here=self._tim_rank() == 0)
        server = self._tim_sync_server(mode)
        return await watch.around(global_steps, lambda: verl_sync(global_steps=global_steps, mode=mode),
                                  None if server is None else server.tim_read_weights.remote, self._tim_gather)

    _tim_replica_reads = False  # set by the driver (tim_expect_replica_reads) where its half of the check holds

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tim_expect_replica_reads(self) -> None:
        """The driver reads the rollout replicas after each disaggregated sync (``tim_read_replicas``): from now on
        this worker's disaggregated syncs keep their record for it."""
        self._tim_replica_reads = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def tim_read_replicas(self, servers: list) -> None:
        """After a disaggregated sync has loaded every replica (the driver, when verl's checkpoint manager returned):
        the rank that sampled the stream reads each replica's server (``servers``: one handle per replica, None
        where the server cannot answer the reads) and compares; every rank's reports reach the pipeline
        (``sync_check.SyncWatch.read_replicas``)."""
        watch = self._tim_watch()
        if watch is None:
            return
        reads = [None if s is None or not hasattr(s, "tim_read_weights") else s.tim_read_weights.remote
                 for s in servers]
        await watch.read_replicas(reads, self._tim_gather)

    def _tim_watch(self):
        """The actor engine's weight-sync check (``sync_check.SyncWatch``), None when it is off or not a tim engine."""
        return getattr(self.actor.engine, "tim_sync_watch", None) if self.actor is not None else None

    async def _tim_gather(self, reports: list) -> tuple[list, bool]:
        return await asyncio.to_thread(self._tim_gather_reports, reports)

    def _tim_sync_mode(self, mode: str) -> str:
        # VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker.update_weights (mode "auto": the checkpoint
        # engine's backend)
        return mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend

    @staticmethod
    def _tim_rank() -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _tim_sync_server(self, mode: str):
        """This rank's replica's server handle when the sync is colocated and this rank holds it and the server
        answers the sync reads (``rollout._SyncReads``), else None."""
        # VERL_SOURCES verl.workers.engine_workers:ActorRolloutRefWorker.update_weights ("naive": colocated, the
        # rollout's update_weights loads the engine before returning)
        rollout = getattr(self, "rollout", None)
        if self._tim_sync_mode(mode) != "naive" or rollout is None:
            return None
        # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter._ensure_server_handle
        ensure = getattr(rollout, "_ensure_server_handle", None)
        if ensure is None or not ensure():
            return None
        handle = rollout.server_handle
        return handle if hasattr(handle, "tim_read_weights") else None

    def _tim_gather_reports(self, reports: list) -> tuple[list, bool]:
        """Every rank's reports of this sync (world group), and whether this rank is the one that hands them to its
        pipeline: the first that holds outputs (the rank whose metrics the driver logs)."""
        holds = self.actor.engine.tim_sync_watch.holds_outputs()
        if not torch.distributed.is_available() or not torch.distributed.is_initialized() \
                or torch.distributed.get_world_size() == 1:
            return list(reports), holds
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (holds, list(reports)))
        first = next((rank for rank, (h, _) in enumerate(gathered) if h), None)
        return [r for _, rs in gathered for r in rs], first == torch.distributed.get_rank()


_WORKER_CLASSES: dict = {}


def tim_worker_class(chosen: type | None) -> type:
    """The tim worker in front of ``chosen``, the class a trainer mode put behind an actor role: verl's
    ``ActorRolloutRefWorker`` itself (or an unknown entry) gives ``TIMActorRolloutRefWorker``; a subclass of it
    (``separate_async``'s ``DetachActorWorker``) gives a class with the tim worker's methods first and the
    subclass's own after them (made once per class)."""
    if not isinstance(chosen, type) or not issubclass(chosen, ActorRolloutRefWorker) \
            or chosen is ActorRolloutRefWorker:
        return TIMActorRolloutRefWorker
    if issubclass(chosen, TIMActorRolloutRefWorker):
        return chosen
    made = _WORKER_CLASSES.get(chosen)
    if made is None:
        made = _WORKER_CLASSES[chosen] = type(f"TIM{chosen.__name__}", (TIMActorRolloutRefWorker, chosen), {
            "__module__": __name__, "__doc__": f"{TIMActorRolloutRefWorker.__name__} in front of verl's "
                                               f"{chosen.__module__}.{chosen.__qualname__}"})
    return made
