"""TRL (vLLM colocate): the engine's own kept sets replayed by the trainer's safe vocabulary.

vLLM returns, per generated token, the tokens its sampler kept (``return_sampling_mask``; Model Runner V2, a GPU
build). With those the trainer renormalises its log-probs over exactly the engine's set (``tim_plugins.replay``),
so no sampled token falls outside it (``tim/safe_vocab/boundary_frac`` 0 by construction), where recomputing the
cut on the trainer's own logits leaves a few. TRL neither asks for the sets nor keeps them: it builds its colocate
``vllm.LLM`` with fixed arguments inside ``GRPOTrainer.__init__`` and keeps only the outputs' ids and log-probs. So:

- ``engine_kept_sets()``: a context manager around ``GRPOTrainer(...)`` under which TRL's colocate engine is built
  with ``return_sampling_mask=True`` (the module global ``LLM`` that ``VLLMGeneration._init_vllm`` calls, replaced
  for the block only and put back on every exit). vLLM checks the rest itself when the engine starts (Model Runner
  V2, processed log-probs: TRL's setting) and per request (``top_k`` > 0 and ``temperature`` > 0:
  ``GRPOConfig(top_k=...)``).
- ``KeptSetStore``: what the callback captures from the live engine's ``generate`` outputs (by prompt and completion
  ids), and hands, per call of TRL's fused lm_head, in the order of the rows that call scores.

TRL's vLLM server mode (``trl vllm-serve``) returns ids and log-probs only: there the trainer recomputes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tim_plugins.capabilities import check
from tim_plugins.integrations.vllm.sampling_mask import (  # noqa: F401 (engine_returns_kept_sets: the callback's)
    ENGINE_KWARG, KeptSetsByIds, engine_returns_kept_sets)
from tim_plugins.patching import Patch
from tim_plugins.replay import KeptSets

from . import features
from .translate import _label_mask

__all__ = ["ENGINE_KWARG", "ChunkSets", "KeptSetStore", "engine_kept_sets", "engine_returns_kept_sets"]


@contextlib.contextmanager
def engine_kept_sets() -> Iterator[None]:
    """Build TRL's colocate vLLM engine inside this block with ``return_sampling_mask=True``::

        with engine_kept_sets():
            trainer = GRPOTrainer(model, args=GRPOConfig(use_vllm=True, vllm_mode="colocate", top_k=20, top_p=0.8),
                                  ...)
        trainer.add_callback(TIMCallback(trainer, TIMConfig(safe_vocab=True)))

    Raises, before anything is built, when the installed TRL moved the call it relies on (with the reason)."""
    status = check(features.KEPT_SET_REPLAY)
    if not status.available:
        raise RuntimeError(f"tim_plugins: engine_kept_sets() cannot reach TRL's vLLM engine: {status.reason} "
                           f"(trl {status.version}). Fix: {status.fix}")
    # hooks.TRL_SOURCES trl.generation.vllm_generation:LLM (looked up by VLLMGeneration._init_vllm at call time)
    import trl.generation.vllm_generation as vllm_generation

    def make(original):
        def LLM(*args, **kwargs):  # noqa: N802 (stands in for the class name TRL calls)
            kwargs.setdefault(ENGINE_KWARG, True)
            return original(*args, **kwargs)

        return LLM

    patch = Patch(vllm_generation, "LLM", make)
    try:
        yield
    finally:
        patch.undo()


@dataclass(frozen=True)
class ChunkSets:
    """The kept sets of one fused-head call's rows (``rows`` of the batch, [rows, L - 1] shifted positions).

    ``labelled``: one set per labelled position, row-major (what TRL scores on Triton devices);
    ``positions``: those positions' flat indices in the [rows, L - 1] grid, ``n_all`` its size (what TRL scores
    elsewhere: every position, the unlabelled ones with an empty set, i.e. the whole vocabulary)."""

    labelled: KeptSets
    positions: torch.Tensor
    n_all: int

    def for_rows(self, n: int) -> KeptSets | None:
        """The sets in the order of a call scoring ``n`` rows, or None when ``n`` is neither layout."""
        if n == len(self.labelled):
            return self.labelled
        if n == self.n_all:
            return self.labelled.placed(self.n_all, self.positions)
        return None


class KeptSetStore(KeptSetsByIds):
    """The kept sets of the current generation batch, captured from the colocate engine's ``RequestOutput``\\ s, by
    (prompt ids, completion ids) (``KeptSetsByIds``); cleared when the next training generation batch starts. Handed
    out per ``_get_per_token_logps_and_entropies`` call, in the order TRL's fused head scores the rows."""

    def for_call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 batch_size: int | None) -> list[ChunkSets | None]:
        """The sets of one ``_get_per_token_logps_and_entropies`` call, one ``ChunkSets`` per fused-head call (TRL
        scores ``batch_size`` rows at a time); None for a fused-head call with a row whose labelled tokens have no
        captured sets (that call alone recomputes)."""
        rows_total = input_ids.size(0)
        batch_size = batch_size or rows_total
        prompt_len = input_ids.size(1) - logits_to_keep
        ids_cpu, mask_cpu = input_ids.detach().cpu(), attention_mask.detach().cpu()
        out = []
        for start in range(0, rows_total, batch_size):
            end = min(start + batch_size, rows_total)
            lm = _label_mask(ids_cpu[start:end], mask_cpu[start:end], logits_to_keep)  # [b, L-1]
            parts = []
            for r in range(start, end):
                n = int(lm[r - start].sum())
                if n == 0:
                    continue
                prompt = tuple(ids_cpu[r, :prompt_len][mask_cpu[r, :prompt_len] == 1].tolist())
                completion = tuple(ids_cpu[r, prompt_len:][mask_cpu[r, prompt_len:] == 1].tolist())
                kept = self.lookup(prompt, completion) if len(completion) == n else None
                if kept is None:
                    parts = None
                    break
                parts.append(kept)
            if parts is None:
                out.append(None)
                continue
            labelled = KeptSets.concat(parts) if parts else KeptSets.from_lists([])
            out.append(ChunkSets(labelled, lm.reshape(-1).nonzero().squeeze(-1), lm.numel()))
        return out

    def next_sets(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  batch_size: int | None) -> Callable[[int], KeptSets | None]:
        """One log-prob call's sets as ``hooks.ReplayHead`` asks for them: each call of the returned function (one
        per fused-head call, with the rows that call scores) gives the next chunk's sets, or None (that call
        recomputes) when one of its rows has no captured sets or the rows are in neither layout."""
        chunks = iter(self.for_call(input_ids, attention_mask, logits_to_keep, batch_size))

        def next_sets(n_rows: int) -> KeptSets | None:
            chunk = next(chunks, None)
            return None if chunk is None else chunk.for_rows(n_rows)

        return next_sets
