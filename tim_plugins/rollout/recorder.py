"""A logits processor that records the processed log-probs of what a sampler draws, one token per call.

A sampling loop that runs its logits processors once per step on ``(input_ids, scores)`` (the sequence so far, the
next token's logits after every earlier processor), then draws the next token from ``softmax(scores)`` and appends
it, can carry a `ProcessedLogprobRecorder` *last*: it then sees exactly the distribution each token is sampled from
and keeps one ``[B, V]`` row of log-probs between steps (no ``T x B x V`` score history).

Only loops that extend every row by one token per call can be recorded this way; a call that does not (beam
search, assisted decoding) stops the record with the reason (``unsupported``) instead of raising inside the
caller's loop, so a diagnostic never breaks the generation it observes.

Torch only. Plugging it into HF ``generate`` patches transformers' internals, so that part lives in the HF adapter:
``tim_plugins.integrations.hf.recorder.record_processed_logprobs`` (with ``RECORDABLE_MODES``; the registry of the
transformers internals used, ``TRANSFORMERS_SOURCES``, is ``tim_plugins.integrations.hf.sources``).
"""

from __future__ import annotations

import torch

__all__ = ["ProcessedLogprobRecorder", "recorded_logprobs"]


class ProcessedLogprobRecorder:
    """A logits processor that records log p(sampled token) under the final processed distribution.

    At step t it keeps the processed scores ([B, V]); at step t+1 ``input_ids[:, -1]`` is the token
    sampled at step t, so its log-prob is gathered then. ``finish(last_tokens)`` collects the last step.

    Each call must extend the same rows by exactly one token (what sampling and greedy decoding do). A call that
    does not (another decoding mode) stops the record: ``unsupported`` then holds the reason, the scores pass
    through untouched, and ``finish`` raises. The processor itself never raises.
    """

    def __init__(self, unsupported: str | None = None, keep_scores: bool = False) -> None:
        self._prev: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []
        self._shape: tuple[int, int] | None = None  # (rows, tokens) of the last call's input_ids
        self.unsupported = unsupported
        # With keep_scores, every step's processed scores ([B, V]) are kept (references, no copy) for
        # `full_logprobs()`: the whole distribution each token was sampled from, T x B x V in memory.
        self.keep_scores = keep_scores
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.unsupported is not None:
            return scores
        try:
            rows, length = input_ids.shape
            expected = None if self._shape is None else (self._shape[0], self._shape[1] + 1)
            if scores.shape[0] != rows or (expected is not None and (rows, length) != expected):
                self._stop(f"processor called on {tuple(input_ids.shape)} input ids after "
                           f"{self._shape} (one row per sequence, one more token per call expected)")
                return scores
            self._shape = (rows, length)
            if self._prev is not None:
                self._steps.append(self._logprob(self._prev, input_ids[:, -1]))
            # Keep a reference only (sampling reads the scores, never writes them); reduce at the next step.
            self._prev = scores
            if self.keep_scores:
                self.scores.append(scores)
        except Exception as err:  # a recording problem must not break the caller's generate
            self._stop(f"recording failed: {err!r}")
        return scores

    def _stop(self, reason: str) -> None:
        self.unsupported = reason
        self._prev = None
        self._steps = []
        self.scores = []

    @staticmethod
    def _logprob(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # log p(a) = z_a − logsumexp(z) over the processed scores (masked entries are −inf: renormalised
        # over the kept support), in fp32; one reduction, no [B, V] output.
        z = scores.float()
        picked = z.gather(1, tokens.to(z.device).long().unsqueeze(1)).squeeze(1)
        return picked - torch.logsumexp(z, dim=-1)

    @property
    def num_rows(self) -> int | None:
        """Rows the processor saw (None before the first call)."""
        return None if self._shape is None else self._shape[0]

    @property
    def num_steps(self) -> int:
        """Tokens generated so far (one processor call per generated token)."""
        return len(self._steps) + (self._prev is not None)

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Close the record with the tokens sampled at the last step ([B]; rows already finished may hold any
        id). Returns [B, T_generated] fp32 log-probs (entries past a row's EOS are junk: mask them).

        Raises ``RuntimeError`` when nothing could be recorded (``unsupported`` says why, check it first) or
        when ``last_tokens`` does not have one entry per recorded row."""
        if self.unsupported is not None:
            raise RuntimeError(f"no processed log-probs were recorded: {self.unsupported}")
        if self._shape is not None and last_tokens.shape[0] != self._shape[0]:
            raise RuntimeError(f"finish() got {last_tokens.shape[0]} last tokens for {self._shape[0]} recorded rows")
        if self._prev is not None:
            self._steps.append(self._logprob(self._prev, last_tokens))
            self._prev = None
        elif not self._steps:
            return torch.zeros(last_tokens.shape[0], 0)
        out = torch.stack(self._steps, dim=1)
        self._steps = []
        return out

    def full_logprobs(self) -> torch.Tensor:
        """[B, T_generated, V] fp32 log-softmax of every step's processed scores (needs ``keep_scores=True``);
        excluded tokens are ``-inf``. Clears the kept scores."""
        if not self.keep_scores:
            raise RuntimeError("ProcessedLogprobRecorder(keep_scores=False) keeps no scores: create it with "
                               "keep_scores=True to read full log-probs")
        if not self.scores:
            raise RuntimeError("ProcessedLogprobRecorder.full_logprobs: no generation step was recorded")
        out = torch.log_softmax(torch.stack(self.scores, dim=1).float(), dim=-1)
        self.scores = []
        return out


def recorded_logprobs(recorder, completion_ids: list[list[int]]) -> tuple[list[list[float]] | None, str | None]:
    """(one list of processed log-probs per completion, None) from the recorder of one generate call (the
    completions as id lists, cut where the generating framework cut them), or (None, why) when that call could not
    be followed (beam search, assisted decoding, ...)."""
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
