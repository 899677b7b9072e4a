"""Trainer side of ``TIMConfig(rollout="exact")``: score completions with the exact sampler's own ops and shape.

The exact sampler (``tim_plugins.rollout.exact``) runs one full forward over a fixed [B, P + max_completion_length]
buffer and takes ``log_softmax(logits.float() / T)``. TRL 1.16 recomputes log-probs through its fused, chunked
lm_head at shape [B, P + longest completion]: both fp32, equal to ~5e-7 nats, but not bitwise, so k3 would read
~1e-14 instead of 0.0. In exact mode the trainer therefore scores like the sampler: completions right-padded to
``max_completion_length`` (mask 0; the causal mask hides them), one forward, the same op on the same slice: the
core's ``rollout.scoring.score_completions``, which the sampler's own recomputation (``exact_logprobs``) is.
Installed through ``tim_plugins.patching.Patch`` (reversible), under the monitor's own wrapper.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tim_plugins.rollout.scoring import score_completions

__all__ = ["exact_scorer"]

# Batches with these inputs are not text-only: they keep TRL's own scoring.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
               "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def exact_scorer(trainer) -> Callable[[Any], Callable]:
    """``make(original)`` for ``Patch(trainer, "_get_per_token_logps_and_entropies", ...)``."""
    width = int(trainer.max_completion_length)
    pad_id = int(trainer.processing_class.pad_token_id)
    temperature = float(trainer.temperature)

    def make(original):
        def scorer(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                   compute_aux_loss=False, **kwargs):
            if compute_aux_loss or logits_to_keep > width or any(kwargs.get(k) is not None for k in _MULTIMODAL):
                return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
            extra = width - int(logits_to_keep)
            if extra > 0:  # the sampler's buffer: completions right-padded to max_completion_length, mask 0
                b = input_ids.size(0)
                input_ids = torch.cat([input_ids, input_ids.new_full((b, extra), pad_id)], dim=1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], dim=1)
            scores = score_completions(model, input_ids, attention_mask, width, temperature=temperature,
                                       entropy=compute_entropy)
            entropies = scores.entropy[:, :logits_to_keep] if compute_entropy else None
            return scores.logprobs[:, :logits_to_keep], entropies, None

        return scorer

    return make
