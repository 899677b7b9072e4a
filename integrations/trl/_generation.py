"""Record the processed log-probs of what TRL's own ``generate`` call samples (use_vllm=False).

TRL 1.16 discards the sampler's log-probs on the transformers path (``logprobs = None``). Rather than replace
TRL's generation, we leave its ``generate`` call untouched and append one logits processor *at the very end*
of the list ``generate`` builds (after temperature / top-k / top-p / min-p), so it sees exactly the
distribution the token is sampled from. It keeps one ``[B, V]`` row of log-probs between steps (no
``output_scores`` history: that would be ``T x B x V``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["ProcessedLogprobRecorder", "record_processed_logprobs"]


class ProcessedLogprobRecorder:
    """A logits processor that records log p(sampled token) under the final processed distribution.

    At step t it stores ``log_softmax(scores_t)`` ([B, V], fp32); at step t+1 ``input_ids[:, -1]`` is the token
    sampled at step t, so its log-prob is gathered then. ``finish(last_tokens)`` collects the last step.
    """

    def __init__(self) -> None:
        self._prev: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:
            self._steps.append(self._prev.gather(1, input_ids[:, -1:].to(self._prev.device)).squeeze(1))
        # log p = z - logsumexp(z) over the processed scores (masked entries are -inf: renormalised support)
        self._prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    @property
    def num_steps(self) -> int:
        """Tokens generated so far (one processor call per generated token)."""
        return len(self._steps) + (self._prev is not None)

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Close the record with the tokens sampled at the last step ([B]; rows already finished may hold any
        id). Returns [B, T_generated] fp32 log-probs (entries past a row's EOS are junk: mask them)."""
        if self._prev is not None:
            tokens = last_tokens.to(self._prev.device).long().unsqueeze(1)
            self._steps.append(self._prev.gather(1, tokens).squeeze(1))
            self._prev = None
        elif not self._steps:
            return torch.zeros(last_tokens.shape[0], 0)
        out = torch.stack(self._steps, dim=1)
        self._steps = []
        return out


@contextmanager
def record_processed_logprobs(model):
    """While active, every ``model.generate`` call gets a `ProcessedLogprobRecorder` appended last.

    Yields a list; each generate call appends its recorder to it. The patch is an instance attribute on
    ``model`` (the transformers model whose ``generate`` runs), removed on exit.
    """
    recorders: list[ProcessedLogprobRecorder] = []
    had_own = "_get_logits_processor" in vars(model)
    previous = vars(model).get("_get_logits_processor")
    original = model._get_logits_processor

    def _get_logits_processor(*args, **kwargs):
        processors = original(*args, **kwargs)
        recorder = ProcessedLogprobRecorder()
        recorders.append(recorder)
        processors.append(recorder)  # last: after the warpers (temperature, top-k/p, min-p)
        return processors

    model._get_logits_processor = _get_logits_processor
    try:
        yield recorders
    finally:
        if had_own:
            model._get_logits_processor = previous
        else:
            del model._get_logits_processor
