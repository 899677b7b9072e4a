"""vLLM's per-token kept sets (``return_sampling_mask``) as the core's packed ``tim_plugins.replay.KeptSets``.

vLLM (Model Runner V2, 0.31 on) returns, with ``LLM(..., return_sampling_mask=True)`` (server:
``--return-sampling-mask``; verl: ``actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask``), one id
list per generated token: ``CompletionOutput.sampling_mask`` is a ``vllm.outputs.SamplingMask`` whose
``token_ids[i]`` lists the tokens that survived the sampler's processing for ``token_ids[i]`` (the finite entries of
the processed logits: custom logits processors, temperature, min-p, top-k, top-p). vLLM accepts the setting only
with Model Runner V2, no speculative decoding, and per request temperature > 0 and top_k > 0 (the bound on the list
sizes); the engine's log-probs must be processed ones for the trainer's renormalised values to be comparable, and a
custom logits processor that changes logit values (not only masks) cannot be replayed (the trainer renormalises its
own logits over the set).

Only the public output classes are read (``vllm.outputs``: ``RequestOutput.outputs``, ``CompletionOutput.token_ids``
and ``.sampling_mask``, ``SamplingMask.token_ids``); vLLM's internal CSR form (``vllm.v1.outputs.SamplingMaskLists``:
``token_ids`` + ``offsets`` arrays) is accepted as well, duck-typed, so nothing here breaks where it moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tim_plugins.replay import KeptSets

__all__ = ["SAMPLING_MASK_FIX", "kept_sets_from_completion", "kept_sets_from_mask", "kept_sets_from_outputs"]

SAMPLING_MASK_FIX = (
    "start vLLM with return_sampling_mask=True (LLM(..., return_sampling_mask=True); server: "
    "--return-sampling-mask; verl: +actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true). It "
    "needs Model Runner V2 (a GPU build), no speculative decoding, and top_k > 0 and temperature > 0 per request"
)


def kept_sets_from_mask(mask: Any, device=None) -> KeptSets:
    """``KeptSets`` from a ``vllm.outputs.SamplingMask`` (``token_ids``: one list per token), or from a CSR pair
    with ``token_ids`` and ``offsets`` arrays (``vllm.v1.outputs.SamplingMaskLists``)."""
    token_ids = getattr(mask, "token_ids", None)
    if token_ids is None:
        raise ValueError(f"{type(mask).__name__} has no token_ids: expected vllm.outputs.SamplingMask")
    offsets = getattr(mask, "offsets", None)
    if offsets is not None:
        return KeptSets.from_csr(token_ids, offsets, device=device)
    if len(token_ids) and not isinstance(token_ids[0], Iterable):
        raise ValueError("SamplingMask.token_ids holds ids, not one list per token: a single position's CSR slice "
                         "(SamplingMaskLists with offsets=None)? Pass the finished output's SamplingMask")
    return KeptSets.from_lists(token_ids, device=device)


def kept_sets_from_completion(completion: Any, device=None) -> KeptSets:
    """One completion's kept sets, one row per generated token (``CompletionOutput.token_ids`` order).

    Raises:
        ValueError: the completion carries no mask (with the engine setting that turns it on), or a mask whose
            length is not the number of generated tokens.
    """
    mask = getattr(completion, "sampling_mask", None)
    n = len(completion.token_ids)
    if mask is None:
        if n == 0:
            return KeptSets.from_lists([], device=device)
        raise ValueError(f"completion {getattr(completion, 'index', '?')} has no sampling_mask: {SAMPLING_MASK_FIX}")
    kept = kept_sets_from_mask(mask, device=device)
    if len(kept) != n:
        raise ValueError(f"completion {getattr(completion, 'index', '?')}: sampling_mask has {len(kept)} kept sets "
                         f"for {n} generated tokens (one per token expected; an unfinished request's output?)")
    return kept


def kept_sets_from_outputs(outputs: Sequence[Any], device=None) -> KeptSets:
    """The kept sets of every completion of ``outputs`` (``RequestOutput`` objects, each with its ``outputs``, or
    ``CompletionOutput`` objects), concatenated in that order: the layout of the completions' generated tokens
    flattened one after another."""
    parts = []
    for out in outputs:
        completions = getattr(out, "outputs", None)
        for comp in (completions if completions is not None else [out]):
            parts.append(kept_sets_from_completion(comp, device=device))
    return KeptSets.concat(parts)
