"""TIMCallback: one TRL callback that monitors, audits and (opt-in) mitigates training-inference mismatch.

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    trainer.add_callback(TIMCallback(trainer, TIMConfig()))

Like TRL's own callbacks that need the trainer (LogCompletionsCallback), it takes the trainer in ``__init__``.
Metrics are appended to ``trainer._metrics["train"]`` at the step TRL logs, so TRL's ``log()`` averages them
with its own and they reach ``trainer.state.log_history``, wandb and tensorboard (keys added in ``on_log``
would reach neither: log_history is appended before ``on_log`` runs).
"""

from __future__ import annotations

import logging
import warnings

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tim_plugins._optional import check_version_range, require
from tim_plugins.metrics import MismatchMonitor

from . import _features
from .config import TIMConfig
from .hooks import TRLHooks

__all__ = ["TIMCallback", "TIMState"]

logger = logging.getLogger("tim_plugins.trl")
STATE_VERSION = 1


class TIMState(TrainerCallback, ExportableState):
    """Carrier of the TIMCallback state in TRL/transformers checkpoints (``trainer_state.json``).

    A separate, argument-free class because transformers rebuilds stateful callbacks as ``type(cb)(**args)``
    (``restore_callback_states_from_checkpoint=True``), which a callback holding the trainer cannot survive.
    """

    def __init__(self, payload: dict | None = None) -> None:
        self.payload = payload
        self.source = None  # the live TIMCallback (not saved)

    def state(self) -> dict:
        payload = self.source.state_payload() if self.source is not None else self.payload
        return {"args": {}, "attributes": {"payload": payload}}


class TIMCallback(TrainerCallback):
    """Training-inference mismatch monitor + mitigations for TRL's GRPOTrainer (see `TIMConfig`).

    Args:
        trainer: the ``GRPOTrainer`` (TRL >= 1.16, < 1.17).
        config: a `TIMConfig` (default: monitor + parity audit, no mitigation).
    """

    def __init__(self, trainer, config: TIMConfig | None = None) -> None:
        require("trl", "tim_plugins.integrations.trl.TIMCallback")
        self.trl_version = check_version_range("trl")
        if config is None:
            config = TIMConfig()
        if not isinstance(config, TIMConfig):
            raise TypeError(f"TIMCallback(config=...) needs a TIMConfig, got {type(config).__name__}: {config!r}")
        self.trainer = trainer
        self.config = config
        self.hooks = TRLHooks(trainer, self)
        self.monitor = MismatchMonitor(ratio_band=config.ratio_band) if config.monitor else None
        self.step_monitor = None  # per-step monitor for the LR controller's k3 signal
        self.diag: dict[str, float] = {}
        self.last_in_safe = None
        self.last_mean_length: float | None = None
        self.last_grad_norm: float | None = None
        self.extra_metrics: dict[str, list[float]] = {}
        self.findings: list = []
        self.generation_count = 0
        self._warned: set[str] = set()
        self._pushed_at: int | None = None  # global step of the last push into TRL's metrics
        self.features = _features.Features(self) if config.enabled else None
        self.rollout_source = self.features.resolve_rollout_source() if self.features else "off"
        self.safe_vocab_active = bool(config.enabled and config.safe_vocab)
        if self.features is not None:
            self.features.validate()
        self.state_carrier = TIMState()
        self.state_carrier.source = self
        if config.enabled:
            trainer.add_callback(self.state_carrier)

    # -------------------------------------------------------------------------------------- lifecycle
    def detach(self) -> None:
        """Remove every wrapper and this callback from the trainer (idempotent)."""
        self.hooks.detach()
        handler = self.trainer.callback_handler
        for cb in (self, self.state_carrier):
            if cb in handler.callbacks:
                handler.remove_callback(cb)

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.config.enabled:
            return
        # transformers may have rebuilt the carrier (restore_callback_states_from_checkpoint=True): relink it.
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, TIMState):
                cb.source = self
                self.state_carrier = cb
        self._restore(state)
        if not self.hooks.attached:
            self.hooks.attach(
                generation=self.rollout_source in ("hf", "exact", "inject"),
                safe_vocab_shim=self.features.safe_vocab_shim() if self.safe_vocab_active else None,
                exact_scoring=self.rollout_source == "exact",
            )
        if self.config.parity_audit:
            self.features.run_parity_audit()

    def on_train_end(self, args, state, control, **kwargs):
        self.hooks.detach()

    # ------------------------------------------------------------------------------ hooks → runtime
    def count_diag(self, name: str, n: float = 1.0, detail: str | None = None) -> None:
        """Count a diagnostic problem under ``tim/diag/<name>`` and log it the first time (``detail`` says what
        happened); strict mode raises instead."""
        if self.config.strict:
            suffix = f": {detail}" if detail else ""
            raise RuntimeError(f"tim_plugins (strict): diagnostic problem '{name}'{suffix}")
        self.diag[name] = self.diag.get(name, 0.0) + n
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("tim_plugins: %s%s (counted under tim/diag/%s; further occurrences not logged)", name,
                           f" ({detail})" if detail else "", name)

    def wants_deferred_monitor(self, inputs: dict) -> bool:
        """Loss-forward capture is needed when TRL did not score the batch at the rollout weights."""
        return (
            self.monitor is not None
            and inputs.get("sampling_per_token_logps") is not None
            and inputs.get("old_per_token_logps") is None
            and "tim_monitored" not in inputs
        )

    def on_generation_batch(self, out: dict, records: list[dict]) -> None:
        """Called with each training generation batch, after TRL built it (before shuffle/split).

        Only ever narrows TRL's loss mask (through ``tool_mask``) and, with an IS correction, scales the
        per-token policy term (``Features.apply_is_weights``); TRL's own flags are never changed."""
        self.generation_count += 1
        metrics = self.trainer._metrics["train"].get("completions/mean_length")
        if metrics:
            self.last_mean_length = float(metrics[-1])
        rollout = out.get("sampling_per_token_logps")
        if rollout is None and not self.hooks.generation_unsupported:  # an unsupported mode was counted already
            if self.monitor is not None or self.config.is_correction is not None:
                self.count_diag("no_rollout_logprobs")
        mask = _response_mask(out)
        train = out.get("old_per_token_logps")
        in_safe = records[0]["in_safe"] if records else None
        boundary = self.safe_vocab_active and self.config.mask_boundary_tokens
        correct = self.config.is_correction is not None and rollout is not None
        if (correct or boundary) and train is None:
            train, in_safe = self.features.score_at_rollout_weights(out)
        is_weights = None
        new_mask = mask
        if boundary:
            new_mask = self.features.apply_boundary_mask(new_mask, in_safe)
        if correct:
            is_weights, new_mask = self.features.apply_is_correction(train, rollout, new_mask)
            if is_weights is not None:
                self.features.apply_is_weights(out, is_weights, mask)
        elif rollout is not None and out.get("importance_sampling_ratio") is not None:  # TRL's own vLLM correction
            is_weights = out["importance_sampling_ratio"].expand_as(rollout)
        if new_mask is not mask:
            self.features.set_loss_mask(out, mask, new_mask)
        if self.monitor is not None and rollout is not None and train is not None:
            self._update_monitor(rollout, train, mask, is_weights, out)
            out["tim_monitored"] = torch.ones((), device=rollout.device)

    def on_loss_batch(self, inputs: dict, train_logps: torch.Tensor) -> None:
        """Deferred monitor update with the loss forward's own log-probs (same weights as the rollout)."""
        mask = _response_mask(inputs)
        self._update_monitor(inputs["sampling_per_token_logps"], train_logps, mask, None, inputs)

    def _update_monitor(self, rollout, train, mask, is_weights, batch) -> None:
        if rollout.shape != train.shape:
            self.count_diag("shape_mismatch")
            return
        self.monitor.update(rollout, train, mask, is_weights=is_weights)
        if self.step_monitor is not None:
            self.step_monitor.update(rollout, train, mask, is_weights=is_weights)
        if self.features.dumper is not None:
            self.features.dump(rollout, train, mask, batch)

    def exact_generate(self, original, *args, **kwargs):
        return self.features.exact_generate(*args, **kwargs)

    # ---------------------------------------------------------------------------------- step / log
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs and logs["grad_norm"] is not None:
            self.last_grad_norm = float(logs["grad_norm"])

    def on_step_end(self, args, state, control, **kwargs):
        if not self.config.enabled:
            return
        step_metrics: dict[str, float] = {}
        if self.step_monitor is not None:
            step_metrics = self.step_monitor.compute()
            self.step_monitor.reset()
        if self.config.lr_decay:
            self.features.lr_decay_step(state.global_step, step_metrics, kwargs.get("optimizer"),
                                        kwargs.get("lr_scheduler"))
        if self.features.dumper is not None:
            self.features.flush_dump(state.global_step)
        if control.should_log:
            self._push_metrics(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        """Runs before the epoch's own log and before the trainer's final log (transformers Trainer
        ``_run_epoch`` → ``_finalize_training``): a run that ends between two ``logging_steps`` boundaries (or
        logs per epoch) still hands its last window to TRL, whose ``log()`` adds it to that final entry."""
        if not self.config.enabled or self._pushed_at == state.global_step:
            return
        if control.should_log or control.should_training_stop or state.global_step >= state.max_steps:
            self._push_metrics(state, control)

    def _push_metrics(self, state, control) -> None:
        """Append this logging window's tim/ metrics to ``trainer._metrics["train"]``: TRL's ``log()`` averages
        them with its own into the next log entry."""
        self._pushed_at = state.global_step
        out: dict[str, float] = {}
        if self.monitor is not None:
            if self.monitor.updates > 0:
                out.update(self.monitor.compute())
                if self.config.log_histograms:
                    self.features.log_histograms(self.monitor)
            self.monitor.reset()
            if self.config.parity_probe:
                decision = self.features.probe_check(state.global_step, out)
                out.update(decision.metrics())
                if decision.stop:
                    logger.warning("tim_plugins: parity probe tripped at step %d (%s); stopping training",
                                   state.global_step, ", ".join(f"{t.key}={t.value:.4g}" for t in decision.trips))
                    control.should_save = True
                    control.should_training_stop = True
        out.update({f"tim/diag/{k}": v for k, v in self.diag.items()})
        for key, values in self.extra_metrics.items():
            if values:
                out[key] = sum(values) / len(values)
        self.extra_metrics = {}
        if self.config.lr_decay:
            out.update(self.features.lr_metrics())
        store = self.trainer._metrics["train"]
        for key, value in out.items():
            if value is None:
                continue
            store[key].append(float(value))

    def add_metric(self, key: str, value: float) -> None:
        self.extra_metrics.setdefault(key, []).append(float(value))

    # ------------------------------------------------------------------------------------ checkpoint
    def state_payload(self) -> dict:
        return {
            "version": STATE_VERSION,
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "step_monitor": self.step_monitor.state_dict() if self.step_monitor is not None else None,
            "lr_controller": self.features.lr_state() if self.features is not None else None,
            "probe": self.features.probe_state() if self.features is not None else None,
            "diag": dict(self.diag),
            "last_mean_length": self.last_mean_length,
            "last_grad_norm": self.last_grad_norm,
            "generation_count": self.generation_count,
        }

    def _restore(self, state) -> None:
        """On resume (global_step > 0), reload what the checkpoint's trainer_state.json holds for us."""
        if state.global_step <= 0:
            return
        saved = (state.stateful_callbacks or {}).get("TIMState")
        if isinstance(saved, list):
            saved = saved[-1] if saved else None
        payload = (saved or {}).get("attributes", {}).get("payload") if isinstance(saved, dict) else None
        if not payload:
            warnings.warn("tim_plugins: resuming from a checkpoint without TIM state; monitor and LR controller "
                          "start fresh", stacklevel=2)
            return
        if payload.get("version") != STATE_VERSION:
            raise RuntimeError(f"tim_plugins: checkpoint TIM state version {payload.get('version')!r} != "
                               f"{STATE_VERSION}; this tim-plugins release cannot resume it")
        if self.monitor is not None and payload.get("monitor"):
            self.monitor.load_state_dict(payload["monitor"])
        if self.step_monitor is not None and payload.get("step_monitor"):
            self.step_monitor.load_state_dict(payload["step_monitor"])
        self.features.load_lr_state(payload.get("lr_controller"))
        self.features.load_probe_state(payload.get("probe"))
        self.diag = dict(payload.get("diag") or {})
        self.last_mean_length = payload.get("last_mean_length")
        self.last_grad_norm = payload.get("last_grad_norm")
        self.generation_count = int(payload.get("generation_count") or 0)


def _response_mask(batch: dict) -> torch.Tensor:
    """[B, T] tokens the loss sees: completion tokens, minus tool-output tokens when TRL marks them."""
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask
