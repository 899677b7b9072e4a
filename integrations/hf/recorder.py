"""Record the processed log-probs of what an HF ``generate`` call samples, without changing the call.

Used by ``.rollout.generate_with_logprobs`` and by the TRL adapter (TRL 1.16 discards the sampler's log-probs on its
transformers path). The ``generate`` call stays untouched; the core's `ProcessedLogprobRecorder` (a plain logits
processor, ``tim_plugins.rollout.recorder``) is appended *at the very end* of the list ``generate`` builds (after
temperature / top-k / top-p / min-p), so it sees exactly the distribution the token is sampled from.

Only decoding modes that pick one token per row per processor call can be recorded this way (multinomial
sampling, greedy). Beam search reorders and multiplies rows, assisted decoding scores candidates that may be
rejected: there the recorder records nothing and says why (``unsupported``) instead of raising inside
``generate``, so a diagnostic never breaks the generation it observes.

The hook is transformers' private ``GenerationMixin._get_logits_processor``, shadowed by an instance attribute for
the duration of the context: it lives in this adapter, not in the core, because it patches transformers'
internals (``.sources.TRANSFORMERS_SOURCES``, checked when a feature that needs them attaches,
``integrations/trl/features.py`` HF_RECORDER, and against the installed transformers by
``tests/test_transformers_sources.py``).
"""

from __future__ import annotations

from contextlib import contextmanager

from tim_plugins._optional import note_version
from tim_plugins.patching import Patch
from tim_plugins.rollout.recorder import ProcessedLogprobRecorder

__all__ = ["RECORDABLE_MODES", "ProcessedLogprobRecorder", "record_processed_logprobs"]

# transformers' GenerationMode values whose steps the recorder follows:
# TRANSFORMERS_SOURCES transformers.generation.configuration_utils:GenerationMode
RECORDABLE_MODES = ("sample", "greedy_search")


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


def _wrap(original, recorders: list, extra_processors, keep_scores: bool):
    """``_get_logits_processor`` with a recorder appended last to the list it builds (see
    ``record_processed_logprobs``)."""

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

    return _get_logits_processor


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

    The recorder's contract (each call extends the same rows by exactly one token, ``input_ids[:, -1]`` being the
    token sampled from the previous call's scores) is what transformers' decoding loop does
    (TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._sample).
    """
    note_version("transformers")
    recorders: list[ProcessedLogprobRecorder] = []
    # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin.generate (instance lookup, by keyword)
    # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor
    # an instance attribute of ``model``, undone on every exit (tim_plugins.patching.Patch)
    with Patch(model, "_get_logits_processor", lambda original: _wrap(original, recorders, extra_processors,
                                                                     keep_scores)):
        yield recorders
