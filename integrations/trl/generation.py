"""The generation side of ``TIMCallback``: TRL's training generation batch measured as TRL built it, the engine's
kept sets recorded, and the rollout log-probs of TRL's transformers path (recorded from its ``generate`` call, or
sampled by the exact sampler).

A mixin of ``callback.TIMCallback``, which installs these wrappers (``attach``) and owns the state they read: the
pipeline, the configuration, the call record of the wrapper call in progress (``_call``) and ``_measure``. Each TRL
detail read here is named in ``hooks.TRL_SOURCES`` at the line that installs its wrapper (``callback.attach``).
"""

from __future__ import annotations

import torch

from tim_plugins.integrations.hf.recorder import record_processed_logprobs
from tim_plugins.pipeline import mean_length
from tim_plugins.rollout.exact import exact_generate, left_padded
from tim_plugins.rollout.recorder import recorded_logprobs

from . import translate

__all__ = ["GenerationWrappers"]


class GenerationWrappers:
    """TIMCallback's wrappers of TRL's generation (``_generate_and_score_completions``, the colocated engine's
    ``generate``, ``_generate_single_turn``) and what they hand to the pipeline."""

    # the mean length of each training generation batch since the last optimizer step, for the LR controller
    # (TIMCallback.on_step_end reads and empties it; on_train_begin sets it empty)
    _step_lengths: list

    def _wrap_generation_batch(self, original):
        def _generate_and_score_completions(*args, **kwargs):
            if not self.trainer.model.training:
                return original(*args, **kwargs)
            self._call.gen_safe, self._call.unsupported_batch = [], False
            if self.kept_sets is not None:  # this batch's sets replace the previous batch's
                self.kept_sets.clear()
            logged = len(self._trl_mean_lengths() or ())
            try:
                out = original(*args, **kwargs)
                self._on_generation_batch(out, self._call.gen_safe, logged)
                if self.server_probe is not None:
                    self.server_probe.captured(out)
            finally:
                self._call.gen_safe = None
            return out

        return _generate_and_score_completions

    def _uncorrected_batch(self) -> RuntimeError:
        """With an IS correction on, a training generation batch without rollout log-probs would train uncorrected:
        the error raised instead. The attach refuses the settings known to yield none (``translate.pipeline_config``);
        this catches what shows only at generation (a decoding mode from the model's own generation config, a
        ``rollout_func`` that returns no log-probs, a call the recorder could not read)."""
        if self._call.unsupported_batch:
            why = ("TRL's generate ran a decoding mode the recorder cannot follow (beam search, assisted "
                   "decoding: tim/diag/unsupported_generation_mode)")
            fix = "sampling or greedy decoding (num_beams=1 in generation_kwargs and in the model's generation config)"
        elif self.rollout_source == "custom":
            why = "the trainer's rollout_func (GRPOTrainer(rollout_func=...)) returned no 'logprobs'"
            fix = "return the sampled tokens' log-probs from rollout_func as 'logprobs'"
        else:
            why = f"no rollout log-probs came with it (rollout log-probs: {self.rollout_source}; tim/diag/*)"
            fix = "use_vllm=True, or the fix of the tim/diag warning logged above"
        return RuntimeError(
            f"tim_plugins: TIMConfig(is_correction={self.config.is_correction!r}) weights each loss forward by the "
            f"rollout log-probs, and the generation batch of step {self.trainer.state.global_step + 1} has none: "
            f"{why}. Its loss would train uncorrected; with a correction on, the adapter raises instead. Fix: {fix}, "
            "or is_correction=None")

    def _trl_mean_lengths(self) -> list | None:
        """The list TRL appends each training generation batch's mean completion length to (its logged
        ``completions/mean_length``), or None (read without creating the key of TRL's defaultdict)."""
        metrics = getattr(self.trainer, "_metrics", None)
        train = metrics.get("train") if isinstance(metrics, dict) else None
        return train.get("completions/mean_length") if isinstance(train, dict) else None

    def _on_generation_batch(self, out: dict, safe: list, logged: int = 0) -> None:
        """Each training generation batch, as TRL built it (before its shuffle and split); ``logged``: how many
        mean lengths TRL had logged before it."""
        self.generation_count += 1
        c, mask, rollout = self.config, translate.response_mask(out), out.get("sampling_per_token_logps")
        if c.lr_decay:
            # the length signal is TRL's completions/mean_length (what lr-replay reads): over every rank, each
            # completion's model tokens (tool_mask 1), a completion mask_truncated_completions masked whole included,
            # whose tool_mask the batch carries zeroed. Where TRL did not log one value for this batch (every rank
            # runs the same code: each takes the same branch), the batch's own count (translate.completion_lengths;
            # every rank generates together: the mean is exact over all of them)
            lengths = self._trl_mean_lengths()
            if lengths is not None and len(lengths) == logged + 1:
                self._length = float(lengths[-1])
            else:
                pad = getattr(translate.tokenizer(self.trainer), "pad_token_id", None)
                self._length = mean_length(translate.completion_lengths(out, pad))
            self._step_lengths.append(self._length)
        if rollout is None and self.pipeline.config.correction is not None:
            raise self._uncorrected_batch()
        if rollout is None and not self._call.unsupported_batch and (c.monitor or c.is_correction is not None):
            self.pipeline.count("no_rollout_logprobs")
        train = out.get("old_per_token_logps")
        if rollout is None or not self.pipeline.measures:
            return
        # the optimizer step this batch was generated at: loss passes after a later step see a moved policy
        out["tim_generated_at"] = torch.full((rollout.shape[0],), self.trainer.state.global_step,
                                             dtype=torch.long, device=rollout.device)
        if train is None:  # measured by the first loss forward over these rows (hence at the rollout weights)
            if self.liger_loss:  # Liger's fused GRPO loss: no loss forward reaches the callback (warned at attach)
                self.pipeline.count("liger_loss_unmeasured", detail="a generation batch TRL scores only in its loss")
                return
            out["tim_pending"] = torch.ones(rollout.shape[0], dtype=torch.bool, device=rollout.device)
            return
        ratio = out.get("importance_sampling_ratio")  # TRL's own vLLM correction, when on
        weights = self._measure(
            rollout, train, mask, safe=safe[0] if safe else None, step=self.trainer.state.global_step + 1,
            is_weights=ratio.expand_as(rollout) if ratio is not None else None, token_ids=out["completion_ids"])
        if weights is not None:
            out["tim_weights"] = weights

    def _wrap_engine_generate(self, original):
        def generate(*args, **kwargs):
            outputs = original(*args, **kwargs)
            if self._call.gen_safe is None:  # not a training generation batch (evaluation): nothing replays them
                return outputs
            try:  # a malformed mask costs the replay of those rows (recomputed), not the step
                problems = self.kept_sets.record(outputs)
            except Exception as err:
                problems = [repr(err)]
            for problem in problems:
                self.pipeline.count("kept_sets_unreadable", detail=problem)
            return outputs

        return generate

    def _wrap_single_turn(self, original):
        def _generate_single_turn(*args, **kwargs):
            if self.rollout_source == "exact":
                return self._exact_generate(*args, **kwargs)
            gen_model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
            if hasattr(gen_model, "get_base_model"):  # PEFT: generate runs on the transformers model inside
                gen_model = gen_model.get_base_model()
            extra = (self.injector,) if self.injector is not None else ()
            with record_processed_logprobs(gen_model, extra) as recorders:
                completion_ids, logprobs = original(*args, **kwargs)
            if logprobs is None:
                logprobs = self._recorded(recorders, completion_ids)
            return completion_ids, logprobs

        return _generate_single_turn

    def _recorded(self, recorders: list, completion_ids: list[list[int]]):
        """Processed log-probs of TRL's generate call, or None (counted): that batch then goes unmeasured."""
        if len(recorders) != 1:
            self.pipeline.count("hf_logprobs_unrecorded",
                                detail=f"{len(recorders)} generate calls in one TRL generation (1 expected)")
            return None
        try:
            logprobs, reason = recorded_logprobs(recorders[0], completion_ids)
        except Exception as err:  # a diagnostic problem never breaks the training step
            self.pipeline.count("hf_logprobs_unrecorded", detail=repr(err))
            return None
        if reason is not None:
            self._call.unsupported_batch = True
            self.pipeline.count("unsupported_generation_mode",
                                detail=f"{reason}; batches generated this way are not measured")
        return logprobs

    def _exact_generate(self, prompt_ids, images=None, *args, **kwargs):
        """``rollout='exact'``: TRL's prompts, left-padded as TRL's transformers path pads them, sampled by the
        exact sampler; returns TRL's (completion_ids, logprobs) lists."""
        t = self.trainer
        if images is not None:
            raise ValueError("TIMConfig.rollout='exact' supports text-only prompts, and this batch has images. "
                             "Fix: TIMConfig(rollout='auto') for a vision-language model")
        pad = translate.tokenizer(t).pad_token_id
        ids, attn = left_padded(prompt_ids, pad)
        device = t.accelerator.device
        with torch.no_grad():
            comp, comp_mask, logps = exact_generate(
                t.accelerator.unwrap_model(t.model_wrapped), ids.to(device), attn.to(device),
                max_new_tokens=t.max_completion_length, temperature=float(t.temperature), pad_token_id=pad,
                seed=int(t.args.seed) * 1_000_003 + self.generation_count, eos_token_id=translate.eos_token_ids(t))
        rows = zip(comp.cpu(), comp_mask.cpu().bool(), logps.cpu())
        completion_ids, logprobs = zip(*[(row[m].tolist(), lp[m].tolist()) for row, m, lp in rows])
        return list(completion_ids), list(logprobs)
