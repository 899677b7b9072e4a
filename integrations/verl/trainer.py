"""Driver side: verl V1 trainer modes ``tim_<mode>`` (``trainer.v1.trainer_mode=tim_sync``).

Each is verl's own registered trainer class with this mixin in front, and runs as that mode (verl's trainer
compares its mode name with "sync" and reads ``trainer.v1.<mode>``: ``trainer_mode`` answers the base mode's name).
Before any worker starts it validates the ``tim`` node against the composed config, runs the parity audit and
prints its table (``tim.parity.strict`` stops here on an error-level finding), copies the settings to
``actor_rollout_ref.tim`` for the workers and swaps in ``TIMActorRolloutRefWorker``. Each step it collects the
workers' DP-merged metrics after the old-log-prob pass and after the actor update, adds them to verl's step metrics
under their exact ``tim/...`` keys (logged by verl's ``Tracking``), and acts on the live probe's decision (made in
the workers from the merged metrics: warn, raise here, or stop after this step's checkpoint). With
``tim.dump.dir`` it writes the run's ``summary.json`` there (``write_run_summary``) and tells the workers each step's
number, which names the per-token dump files (``tim-plugins report <tim.dump.dir>`` renders them). The verl
internals it overrides or reads are entries of ``sources.VERL_SOURCES``, named where they are used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import torch
from omegaconf import open_dict

from tim_plugins.by_key import policy_lag
from tim_plugins.parity.findings import ParityError

from .composed import asks_sampling_mask, check_composed_config, dump_dir_problems
from .config import LAG_FIELD, TRAINER_MODE_PREFIX, ActorContext, TIMVerlConfig

__all__ = ["AUDIT_TITLE", "TIMTrainerMixin", "refuse_tim_node_under_legacy_trainer", "refuse_unread_tim_node",
           "register_tim_trainers", "run_startup_audit", "use_tim_actor_worker", "write_run_summary"]

logger = logging.getLogger(__name__)

# First line of the start-up audit's printout (tests and log scrapers look for it).
AUDIT_TITLE = "tim-plugins parity audit (vLLM rollout vs FSDP actor, from the composed config)"


def run_startup_audit(config, tim: TIMVerlConfig, out=None):
    """Audit rollout vs trainer numerics on the composed config; print the table. Returns the findings. Raises ``ParityError`` when ``tim.parity.strict`` and an error is found."""
    out = out or sys.stdout
    from tim_plugins.parity.report import audit_and_report

    from .parity_spec import specs_from_config

    rollout, trainer = specs_from_config(config)
    return audit_and_report(rollout, trainer, framework="verl", title=AUDIT_TITLE, strict=tim.parity.strict,
                            emit=lambda report: print(report.text, file=out),
                            strict_off="set ++tim.parity.strict=false").findings


def write_run_summary(config, tim: TIMVerlConfig, findings) -> Path:
    """``<tim.dump.dir>/summary.json`` (``tim_plugins.dump.write_summary``): what ``tim-plugins report`` needs beside
    the dump files to render a verl run as a TRL one: the framework (the fix column in verl's terms), the start-up
    audit's findings, and the model folder (its tokenizer decodes the largest disagreements). Written by the driver
    when training starts, after an earlier attempt's steps (and its summary) were moved aside."""
    from tim_plugins.dump import write_summary

    arr = config.actor_rollout_ref
    settings = {
        "model": str(arr.model.path),
        "rollout": f"{arr.rollout.get('name')} ({arr.rollout.get('dtype', 'bfloat16')})",
        "actor strategy": str(arr.actor.get("strategy")),
        "trainer mode": str(config.trainer.get("v1", {}).get("trainer_mode", "")),
        "tim": json.dumps(tim.to_dict(), sort_keys=True),
        # the sampler's truncation as set: the report's truncation section names these overrides
        "rollout sampling": json.dumps({k: arr.rollout.get(k) for k in ("top_p", "top_k", "temperature")}),
        # whether vLLM was asked for its kept sets: the report's truncation section says replay or recompute
        "sampling mask": "true" if asks_sampling_mask(config) else "false",
    }
    return write_summary(tim.dump.dir, framework="verl", title="Training-inference mismatch report (verl run)",
                         settings=settings, findings=None if findings is None else [f.to_dict() for f in findings])


class TIMTrainerMixin:
    """Put in front of a verl ``PPOTrainer`` subclass (``register_tim_trainers`` sets ``_tim_base_mode``)."""

    _tim_base_mode = "sync"

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__ (self.trainer_mode = the config's name, then
    # compared with "sync" and used as the config.trainer.v1 section): a tim mode runs as the mode it extends.
    @property
    def trainer_mode(self) -> str:
        return self._tim_base_mode

    @trainer_mode.setter
    def trainer_mode(self, name: str) -> None:
        if name not in (self._tim_base_mode, TRAINER_MODE_PREFIX + self._tim_base_mode):
            raise ValueError(f"tim-plugins: {type(self).__name__} runs trainer mode "
                             f"{TRAINER_MODE_PREFIX + self._tim_base_mode!r}, not {name!r}")

    def __init__(self, config):
        tim, problems, notes = check_composed_config(config)
        problems += dump_dir_problems(tim, config)
        for note in notes:
            logger.warning("tim-plugins: %s", note)
        if problems:
            raise ValueError("tim-plugins: the config cannot work as composed:\n  - " + "\n  - ".join(problems))
        findings = run_startup_audit(config, tim) if tim.parity.audit else None
        if tim.safe_vocab.enabled:  # replay or recompute, and why: one line beside the audit
            from tim_plugins._optional import package_version
            from tim_plugins.kept_set import kept_set_line

            print(kept_set_line("verl", package_version("verl"), sampling_mask=asks_sampling_mask(config)))
        self.tim = tim
        self._tim_findings = findings  # summary.json's audit table, written once the dump folder is this run's
        self._tim_stop: tuple[int, int] | None = None  # (step, total steps before the probe cut it)
        self._tim_lag_off = self._tim_base_mode != "sync" and not self._tim_lag_available()
        context = ActorContext.from_config(config, asynchronous=self._tim_base_mode != "sync",
                                           features_off=("verl_async_lag",) if self._tim_lag_off else (),
                                           audit_errors=tuple(f.code for f in findings or () if f.severity == "error"))
        with open_dict(config):
            config.actor_rollout_ref.tim = tim.to_dict()
            # what the actor's engine needs to know of the rest of the config (the workers get actor_rollout_ref only)
            config.actor_rollout_ref[ActorContext.NODE] = context.to_dict()
            self._tim_alias_mode_node(config)
        super().__init__(config)

    def _tim_alias_mode_node(self, config) -> None:
        """Point ``trainer.v1.<tim mode>`` at the base mode's node (an interpolation: one node, read under both
        names). ``trainer_mode`` answers the base name to the trainer's own lookups, but the config still says
        ``trainer.v1.trainer_mode=tim_<mode>``, and verl code that reads ``trainer.v1.<configured mode>`` from the
        config (VERL_SOURCES verl.utils.skip.rollout_skip:RolloutTqSkip.__init__: parameter_sync_step, default 1)
        would miss the mode's settings. A node the user wrote under the tim name is refused by
        check_composed_config before this."""
        v1 = config.trainer.get("v1")
        name = TRAINER_MODE_PREFIX + self._tim_base_mode
        if v1 is None or v1.get("trainer_mode") != name or self._tim_base_mode not in v1:
            return  # a mode without a node of its own: verl's lookups fall back to their defaults either way
        v1[name] = "${." + self._tim_base_mode + "}"

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._setup (builds the checkpoint managers; a mode's own
    # _setup, e.g. separate_async's, adds its standalone one after calling it)
    def _setup(self):
        super()._setup()
        if self.tim.worker_side_active and self.tim.causes.enable and self.tim.sync_check.enable:
            self._tim_read_disaggregated_syncs()

    def _tim_read_disaggregated_syncs(self) -> None:
        """The driver's half of the weight-sync check on a disaggregated sync (``sync_check``): every checkpoint
        manager of a backend other than ``naive`` (``separate_async``'s standalone replicas) asks the actor ranks,
        once it has returned, to read its replicas. Where the hooks moved, nothing is wrapped and the actor counts
        those syncs unread (one line)."""
        # VERL_SOURCES verl.checkpoint_engine.base:CheckpointEngineManager
        from verl.checkpoint_engine import CheckpointEngineManager

        managers = [m for m in vars(self).values() if isinstance(m, CheckpointEngineManager)
                    and getattr(m, "backend", "naive") not in ("naive", "delta_sharded")]
        if not managers:
            return
        from tim_plugins.capabilities import check

        from .features import SYNC_CHECK_DISAGGREGATED

        status = check(SYNC_CHECK_DISAGGREGATED)
        if not status.available:
            print(status.warning(), file=sys.stderr)
            return
        for manager in managers:
            manager.update_weights = self._tim_reading_after(manager, manager.update_weights)
        self.actor_rollout_wg.tim_expect_replica_reads()

    def _tim_reading_after(self, manager, original):
        """``manager.update_weights`` (verl's, ``auto_await``: called plainly or awaited) followed by the actor ranks'
        reads of the manager's replicas; a failed read is logged, never raised into verl's sync."""
        # VERL_SOURCES verl.utils.ray_utils:auto_await
        from verl.utils.ray_utils import auto_await

        wg = self.actor_rollout_wg

        @auto_await
        async def update_weights(global_steps: int = None):
            # VERL_SOURCES verl.checkpoint_engine.base:CheckpointEngineManager.update_weights (returns once every
            # replica has loaded)
            result = await original(global_steps)
            try:
                # VERL_SOURCES verl.workers.rollout.replica:RolloutReplica.server_handle (read at each sync: replicas
                # can be added and removed between syncs)
                servers = [replica.server_handle for replica in manager.replicas]
                await asyncio.gather(*wg.tim_read_replicas(servers))
            except Exception as err:  # the check costs its own result, never the sync
                logger.warning("tim-plugins: reading the rollout replicas after a weight sync failed: %r", err)
            return result

        return update_weights

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._init_resource_pool_mgr
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        use_tim_actor_worker(self.role_worker_mapping)

    def _tim_collect(self, metrics: dict) -> None:
        if not self.tim.worker_side_active:
            return
        # one result per rank: VERL_SOURCES verl.single_controller.base.decorator:register (Dispatch.ONE_TO_ALL);
        # a holding rank's (with Megatron's pipeline parallelism rank 0 is on the first stage, which has no outputs)
        results = self.actor_rollout_wg.tim_pop_metrics()
        found = next((r for r in results if r.get("holds")), {})
        metrics.update(found.get("metrics") or {})
        self._tim_causes = found.get("causes") or getattr(self, "_tim_causes", {})
        decision = found.get("decision")
        if decision is None:
            return
        # the probe decided in the actor workers on the merged metrics (StepPipeline.compute); the driver acts
        if decision.action == "raise":
            self._tim_record_tripped_step(metrics)
            raise ParityError(decision.message, trip=decision)
        if decision.stop and self._tim_stop is None:
            # make this step the last one; its checkpoint is written in on_step_end. verl's final validation (run on
            # a last step verl planned) is not: it samples from the rollout engine, which the probe just found
            # holding other weights than the trainer's (a named cause) or over its mismatch limit, so its scores
            # would describe the fault, not the policy; the checkpoint is validated once the fault is fixed
            logger.warning("tim-plugins: parity probe asked to stop at step %s (%s): the run ends after this step, "
                           "with its checkpoint (trainer.save_freq > 0) and without verl's final validation, which "
                           "would sample from the rollout engine the probe found faulty. Once fixed, validate the "
                           "checkpoint with trainer.resume_mode=auto trainer.val_only=true", self.global_steps,
                           decision.message)
            self._tim_stop = (self.global_steps, self.total_training_steps)
            self.total_training_steps = self.global_steps

    def _tim_record_tripped_step(self, metrics: dict) -> None:
        """Before the driver raises: the step's ``tim/*`` metrics, which verl logs only at the end of the step that
        the raise never reaches, go where that row would have gone: the dump's ``log_history.jsonl`` (the report's
        series) and verl's tracker (the step's ``tim/*`` row, wandb's chart of the trip). Never raised itself."""
        from tim_plugins.log_keys import for_step_log

        self._tim_append_history(metrics)
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit (self.logger, the step's Tracking)
        tracker = getattr(self, "logger", None)
        if tracker is None:
            return
        row = for_step_log({k: v for k, v in metrics.items() if k.startswith("tim/")}, self.tim.monitor.log_detail)
        try:
            tracker.log(data=row, step=self.global_steps)
        except Exception as err:  # the ParityError that follows says what tripped
            logger.warning("tim-plugins: could not log the tripped step's metrics: %r", err)

    def _tim_append_history(self, metrics: dict) -> None:
        """The step's row beside the dump (``log_history.jsonl``, the report's series); a failed write costs the
        report that point, never the step."""
        if not self.tim.dump.enabled:
            return
        from tim_plugins.dump import append_log_history

        try:
            append_log_history(self.tim.dump.dir, self.global_steps, metrics)
        except OSError as err:
            logger.warning("tim-plugins: could not append to %s/log_history.jsonl: %r", self.tim.dump.dir, err)

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_train_begin (fit calls it before the first step,
    # global_steps already that step: the checkpoint's step + 1 on a resume, else 1)
    def on_train_begin(self):
        if self.tim.dump.enabled:
            self._tim_supersede(self.global_steps)
            # after the move, which keeps the crashed attempt's summary.json beside its steps
            try:
                write_run_summary(self.config, self.tim, getattr(self, "_tim_findings", None))
            except OSError as err:  # the report loses its audit table and fix words; training goes on
                logger.warning("tim-plugins: could not write %s/summary.json: %r", self.tim.dump.dir, err)
        super().on_train_begin()

    def _tim_supersede(self, first_step: int) -> None:
        """The dump folder as this attempt starts at ``first_step``: what an earlier attempt (crashed or stopped
        after the checkpoint resumed from) wrote for these steps, every rank's, moved aside
        (``dump.supersede_from``). The driver does it before any step, so before any worker writes this attempt's
        first file or cause. A failure costs the report its clean steps (said), never the run."""
        from tim_plugins.dump import supersede_from, superseded_failure_line, superseded_line

        try:
            line = superseded_line(first_step, *supersede_from(self.tim.dump.dir, first_step))
        except OSError as err:
            line = superseded_failure_line(self.tim.dump.dir, first_step, err)
        if line:
            logger.warning("tim-plugins: %s", line)

    def on_step_end(self):
        # first, where verl's fit writes its own (after the step, before on_step_end, whose colocated modes wake the
        # rollout replicas, weights and KV cache, and colocate_async resumes generation)
        self._tim_checkpoint_on_stop()
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit (returns after its last step without calling
        # on_train_end; global_steps is still that step here)
        if self.global_steps >= getattr(self, "total_training_steps", float("inf")):
            self._tim_summarize_causes()
        super().on_step_end()

    def _tim_summarize_causes(self) -> None:
        """At the run's last step (the planned one, or the one the probe stopped at): the causes the workers named,
        one line each, with the steps and verl's fix (``CauseTracker.summary_lines``)."""
        from tim_plugins.cause_registry import run_summary_lines

        for line in run_summary_lines(getattr(self, "_tim_causes", {}), "verl"):
            logger.warning(line)

    def _tim_checkpoint_on_stop(self) -> None:
        """Write the checkpoint verl writes on a run's last step, for a step the probe made the last one.

        verl decides to save before ``on_step_end`` from ``is_last_step``, which it computed before the step
        (trainer/ppo/v1/trainer_base.py ``fit``): a step cut short by the probe is saved here unless verl saved it
        anyway (``save_freq`` divides it, or it was the last step already). ``save_freq <= 0`` (no checkpoints)
        is respected. Called at the start of ``on_step_end``, before the mode's own: the same point as verl's save
        (with the rollout replicas still asleep: saving loads an offloaded actor back onto the GPUs).
        """
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint
        if self._tim_stop is None or self._tim_stop[0] != self.global_steps:
            return
        step, planned_total = self._tim_stop
        save_freq = self.config.trainer.save_freq
        if save_freq > 0 and step < planned_total and step % save_freq != 0:
            self._save_checkpoint()

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob
    def _compute_old_log_prob(self, batch, metrics):
        if self.tim.worker_side_active:  # the update's first actor pass (also in bypass mode, where it is the update)
            # the update among the global step's parameter_sync_step (separate_async; without them each update
            # closes a window of its own): VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.step
            self.actor_rollout_wg.tim_begin_step(self.global_steps, getattr(self, "local_trigger_step", 0),
                                                 getattr(self, "parameter_sync_step", 1))
            if self._tim_base_mode != "sync":  # whatever measures (monitor, probe, LR decay's k3) needs the lag
                self._tim_put_lag(batch)
        batch = super()._compute_old_log_prob(batch, metrics)
        self._tim_collect(metrics)
        return batch

    def _tim_put_lag(self, batch) -> None:
        """Asynchronous modes: each sample's policy lag at this step, written to TransferQueue as the per-sample
        field ``LAG_FIELD`` (the workers get a batch's fields, never its tags).

        verl tags every trajectory with the weight versions it was sampled across, ``min_global_steps`` ..
        ``max_global_steps`` (a partial rollout spans several), and the actor at step ``global_steps`` holds version
        ``global_steps - 1`` (verl's own ``training/off_policy/trajectory_staleness``). The lag is counted from the
        oldest version, so lag 0 holds only trajectories sampled wholly by the weights that score them (the
        mismatch floor), and in optimizer steps (each version is ``updates_per_version`` of them), the unit of the
        training passes' lag (``tim/by_lag/*``). -1: the tag is missing, the sample's tokens are counted, not keyed.
        """
        import transfer_queue as tq
        from tensordict import TensorDict

        if self._tim_lag_off:  # the engine counts the tokens it gets no lag for
            return
        current = self.global_steps - 1
        lags = []
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_metrics (batch.tags' min_global_steps)
        for tag in batch.tags:
            version = (tag or {}).get("min_global_steps")
            lags.append(policy_lag(None if version is None else int(version), current,
                                   steps_per_version=self._tim_updates_per_version))
        # every key, padding included: TransferQueue hands a worker only the fields all of its samples have
        # VERL_SOURCES transfer_queue:kv_batch_put
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({LAG_FIELD: torch.tensor(lags, dtype=torch.long)}, batch_size=[len(lags)]))

    @staticmethod
    def _tim_lag_available() -> bool:
        """The asynchronous modes' lag hooks (``features.ASYNC_LAG``) are where they were; else one warning."""
        from tim_plugins.capabilities import check

        from .features import ASYNC_LAG

        status = check(ASYNC_LAG)
        if not status.available:
            print(status.warning(), file=sys.stderr)
        return status.available

    @property
    def _tim_updates_per_version(self) -> int:
        """Optimizer steps per global step: ``ppo_epochs`` × the mini-batches of a train batch."""
        actor, data = self.config.actor_rollout_ref.actor, self.config.data
        return int(actor.ppo_epochs) * max(int(data.train_batch_size) // int(actor.ppo_mini_batch_size), 1)

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._update_actor
    def _update_actor(self, batch, metrics):
        batch = super()._update_actor(batch, metrics)
        self._tim_collect(metrics)
        return batch

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_metrics
    def _compute_metrics(self, batch, metrics, *args, **kwargs):
        """After verl's own step metrics (the reward, lengths, timing): the step's whole logged row beside the dump,
        for the report (its tim/* series, the LR, the reward); then the row verl's tracker logs keeps the tim/*
        metrics read each step, every one with ``tim.monitor.log_detail`` (``tim_plugins.log_keys``)."""
        out = super()._compute_metrics(batch, metrics, *args, **kwargs)
        self._tim_append_history(metrics)
        if not self.tim.monitor.log_detail:
            from tim_plugins.log_keys import in_step_log

            # in place: fit logs this dict next (VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit)
            for key in [k for k in metrics if not in_step_log(k)]:
                del metrics[key]
        return out


def use_tim_actor_worker(role_worker_mapping: dict) -> None:
    """Put the tim worker (``worker.TIMActorRolloutRefWorker``) behind every role that holds the actor, in place.

    verl's V1 trainer maps ``Role.Actor`` / ``Role.ActorRollout`` / ``Role.ActorRolloutRef`` to
    ``ray.remote(ActorRolloutRefWorker)`` (trainer/ppo/v1/trainer_base.py ``_init_resource_pool_mgr``), and a mode may
    put its own subclass there (``separate_async``: ``DetachActorWorker``, whose CPU copies of the weights its
    old-log-prob pass needs): the tim worker is put in front of whatever class the mode chose
    (``worker.tim_worker_class``). A separate reference worker (``Role.RefPolicy``) and the critic keep verl's
    classes.
    """
    import ray

    # VERL_SOURCES verl.trainer.ppo.utils:Role
    from verl.trainer.ppo.utils import Role

    from .worker import tim_worker_class

    for role in list(role_worker_mapping):
        if role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            # Ray's ActorClass keeps the class it wraps as __ray_actor_class__; a mode's own, e.g.
            # VERL_SOURCES verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync._init_resource_pool_mgr
            chosen = getattr(role_worker_mapping[role], "__ray_actor_class__", None)
            role_worker_mapping[role] = ray.remote(tim_worker_class(chosen))


def refuse_unread_tim_node(config, mode: str) -> None:
    """A ``tim`` node in a run whose trainer is verl's own (not a ``tim_*`` mode): verl never reads it, so every tim
    setting in it would be silently ignored. Stops the driver before any worker starts, with the fix."""
    node = config.get("tim") if hasattr(config, "get") else None
    if node is None:
        return
    sections = sorted(node.keys()) if hasattr(node, "keys") else node
    raise ValueError(
        f"tim-plugins: the config has a tim node (tim.{sections}) but trainer.v1.trainer_mode={mode!r} runs verl's "
        f"own trainer, which never reads it: every tim setting would be ignored. Fix: "
        f"trainer.v1.trainer_mode={TRAINER_MODE_PREFIX}{mode} (or drop the +tim.* overrides)")


def refuse_tim_node_under_legacy_trainer(config) -> None:
    """A ``tim`` node with ``trainer.use_v1=false``: verl's legacy trainer (``main_ppo_v0.TaskRunner`` and
    ``RayPPOTrainer``) consults no registry, so no tim trainer mode runs and every tim setting would be silently
    ignored. Stops the driver before Ray starts (from the ``validate_config`` main_ppo calls on the composed config,
    ``plugin._guard_legacy_trainer``), with the fix."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    node = config.get("tim") if hasattr(config, "get") else None
    if node is None or trainer is None or trainer.get("use_v1", True):
        return
    sections = sorted(node.keys()) if hasattr(node, "keys") else node
    v1 = trainer.get("v1") or {}
    mode = str(v1.get("trainer_mode", "sync") or "sync")
    fix = "trainer.use_v1=true" + ("" if mode.startswith(TRAINER_MODE_PREFIX)
                                   else f" trainer.v1.trainer_mode={TRAINER_MODE_PREFIX}{mode}")
    raise ValueError(
        f"tim-plugins: the config has a tim node (tim.{sections}) but trainer.use_v1=false runs verl's legacy trainer, "
        f"which never reads it: every tim setting would be ignored. Fix: {fix} (or drop the +tim.* overrides)")


class _UnreadTIMNodeGuard:
    """In front of each of verl's own registered trainers (``register_tim_trainers``): it only checks, at
    ``__init__``, that the run has no ``tim`` node (``refuse_unread_tim_node``), then is verl's class."""

    _tim_guarded_mode = "sync"

    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__ (config first)
    def __init__(self, config, *args, **kwargs):
        refuse_unread_tim_node(config, self._tim_guarded_mode)
        super().__init__(config, *args, **kwargs)


def register_tim_trainers() -> list[str]:
    """Register ``tim_<name>`` for every trainer mode verl has registered, and put ``_UnreadTIMNodeGuard`` in front
    of verl's own entry for that mode (a run in verl's mode with a ``tim`` node stops at start-up instead of
    ignoring it); returns the new names."""
    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:TRAINER_REGISTRY (read by get_trainer_cls at run time, so an
    # entry replaced here is what main_ppo's TaskRunner builds; register_trainer refuses replacing one)
    # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:register_trainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    added = []
    for name, cls in list(TRAINER_REGISTRY.items()):
        if name.startswith(TRAINER_MODE_PREFIX) or issubclass(cls, _UnreadTIMNodeGuard):
            continue
        tim_name = TRAINER_MODE_PREFIX + name
        if tim_name not in TRAINER_REGISTRY:
            register_trainer(tim_name)(type(f"TIM{cls.__name__}", (TIMTrainerMixin, cls),
                                            {"__module__": __name__, "_tim_base_mode": name}))
            added.append(tim_name)
        TRAINER_REGISTRY[name] = type(cls.__name__, (_UnreadTIMNodeGuard, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_tim_guarded_mode": name})
    return added
