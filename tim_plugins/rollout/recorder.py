"""Record the processed log-probs of what an HF ``generate`` call samples, without changing the call.

Used by ``rollout.hf.generate_with_logprobs`` and by the TRL adapter (TRL 1.16 discards the sampler's log-probs
on its transformers path). The ``generate`` call stays untouched; one logits processor is appended *at the very end*
of the list ``generate`` builds (after temperature / top-k / top-p / min-p), so it sees exactly the
distribution the token is sampled from. It keeps one ``[B, V]`` row of log-probs between steps (no
``output_scores`` history: that would be ``T x B x V``).

Only decoding modes that pick one token per row per processor call can be recorded this way (multinomial
sampling, greedy). Beam search reorders and multiplies rows, assisted decoding scores candidates that may be
rejected: there the recorder records nothing and says why (``unsupported``) instead of raising inside
``generate``, so a diagnostic never breaks the generation it observes.

The hook is transformers' private ``GenerationMixin._get_logits_processor``, shadowed by an instance attribute for
the duration of the context. It and every other transformers internal tim-plugins relies on (here, in the parity
reader and in the TRL adapter) are entries of ``TRANSFORMERS_SOURCES`` below, named where they are used, checked
when a feature that needs them attaches (``tim_plugins.capabilities``) and against the installed transformers by
``tests/test_transformers_sources.py``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tim_plugins._optional import note_version

__all__ = ["RECORDABLE_MODES", "TRANSFORMERS_SINCE", "TRANSFORMERS_SOURCES", "ProcessedLogprobRecorder",
           "record_processed_logprobs"]

# The transformers source each use relies on (5.0 - 5.24): (module, qualified name) -> what is assumed of it. An
# entry that exists only from some release on is in TRANSFORMERS_SINCE, and the entry that holds the same code
# before it is named beside it.
TRANSFORMERS_SOURCES = {
    ("transformers.generation.utils", "GenerationMixin.generate"):
        "calls self._get_logits_processor(generation_config=..., logits_processor=..., ...) once per call, by "
        "keyword and looked up on the model instance, and hands the list it returns to the decoding loop",
    ("transformers.generation.utils", "GenerationMixin._get_logits_processor"):
        "(generation_config, input_ids_seq_length, encoder_input_ids, prefix_allowed_tokens_fn, "
        "logits_processor, ...) -> LogitsProcessorList: the processors, then the caller's logits_processor "
        "merged in (_merge_criteria_processor_list), then, when sampling, the warpers temperature -> top-k -> "
        "top-p -> min-p; watermarking and renormalize_logits last",
    ("transformers.generation.utils", "GenerationMixin._sample"):
        "per step: next_token_scores = logits_processor(input_ids, fp32 logits of the last position) with "
        "input_ids the whole sequence so far; the token is drawn from softmax(next_token_scores) (argmax when "
        "greedy) and appended to input_ids, one per row",
    ("transformers.generation.configuration_utils", "GenerationMode"):
        "values 'sample' and 'greedy_search' (GenerationConfig.get_generation_mode()) are the one-token-per-row "
        "modes; beam, assisted, contrastive and DoLa modes are others",
    ("transformers.configuration_utils", "PreTrainedConfig._attn_implementation"):
        "a property: the attention implementation the model runs ('sdpa', 'eager', 'flash_attention_2', ...)",
    ("transformers.trainer", "Trainer._load_callback_state"):
        "with restore_callback_states_from_checkpoint, rebuilds each stateful callback as type(cb)(**args) then "
        "sets its saved attributes, from cb.state() = {'args', 'attributes'} stored by class name",
    ("transformers.trainer", "Trainer._run_epoch"):
        "on_epoch_end runs before the epoch's _maybe_log_save_evaluate (so a window pushed then is logged)",
    ("transformers.trainer", "Trainer._inner_training_loop"):
        "transformers < 5.3: the epoch loop itself (5.3 moved it into Trainer._run_epoch), with the same order: "
        "on_epoch_end before the epoch's _maybe_log_save_evaluate",
}

# Entries that exist from a transformers release on (the guard test checks they exist exactly from then on).
TRANSFORMERS_SINCE = {
    ("transformers.trainer", "Trainer._run_epoch"): "5.3",
}

# transformers' GenerationMode values whose steps the recorder follows:
# TRANSFORMERS_SOURCES transformers.generation.configuration_utils:GenerationMode
RECORDABLE_MODES = ("sample", "greedy_search")


class ProcessedLogprobRecorder:
    """A logits processor that records log p(sampled token) under the final processed distribution.

    At step t it keeps the processed scores ([B, V]); at step t+1 ``input_ids[:, -1]`` is the token
    sampled at step t, so its log-prob is gathered then. ``finish(last_tokens)`` collects the last step.
    (TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._sample)

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


def _generation_mode(args: tuple, kwargs: dict) -> str | None:
    """The decoding mode of the ``generation_config`` handed to ``_get_logits_processor`` (None if unknown)."""
    config = kwargs.get("generation_config", args[0] if args else None)
    get_mode = getattr(config, "get_generation_mode", None)
    if get_mode is None:
        return None
    try:
        mode = get_mode()
    except Exception:  # an odd config: leave the decision to the per-call checks
        return None
    return str(getattr(mode, "value", mode))


@contextmanager
def record_processed_logprobs(model, extra_processors=(), keep_scores: bool = False):
    """While active, every ``model.generate`` call gets a `ProcessedLogprobRecorder` appended last.

    ``extra_processors`` (e.g. the TIM injector) are passed as if the caller had given them to ``generate``
    (``logits_processor=``): transformers places them before the sampling warpers, so their effect is part of
    the distribution sampled from and of the recorded log-probs, as an engine's mismatch would be.

    ``keep_scores=True``: the recorders also keep every step's processed scores (``full_logprobs()``).

    Yields a list; each generate call appends its recorder to it. A call in a decoding mode outside
    ``RECORDABLE_MODES`` (beam search, assisted decoding, ...) gets a recorder that records nothing and names
    the mode in ``unsupported``. The patch is an instance attribute on ``model`` (the transformers model whose
    ``generate`` runs), removed on exit. Outside the tested transformers range it warns once (the hook is private;
    the TRL adapter checks it first, ``integrations/trl/features.py``).
    """
    note_version("transformers")
    recorders: list[ProcessedLogprobRecorder] = []
    # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin.generate (instance lookup, by keyword)
    # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor
    had_own = "_get_logits_processor" in vars(model)
    previous = vars(model).get("_get_logits_processor")
    original = model._get_logits_processor

    def _get_logits_processor(*args, **kwargs):
        if extra_processors:
            from transformers import LogitsProcessorList

            custom = LogitsProcessorList(kwargs.get("logits_processor") or [])
            custom.extend(extra_processors)
            kwargs["logits_processor"] = custom
        processors = original(*args, **kwargs)
        mode = _generation_mode(args, kwargs)
        if mode is not None and mode not in RECORDABLE_MODES:
            recorders.append(ProcessedLogprobRecorder(unsupported=f"generation mode '{mode}'"))
            return processors
        recorder = ProcessedLogprobRecorder(keep_scores=keep_scores)
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
