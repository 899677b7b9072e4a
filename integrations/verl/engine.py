"""The actor engine: a subclass of verl 0.9.1's FSDP LM-head engine with the tim hooks, registered through
``EngineRegistry``.

Registered under ``device="cuda", vendor="nvidia"``: verl looks the (device, vendor) key up before its own
device-only entry (``workers/engine/base.py`` ``EngineRegistry.get_engine_cls``), so every FSDP/FSDP2 language-model
engine verl builds on NVIDIA CUDA is this class (other vendors, e.g. ROCm's "amd", and NPUs keep verl's engine).
Until ``tim_configure`` is called (only the tim trainer modes do, on the actor) every override returns the parent's
result untouched: numerics are stock verl's.

No verl object is patched (the only change to verl's state is the registry entry): the class overrides five
methods of ``FSDPEngineWithLMHead`` (three inherited from ``FSDPEngine`` / ``BaseEngine``) and calls the parent's:
* ``prepare_model_outputs``: after the parent, recomputes log-probs (and entropy) as safe-vocabulary log-probs
  (``tim_plugins.safe_vocab``) from ``output.logits`` scaled as the parent scales them; both the old-log-prob pass
  and the training pass go through it.
* ``forward_step``: wraps the loss function so the micro-batch's ``response_mask`` is multiplied by the pipeline's
  loss factor (``StepPipeline.loss_factor``: boundary tokens, outside the trainer's safe set, leave the loss) before
  the loss; feeds the pipeline's measurement (``measure``) on measurement passes and its split
  (``loss_pass``) on training passes.
* ``forward_backward_batch`` / ``train_batch``: merge the monitor exactly over the data-parallel group after a
  measurement pass; close each optimizer step through the pipeline (``StepPipeline.end_step``: the DP-mean
  response length, the step's k3 merged over the DP group, the last step's grad norm) and hand its LR scale to
  the optimizer (``optim.py``).
* ``lr_scheduler_step``: report the effective LR (schedule × decay scale) as ``actor/lr``; merge the step's training
  passes' split of the log-ratio into staleness and mismatch (``tim/staleness/*``, ``tim/split/*``,
  ``tim/by_lag/*``; lag = optimizer steps since the rollout, from mini-batches and ``ppo_epochs``). In an
  asynchronous mode each sample also carries the lag it was drawn with (the driver's ``LAG_FIELD``): the monitor
  then measures the lag-0 samples only (the mismatch), and the split is by lag alone (``tim/by_lag/*``).
With ``tim.dump.dir`` the measurement pass also hands the sampled token ids (``responses``) to the pipeline, which
writes the step's per-token dump file after the merge (the file named by the driver's global step,
``tim_begin_step``).
It reads verl internals to do so: the ``output_args`` keys ``temperature_is_one``, ``temperature_rmpad``,
``input_ids_rmpad_rolled``, ``pad_size`` and ``temperature`` (filled by ``prepare_model_inputs``), the non-tensor
batch keys ``use_remove_padding``, ``use_fused_kernels`` and ``calculate_entropy``, the private
``_gather_and_unpad_packed``, ``no_padding_2_padding``, and the keyword call ``loss_function(model_output=, data=,
dp_group=)``. Each is an entry of ``sources.VERL_SOURCES``, named in a comment where it is used and checked
against the installed verl by ``tests/verl_suite/test_verl_sources.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import no_padding_2_padding

from tim_plugins.by_key import turn_keys
from tim_plugins.pipeline import PipelineConfig, StepPipeline, mean_response_length
from tim_plugins.safe_vocab import SafeLogprobs, safe_logprobs_from_logits

from .config import LAG_FIELD, OPTIMIZER_IMPL, TIMVerlConfig

__all__ = ["TIMFSDPEngineWithLMHead", "padded_response"]

def padded_response(x: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """A response-shaped field ([B, R] dense or nested jagged [B, j]) as a dense [B, width] tensor."""
    if x.is_nested:
        return torch.nested.to_padded_tensor(x, fill, output_size=(x.size(0), width))
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)


def _with_response_values(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``mask`` (dense [B, R] or nested [B, j]) times ``keep`` ([B, W] dense, response-aligned), in ``mask``'s layout.

    A nested result carries its row lengths' min/max: without them ``TensorDict.to_padded_tensor()`` (what verl's
    ``ppo_loss`` calls) pads it to the total token count instead of the longest response.
    """
    if not mask.is_nested:
        width = mask.shape[1]
        return mask * padded_response(keep, width).to(mask.dtype)
    offsets = mask.offsets()
    lengths = offsets.diff()
    # output_size: no device -> host sync to size the result; the min/max below are the one sync left
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=mask.values().shape[0])
    cols = torch.arange(rows.numel(), device=offsets.device) - offsets[:-1][rows]
    values = mask.values() * keep[rows, cols].to(mask.dtype)
    if lengths.numel() == 0:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    lo, hi = torch.stack(torch.aminmax(lengths)).tolist()
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo, max_seqlen=hi)


class _BoundaryMaskedLoss:
    """Calls verl's loss with ``response_mask`` (the mask the loss aggregates) times the pipeline's loss factor
    (``StepPipeline.loss_factor``, what the TRL callback applies to its loss too): boundary tokens leave the loss.

    The global token count verl normalises by (``batch_num_tokens``) is taken before the forward pass, so it
    still includes the masked tokens: the loss is Σ_kept / N_all, i.e. boundary tokens count as zero-loss
    tokens. Other calls (the distillation logits processor) pass straight through.
    """

    def __init__(self, loss_fn: Callable, engine: "TIMFSDPEngineWithLMHead") -> None:
        self.loss_fn = loss_fn
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step (the keyword
        # call loss_function(model_output=, data=micro_batch, ...); the distillation call has no model_output)
        state = self.engine._tim_mb
        if "model_output" not in kwargs or state is None:
            return self.loss_fn(*args, **kwargs)
        data = kwargs["data"]
        # VERL_SOURCES verl.workers.utils.padding:no_padding_2_padding
        in_safe = no_padding_2_padding(state["in_safe"], data)  # [b, W] response-aligned
        mask = padded_response(data["response_mask"], in_safe.shape[1])
        # verl applies its own IS correction (algorithm.rollout_correction): no pipeline weights here
        keep = self.engine._tim_pipeline.loss_factor(mask, in_safe, None)
        # VERL_SOURCES verl.workers.utils.losses:ppo_loss (reads data["response_mask"] as the loss mask) and
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch (normaliser)
        data["response_mask"] = _with_response_values(data["response_mask"], keep)
        return self.loss_fn(*args, **kwargs)


# VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead
class TIMFSDPEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP LM-head engine with tim-plugins' hooks (inactive until ``tim_configure``)."""

    _tim: TIMVerlConfig | None = None
    _tim_decision = None

    # ------------------------------------------------------------------------------------------- configure
    def tim_configure(self, config: TIMVerlConfig, *, bypass_mode: bool = False, multi_turn: bool = False,
                      asynchronous: bool = False) -> None:
        """Switch the hooks on for this (actor) engine. Fails early on settings the engine cannot honour.
        ``multi_turn``: the rollout is verl's multi-turn agent loop (``rollout.multi_turn.enable``), whose responses
        hold tool / user messages with ``response_mask`` 0 between the model's turns: ``tim/by_turn/*``.
        ``asynchronous``: an asynchronous trainer mode, whose batches carry each sample's policy lag
        (``LAG_FIELD``): π_old is not at every sample's rollout weights, so there is no exact split."""
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead (engine_config, model_config,
        # optimizer attributes)
        if config.safe_vocab.enabled and (self.engine_config.use_fused_kernels or self.model_config.use_fused_kernels):
            raise ValueError(
                f"tim.safe_vocab.min_p={config.safe_vocab.min_p!r} with use_fused_kernels=True: fused kernels return "
                "log-probs without logits, so the safe vocabulary cannot be applied. Fix: "
                "actor_rollout_ref.model.use_fused_kernels=false")
        if config.lr_decay.enable and not hasattr(self.optimizer, "tim_configure"):
            raise ValueError(
                f"tim.lr_decay.enable=true but the actor optimizer is {type(self.optimizer).__module__}."
                f"{type(self.optimizer).__name__}: the decay acts inside the optimizer's step(). Fix: "
                f"actor_rollout_ref.actor.optim.optimizer_impl={OPTIMIZER_IMPL} "
                "actor_rollout_ref.actor.optim.optimizer=AdamW")
        self._tim_pipeline = StepPipeline(PipelineConfig(
            monitor=config.monitor.enable, ratio_band=config.monitor.ratio_band,
            safe_vocab=config.safe_vocab.enabled, mask_boundary=config.safe_vocab.mask_boundary,
            lr_decay=config.lr_decay.options if config.lr_decay.enable else None,
            dump=config.dump.config() if config.dump.enabled else None,
            # as the TRL callback: the split of every training pass, and the mismatch by response position
            staleness=config.monitor.enable, by_position=config.monitor.enable,
            by_turn=config.monitor.enable and multi_turn, exact_split=not asynchronous,
            probe=config.probe.config()), rank=self._tim_dp_rank())
        if config.lr_decay.enable:  # verl's LambdaLR rewrites the LR each step: the optimizer applies the scale
            self.optimizer.tim_configure(self._tim_pipeline.lr_controller)
        self._tim = config
        self._tim_bypass = bool(bypass_mode)
        self._tim_multi_turn = bool(multi_turn)
        self._tim_async = bool(asynchronous)
        self._tim_unknown: torch.Tensor | None = None  # measured tokens of unknown lag since the last merge (device)
        self._tim_measured = False
        self._tim_step_start = True
        self._tim_mb = None
        self._tim_pending: dict[str, float] = {}
        self._tim_decision = None  # the probe's decision at the last merge, for the driver to act on
        self._tim_grad_norm: float | None = None  # the last optimizer step's (the grad_norm signal)
        self._tim_step = 0  # verl's global step (the driver's tim_begin_step): the dump's file name
        self._tim_updates = 0  # optimizer steps since this global step's rollout: the policy lag of a training pass

    def tim_deconfigure(self) -> None:
        """Switch the hooks off again: from here on the engine computes as stock verl's ``FSDPEngineWithLMHead``
        (full-vocabulary log-probs, verl's own loss mask, nothing measured, the scheduler's LR unscaled), as
        before ``tim_configure``. Metrics not popped yet are dropped; the LR controller's state stays in the
        optimizer's param groups, so a later ``tim_configure`` continues from it."""
        if self._tim is not None and self._tim.lr_decay.enable:
            self.optimizer.tim_deconfigure()
        self._tim = None
        self._tim_pipeline = None
        self._tim_pending = {}

    @property
    def tim_active(self) -> bool:
        return self._tim is not None

    def tim_begin_step(self, step: int) -> None:
        """The driver's global step, before the step's first pass (it names the step's dump file and the probe's
        checks)."""
        self._tim_step = int(step)

    def _tim_dp_rank(self) -> int:
        """This rank's index in the data-parallel group (0 outside torch.distributed): the dump's ``rank``."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return 0
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_data_parallel_group
        return torch.distributed.get_rank(self.get_data_parallel_group())

    def tim_pop_metrics(self) -> dict[str, float]:
        """Metrics merged since the last call (identical on every DP rank), plus the LR controller's."""
        if self._tim is None:
            return {}
        out, self._tim_pending = self._tim_pending, {}
        controller = self._tim_pipeline.lr_controller
        if controller is not None:
            out.update(controller.metrics())
        return out

    def tim_pop_decision(self):
        """The parity probe's decision at the last merge (``ProbeDecision``; the same on every DP rank, made from
        the merged metrics), or None: the driver acts on it (warn, raise, stop)."""
        decision, self._tim_decision = self._tim_decision, None
        return decision

    # ------------------------------------------------------------------------------------ safe vocabulary
    def _flat_scaled_logits(self, output, output_args, micro_batch) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """([N, V] logits / T, [N] labels, packed?) exactly as the parent sees them before log_softmax."""
        from torch.distributed.tensor import DTensor

        # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data (use_remove_padding, default True as the
        # parent reads it); the output_args keys below:
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs
        # and the scaling: VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:_scale_logits_by_temperature
        use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        unit = output_args.get("temperature_is_one", False)
        if use_remove_padding:
            logits = output.logits.squeeze(0)
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            if not unit:
                logits = logits / output_args["temperature_rmpad"].clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)
            return logits, output_args["input_ids_rmpad_rolled"], True
        logits = output.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if not unit:
            t = output_args["temperature"].clamp(min=1e-8).to(logits.dtype)
            logits = logits / t.view(-1, 1, 1)
        lengths = micro_batch["input_ids"].offsets().diff()
        logits = torch.cat([logits[i, : int(n)] for i, n in enumerate(lengths.tolist())])
        return logits, output_args["input_ids_rmpad_rolled"], False

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if self._tim is None or not self._tim.safe_vocab.enabled or "log_probs" not in model_output:
            return model_output
        # VERL_SOURCES verl.utils.tensordict_utils:get_non_tensor_data (use_fused_kernels)
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            raise ValueError("tim.safe_vocab needs logits; set actor_rollout_ref.model.use_fused_kernels=false")
        want_entropy = "entropy" in model_output
        logits, labels, packed = self._flat_scaled_logits(output, output_args, micro_batch)
        res = safe_logprobs_from_logits(logits, labels, min_p=self._tim.safe_vocab.min_p,
                                        compute_entropy=want_entropy)
        fields = {"log_probs": res.logprobs, "in_safe": res.in_safe, "pruned_mass": res.pruned_mass,
                  "size": res.size}
        if want_entropy:
            fields["entropy"] = res.entropy
        cu_seqlens = micro_batch["input_ids"].offsets()
        nested = {}
        for key, value in fields.items():
            if packed:  # drop the SP / bucket padding exactly as the parent does for its log-probs
                # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine._gather_and_unpad_packed
                value = self._gather_and_unpad_packed(value, output_args["pad_size"])
            nested[key] = torch.nested.nested_tensor_from_jagged(value, cu_seqlens)
        model_output["log_probs"] = nested["log_probs"]
        if want_entropy:
            model_output["entropy"] = nested["entropy"]
        self._tim_mb = {k: nested[k] for k in ("in_safe", "pruned_mass", "size")}
        return model_output

    # ------------------------------------------------------------------------------------------ per step
    def _measuring(self, micro_batch, forward_only: bool) -> bool:
        """Whether this pass measures rollout vs trainer: the actor's old-log-prob pass (verl asks for the entropy
        there and not on the reference pass), or in bypass mode the training pass before the first update."""
        if "rollout_log_probs" not in micro_batch.keys():
            return False
        if forward_only:
            # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob (entropy asked) and
            # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_ref_log_prob (not asked)
            return bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        return self._tim_bypass and self._tim_step_start

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step
    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._tim is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        self._tim_mb = None
        if loss_function is not None and self._tim.safe_vocab.enabled and self._tim.safe_vocab.mask_boundary:
            loss_function = _BoundaryMaskedLoss(loss_function, self)
        loss, output = super().forward_step(micro_batch, loss_function, forward_only)
        if self._measuring(micro_batch, forward_only):
            self._tim_update(micro_batch, output["model_output"])
        if not forward_only and self._tim_pipeline.by_lag is not None:
            self._tim_loss_pass(micro_batch, output["model_output"])
        self._tim_mb = None
        return loss, output

    @torch.no_grad()
    def _tim_loss_pass(self, micro_batch, model_output) -> None:
        """A training pass's split of log π_θ − log π_rollout into staleness (π_θ vs π_old) and mismatch (π_old vs
        π_rollout), ``StepPipeline.loss_pass``. π_old is verl's ``old_log_probs`` (the actor at the rollout's
        weights, recomputed in the old-log-prob pass) once an optimizer step has run since the rollout; before that
        π_θ is π_old, and the staleness part is exactly 0. The lag is the optimizer steps taken since the rollout
        (mini-batches and ``ppo_epochs`` of this global step). In bypass mode π_old is the rollout itself: no split."""
        keys = micro_batch.keys()
        if self._tim_bypass or "rollout_log_probs" not in keys or "old_log_probs" not in keys \
                or "log_probs" not in model_output:
            return
        # VERL_SOURCES verl.workers.utils.padding:no_padding_2_padding
        current = no_padding_2_padding(model_output["log_probs"], micro_batch).float()  # [b, W]
        width = current.shape[1]
        # the loss's own mask: with mask_boundary, _BoundaryMaskedLoss has already taken the boundary tokens out
        mask = padded_response(micro_batch["response_mask"], width).bool()
        rollout = padded_response(micro_batch["rollout_log_probs"], width).float()
        sample_lag = self._tim_sample_lag(micro_batch, mask)
        if sample_lag is not None:  # asynchronous: no π_old at every sample's rollout weights, the split is by lag
            known = mask & (sample_lag >= 0)[:, None]
            lag = (sample_lag.clamp(min=0) + self._tim_updates)[:, None].expand(mask.shape)
            self._tim_pipeline.loss_pass(rollout, None, current, known, lag=lag)
            return
        old = current if self._tim_updates == 0 else padded_response(micro_batch["old_log_probs"], width).float()
        lag = torch.full(mask.shape, self._tim_updates, dtype=torch.long, device=mask.device)
        self._tim_pipeline.loss_pass(rollout, old, current, mask, lag=lag)

    def _tim_sample_lag(self, micro_batch, mask: torch.Tensor) -> torch.Tensor | None:
        """[b] each sample's policy lag when its rollout was drawn, in optimizer steps (the driver's ``LAG_FIELD``;
        -1 unknown), or None in a synchronous mode. Unknown or absent: those tokens are counted under
        ``tim/diag/async_lag_unknown`` (by the measurement pass) and left out."""
        if not self._tim_async:
            return None
        if LAG_FIELD in micro_batch.keys():
            lag = micro_batch[LAG_FIELD].to(device=mask.device, dtype=torch.long).reshape(-1)
        else:
            lag = torch.full(mask.shape[:1], -1, dtype=torch.long, device=mask.device)
        return lag

    @torch.no_grad()
    def _tim_update(self, micro_batch, model_output) -> None:
        """A measurement pass's micro-batch, response-aligned [b, W], into the pipeline."""
        # VERL_SOURCES verl.workers.utils.padding:no_padding_2_padding
        train = no_padding_2_padding(model_output["log_probs"], micro_batch).float()  # [b, W]
        width = train.shape[1]
        mask = padded_response(micro_batch["response_mask"], width).bool()
        rollout = padded_response(micro_batch["rollout_log_probs"], width).float()
        state, safe = self._tim_mb, None
        if state is not None:
            safe = SafeLogprobs(None, *(no_padding_2_padding(state[k], micro_batch)
                                        for k in ("in_safe", "pruned_mass", "size")))
        # the sampled tokens, for the dump: micro_batch["responses"] is what no_padding_2_padding slices by
        token_ids = padded_response(micro_batch["responses"], width).long() if self._tim.dump.enabled else None
        # the turn of each token: the environment segments (response_mask 0 inside the response) before it; the
        # padding after the last turn also counts as one, but those tokens are not measured
        turn = turn_keys(mask) if self._tim_multi_turn else None
        sample_lag = self._tim_sample_lag(micro_batch, mask)
        if sample_lag is not None:
            # π_old is the actor now: only samples drawn by these weights measure the mismatch alone; tokens of
            # unknown lag are summed on the device and counted once, at the merge (no host read per micro-batch)
            unknown = (mask & (sample_lag < 0)[:, None]).sum()
            self._tim_unknown = unknown if self._tim_unknown is None else self._tim_unknown + unknown
            mask = mask & (sample_lag == 0)[:, None]
        self._tim_pipeline.measure(rollout, train, mask, safe=safe, token_ids=token_ids, step=self._tim_step,
                                   turn=turn)
        self._tim_measured = True

    def _tim_merge(self) -> None:
        """The pipeline's statistics, merged over the DP group (every DP rank runs the pass, so all call it)."""
        if not self._tim_measured:
            return
        if self._tim_unknown is not None:
            unknown, self._tim_unknown = int(self._tim_unknown), None
            if unknown:
                self._tim_pipeline.count("async_lag_unknown", unknown,
                                         detail=f"no {LAG_FIELD} for these samples (no weight-version tag)")
        # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_data_parallel_group
        # the training passes' split is merged at the end of the actor update (lr_scheduler_step)
        # the probe decides here, on the merged metrics; the driver acts (raising in a Ray worker would not stop it)
        metrics, decision, _ = self._tim_pipeline.compute(self._tim_step, sync=True,
                                                          group=self.get_data_parallel_group(), loss_passes=False,
                                                          raise_on_trip=False)
        self._tim_pending.update(metrics)
        if decision is not None:
            self._tim_decision = decision
        self._tim_pipeline.flush_dump(self._tim_step)
        self._tim_measured = False

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch; forward_only is
    # the old-log-prob / reference pass: VERL_SOURCES verl.workers.engine.base:BaseEngine.infer_batch
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if self._tim is not None and forward_only:
            self._tim_merge()
        return out

    # VERL_SOURCES verl.workers.engine.base:BaseEngine.train_batch (one optimizer step per call; its metrics carry
    # the step's grad_norm)
    def train_batch(self, data, loss_function):
        if self._tim is None:
            return super().train_batch(data, loss_function)
        if self._tim.lr_decay.enable:
            self._tim_end_step(data)
        out = super().train_batch(data, loss_function)
        self._tim_updates += 1
        grad_norm = (out.get("metrics") or {}).get("grad_norm") if isinstance(out, dict) else None
        if grad_norm is not None:
            self._tim_grad_norm = float(grad_norm)
        if self._tim_bypass and self._tim_step_start:
            self._tim_merge()
        self._tim_step_start = False
        return out

    def _tim_end_step(self, data) -> None:
        """Close one optimizer step through the pipeline, before verl's: the DP-mean response length of the
        mini-batch, the step's k3 (the monitor's measurement of this step's batch, merged over the DP group) and the
        last step's grad norm feed the LR controller; its scale goes to the optimizer for this step."""
        group = self.get_data_parallel_group()
        length = mean_response_length(data["response_mask"], group=group)
        self.optimizer.tim_sync_state()
        # verl's global step is not known here (and restarts are not monotone here): the controller counts calls
        scale = self._tim_pipeline.end_step(None, response_length=length, grad_norm=self._tim_grad_norm,
                                            sync=True, group=group)
        self.optimizer.tim_apply_scale(scale)

    # VERL_SOURCES verl.workers.engine.fsdp.transformer_impl:FSDPEngine.lr_scheduler_step; its result is logged
    # as actor/lr: VERL_SOURCES verl.workers.engine_workers:TrainingWorker.train_batch
    def lr_scheduler_step(self):
        lr = super().lr_scheduler_step()
        if self._tim is None:
            return lr
        # verl steps the scheduler after the last mini-batch of a step:
        # VERL_SOURCES verl.workers.engine_workers:TrainingWorker.train_mini_batch
        self._tim_step_start = True
        self._tim_updates = 0
        if self._tim_pipeline.by_lag is not None:  # every DP rank steps the scheduler: all merge here
            self._tim_pending.update(self._tim_pipeline.compute_loss_passes(
                sync=True, group=self.get_data_parallel_group()))
        return lr * float(getattr(self.optimizer, "lr_scale", 1.0))
