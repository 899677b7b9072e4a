"""The safe vocabulary's head, one rule for every shape an adapter runs: the engine's own kept sets replayed where the
rows carry them (``tim_plugins.replay``: vLLM's ``sampling_mask``, laid over the head's rows), else the sampler's cut
recomputed on the trainer's logits (``tim_plugins.safe_vocab``, ``tim_plugins.truncation``). ``tim_plugins.kept_set``
says which one a run uses and why.

The head is full logits, or hidden states times the output weight (chunked, never the whole [N, V] at once), on one
device or split over a tensor-parallel group's vocabulary shards (``tim_plugins.safe_vocab_tp``).

    res = kept_set_logprobs(labels, truncation, kept, logits=logits)              # verl's FSDP engine
    res = kept_set_logprobs(labels, truncation, kept, hidden=h, weight=w, temperature=T, group=tp, vocab_start=s)
"""

from __future__ import annotations

import dataclasses

import torch

from .replay import KeptSets, replay_logprobs_from_hidden, replay_logprobs_from_logits
from .safe_vocab import SafeLogprobs, safe_linear_logprobs, safe_logprobs_from_logits
from .safe_vocab_tp import (replay_linear_logprobs_vocab_parallel, replay_logprobs_vocab_parallel,
                            safe_linear_logprobs_vocab_parallel, safe_logprobs_vocab_parallel)
from .truncation import Truncation

__all__ = ["kept_set_logprobs"]


def kept_set_logprobs(labels: torch.Tensor, truncation: Truncation, kept: KeptSets | None = None, *,
                      logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                      weight: torch.Tensor | None = None, temperature: float = 1.0, group=None, vocab_start: int = 0,
                      compute_entropy: bool = False, check_ids: bool = True) -> SafeLogprobs:
    """The safe-vocabulary log-probs of ``labels`` ([N]) over ``kept`` (the engine's sets, one per row) where given,
    else over ``truncation``'s cut recomputed on the head's logits.

    Args:
        logits: [N, V] (or this rank's [N, V / TP] shard), or None with ``hidden`` [N, H] and ``weight`` [V, H] (or
            this rank's rows of it).
        temperature: what the logits are divided by (1.0 where they already are; ``truncation``'s own is not used).
        group, vocab_start: the tensor-parallel group the vocabulary is split over and this rank's first column
            (None: one device).
        check_ids: range-check the labels on one device (a host read; off where they are the model's own ids).
    """
    if (logits is None) == (hidden is None) or (hidden is not None and weight is None):
        raise ValueError("kept_set_logprobs takes logits, or hidden states with the output weight")
    t = float(temperature)
    shard = {} if group is None else dict(group=group, vocab_start=int(vocab_start))
    if kept is not None:  # the engine's own sets, replayed
        if logits is not None:
            replay = replay_logprobs_from_logits if group is None else replay_logprobs_vocab_parallel
            return replay(logits, labels, kept, temperature=t, compute_entropy=compute_entropy, **shard)
        replay = replay_logprobs_from_hidden if group is None else replay_linear_logprobs_vocab_parallel
        return replay(hidden, weight, labels, kept, temperature=t, compute_entropy=compute_entropy, **shard)
    cut = dataclasses.replace(truncation, temperature=t)  # the sampler's rule, recomputed
    if group is None and logits is not None:
        return safe_logprobs_from_logits(logits, labels, min_p=cut.min_p, temperature=t, top_p=cut.top_p,
                                         top_k=cut.top_k, order=cut.order, compute_entropy=compute_entropy,
                                         check_ids=check_ids)
    if group is None:
        return safe_linear_logprobs(hidden, weight, labels, cut, compute_entropy=compute_entropy, check_ids=check_ids)
    if logits is not None:
        return safe_logprobs_vocab_parallel(logits, labels, cut, compute_entropy=compute_entropy, **shard)
    return safe_linear_logprobs_vocab_parallel(hidden, weight, labels, cut, compute_entropy=compute_entropy, **shard)
