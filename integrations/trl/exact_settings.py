"""Which transformers generation settings change the distribution TRL's transformers generation samples from
(``GENERATION_INERT``, ``GENERATION_NEUTRAL``, ``is_neutral``; the parity audit's TRL reader uses them too), and what
``TIMConfig(rollout="exact")`` can reproduce of it, read from GRPOConfig and its ``generation_kwargs`` as TRL merges
them: a setting that makes TRL sample anything else is refused at attach time."""

from __future__ import annotations

__all__ = ["check_exact_sampler", "GENERATION_INERT", "GENERATION_NEUTRAL", "HF_GLOBAL_DEFAULTS",
           "HF_NEUTRAL_OVERRIDES", "is_neutral", "model_generation_config_fixes", "resolve_hf_settings"]


# What TIMConfig(rollout="exact") reproduces of TRL's transformers generation: softmax(logits / T) sampled one token
# per row per step, T = GRPOConfig.temperature (the trainer divides by it), max_completion_length tokens, ending at
# TRL's EOS ids. TRL builds its GenerationConfig from its own dict (do_sample=True, max_new_tokens, eos_token_id,
# temperature, top_p, top_k, min_p, repetition_penalty, ...) updated with GRPOConfig.generation_kwargs
# (trl/trainer/grpo_trainer.py GRPOTrainer.__init__), so generation_kwargs win. Read as transformers reads each
# setting (GenerationMixin._get_logits_processor, GenerationConfig.get_generation_mode):
#
# settings that leave the sampled distribution as it is, whatever their value: outputs, caches, compilation, ids
# that only fill finished rows, max_length (TRL sets max_new_tokens, which takes precedence), the final
# log-softmax (renormalize_logits), inf/nan removal, and what only beam search, contrastive search or assisted
# decoding read (each selected by a setting checked below: num_beams, do_sample, the assistant keys)
GENERATION_INERT = frozenset({
    "use_cache", "cache_implementation", "cache_config", "compile_config", "disable_compile", "prefill_chunk_size",
    "continuous_batching_config", "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "pad_token_id", "bos_token_id", "decoder_start_token_id", "max_length",
    "renormalize_logits", "remove_invalid_values", "length_penalty", "early_stopping", "num_beam_groups",
    "diversity_penalty", "penalty_alpha", "low_memory", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size",
    "is_assistant"})
# settings that change what is sampled unless they hold the value given: key -> (test, that value)
GENERATION_NEUTRAL = {
    "top_p": (lambda v: v >= 1.0, "1.0"), "top_k": (lambda v: v <= 0, "0"), "min_p": (lambda v: v == 0, "None"),
    "typical_p": (lambda v: v >= 1.0, "1.0"), "epsilon_cutoff": (lambda v: not 0 < v < 1, "0.0"),
    "eta_cutoff": (lambda v: not 0 < v < 1, "0.0"), "repetition_penalty": (lambda v: v == 1.0, "1.0"),
    "encoder_repetition_penalty": (lambda v: v == 1.0, "1.0"), "no_repeat_ngram_size": (lambda v: v <= 0, "0"),
    "encoder_no_repeat_ngram_size": (lambda v: v <= 0, "0"), "min_length": (lambda v: v <= 0, "0"),
    "min_new_tokens": (lambda v: v <= 0, "None"), "guidance_scale": (lambda v: v == 1, "None"),
    "num_beams": (lambda v: v == 1, "1"), "num_return_sequences": (lambda v: v == 1, "1"),
    "do_sample": (lambda v: v is True, "True"), "token_healing": (lambda v: v is False, "False"),
    # logit processors, forced or suppressed tokens, stops, constrained / assisted / DoLa decoding: off when unset
    **{k: (lambda v: False, "None") for k in (
        "top_h", "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
        "forced_eos_token_id", "exponential_decay_length_penalty", "watermarking_config", "constraints",
        "force_words_ids", "stop_strings", "max_time", "assistant_model", "prompt_lookup_num_tokens",
        "assistant_early_exit", "dola_layers")},
}
# What generate() fills a setting left None with (transformers/generation/utils.py
# GenerationMixin._prepare_generation_config, transformers >= 5): the model's own generation_config first, then
# GenerationConfig's global defaults (transformers/generation/configuration_utils.py
# GenerationConfig._get_default_generation_params). The defaults of the settings that change the sampled distribution;
# only top_k's cuts (TRL passing top_k=None samples the top 50), do_sample=False decodes greedily.
# tests/test_trl_hf_sampler_defaults.py checks them against the installed transformers.
HF_GLOBAL_DEFAULTS = {
    "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "num_beams": 1, "num_return_sequences": 1}


def resolve_hf_settings(settings: dict, model_generation_config=None) -> tuple[dict, dict]:
    """(the values transformers' generate runs ``settings`` with, {key: where a value left None came from}) for every
    key of ``GENERATION_NEUTRAL`` and of ``settings``. ``settings``: TRL's GenerationConfig dict (its own sampler dict
    updated with generation_kwargs); ``model_generation_config``: the model's ``generation_config`` (None: unknown,
    transformers' defaults then, as for a model that sets none of them). A value left None takes the model's, then
    transformers' default (``HF_GLOBAL_DEFAULTS``); the origin reads "the model's generation_config", or "transformers'
    default" for a key ``settings`` holds as None."""
    values, origin = {}, {}
    for key in dict.fromkeys([*settings, *GENERATION_NEUTRAL]):
        value = settings.get(key)
        if value is None and model_generation_config is not None \
                and getattr(model_generation_config, key, None) is not None:
            value, origin[key] = getattr(model_generation_config, key), "the model's generation_config"
        elif value is None and HF_GLOBAL_DEFAULTS.get(key) is not None:
            value = HF_GLOBAL_DEFAULTS[key]
            if key in settings:  # set None there: say where its value comes from (the others are simply unset)
                origin[key] = "transformers' default"
        values[key] = value
    return values, origin


# the neutral value of a setting that generation_kwargs can give to override the model's generation_config (a None
# there hands the setting back to the model's); a setting not here has none (top_h keeps at most 100 tokens whatever
# its value)
HF_NEUTRAL_OVERRIDES = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0, "num_beams": 1,
    "num_return_sequences": 1, "do_sample": True}
# the settings TRL gives a value of its own: a None there hands them to the model's generation config, else to
# transformers' defaults (top_k=50, do_sample=False)
_EXACT_TRL_SETS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens",
                   "eos_token_id")


def _exact_neutral(trainer, eos_ids, key: str, value) -> tuple[bool, str | None]:
    """(whether ``key=value`` in TRL's merged generation settings leaves the exact sampler's distribution as it is,
    the value that would: None for a key to drop)."""
    if key in ("temperature", "max_new_tokens", "eos_token_id"):  # what the exact sampler itself runs with
        want = (float(trainer.temperature) if key == "temperature" else
                trainer.max_completion_length if key == "max_new_tokens" else eos_ids())
        as_set = (lambda x: set(x) if isinstance(x, (list, tuple)) else {x}) if key == "eos_token_id" else None
        same = value is not None and (as_set(value) == as_set(want) if as_set else value == want)
        return same, repr(want)
    if key in GENERATION_INERT:
        return True, None
    if key not in GENERATION_NEUTRAL:
        return False, None
    return is_neutral(key, value), GENERATION_NEUTRAL[key][1]


def is_neutral(key: str, value) -> bool:
    """Whether ``key=value`` (a key of ``GENERATION_NEUTRAL``) in TRL's merged generation settings leaves transformers'
    sampled distribution as it is: unset (None, empty) or the neutral value. Also read by the parity audit's TRL
    reader (``parity_spec.hf_sampler_processors``)."""
    test = GENERATION_NEUTRAL[key][0]
    if value is None or (isinstance(value, (list, tuple, dict, str)) and len(value) == 0):
        return key not in _EXACT_TRL_SETS
    try:
        return bool(test(value))
    except TypeError:  # a value transformers would not take either
        return False


def model_generation_config_fixes(bad: dict) -> tuple[str, list[str]]:
    """(what a refusal says of the settings ``bad`` that the model's generation_config sets and TRL's GenerationConfig
    leaves None, the fixes): the neutral value in generation_kwargs where one overrides it
    (``HF_NEUTRAL_OVERRIDES``), else the model's generation_config cleared before the trainer is built."""
    where = (f"the model's generation_config sets {bad} (TRL's GenerationConfig leaves "
             f"{'it' if len(bad) == 1 else 'them'} None, and generate() takes the model's)")
    settable = {k: HF_NEUTRAL_OVERRIDES[k] for k in bad if k in HF_NEUTRAL_OVERRIDES}
    unsettable = [k for k in bad if k not in HF_NEUTRAL_OVERRIDES]
    fixes = []
    if settable:
        fixes.append(f"add {settable!r} to GRPOConfig.generation_kwargs")
    if unsettable:
        fixes.append(" and ".join(f"model.generation_config.{k} = None" for k in unsettable)
                     + " before building the GRPOTrainer")
    return where, fixes


def check_exact_sampler(trainer, gen: dict, eos_ids) -> None:
    """Refuse ``rollout='exact'`` when TRL's transformers generation, as configured, would sample anything else than
    what the exact sampler reproduces: GRPOConfig's sampler settings, and ``generation_kwargs`` (laid over them).
    ``gen``: GRPOConfig.generation_kwargs (``parity_spec.generation_kwargs``); ``eos_ids()``: the EOS ids TRL ends a
    completion at (``translate.eos_token_ids``), read where a setting names them. A setting TRL's GenerationConfig
    leaves None (GRPOConfig's default min_p, or one TRL does not set) is the model's generation_config's
    (``resolve_hf_settings``), and counts too."""
    own = {k: v for k, v in (("top_p", trainer.top_p), ("top_k", trainer.top_k), ("min_p", trainer.min_p),
                             ("repetition_penalty", trainer.repetition_penalty)) if k not in gen}
    bad_own = {k: v for k, v in own.items() if not _exact_neutral(trainer, eos_ids, k, v)[0]}
    bad_gen = {}
    for key, value in gen.items():
        ok, neutral = _exact_neutral(trainer, eos_ids, key, value)
        if not ok:
            bad_gen[key] = neutral
    model_gc = getattr(getattr(trainer, "model", None), "generation_config", None)
    trl_dict = {"do_sample": True, "temperature": getattr(trainer, "temperature", None), **own, **gen}
    values, origin = resolve_hf_settings(trl_dict, model_gc)
    bad_model = {k: values[k] for k, where in origin.items() if where == "the model's generation_config"
                 and k not in bad_own and k not in bad_gen and not _exact_neutral(trainer, eos_ids, k, values[k])[0]}
    if not bad_own and not bad_gen and not bad_model:
        return
    parts, fixes = [], []
    if bad_own:
        parts.append(f"GRPOConfig sets {bad_own}")
        fixes.append("GRPOConfig(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)")
    if bad_gen:
        shown = {k: gen[k] for k in bad_gen}
        unknown = [k for k, neutral in bad_gen.items() if neutral is None]
        parts.append(f"GRPOConfig.generation_kwargs, which TRL lays over GRPOConfig's sampler settings, sets {shown}"
                     + (f" ({', '.join(map(repr, unknown))}: not a transformers generation setting known to leave "
                        "that distribution as it is)" if unknown else ""))
        fix = f"drop {', '.join(map(repr, bad_gen))} from generation_kwargs"
        settable = {k: v for k, v in bad_gen.items() if v is not None and v != "None"}
        if settable:
            fix += f" (or set {', '.join(f'{k}={v}' for k, v in settable.items())} there)"
        for key, field_name in (("temperature", "temperature"), ("max_new_tokens", "max_completion_length")):
            if key in bad_gen:
                fix += f"; set GRPOConfig.{field_name} instead of generation_kwargs[{key!r}]"
        fixes.append(fix)
    if bad_model:
        where, model_fixes = model_generation_config_fixes(bad_model)
        parts.append(where)
        fixes.extend(model_fixes)
    raise ValueError(
        f"TIMConfig.rollout='exact' samples softmax(logits/T) only (T = GRPOConfig.temperature, one token per row per "
        f"step, max_completion_length tokens, ending at TRL's EOS ids), but {' and '.join(parts)}. Fix: "
        f"{'; and '.join(fixes)} for the exact run, or TIMConfig(rollout='auto') to keep that sampler.")
