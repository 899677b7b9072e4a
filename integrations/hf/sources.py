"""The transformers internals (5.0 - 5.24) tim-plugins relies on, each named with what is assumed of it.

No public hook of transformers gives what the adapters need (the distribution ``generate`` samples each token
from, the attention kernel a model runs, the trainer's callback and epoch order), so they use private code: every
use site names its entry here in a comment (``# TRANSFORMERS_SOURCES <module>:<qualname>``,
``tests/test_upstream_sources.py``), and ``tests/test_transformers_sources.py`` checks each assumption against the
installed transformers (signatures, statements in the source, and behaviour where cheap). Users: this adapter
(``recorder``, ``parity_spec``) and the TRL adapter (``integrations/trl``: callback, features, parity reader).

It imports nothing (the guard tests load it without transformers); the core names none of these internals
(``tests/test_layering.py``).
"""

from __future__ import annotations

__all__ = ["TRANSFORMERS_SINCE", "TRANSFORMERS_SOURCES"]

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
    ("transformers.trainer", "Trainer._get_grad_norm"):
        "(model, grad_norm=None) -> the step's pre-clip gradient norm (a tensor, or a float under DeepSpeed), called "
        "on the instance once per optimizer step, after clipping and before the optimizer step and on_step_end; "
        "the same value reaches the step's logged grad_norm",
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
