"""Where the TRL adapter touches GRPOTrainer (TRL 1.9 - 1.16), and the translations between TRL's tensors and the
core's.

TRL exposes no callback that sees the rollout batch or the loss inputs, so ``TIMCallback`` wraps *instance*
methods with ``Patch`` (reversible; the class is never touched, so other trainers in the process are unaffected)
and, with ``safe_vocab``, replaces one module global *for the duration of its own trainer's log-prob call*: the
per-token kernel of TRL's fused lm_head (TRL >= 1.15) or ``selective_log_softmax`` (TRL 1.9 - 1.13). Each depends
on the TRL source named in ``TRL_SOURCES``; ``features.py`` checks each one when the callback attaches (a moved
one switches its feature off) and ``tests/test_trl_hook_guards.py`` fails when one of them changes shape. Every
wrapper takes ``*args, **kwargs`` and forwards them unchanged (signatures vary by release).

This module holds no state: ``Patch``, the safe-vocab stand-ins (``SafeVocabHead``, ``SafeLogSoftmax``, which hand
each call's safe-set fields to a sink), and pure functions mapping TRL's tensors to the core's [B, T] layout and
back.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

from tim_plugins.safe_vocab import SafeLogprobs, safe_logprobs_from_hidden, safe_logprobs_from_logits
from tim_plugins.truncation import Truncation

__all__ = ["Patch", "SafeLogSoftmax", "SafeVocabHead", "TRL_SOURCES", "TRL_SOURCE_FEATURES", "map_safe_calls",
           "recorded_logprobs", "response_mask", "scale_policy_term"]

logger = logging.getLogger(__name__)

# The TRL source each hook relies on (TRL 1.9 - 1.16): (module, qualified name) -> what is assumed of it. Not every
# release has every entry: each serves one feature (TRL_SOURCE_FEATURES), which integrations/trl/features.py checks
# against the installed TRL. The guard tests (tests/test_trl_hook_guards.py) check the assumptions of the entries
# whose feature the installed TRL supports, and that the others are reported off.
TRL_SOURCES = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"):
        "called once per generation batch with the raw inputs; returns the batch dict (masks, log-probs, "
        "advantages) that _prepare_inputs shuffles and splits row-wise; old_per_token_logps is its first policy "
        "forward, present only when generation and optimisation are misaligned or vLLM IS correction is on",
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
    ("trl.trainer.utils", "_ChunkedLogProbFunction"):
        "looked up at call time by add_fused_lm_head; .apply(hidden, weight, bias, targets, temperature, "
        "chunk_size, final_logit_softcapping, logit_scale, outputs)",
    ("trl.trainer.grpo_trainer", "selective_log_softmax"):
        "TRL 1.9 - 1.13: looked up at call time by GRPOTrainer._get_per_token_logps_and_entropies as "
        "selective_log_softmax(logits, completion_ids) on [B, logits_to_keep, V] logits already divided by the "
        "temperature",
}

# Which feature (integrations/trl/features.py, by name) each TRL_SOURCES entry serves. The two safe-vocabulary
# routes need different releases: the fused head's kernel (TRL >= 1.15) and selective_log_softmax on full logits
# (TRL 1.9 - 1.13); at least one of them is available on every tested release.
TRL_SOURCE_FEATURES = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"): "monitor",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._compute_loss"): "monitor",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps_and_entropies"): "monitor",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_single_turn"): "hf_recorder",
    ("trl.trainer.grpo_trainer", "GRPOTrainer.log"): "monitor",
    ("trl.generation.vllm_generation", "VLLMGeneration._init_vllm"): "parity_audit_engine",
    ("trl.generation.vllm_client", "VLLMClient.get_server_info"): "parity_audit_server",
    ("trl.trainer.utils", "_ChunkedLogProbFunction"): "safe_vocab_fused_head",
    ("trl.trainer.grpo_trainer", "selective_log_softmax"): "safe_vocab_logits",
}


class Patch:
    """setattr(obj, name, make(original)) with an exact undo (restores an own attribute or deletes ours)."""

    def __init__(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.obj, self.name = obj, name
        own = vars(obj) if not inspect.ismodule(obj) else obj.__dict__
        self._had_own = name in own
        self._previous = own.get(name)
        self.original = getattr(obj, name)
        self.replacement = make(self.original)
        setattr(obj, name, self.replacement)

    def undo(self) -> None:
        if getattr(self.obj, self.name, None) is not self.replacement:
            logger.warning("tim_plugins: %s.%s was re-patched by someone else; restoring ours anyway",
                           type(self.obj).__name__, self.name)
        if self._had_own or inspect.ismodule(self.obj):
            setattr(self.obj, self.name, self._previous)
        else:
            delattr(self.obj, self.name)


class SafeVocabHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` (same ``apply`` signature, trl/kernels/chunked_logprob.py)
    and returns safe-vocab log-probs (and the safe distribution's entropy) from the same hidden states.

    Only the per-token kernel changes: TRL still runs the backbone, selects the scored positions and scatters the
    result back. Each call's flat ``SafeLogprobs`` (detached) goes to ``sink``. Heads the core function cannot
    reproduce (bias, logit softcapping) keep TRL's kernel, reported through ``unsupported()``.
    """

    def __init__(self, original, truncation: Truncation, sink: Callable[[SafeLogprobs], None],
                 unsupported: Callable[[], None]) -> None:
        self.original, self.truncation, self.sink, self.unsupported = original, truncation, sink, unsupported

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        if bias is not None or final_logit_softcapping is not None:
            self.unsupported()
            return self.original.apply(*args)
        t = self.truncation
        # z·s/T = z/(T/s): a logit scale folds into the temperature.
        res = safe_logprobs_from_hidden(
            hidden, weight, targets, min_p=t.min_p, temperature=float(temperature) / float(logit_scale),
            top_p=t.top_p, top_k=t.top_k, order=t.order, compute_entropy="entropy" in outputs)
        self.sink(SafeLogprobs(None, res.in_safe.detach(), res.pruned_mass.detach(), res.size))
        extra = (None, None, None)
        if any(name in outputs for name in ("log_sum_sq_probs", "mean_logits", "is_top1")):
            with torch.no_grad():
                extra = tuple(self.original.apply(*args)[2:])
        return (res.logprobs, res.entropy, *extra)


class SafeLogSoftmax:
    """Stands in for TRL's module global ``selective_log_softmax(logits, index)`` where TRL (1.9 - 1.13) builds full
    logits, divides them by the temperature (in place on 1.9) and then calls it
    (trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies): returns the safe-vocab log-probs
    of ``index`` from the same logits (temperature 1: already applied) and hands each call's [B, T] safe-set fields
    (detached) to ``sink``. TRL's entropy on that route stays the full distribution's."""

    def __init__(self, original, truncation: Truncation, sink: Callable[[SafeLogprobs], None]) -> None:
        self.original, self.truncation, self.sink = original, truncation, sink

    def __call__(self, logits, index):
        t = self.truncation
        shape = index.shape
        res = safe_logprobs_from_logits(logits.reshape(-1, logits.shape[-1]), index.reshape(-1), min_p=t.min_p,
                                        temperature=1.0, top_p=t.top_p, top_k=t.top_k, order=t.order)
        self.sink(SafeLogprobs(None, res.in_safe.detach().view(shape), res.pruned_mass.detach().view(shape),
                               res.size.view(shape)))
        return res.logprobs.view(shape)


def response_mask(batch: dict) -> torch.Tensor:
    """[B, T] tokens TRL's loss sees: completion tokens, minus tool-output tokens when TRL marks them."""
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask


def _label_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Which shifted positions TRL's fused head scores: labels != -100, labelled as in
    trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies and scored by
    trl/trainer/utils.py add_fused_lm_head (both guarded in tests/test_trl_hook_guards.py)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    return labels[:, 1:] != -100  # [b, L-1]


def map_safe_calls(arguments: dict, calls: list[SafeLogprobs]) -> SafeLogprobs | None:
    """The fused head's flat per-call fields of one ``_get_per_token_logps_and_entropies`` call (bound
    ``arguments``) as [B, logits_to_keep] tensors, sliced as TRL slices its log-probs; None when they do not map.

    TRL calls the head once per ``batch_size`` rows; on Triton devices it scores only the labelled positions, else
    every position (prompt and padding too)."""
    input_ids, attention_mask = arguments["input_ids"], arguments["attention_mask"]
    keep = arguments["logits_to_keep"]
    batch_size = arguments.get("batch_size") or input_ids.size(0)
    starts = list(range(0, input_ids.size(0), batch_size))
    if len(calls) != len(starts):
        return None
    grids: tuple[list, list, list] = ([], [], [])
    for start, call in zip(starts, calls):
        end = min(start + batch_size, input_ids.size(0))
        fields = (call.in_safe, call.pruned_mass, call.size)
        if tuple(call.in_safe.shape) == (end - start, keep):  # SafeLogSoftmax: already [b, logits_to_keep]
            for grid, x in zip(grids, fields):
                grid.append(x)
            continue
        lm = _label_mask(input_ids[start:end], attention_mask[start:end], keep).to(call.in_safe.device)
        if call.in_safe.numel() == lm.numel():  # every position scored
            fields = tuple(x.view(lm.shape) for x in fields)
        elif call.in_safe.numel() == int(lm.sum()):  # only the labelled positions
            fields = tuple(x.new_zeros(lm.shape).masked_scatter(lm, x) for x in fields)
        else:
            return None
        for grid, x in zip(grids, fields):
            grid.append(x[:, -keep:])
    in_safe, pruned, size = (torch.cat(g, dim=0) for g in grids)
    return SafeLogprobs(None, in_safe, pruned, size)


def scale_policy_term(inputs: dict, factor: torch.Tensor, mask: torch.Tensor, loss_type: str) -> dict:
    """Make TRL's loss multiply its per-token policy term by ``factor`` [B, T] (>= 0), reading TRL's configuration
    as it is; returns {key: previous value} of the ``inputs`` entries changed, to put back after the loss.

    TRL multiplies its per-token loss by ``inputs["importance_sampling_ratio"]`` only under ``use_vllm and
    vllm_importance_sampling_correction`` (trl/trainer/grpo_trainer.py ``GRPOTrainer._compute_loss``). The same
    product is reached through an input TRL reads in every mode: ``_compute_loss`` accepts (B, T) advantages, and
    for every loss type but vespo the per-token policy term is positively homogeneous in them (-min(r·A,
    clip(r)·A), -sg(min(r, ε))·A·log p, sapo's soft gate · A, ...): with w >= 0, A·w gives exactly w × TRL's term,
    ahead of the same masks and the same KL term TRL's vLLM branch leaves unweighted. vespo folds the ratio into
    its sequence weight instead (``get_gamma_weights`` reads ``inputs["importance_sampling_ratio"]`` whether or not
    vLLM is used); there the factor multiplies that key. Both routes take the factor as 1 outside TRL's loss mask, as
    TRL's own ratio is there: the loss types mask those positions anyway, except TRL 1.9's luspo, which aggregates
    ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` with the unmasked positions in it.
    ``tests/test_trl_hook_guards.py`` checks both routes against TRL's vLLM branch for every loss type.
    """
    factor = torch.where(mask.bool(), factor, torch.ones_like(factor))
    if loss_type == "vespo":
        key = "importance_sampling_ratio"
        value = factor
        if inputs.get(key) is not None:
            value = inputs[key] * value
    else:
        key = "advantages"
        adv = inputs[key]
        value = (adv if adv.dim() == 2 else adv.unsqueeze(1)) * factor.to(adv.dtype)
    saved = {key: inputs.get(key)}
    inputs[key] = value
    return saved


def recorded_logprobs(recorder, completion_ids: list[list[int]]) -> tuple[list[list[float]] | None, str | None]:
    """(one list of processed log-probs per completion, None) from the recorder of TRL's generate call, or
    (None, why) when that call could not be followed (beam search, assisted decoding, ...)."""
    n = recorder.num_steps
    reason = recorder.unsupported
    if reason is None and recorder.num_rows not in (None, len(completion_ids)):
        reason = f"{recorder.num_rows} rows generated for {len(completion_ids)} completions"
    if reason is None and any(len(ids) > n for ids in completion_ids):
        reason = f"completions longer than the {n} recorded steps"
    if reason is not None:
        return None, reason
    if n == 0:
        return [[] for _ in completion_ids], None
    last = torch.tensor([ids[n - 1] if len(ids) >= n else 0 for ids in completion_ids])
    table = recorder.finish(last).cpu()
    return [table[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)], None
