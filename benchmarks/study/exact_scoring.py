"""Trainer side of the study's exact arm: score completions with the exact sampler's own ops and shape.

``TIMConfig(rollout="exact")`` samples with ``tim_plugins.rollout.exact`` (full forward over a fixed
[B, P + max_completion_length] buffer, ``log_softmax(logits.float() / T)``), but TRL 1.16 recomputes the
log-probs through its fused, chunked lm_head (``logsumexp`` per chunk) at shape [B, P + longest completion].
Both are fp32 and agree to ~5e-7 nats, yet not bitwise: the monitor then reads k3 ~ 1e-14, not 0.0. The
exact arm is the zero-mismatch reference, so for that arm only the trainer recomputes exactly like the
sampler: completions right-padded to ``max_completion_length`` (mask 0; the causal mask hides them), one
forward over the whole batch, and the same ``log_softmax`` on the same slice. Installed as an instance
attribute (reversible) before the TIM callback wraps the method.
"""

from __future__ import annotations

import contextlib

__all__ = ["ExactScoring"]

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
               "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class ExactScoring:
    def __init__(self, trainer) -> None:
        import torch

        from tim_plugins.rollout.exact import _logprobs_of_positions  # the sampler's own op (one source)

        self.trainer = trainer
        original = trainer._get_per_token_logps_and_entropies
        width = int(trainer.max_completion_length)
        pad_id = int(trainer.processing_class.pad_token_id)

        def scorer(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                   compute_aux_loss=False, **kwargs):
            if compute_aux_loss or any(kwargs.get(k) is not None for k in _MULTIMODAL) or logits_to_keep > width:
                return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
            extra = width - int(logits_to_keep)
            if extra > 0:  # the sampler's buffer: completions right-padded to max_completion_length, mask 0
                b = input_ids.size(0)
                input_ids = torch.cat([input_ids, input_ids.new_full((b, extra), pad_id)], dim=1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], dim=1)
            p = input_ids.size(1) - width
            # One forward over the whole batch (the sampler's batch), no KV cache, as in exact_generate.
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            logp_all = _logprobs_of_positions(logits[:, p - 1:-1], float(trainer.temperature))  # [B, W, V]
            comp = input_ids[:, p:]
            logps = logp_all.gather(-1, comp.unsqueeze(-1)).squeeze(-1)[:, :logits_to_keep]
            entropies = None
            if compute_entropy:
                entropies = -(logp_all.exp() * logp_all).sum(-1)[:, :logits_to_keep]  # H = −Σ p log p
            return logps, entropies, None

        trainer._get_per_token_logps_and_entropies = scorer

    def undo(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.trainer._get_per_token_logps_and_entropies
