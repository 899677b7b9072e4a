"""Where the TRL adapter touches GRPOTrainer (TRL 1.9 - 1.16): installation.

TRL exposes no callback that sees the rollout batch or the loss inputs, so ``TIMCallback`` wraps *instance*
methods with ``tim_plugins.patching.Patch`` (reversible; the class is never touched, so other trainers in the
process are unaffected) and, with ``safe_vocab``, replaces one module global *for the duration of its own trainer's
policy log-prob call*: the per-token kernel of TRL's fused lm_head (TRL >= 1.15) or ``selective_log_softmax`` (TRL
1.9 - 1.13). The one class attribute, AsyncGRPOTrainer's ``TreeRow.pack`` (its rows are built per batch: no
instance to patch), is replaced only while this trainer's ``train()`` runs and acts on its thread only
(``async_grpo.py``). Each depends on the TRL source named in ``TRL_SOURCES``; ``features.py`` checks each one when
the callback attaches (a moved one switches its feature off) and ``tests/test_trl_hook_guards.py`` fails when one
of them changes shape. Every wrapper takes ``*args, **kwargs`` and forwards them unchanged (signatures vary by release).

Here: the safe-vocab stand-ins (``SafeVocabHead``, ``SafeLogSoftmax``, which hand each call's safe-set fields to a
sink). One callback's set of patches, undone on every exit of ``train()``, is ``tim_plugins.patching.Installation``
(framework-neutral: a trainer with a ``train()`` method). The translations of TRL's tensors are ``translate.py``'s;
the lifecycle is ``callback.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from tim_plugins.patching import Installation  # noqa: F401 (the callback's hooks.Installation)
from tim_plugins.safe_head import kept_set_logprobs
from tim_plugins.safe_vocab import SafeLogprobs
from tim_plugins.truncation import Truncation

__all__ = ["ReplayHead", "SafeLogSoftmax", "SafeVocabHead", "TRL_SOURCES", "TRL_SOURCE_FEATURES"]

logger = logging.getLogger(__name__)

# The TRL source each hook relies on (TRL 1.9 - 1.16): (module, qualified name) -> what is assumed of it. Not every
# release has every entry: each serves the features of TRL_SOURCE_FEATURES, which integrations/trl/features.py
# checks against the installed TRL. The guard tests (tests/test_trl_hook_guards.py) check that every feature the
# installed TRL should support (FEATURE_RELEASES there) is available and the assumptions of its entries hold, and
# that the others are reported off.
TRL_SOURCES = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer.__init__"):
        "copies the generation settings from its args to the attributes the adapter reads: self.use_vllm, "
        "self.vllm_importance_sampling_correction, self.loss_type, self.temperature, self.top_p, self.top_k, "
        "self.min_p, self.repetition_penalty, self.max_completion_length, "
        "self.use_transformers_continuous_batching (each `self.<name> = args.<name>`), self.rollout_func = "
        "rollout_func; TRL >= 1.15: self.eos_token_ids (the generation config's EOS ids, the tokenizer's first), "
        "where _generate_single_turn cuts completions (TRL 1.9 - 1.14 cut at the tokenizer's eos_token_id); the "
        "transformers path's GenerationConfig is built from its own dict (do_sample=True, max_new_tokens, "
        "temperature, top_p, top_k, min_p, repetition_penalty, ...; suppress_tokens=[image_token_id] for a "
        "ProcessorMixin processing class) updated with args.generation_kwargs, which win, kept as "
        "self.generation_kwargs (the exact sampler's check, the safe vocabulary's refusals and the parity audit "
        "read them so; transformers fills a None from the model's generation_config, then its own defaults)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"):
        "called once per generation batch with the raw inputs; returns the batch dict (masks, log-probs, "
        "advantages) that _prepare_inputs shuffles and splits row-wise; old_per_token_logps is its first policy "
        "forward, present only when generation and optimisation are misaligned or vLLM IS correction is on; "
        "appends the batch's mean completion length over all ranks (model tokens: sum(tool_mask), before "
        "mask_truncated_completions) to self._metrics['train']['completions/mean_length'] (the LR decay's length; "
        "without that one value it counts the batch itself)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._compute_loss"):
        "(model, inputs) -> loss; loss mask = completion_mask * tool_mask; it reads inputs['advantages'] "
        "((B,) or (B, T)) and, for vespo, inputs['importance_sampling_ratio'] only after its log-prob call; the "
        "per-token policy term is positively homogeneous in the advantages (all loss types but vespo)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps_and_entropies"):
        "(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, ...) -> "
        "(logps [B, logits_to_keep], entropies, aux_loss); labels = input_ids, -100 on padding and prompt",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_single_turn"):
        "transformers path: one unwrapped_model.generate(..., generation_config=self.generation_config) call, "
        "returns (completion_ids cut after the first EOS, logprobs=None)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer.log"):
        "averages every list in self._metrics[mode] into the logged values and clears them (the callback appends "
        "its tim/ values there)",
    ("trl.generation.vllm_generation", "VLLMGeneration._init_vllm"):
        "called by VLLMGeneration.__init__, which GRPOTrainer keeps as self.vllm_generation when use_vllm; "
        "colocate: self.llm = vllm.LLM(...) (the live engine the audit reads); server mode, main process: "
        "self.vllm_client = VLLMClient(...)",
    ("trl.generation.vllm_client", "VLLMClient.get_server_info"):
        "() -> the 'vllm_config' tree of the server's GET /server_info?config_format=json",
    ("trl.generation.vllm_client", "VLLMClient.get_sequence_logprobs"):
        "(sequences, prompt_lengths, top_logprobs, temperature) -> a dict whose 'actual_logprobs' holds, per "
        "sequence, [log-prob] of each token from position prompt_length on (the server's prompt log-probs)",
    ("trl.generation.vllm_generation", "LLM"):
        "vllm.LLM, a module global that VLLMGeneration._init_vllm looks up when it builds the colocate engine "
        "(kept_sets.engine_kept_sets adds return_sampling_mask=True inside its block)",
    ("trl.generation.vllm_generation", "VLLMGeneration.generate"):
        "colocate: one all_outputs = self.llm.generate(vllm_prompts, sampling_params=...) per generation, whose "
        "outputs' prompt_token_ids and outputs[].token_ids become the batch's prompt and completion ids (the "
        "callback captures each completion's sampling_mask from the same outputs, kept_sets.KeptSetStore)",
    ("trl.generation.vllm_generation", "VLLMGeneration.sync_weights"):
        "() -> None, called by GRPOTrainer before generating when global_step moved (the first time at step 0); "
        "colocate: every (name, tensor) of self._iter_named_params() written through "
        "self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param)]), then "
        "the prefix cache reset (the sync check wraps it on the instance and samples load_weights' input); a PEFT "
        "model: model.merge_adapter() first, each base parameter sent as name.removeprefix('base_model.model.')"
        ".replace('.base_layer', '') fixed with extra_prefixes=['modules_to_save.default.'], names holding "
        "model.prefix or 'original_module' skipped, then model.unmerge_adapter() (in _iter_named_params from 1.11)",
    ("trl.generation.vllm_generation", "VLLMGeneration._fix_param_name_to_vllm"):
        "(name) -> the name TRL's sync sends for a parameter of a plain model (wrapper prefixes dropped)",
    ("trl.trainer.utils", "_ChunkedLogProbFunction"):
        "looked up at call time by add_fused_lm_head; .apply(hidden, weight, bias, targets, temperature, "
        "chunk_size, final_logit_softcapping, logit_scale, outputs)",
    ("trl.trainer.grpo_trainer", "selective_log_softmax"):
        "TRL 1.9 - 1.13: looked up at call time by GRPOTrainer._get_per_token_logps_and_entropies as "
        "selective_log_softmax(logits, completion_ids) on [B, logits_to_keep, V] logits already divided by the "
        "temperature",
    ("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer.compute_loss"):
        "(model, inputs) -> loss over one packed row per rank: the trained tokens are inputs['token_index'] >= 0, "
        "each with old_log_probs (the rollout's) and segment_id (its sample in the row); one model(..., "
        "fused_lm_head=True) forward whose outputs.log_probs.flatten()[token_index] are the trainer's",
    ("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer.get_train_dataloader"):
        "reads self.rollout_queue (the rollout worker's buffer of RolloutSample) into RolloutQueueDataset, whose "
        "staleness is self.model_version (bumped at each weight sync, on the main process) - sample.model_version",
    ("trl.experimental.async_grpo.async_grpo_trainer", "RolloutQueueDataset.__iter__"):
        "sample = self.queue.get(...) for each sample, and yields a dict holding sample.old_log_probs itself",
    ("trl.experimental.async_grpo.packing", "TreeRow.pack"):
        "(row) -> dict of per-row tensors; trained tokens in sample order, segment_id their index in row.samples",
    ("trl.experimental.async_grpo.async_grpo_trainer", "DataCollatorForRollout.torch_call"):
        "pads every key of TreeRow.pack's output into the batch (extra keys included)",
    ("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer.log"):
        "reduces every list in self._metrics[mode] into the logged values and clears them",
}

# Which features (integrations/trl/features.py, by name) each TRL_SOURCES entry serves: a feature that needs an entry
# checks it among its hooks, so an entry that moves switches off its features only. The two safe-vocabulary routes
# need different releases: the fused head's kernel (TRL >= 1.15) and selective_log_softmax on full logits (TRL 1.9 -
# 1.13); at least one of them is available on every tested release.
_SAFE_VOCAB = ("safe_vocab_fused_head", "safe_vocab_logits")
TRL_SOURCE_FEATURES = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer.__init__"):
        ("monitor", "loss_factor", *_SAFE_VOCAB, "hf_recorder", "exact_sampler"),
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"): ("monitor",),
    ("trl.trainer.grpo_trainer", "GRPOTrainer._compute_loss"): ("monitor", "loss_factor"),
    ("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps_and_entropies"): ("monitor", *_SAFE_VOCAB),
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_single_turn"): ("hf_recorder", "exact_sampler"),
    ("trl.trainer.grpo_trainer", "GRPOTrainer.log"): ("monitor",),
    ("trl.generation.vllm_generation", "VLLMGeneration._init_vllm"):
        ("parity_audit_engine", "parity_audit_server", "kept_set_replay", "sync_check", "sync_probe_server"),
    ("trl.generation.vllm_generation", "LLM"): ("kept_set_replay",),
    ("trl.generation.vllm_generation", "VLLMGeneration.generate"): ("kept_set_replay",),
    ("trl.generation.vllm_client", "VLLMClient.get_server_info"): ("parity_audit_server",),
    ("trl.generation.vllm_generation", "VLLMGeneration.sync_weights"): ("sync_check", "sync_probe_server"),
    ("trl.generation.vllm_client", "VLLMClient.get_sequence_logprobs"): ("sync_probe_server",),
    ("trl.generation.vllm_generation", "VLLMGeneration._fix_param_name_to_vllm"): ("sync_check",),
    ("trl.trainer.utils", "_ChunkedLogProbFunction"): ("safe_vocab_fused_head",),
    ("trl.trainer.grpo_trainer", "selective_log_softmax"): ("safe_vocab_logits",),
    **{key: ("async_monitor",) for key in TRL_SOURCES if key[0].startswith("trl.experimental.async_grpo")},
}


class SafeVocabHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` (same ``apply`` signature, trl/kernels/chunked_logprob.py)
    and returns safe-vocab log-probs (and the safe distribution's entropy) from the same hidden states.

    Only the per-token kernel changes: TRL still runs the backbone, selects the scored positions and scatters the
    result back. Each call's flat ``SafeLogprobs`` (detached) goes to ``sink``. Heads the core function cannot
    reproduce (bias, logit softcapping) keep TRL's kernel, reported through ``unsupported()``.
    """

    next_sets: Callable[[int], Any] | None = None  # ReplayHead's: the engine's kept sets of each call's rows
    fallback: Callable[[], None] | None = None

    def __init__(self, original, truncation: Truncation, sink: Callable[[SafeLogprobs], None],
                 unsupported: Callable[[], None]) -> None:
        self.original, self.truncation, self.sink, self.unsupported = original, truncation, sink, unsupported

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        kept = self.next_sets(targets.numel()) if self.next_sets is not None else None
        if kept is None and self.fallback is not None:
            self.fallback()
        if bias is not None or final_logit_softcapping is not None:
            self.unsupported()
            return self.original.apply(*args)
        # the one rule (tim_plugins.safe_head): the engine's kept sets replayed where given, else the cut recomputed;
        # z·s/T = z/(T/s): a logit scale folds into the temperature.
        def safe(sets):
            return kept_set_logprobs(targets, self.truncation, sets, hidden=hidden, weight=weight,
                                     temperature=float(temperature) / float(logit_scale),
                                     compute_entropy="entropy" in outputs)

        if kept is None:
            return self._returned(safe(None), args)
        try:
            res = safe(kept.to(hidden.device))
        except ValueError:  # sets the head cannot take (ids past its vocabulary): recomputed, never the step's end
            if self.fallback is not None:
                self.fallback()
            res = safe(None)
        return self._returned(res, args)

    def _returned(self, res: SafeLogprobs, args: tuple) -> tuple:
        """What TRL's kernel returns, from the safe-set result (its fields go to the sink); the outputs the core
        does not compute (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) from TRL's own kernel, without grad."""
        self.sink(SafeLogprobs(None, res.in_safe.detach(), res.pruned_mass.detach(), res.size))
        extra = (None, None, None)
        if any(name in args[-1] for name in ("log_sum_sq_probs", "mean_logits", "is_top1")):
            with torch.no_grad():
                extra = tuple(self.original.apply(*args)[2:])
        return (res.logprobs, res.entropy, *extra)


class ReplayHead(SafeVocabHead):
    """``SafeVocabHead`` over the engine's own kept sets (``kept_sets.py``): each call takes its rows' sets from
    ``next_sets(n_rows)`` (the callback's queue for this log-prob call, in TRL's chunk order) and renormalises over
    them (``tim_plugins.replay``); where there are none (a row without captured sets) it recomputes the cut as
    ``SafeVocabHead`` does and calls ``fallback()``."""

    def __init__(self, original, truncation: Truncation, sink: Callable[[SafeLogprobs], None],
                 unsupported: Callable[[], None], next_sets: Callable[[int], Any],
                 fallback: Callable[[], None]) -> None:
        super().__init__(original, truncation, sink, unsupported)
        self.next_sets, self.fallback = next_sets, fallback


class SafeLogSoftmax:
    """Stands in for TRL's module global ``selective_log_softmax(logits, index)`` where TRL (1.9 - 1.13) builds full
    logits, divides them by the temperature (in place on 1.9) and then calls it
    (trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies): returns the safe-vocab log-probs
    of ``index`` from the same logits (temperature 1: already applied) and hands each call's [B, T] safe-set fields
    (detached) to ``sink``. TRL's entropy on that route stays the full distribution's."""

    def __init__(self, original, truncation: Truncation, sink: Callable[[SafeLogprobs], None]) -> None:
        self.original, self.truncation, self.sink = original, truncation, sink

    def __call__(self, logits, index):
        shape = index.shape
        res = kept_set_logprobs(index.reshape(-1), self.truncation, logits=logits.reshape(-1, logits.shape[-1]))
        self.sink(SafeLogprobs(None, res.in_safe.detach().view(shape), res.pruned_mass.detach().view(shape),
                               res.size.view(shape)))
        return res.logprobs.view(shape)
