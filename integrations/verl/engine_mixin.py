"""What every tim actor engine does, whatever verl backend it subclasses (FSDP ``engine.py``, Megatron
``megatron_engine.py``): the translation of verl's micro-batches into the core's per-step pipeline
(``tim_plugins.pipeline.StepPipeline``) and the pipeline's lifecycle over verl's actor passes.

A backend subclass puts ``TIMEngineMixin`` in front of verl's engine class and, per micro-batch, wraps verl's loss
call and hands the micro-batch's output over:

    loss_function = self._tim_wrap_loss(loss_function)      # before verl calls the loss (boundary mask)
    ... verl's own forward and loss ...
    self._tim_after_forward(micro_batch, model_output, forward_only)   # after (measure, split by lag)

where ``model_output`` holds verl's per-token ``log_probs`` (jagged nested on the input ids; ``ResponseLayout``, in
``micro_batch.py`` with the rest of the micro-batch layout, finds the response tokens in them on the device). The
micro-batches of a pass are kept on the device and handed to the pipeline as one batch at the end of the pass (the
measurement) or of the optimizer step (the split): one host read each, none per micro-batch. With the safe
vocabulary the backend computes the safe-set fields of the micro-batch's log-probs and sets ``self._tim_mb`` to
``{"in_safe", "pruned_mass", "size"}`` (same layout as ``log_probs``) before the loss. Where the rollout carried
the engine's own kept sets (``rollout.py``, ``extra_fields``), ``_tim_micro_batch_kept`` hands them to the backend
laid out over the micro-batch (``MicroBatchKeptSets``), to replay in place of recomputing (both engines do).

The mixin overrides ``forward_backward_batch`` (the merge after a forward-only measurement pass, the batch's response
lengths), ``train_batch`` (one optimizer step; an actor update's first feeds the LR decay) and ``lr_scheduler_step``
(end of the actor update: the loss passes' split, the effective LR), which both backends inherit from
``BaseEngine``'s contract. Backend hooks it calls, with the FSDP engine's behaviour as the default where there is one:
``_tim_dp_group``, ``_tim_holds_outputs``, ``_tim_check_config``, ``_tim_safe_vocab_feature``, ``_tim_features_off``,
``_tim_lr_attach`` / ``_tim_lr_detach`` / ``_tim_lr_sync`` / ``_tim_lr_apply`` / ``_tim_lr_scale``.

The weight-sync check (``sync_check.SyncWatch``, with the causes on and ``tim.sync_check.enable``) is the engine's
too: ``get_per_tensor_param``, the stream verl's weight sync sends the rollout, passes through the watch, which samples
each tensor while a checked sync is in flight; the worker (``worker.TIMActorRolloutRefWorker.update_weights``) drives
the rest.

Until ``tim_configure`` is called (only the tim trainer modes do, on the actor) nothing here acts: each override
returns verl's result untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from verl.utils import tensordict_utils as tu

from tim_plugins.by_key import lag_after, turn_keys
from tim_plugins.lr_scaling import ControllerCheckpoint
from tim_plugins.pipeline import StepPipeline, exact_mean, old_logprobs, response_length_sums
from tim_plugins.safe_vocab import SafeLogprobs
from tim_plugins.truncation import Truncation

from . import _plugin_import_ended
from .config import LAG_FIELD, ActorContext, TIMVerlConfig
from .features import SAFE_VOCAB, SYNC_CHECK
from .micro_batch import MicroBatchKeptSets, PassCells, ResponseLayout, kept_sets_of_micro_batch
from .sync_check import SyncWatch

__all__ = ["CAUSES_STATE_KEY", "GRAD_NORM_STATE_KEY", "TIMEngineMixin"]

# Where the cause tracker's state rides in verl's checkpoint: the actor optimizer's first param group (beside the LR
# controller's), which verl's FSDP and Megatron checkpoints save and load with the optimizer.
CAUSES_STATE_KEY = "tim_causes"
# The last optimizer step's grad norm (the LR controller's grad_norm signal feeds each global step the norm of the
# optimizer step before it), in the same param group: a resumed run's first step is fed the norm of the checkpoint's
# last step.
GRAD_NORM_STATE_KEY = "tim_grad_norm"

# the cut that keeps every token (logits already divided by the temperature): a reference pass's head
_WHOLE_VOCABULARY = Truncation(temperature=1.0)


class _BoundaryMaskedLoss:
    """Calls verl's loss with ``response_mask`` (the mask the loss aggregates) times the pipeline's loss factor
    (``StepPipeline.loss_factor``, what the TRL callback applies to its loss too): boundary tokens leave the loss.
    The micro-batch's own ``response_mask`` is put back after the call.

    The global token count verl normalises by (``batch_num_tokens``) is taken before the forward pass, so it
    still includes the masked tokens: the loss is Σ_kept / N_all, i.e. boundary tokens count as zero-loss
    tokens. Other calls (the distillation logits processor) pass straight through.
    """

    def __init__(self, loss_fn: Callable, engine: "TIMEngineMixin") -> None:
        self.loss_fn = loss_fn
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step (the keyword
        # call loss_function(model_output=, data=micro_batch, ...); the distillation call has no model_output)
        state = self.engine._tim_mb
        if "model_output" not in kwargs or state is None:
            return self.loss_fn(*args, **kwargs)
        data = kwargs["data"]
        layout = ResponseLayout(data)
        original = data["response_mask"]
        in_safe = layout.gather(state["in_safe"]).bool()
        # verl applies its own IS correction (algorithm.rollout_correction): no pipeline weights here
        keep = self.engine._tim_pipeline.loss_factor(layout.cells(original), in_safe, None)
        # VERL_SOURCES verl.workers.utils.losses:ppo_loss (reads data["response_mask"] as the loss mask) and
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch (normaliser)
        data["response_mask"] = original * layout.like(original, keep)
        try:
            return self.loss_fn(*args, **kwargs)
        finally:
            data["response_mask"] = original


class TIMEngineMixin:
    """The tim hooks of an actor engine (see the module docstring); inactive until ``tim_configure``."""

    _tim: TIMVerlConfig | None = None
    _tim_pipeline: StepPipeline | None = None
    _tim_decision = None
    _tim_window = None  # the probe's decision at the step's window (its threshold check), for the step's row
    _tim_mb: dict | None = None
    _tim_kept = None  # MicroBatchKeptSets of the micro-batch in flight, where the engine's kept sets are replayed
    _tim_truncation = None  # the safe vocabulary's cut (tim_configure), None when it is off
    _tim_reference = False  # inside disable_adapter: a LoRA actor's reference pass
    _tim_sync: SyncWatch | None = None  # the weight-sync check (sync_check.py), with the causes and the feature on
    _tim_causes_checkpoint: ControllerCheckpoint | None = None  # where verl's checkpoint carries the causes' state
    _TIM_SYNC_FEATURES = (SYNC_CHECK.name,)  # the features the weight-sync check runs on (off if one is)

    # -------------------------------------------------------------------------------------- backend hooks
    def _tim_dp_group(self):
        """The data-parallel process group the statistics merge over."""
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_data_parallel_group
        return self.get_data_parallel_group()

    def _tim_holds_outputs(self) -> bool:
        """Whether this rank gets per-token outputs (Megatron: the last pipeline stage only)."""
        return True

    def _tim_writes_files(self) -> bool:
        """Whether this rank writes the dump and the cause lines: the rank verl collects outputs from. FSDP with
        Ulysses sequence parallelism: every SP rank holds the gathered outputs and measures them (the same numbers,
        so each rank's LR decision is the same), SP rank 0 alone writes."""
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.is_mp_src_rank_with_outputs
        return bool(self.is_mp_src_rank_with_outputs())

    def _tim_check_config(self, config: TIMVerlConfig) -> None:
        """Raise ValueError (the value, the rule, the fix) for settings this backend cannot honour."""

    def _tim_safe_vocab_feature(self) -> str | None:
        """The feature whose hooks this backend's safe vocabulary runs on: off, the safe vocabulary is switched off
        (None: it runs on the engine's own hooks, registered only where they hold)."""
        return SAFE_VOCAB.name

    def _tim_features_off(self, config: TIMVerlConfig) -> tuple[str, ...]:
        """This backend's features for ``config`` whose hooks moved (checked at configure), besides the worker's."""
        return ()

    def _tim_lr_attach(self, controller) -> None:
        """Hand the LR controller to whatever applies its scale each optimizer step."""
        self.optimizer.tim_configure(controller)

    def _tim_lr_detach(self) -> None:
        self.optimizer.tim_deconfigure()

    def _tim_lr_sync(self) -> None:
        """Before the controller is fed: pick up a controller state a checkpoint load put in place."""
        self.optimizer.tim_sync_state()

    def _tim_lr_apply(self, scale: float) -> None:
        """The scale for the coming optimizer step (and the controller's state stored where checkpoints carry it)."""
        self.optimizer.tim_apply_scale(scale)

    def _tim_lr_scale(self) -> float:
        """The scale in force (``actor/lr`` reports the schedule's LR times it)."""
        return float(getattr(self.optimizer, "lr_scale", 1.0))

    # ------------------------------------------------------------------------------------------- configure
    def tim_configure(self, config: TIMVerlConfig, *, context: ActorContext | None = None, bypass_mode: bool = False,
                      multi_turn: bool = False, asynchronous: bool = False, features_off: tuple[str, ...] = ()) -> None:
        """Switch the hooks on for this (actor) engine. Fails early on settings the engine cannot honour.
        ``multi_turn``: the rollout is verl's multi-turn agent loop (``rollout.multi_turn.enable``), whose responses
        hold tool / user messages with ``response_mask`` 0 between the model's turns: ``tim/by_turn/*``.
        ``asynchronous``: an asynchronous trainer mode, whose batches carry each sample's policy lag
        (``LAG_FIELD``): π_old is not at every sample's rollout weights, so there is no exact split.
        ``features_off``: the features switched off because an upstream hook moved (``tim/diag/feature_off/*``).
        ``context`` (what the worker passes: the driver's ``ActorContext``, the sampler's top-p / top-k included)
        replaces the four keywords."""
        if context is None:
            context = ActorContext(bypass_mode=bypass_mode, multi_turn=multi_turn, asynchronous=asynchronous,
                                   features_off=tuple(features_off))
        features_off = tuple(dict.fromkeys((*context.features_off, *self._tim_features_off(config))))
        # the safe vocabulary's hooks moved: it is off, the rest runs
        if config.safe_vocab.enabled and self._tim_safe_vocab_feature() in features_off:
            off = dataclasses.replace(config.safe_vocab, min_p=0.0, enable=False)
            config = dataclasses.replace(config, safe_vocab=off)
        self._tim_check_config(config)
        # the sampler's rule the safe vocabulary applies to the trainer's log-probs (old-log-prob and training passes)
        self._tim_truncation = context.truncation(config.safe_vocab.min_p) if config.safe_vocab.enabled else None
        self._tim_pipeline = StepPipeline(config.pipeline_config(context), rank=self._tim_dp_rank(), framework="verl",
                                          writes=self._tim_writes_files())
        self._tim_pipeline.audited(context.audit_errors)  # the driver's start-up audit (the causes' sampler rules)
        self._tim_causes_checkpoint = self._tim_causes_attach()
        for name in features_off:
            self._tim_pipeline.feature_off(name)
        self._tim_sync = SyncWatch(config.sync_check.config().for_tensor_parallel(context.rollout_tp),
                                   self._tim_pipeline, self._tim_holds_outputs, self._tim_causes_after_sync) \
            if config.sync_check.enable and self._tim_pipeline.causes is not None \
            and not set(self._TIM_SYNC_FEATURES) & set(features_off) else None
        if config.lr_decay.enable:  # verl's scheduler rewrites the LR each step: the optimizer side applies the scale
            self._tim_lr_attach(self._tim_pipeline.lr_controller)
        self._tim = config
        self._tim_context = context
        self._tim_measured = False
        self._tim_measure_cells = PassCells()  # the measurement pass's micro-batches (device)
        self._tim_loss_cells = PassCells()  # the current optimizer step's training micro-batches (device)
        self._tim_step_start = True
        self._tim_mb = None
        self._tim_kept = None  # the current micro-batch's engine kept sets (MicroBatchKeptSets), if replayed
        self._tim_pending: dict[str, float] = {}
        self._tim_decision = None  # the probe's decision at the last merge, for the driver to act on
        self._tim_window = None  # the same, kept after the driver popped it: the step's row shows both checks
        self._tim_step = 0  # verl's global step (the driver's tim_begin_step): the dump's file name
        self._tim_updates = 0  # optimizer steps since this global step's rollout: the policy lag of a training pass
        # (response tokens, responses) of the last forward-only pass (the step's old-log-prob pass, this rank's
        # part), before anything trains on the batch: the LR decay's length signal (_tim_end_step)
        self._tim_pass_lengths: torch.Tensor | None = None
        # optimizer steps of this global step's earlier actor updates: separate_async makes parameter_sync_step of
        # them per global step (each with its old-log-prob pass and scheduler step) before the rollout is synced
        self._tim_earlier = 0
        self._tim_closes = True  # this actor update is the global step's last: its window closes after it

    def tim_deconfigure(self) -> None:
        """Switch the hooks off again: from here on the engine computes as verl's own (full-vocabulary log-probs,
        verl's own loss mask, nothing measured, the scheduler's LR unscaled), as before ``tim_configure``. Metrics
        not popped yet are dropped (the cause tracker's window in progress with them); the LR controller's and the
        cause tracker's states stay where checkpoints carry them, so a later ``tim_configure`` continues from them."""
        if self._tim is not None and self._tim.lr_decay.enable:
            self._tim_lr_detach()
        if self._tim_causes_checkpoint is not None and self._tim_holds_outputs():
            self._tim_causes_checkpoint.sync()  # a state loaded since the last store is the one to keep
            self._tim_pipeline.causes.drop_window()
            self._tim_causes_checkpoint.store()
        self._tim = None
        self._tim_pipeline = None
        self._tim_sync = None
        self._tim_causes_checkpoint = None
        self._tim_pending = {}

    @property
    def tim_active(self) -> bool:
        return self._tim is not None

    @property
    def tim_sync_watch(self) -> SyncWatch | None:
        """The weight-sync check the worker drives around verl's ``update_weights`` (None: off)."""
        return self._tim_sync

    # what the weight sync streams, (generator of (HF name, full tensor), peft_config):
    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_per_tensor_param and
    # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_per_tensor_param
    def get_per_tensor_param(self, *args, **kwargs):
        """verl's stream of the weights to sync, sampled as it passes by a checked sync (``sync_check.SyncWatch``)."""
        result = super().get_per_tensor_param(*args, **kwargs)
        if self._tim_sync is None:
            return result
        weights, peft_config = result
        return self._tim_sync.observing(weights, peft_config), peft_config

    def tim_begin_step(self, step: int, part: int = 0, parts: int = 1) -> None:
        """The driver's global step, before the step's first pass (it names the step's dump file and the probe's
        checks). The driver calls it before each actor update: again with the same step for separate_async's later
        updates of one global step (``part`` of ``parts``, its ``parameter_sync_step``), whose samples' lags count
        the earlier ones' optimizer steps too. The step's window (metrics, causes, the probe, the LR controller's
        metrics) closes after its last update, over all of them: one row per global step, as with one update."""
        if int(step) != self._tim_step:
            self._tim_earlier = 0
        self._tim_step = int(step)
        self._tim_closes = int(part) >= int(parts) - 1

    def _tim_dp_rank(self) -> int:
        """This rank's index in the data-parallel group (0 outside torch.distributed): the dump's ``rank``."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return 0
        return torch.distributed.get_rank(self._tim_dp_group())

    def tim_pop_metrics(self) -> dict[str, float]:
        """Metrics merged since the last call (identical on every output-holding DP rank), plus the LR
        controller's; {} on a rank without outputs."""
        if self._tim is None:
            return {}
        out, self._tim_pending = self._tim_pending, {}
        if not self._tim_holds_outputs():
            return {}
        controller = self._tim_pipeline.lr_controller
        if controller is not None and self._tim_closes:
            out.update(controller.metrics())
        return out

    def tim_pop_decision(self):
        """The parity probe's decision at the last merge (``ProbeDecision``; the same on every DP rank, made from
        the merged metrics), or None: the driver acts on it (warn, raise, stop)."""
        decision, self._tim_decision = self._tim_decision, None
        return decision

    def tim_report(self) -> dict:
        """What this rank hands the driver after a step (the worker's ``tim_pop_metrics``, one answer per rank):
        ``{"holds": whether this rank holds outputs, "metrics": tim_pop_metrics(), "decision": tim_pop_decision(),
        "causes": the causes named so far (``CauseTracker.tally``, the same on every holding rank; {} without)}``.
        The driver reads a holding rank's answer: a rank without outputs (Megatron: a pipeline stage before the last,
        a TP rank other than 0) pops its state too, but its metrics are {} and its decision None."""
        causes = self._tim_pipeline.causes if self._tim_pipeline is not None else None
        return {"holds": self._tim_holds_outputs(), "metrics": self.tim_pop_metrics(),
                "decision": self.tim_pop_decision(), "causes": dict(causes.tally) if causes is not None else {}}

    # ------------------------------------------------------------------------------------- cause checkpoints
    def _tim_causes_attach(self) -> ControllerCheckpoint | None:
        """The cause tracker's state (the lag-0 floor's trailing windows, the causes named and their tally) kept in
        the actor optimizer's first param group under ``CAUSES_STATE_KEY``, so verl's own checkpoint carries it as it
        carries the LR controller's: a resumed run judges its first floors against the windows before its checkpoint
        and closes with every cause named since the run began. A state loaded before this call is picked up now,
        one loaded later at the next window (``_tim_causes_sync``). The parity audit's codes stay this attempt's own
        (``CauseTracker.load_state_dict``). None without the causes or an optimizer with param groups."""
        tracker = self._tim_pipeline.causes
        if tracker is None or self._tim_state_group() is None:
            return None
        return ControllerCheckpoint(self.optimizer, tracker, CAUSES_STATE_KEY)

    def _tim_causes_sync(self) -> None:
        """Before the tracker judges a window: continue from a state verl's ``load_checkpoint`` put in place since."""
        if self._tim_causes_checkpoint is not None:
            self._tim_causes_checkpoint.sync()

    def _tim_causes_store(self) -> None:
        """After the tracker judged a window: its state where verl's next checkpoint saves it. Only a rank that holds
        outputs stores it (the others' tracker judges no window of its own)."""
        if self._tim_causes_checkpoint is not None and self._tim_holds_outputs():
            self._tim_causes_checkpoint.store()

    def _tim_causes_after_sync(self) -> None:
        """After a checked sync's causes reached the tracker: its state where verl's next checkpoint saves it, as
        after a window (verl syncs after the step's update and may save a checkpoint before the next window: the
        resumed run's first window names them). A state loaded since the last store is picked up first."""
        self._tim_causes_sync()
        self._tim_causes_store()

    # ------------------------------------------------------------------------------------- per micro-batch
    def _tim_micro_batch_kept(self, micro_batch) -> MicroBatchKeptSets | None:
        """The engine's kept sets for this micro-batch's safe vocabulary, or None to recompute them on the trainer's
        logits. A micro-batch whose samples carry sets that cannot all be used recomputes and is counted under
        ``tim/diag/kept_sets_fallback`` (the pipeline's ``count``: raises only in a strict pipeline, which verl's actor
        does not build); an unreadable field is a fallback too (diagnostics do not stop training). None in a
        reference pass (``disable_adapter``): the reference keeps every token."""
        if self._tim_reference:
            return None
        try:
            kept, reason = kept_sets_of_micro_batch(micro_batch)
        except Exception as err:  # an unreadable field is a fallback, not a crash
            kept, reason = None, f"unreadable kept sets ({type(err).__name__}: {err})"
        if reason is not None:
            self._tim_pipeline.count("kept_sets_fallback", detail=reason + "; the trainer recomputes the kept set "
                                     "for this micro-batch")
        return kept

    def _tim_wrap_loss(self, loss_function: Callable | None) -> Callable | None:
        """verl's loss for this micro-batch, with the boundary mask where the safe vocabulary asks for it."""
        tim = self._tim
        if loss_function is None or tim is None or not (tim.safe_vocab.enabled and tim.safe_vocab.mask_boundary):
            return loss_function
        return _BoundaryMaskedLoss(loss_function, self)

    # VERL_SOURCES verl.workers.engine.base:BaseEngine.disable_adapter
    @contextlib.contextmanager
    def disable_adapter(self):
        """verl's, with the safe vocabulary's cut off inside: on a LoRA actor verl scores the reference in the actor
        with the adapter off (``no_lora_adapter``: VERL_SOURCES verl.workers.engine_workers:TrainingWorker.infer_batch),
        and the reference's log-probs stay full-vocabulary, as a separate reference worker's and TRL's (docs/verl.md).
        The head stays the engine's (the cut that keeps every token: with fused kernels verl's own head fails where
        ours runs), and the rollout's kept sets are not replayed there."""
        with super().disable_adapter():
            if self._tim_truncation is None:
                yield
                return
            saved, self._tim_truncation, self._tim_reference = self._tim_truncation, _WHOLE_VOCABULARY, True
            try:
                yield
            finally:
                self._tim_truncation, self._tim_reference = saved, False

    def _tim_after_forward(self, micro_batch, model_output, forward_only: bool) -> None:
        """A micro-batch's output, after verl's loss: measured on a measurement pass, split by lag on a training
        pass, on the rank that holds the outputs (``_tim_holds_outputs``). Clears the micro-batch's safe-set fields."""
        try:
            if self._tim is None or "log_probs" not in model_output or not self._tim_holds_outputs():
                return
            if self._tim_measuring(micro_batch, forward_only):
                try:
                    self._tim_update(micro_batch, model_output)
                except Exception as err:  # a micro-batch the measurement cannot read costs its statistics, not the
                    # step; the rank still takes part in the pass's merge (_tim_merge), as every rank of its group
                    self._tim_measured = True
                    self._tim_pipeline.count("measure_failed", detail=repr(err))  # strict mode raises
            if not forward_only and self._tim_pipeline.by_lag is not None:
                try:
                    self._tim_loss_pass(micro_batch, model_output)
                except Exception as err:
                    self._tim_pipeline.count("measure_failed", detail=repr(err))
        finally:
            self._tim_mb = None

    def _tim_measuring(self, micro_batch, forward_only: bool) -> bool:
        """Whether this pass measures rollout vs trainer: the actor's old-log-prob pass (verl asks for the entropy
        there and not on the reference pass), or in bypass mode the training pass before the first update."""
        if "rollout_log_probs" not in micro_batch.keys():
            return False
        if forward_only:
            # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob (entropy asked) and
            # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_ref_log_prob (not asked)
            # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data
            return bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        return self._tim_context.bypass_mode and self._tim_step_start

    def _tim_cells(self, micro_batch, model_output) -> tuple[ResponseLayout, dict[str, torch.Tensor]]:
        """A micro-batch's response tokens as [cells] (``ResponseLayout``): this pass's log-probs, the response mask
        (0 on invalid cells), the rollout's log-probs, and each sample's policy lag in an asynchronous mode (the
        driver's ``LAG_FIELD``; -1 unknown, also when the field is absent)."""
        layout = ResponseLayout(micro_batch)
        fields = {"current": layout.gather(model_output["log_probs"]).float(),
                  "mask": layout.cells(micro_batch["response_mask"]).bool() & layout.valid,
                  "rollout": layout.cells(micro_batch["rollout_log_probs"]).float()}
        if self._tim_context.asynchronous:
            if LAG_FIELD in micro_batch.keys():
                lag = micro_batch[LAG_FIELD].to(device=layout.rows.device, dtype=torch.long).reshape(-1)
            else:
                lag = torch.full((layout.batch,), -1, dtype=torch.long, device=layout.rows.device)
            fields["lag"] = lag[layout.rows]
        return layout, fields

    @torch.no_grad()
    def _tim_update(self, micro_batch, model_output) -> None:
        """A measurement pass's micro-batch, kept on the device until the pass ends (``_tim_measure_pass``)."""
        layout, fields = self._tim_cells(micro_batch, model_output)
        state = self._tim_mb
        if state is not None:
            fields.update({k: layout.gather(state[k]) for k in ("in_safe", "pruned_mass", "size")})
        if self._tim.dump.enabled:  # the sampled tokens
            fields["token_ids"] = layout.cells(micro_batch["responses"]).long()
        self._tim_measure_cells.add(layout, **fields)
        self._tim_measured = True

    def _tim_measure_pass(self) -> None:
        """The measurement pass's micro-batches as one [B, W] batch into the pipeline."""
        b = self._tim_measure_cells.batch()
        if b is None:
            return
        mask = b["mask"]
        safe = SafeLogprobs(None, b["in_safe"].bool(), b["pruned_mass"], b["size"]) if "in_safe" in b else None
        # the turn of each token: the environment segments (response_mask 0 inside the response) before it; the
        # padding after the last turn also counts as one, but those tokens are not measured
        turn = turn_keys(mask) if self._tim_context.multi_turn else None
        kwargs = dict(safe=safe, token_ids=b.get("token_ids"), step=self._tim_step, turn=turn)
        if "lag" in b:  # π_old is the actor now: only samples drawn by these weights measure the mismatch alone
            self._tim_pipeline.measure_lagged(b["rollout"], b["current"], mask, b["lag"], **kwargs)
        else:
            self._tim_pipeline.measure(b["rollout"], b["current"], mask, **kwargs)

    @torch.no_grad()
    def _tim_loss_pass(self, micro_batch, model_output) -> None:
        """A training pass's micro-batch for the split of log π_θ − log π_rollout into staleness (π_θ vs π_old)
        and mismatch (π_old vs π_rollout), ``StepPipeline.loss_pass``, over the tokens the loss trains (boundary
        tokens out), kept on the device until the optimizer step ends (``_tim_loss_step``). π_old is verl's
        ``old_log_probs`` once an optimizer step has run since the rollout (``pipeline.old_logprobs``). The lag is
        the optimizer steps taken since the rollout (mini-batches and ``ppo_epochs`` of this global step), plus the
        sample's own lag in an asynchronous mode. In bypass mode π_old is the rollout itself: no split, the log-ratio
        by lag alone (``loss_pass_lagged``; lag 0, the update's first optimizer step, is the batch the monitor
        measured)."""
        keys = micro_batch.keys()
        bypass = self._tim_context.bypass_mode
        if "rollout_log_probs" not in keys or ("old_log_probs" not in keys and not bypass):
            return
        layout, fields = self._tim_cells(micro_batch, model_output)
        if self._tim_mb is not None and self._tim.safe_vocab.mask_boundary:  # the loss's own mask
            fields["mask"] = fields["mask"] & layout.gather(self._tim_mb["in_safe"]).bool()
        if "lag" in fields:
            fields["lag"] = lag_after(fields["lag"], self._tim_earlier + self._tim_updates)
        elif bypass:
            fields["lag"] = torch.full_like(fields["mask"], self._tim_updates, dtype=torch.long)
        else:
            fields["old"] = old_logprobs(fields["current"], layout.cells(micro_batch["old_log_probs"]).float(),
                                         fresh=self._tim_updates == 0)
            fields["lag"] = torch.full_like(fields["mask"], self._tim_updates, dtype=torch.long)
        self._tim_loss_cells.add(layout, **fields)

    def _tim_loss_step(self) -> None:
        """The optimizer step's training micro-batches as one [B, W] batch into the pipeline's split."""
        b = self._tim_loss_cells.batch()
        if b is None:
            return
        if "old" in b:
            self._tim_pipeline.loss_pass(b["rollout"], b["old"], b["current"], b["mask"], lag=b["lag"])
        else:
            self._tim_pipeline.loss_pass_lagged(b["rollout"], b["current"], b["mask"], b["lag"])

    def _tim_merge(self) -> None:
        """The pipeline's statistics, merged over the DP group (every DP rank of the ranks that hold outputs runs
        the pass, so all of them call it; the others measure nothing and skip it). An actor update before the global
        step's last measures and dumps its batch; the last one closes the step's window."""
        self._tim_causes_sync()
        if not self._tim_measured:
            return
        self._tim_measure_pass()
        # the training passes' split is merged at the end of the actor update (lr_scheduler_step)
        # the probe decides here, on the merged metrics; the driver acts (raising in a Ray worker would not stop it)
        if self._tim_closes:
            metrics, decision, _ = self._tim_pipeline.compute(self._tim_step, sync=True, group=self._tim_dp_group(),
                                                              loss_passes=False, raise_on_trip=False)
            self._tim_pending.update(metrics)
            self._tim_window = decision
            if decision is not None:
                self._tim_decision = decision
            self._tim_causes_store()
        self._tim_pipeline.flush_dump(self._tim_step)
        self._tim_measured = False

    # ------------------------------------------------------------------------------------------ per step
    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch; forward_only is
    # the old-log-prob / reference pass: VERL_SOURCES verl.workers.engine.base:BaseEngine.infer_batch
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if self._tim is not None and forward_only:
            self._tim_merge()
            if self._tim.lr_decay.enable:
                self._tim_record_lengths(data)
        return out

    def _tim_record_lengths(self, data) -> None:
        """The response lengths of a forward-only pass over the step's batch: the whole batch (this rank's part), as
        rolled out, before verl's rollout correction masks rejected tokens out of ``response_mask`` (VERL_SOURCES
        verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch, after the old-log-prob
        pass); a later forward-only pass (a reference computed on this engine) reads the same batch."""
        try:
            mask = data["response_mask"]
        except KeyError:  # a pass over other data than a rollout batch
            return
        self._tim_pass_lengths = response_length_sums(mask, skip_empty=True)

    # VERL_SOURCES verl.workers.engine.base:BaseEngine.train_batch (one optimizer step per call)
    def train_batch(self, data, loss_function):
        if self._tim is None:
            return super().train_batch(data, loss_function)
        if self._tim.lr_decay.enable and self._tim_step_start:  # once per actor update (_tim_end_step)
            self._tim_end_step(data)
        out = super().train_batch(data, loss_function)
        self._tim_loss_step()
        self._tim_updates += 1
        if self._tim_context.bypass_mode and self._tim_step_start:
            self._tim_merge()
        self._tim_step_start = False
        return out

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.optimizer_step (the norm on every rank;
    # train_batch's metrics carry it on the rank with outputs alone: with Ulysses SP the others would never see one
    # and decide another LR scale for their shard)
    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        group = self._tim_state_group()
        if group is None:
            return grad_norm
        if self._tim is None:
            group.pop(GRAD_NORM_STATE_KEY, None)  # a norm stored while configured is stale from here on
            return grad_norm
        try:
            group[GRAD_NORM_STATE_KEY] = float(grad_norm)
        except (TypeError, ValueError, RuntimeError):  # not a number: the signal is missing this step
            group[GRAD_NORM_STATE_KEY] = None
        return grad_norm

    def _tim_state_group(self) -> dict | None:
        """The actor optimizer's first param group, where verl's checkpoint carries tim's state (the causes', the
        last grad norm; the LR controller's through its optimizer); None without an optimizer with param groups."""
        groups = getattr(getattr(self, "optimizer", None), "param_groups", None)
        return groups[0] if groups else None

    def _tim_last_grad_norm(self) -> float | None:
        """The last optimizer step's grad norm, where verl's checkpoint carries it (``GRAD_NORM_STATE_KEY``): after a
        load, the checkpoint's last step's. None before any step, or without param groups (the signal is skipped)."""
        group = self._tim_state_group()
        return group.get(GRAD_NORM_STATE_KEY) if group is not None else None

    def _tim_end_step(self, data) -> None:
        """Feed the LR controller once per actor update (the optimizer steps between two of verl's scheduler steps: a
        global step of the sync trainer, each of separate_async's parameter_sync_step updates), before its first
        optimizer step (one rollout batch, one observation, as ``tim-plugins lr-replay`` reads verl's per-step log;
        the mini-batches and PPO epochs after it run at the scale it decides): the DP-mean response length of the
        step's batch (padding samples left out) from its old-log-prob pass, taken before verl's rollout correction
        masks rejected tokens (in bypass mode,
        which has no such pass and masks nothing in the batch, this first mini-batch's), the step's k3 (the monitor's
        measurement of this step's batch, merged over the DP group; in bypass mode the batch is measured in the first
        mini-batch's forward, so this sees the previous step's) and the last optimizer step's grad norm."""
        group = self._tim_dp_group()
        # verl's synthetic padding samples (is_padding, all-zero response_mask) are not responses:
        # VERL_SOURCES verl.trainer.ppo.padding_utils:upsample_batch_to_divisible_size
        sums, self._tim_pass_lengths = self._tim_pass_lengths, None
        if sums is None:
            sums = response_length_sums(data["response_mask"], skip_empty=True)
        length = exact_mean(sums, sync=True, group=group)
        self._tim_lr_sync()
        # verl's global step is not known here (and restarts are not monotone here): the controller counts calls
        scale = self._tim_pipeline.end_step(None, response_length=length, grad_norm=self._tim_last_grad_norm(),
                                            sync=True, group=group, carry_k3=True)
        self._tim_lr_apply(scale)

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.lr_scheduler_step; its result is logged
    # as actor/lr: VERL_SOURCES verl.workers.engine_workers:TrainingWorker.train_batch
    def lr_scheduler_step(self):
        lr = super().lr_scheduler_step()
        if self._tim is None:
            return lr
        # verl steps the scheduler after the last mini-batch of a step:
        # VERL_SOURCES verl.workers.engine_workers:TrainingWorker.train_mini_batch
        self._tim_step_start = True
        self._tim_earlier += self._tim_updates
        self._tim_updates = 0
        if self._tim_pipeline.by_lag is not None and self._tim_closes:  # every DP rank steps the scheduler: all merge
            # the split's rule (staleness) names its cause in the step's window; the driver acts on the decision
            self._tim_causes_sync()
            metrics, decision = self._tim_pipeline.close_loss_passes(self._tim_step, sync=True,
                                                                     group=self._tim_dp_group(), raise_on_trip=False)
            self._tim_pending.update(metrics)
            if decision is not None:
                self._tim_decision = decision if self._tim_decision is None else self._tim_decision.merged(decision)
                # the step's row (the driver logs both collections in one): this trip beside the window's threshold
                # check, whose decision the driver may have popped already (a cause's decision checks no threshold)
                window = self._tim_window
                self._tim_pending.update((decision if window is None else window.merged(decision)).metrics())
            self._tim_window = None
            self._tim_causes_store()
        return lr * self._tim_lr_scale()


_plugin_import_ended()  # a plugin registration deferred while this module was half-imported (plugin.py)
