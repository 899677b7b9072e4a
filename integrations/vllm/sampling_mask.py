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

``engine_returns_kept_sets`` reads whether a live ``vllm.LLM`` was started with the setting; ``KeptSetsByIds`` keeps
the sets of ``LLM.generate``'s outputs by the prompt and completion ids they were generated for (the TRL adapter's
colocate capture).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tim_plugins.replay import KeptSets

__all__ = ["ENGINE_KWARG", "SAMPLING_MASK_FIX", "KeptSetsByIds", "engine_returns_kept_sets", "kept_sets_from_completion",
           "kept_sets_from_mask", "kept_sets_from_outputs"]

# the engine argument that makes vLLM return the sets (LLM(..., return_sampling_mask=True))
ENGINE_KWARG = "return_sampling_mask"
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


def engine_returns_kept_sets(llm: Any) -> bool:
    """Whether a live ``vllm.LLM`` was started with ``return_sampling_mask`` (its own model config)."""
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine), vllm.v1.engine.llm_engine:LLMEngine.__init__
    # (vllm_config), vllm.config:ModelConfig (return_sampling_mask)
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
    return bool(getattr(config, ENGINE_KWARG, False))


class KeptSetsByIds:
    """vLLM's kept sets captured from ``LLM.generate``'s outputs, by (prompt ids, completion ids): ``record`` the
    outputs, ``lookup`` a completion's sets (a prefix of a captured completion too), ``clear`` between batches."""

    def __init__(self) -> None:
        self._sets: dict[tuple[tuple[int, ...], tuple[int, ...]], KeptSets] = {}
        self._by_prompt: dict[tuple[int, ...], list[tuple[tuple[int, ...], KeptSets]]] = {}
        self.without_mask = 0  # completions the engine returned without a sampling_mask

    def __len__(self) -> int:
        return len(self._sets)

    def clear(self) -> None:
        self._sets.clear()
        self._by_prompt.clear()

    def record(self, outputs: Iterable[Any]) -> list[str]:
        """``vllm.LLM.generate``'s outputs: each completion's sets under its prompt and completion ids. Returns why
        each completion whose mask could not be read was left out (its rows then recompute)."""
        problems = []
        for request in outputs:
            prompt = tuple(int(t) for t in request.prompt_token_ids)
            for completion in request.outputs:
                if getattr(completion, "sampling_mask", None) is None:
                    self.without_mask += 1
                    continue
                key = (prompt, tuple(int(t) for t in completion.token_ids))
                if key in self._sets:
                    continue
                try:
                    kept = kept_sets_from_completion(completion)
                except ValueError as err:  # e.g. not one set per generated token
                    problems.append(str(err))
                    continue
                self._sets[key] = kept
                self._by_prompt.setdefault(prompt, []).append((key[1], kept))
        return problems

    def lookup(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> KeptSets | None:
        """The sets of ``completion``'s tokens after ``prompt``: an exact match, else a captured completion that
        starts with it (each token's set depends only on what precedes it), else None."""
        kept = self._sets.get((prompt, completion))
        if kept is not None:
            return kept
        n = len(completion)
        for ids, kept in self._by_prompt.get(prompt, ()):
            if ids[:n] == completion:
                return KeptSets(kept.ids[: int(kept.offsets[n])], kept.offsets[: n + 1])
        return None
