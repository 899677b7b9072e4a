"""The TRL adapter's translations, pure functions: TRL's trainer settings to the core pipeline's configuration, and
TRL's batch dicts and tensors to the core's [B, T] layout and back. No state and no patching (``hooks.py`` installs,
``callback.py`` runs the lifecycle); each TRL detail read here is named in ``hooks.TRL_SOURCES``.
"""

from __future__ import annotations

import logging

import torch

from tim_plugins.by_key import lag_keys
from tim_plugins.options import SAFE_VOCAB_NEEDS_A_CUT
from tim_plugins.pipeline import PipelineConfig, TrainingSetup, old_logprobs
from tim_plugins.pipeline import pipeline_config as core_pipeline_config
from tim_plugins.safe_vocab import SafeLogprobs
from tim_plugins.truncation import DEFAULT_MIN_P, Truncation

from .config import TIMConfig
from .exact_settings import HF_NEUTRAL_OVERRIDES, check_exact_sampler, is_neutral, model_generation_config_fixes
from .parity_spec import generation_kwargs, greedy_decoding, hf_generation_settings, sampler_settings

__all__ = ["completion_lengths", "eos_token_ids", "loss_pass_inputs", "map_safe_calls", "packed_rows",
           "pipeline_config", "response_mask", "rollout_source", "safe_truncation", "scale_policy_term", "tokenizer"]

logger = logging.getLogger("tim_plugins.trl")


def rollout_source(trainer, config: TIMConfig) -> str:
    """Where the rollout log-probs come from: vllm, hf (recorded from TRL's generate), exact, inject, custom
    (the user's rollout_func returns them) or unavailable."""
    # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__ (use_vllm, rollout_func,
    # use_transformers_continuous_batching; features.MONITOR, features.HF_RECORDER)
    if getattr(trainer, "rollout_func", None) is not None and config.rollout in ("hf", "exact", "inject"):
        # GRPOTrainer._generate calls the rollout_func instead of the transformers generation these modes record or
        # replace: they would measure nothing they promise (exact's 0, inject's noise), without a word
        raise ValueError(
            f"TIMConfig.rollout={config.rollout!r} records or replaces TRL's transformers generation, which "
            "GRPOTrainer(rollout_func=...) bypasses: the rollout_func generates every completion. Fix: "
            "rollout='auto' (the log-probs your rollout_func returns are measured), or drop rollout_func.")
    if config.rollout in ("exact", "inject"):
        if trainer.use_vllm:
            raise ValueError(f"TIMConfig.rollout={config.rollout!r} replaces TRL's transformers generation and needs "
                             "GRPOConfig.use_vllm=False (got use_vllm=True).")
        return config.rollout
    if trainer.use_vllm:
        if config.rollout == "hf":
            raise ValueError(
                "TIMConfig.rollout='hf' but the trainer uses vLLM (GRPOConfig.use_vllm=True): the rollouts come "
                "from vLLM. Use rollout='auto', or set use_vllm=False to record HF generate's log-probs.")
        return "vllm"
    if getattr(trainer, "rollout_func", None) is not None:
        return "custom"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        if config.monitor and config.is_correction is None:  # with a correction, pipeline_config refuses it
            logger.warning("tim_plugins: use_transformers_continuous_batching=True returns no log-probs; the "
                           "monitor has no rollout log-probs (set it False, or use vLLM)")
        return "unavailable"
    return "hf"


def eos_token_ids(trainer):
    """The ids that end a completion: ``GRPOTrainer.eos_token_ids`` (TRL >= 1.15: the generation config's, which may
    list several), else the tokenizer's one EOS (TRL 1.9 - 1.14 end completions there)."""
    # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__ (eos_token_ids; features.EXACT_SAMPLER)
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is not None:
        return ids
    return tokenizer(trainer).eos_token_id


def tokenizer(trainer):
    """The trainer's tokenizer (a processor's own, for vision-language models)."""
    return getattr(trainer.processing_class, "tokenizer", trainer.processing_class)


def safe_truncation(trainer, config: TIMConfig, engine_min_p: float = 0.0,
                    engine_logprobs_mode: str | None = None) -> Truncation:
    """The sampler's truncation, applied by the trainer's safe-vocab head; fails early when it cannot be.
    ``engine_min_p``: the min-p the vLLM server cuts every request at on its own (tim-plugins' min-p processor,
    ``--logits-processors`` with ``--additional-config '{"tim_min_p": x}'``); the sampler cuts at the larger of it
    and its own min_p (GRPOConfig.min_p, or generation_kwargs' when given). ``engine_logprobs_mode``: the
    server's (None: unknown, or TRL's colocate engine, which TRL builds with processed log-probs)."""
    # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__ (temperature, use_vllm; the sampler's min_p,
    # top_k and top_p merged from GRPOConfig and its generation_kwargs as TRL merges them, and do_sample; the
    # safe-vocabulary routes of features.py)
    args = trainer.args
    model = trainer.model  # transformers fills what TRL's GenerationConfig leaves None from its generation_config
    if engine_logprobs_mode is not None and engine_logprobs_mode != "processed_logprobs":
        # the same rule as tim_plugins.integrations.vllm.sampling.check_vllm_engine
        raise ValueError(
            f"TIMConfig.safe_vocab=True with a vLLM server whose logprobs_mode={engine_logprobs_mode!r}: the safe "
            "vocabulary renormalises the trainer's log-probs over the sampler's kept set, and the rollout's must be "
            "the same set's, processed log-probs; raw ones are taken before the cut (every ratio would read the kept "
            "mass). Fix: restart the server with --logprobs-mode processed_logprobs (`trl vllm-serve` sets it; a "
            "plain `vllm serve` needs it), or safe_vocab=False")
    greedy = greedy_decoding(args, None if trainer.use_vllm else model)
    if greedy is not None:
        fix = ("drop do_sample from generation_kwargs (TRL samples then)" if not trainer.use_vllm else
               "a temperature >= 1e-5 (GRPOConfig.temperature, or generation_kwargs' own)")
        raise ValueError(
            f"TIMConfig.safe_vocab=True with greedy decoding ({greedy}) is invalid: {SAFE_VOCAB_NEEDS_A_CUT}, and "
            "greedy decoding cuts nothing (transformers applies top-k/top-p/min-p only when it samples, vLLM resets "
            "them for greedy requests): the rollout's log-probs are the full softmax at T=1, whatever GRPOConfig's "
            f"min_p / top_p / top_k say. Fix: {fix}, or safe_vocab=False")
    # the cut TRL's sampler makes: GRPOConfig's min_p / top_k / top_p as generation_kwargs override them, read as
    # the parity audit reads the rollout side
    if not trainer.use_vllm:
        _check_hf_cuts(args, model)
    sampling, gen = sampler_settings(args, None if trainer.use_vllm else model), generation_kwargs(args)
    origin = {} if trainer.use_vllm else hf_generation_settings(args, model)[1]
    own_min_p = float(sampling["min_p"] or 0.0)
    sampler_min_p = max(own_min_p, engine_min_p)
    cut = {k: gen[k] for k in ("min_p", "top_p", "top_k") if k in gen}  # what generation_kwargs override
    own = f"generation_kwargs['min_p']={gen['min_p']!r}" if "min_p" in gen else f"GRPOConfig.min_p={args.min_p!r}"
    if "min_p" in origin:  # TRL passes min_p=None: transformers cuts at the model's generation_config min_p
        own += f" ({origin['min_p']}: min_p={sampling['min_p']!r})"
    sampler = (own if engine_min_p <= own_min_p else
               f"the vLLM server's min-p processor: tim_min_p={engine_min_p:g}, over {own}")
    min_p = config.safe_vocab_min_p if config.safe_vocab_min_p is not None else sampler_min_p
    top_p = float(sampling["top_p"] if sampling["top_p"] is not None else 1.0)
    top_k = max(int(sampling["top_k"] or 0), 0)
    if min_p <= 0 and top_p >= 1.0 and top_k == 0:
        raise ValueError(
            f"TIMConfig.safe_vocab=True with GRPOConfig(min_p={args.min_p!r}, top_p={args.top_p!r}, "
            f"top_k={args.top_k!r}{f', generation_kwargs={cut!r}' if cut else ''}) and "
            f"TIMConfig.safe_vocab_min_p={config.safe_vocab_min_p!r}"
            f"{''.join(f', {k}={sampling[k]!r} from {origin[k]}' for k in ('min_p', 'top_p', 'top_k') if k in origin)}"
            f": {SAFE_VOCAB_NEEDS_A_CUT}, and this sampler keeps the whole vocabulary. Fix: GRPOConfig(min_p="
            f"{DEFAULT_MIN_P:g}) (the extreme tail pruned on both sides, tim_plugins.truncation.DEFAULT_MIN_P), or "
            "your top_p < 1 / top_k > 0, or safe_vocab=False")
    if config.safe_vocab_min_p is not None and config.safe_vocab_min_p != sampler_min_p:
        # TRL's sampler applies GRPOConfig.min_p (and a server's min-p processor its own): another min-p cuts
        # another tail on the trainer's side
        other = "min_p=None" if config.safe_vocab_min_p == 0 else f"min_p={config.safe_vocab_min_p:g}"
        where = f"GRPOConfig(generation_kwargs={{'min_p': {config.safe_vocab_min_p:g}}})" if "min_p" in gen else \
            f"GRPOConfig({other})"
        fix = (where if engine_min_p <= 0 else
               f"the server's --additional-config '{{\"tim_min_p\": {config.safe_vocab_min_p:g}}}'")
        logger.warning("tim_plugins: safe_vocab_min_p=%g differs from the sampler's min-p (%s): the trainer's safe "
                       "set is not the sampler's cut, so the ratio leaves 1 on the tokens between the two cuts (the "
                       "parity audit's sampler-truncation-unmatched). Fix: safe_vocab_min_p=None (the trainer then "
                       "cuts at %g, as the sampler does), or %s", config.safe_vocab_min_p, sampler, sampler_min_p, fix)
    if getattr(trainer.model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError("TIMConfig.safe_vocab=True: the lm_head has a bias, which the safe-vocab head does not "
                         "support; use safe_vocab=False for this model.")
    softcap = getattr(trainer.model.config.get_text_config(), "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"TIMConfig.safe_vocab=True: final_logit_softcapping={softcap!r} is not supported by the "
                         "safe-vocab head; use safe_vocab=False for this model.")
    return Truncation(min_p=float(min_p), top_p=top_p, top_k=top_k, temperature=float(trainer.temperature),
                      order="vllm" if trainer.use_vllm else "hf")  # validates, quoting values


# transformers' cuts that the safe vocabulary does not make (it cuts at top-k, top-p, min-p only): generate() applies
# them with those three when sampling (transformers/generation/utils.py GenerationMixin._get_logits_processor), so the
# sampler's kept set would be smaller than the trainer's (the value that turns each off from generation_kwargs:
# exact_settings.HF_NEUTRAL_OVERRIDES; top-h has none)
_HF_CUTS_NOT_FOLLOWED = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


def _check_hf_cuts(args, model) -> None:
    """Refuse the safe vocabulary when TRL's transformers generation cuts with a rule it does not follow: top-h,
    typical-p, epsilon or eta, from ``GRPOConfig.generation_kwargs`` or, where TRL leaves the key unset, the model's
    generation_config (``parity_spec.hf_generation_settings``). Greedy decoding is refused before (none applies)."""
    settings, origin = hf_generation_settings(args, model)
    bad = {k: settings[k] for k in _HF_CUTS_NOT_FOLLOWED if not is_neutral(k, settings[k])}
    if not bad:
        return
    where, fixes = [], []
    from_gen = {k: v for k, v in bad.items() if k not in origin}
    from_model = {k: v for k, v in bad.items() if k in origin}
    if from_gen:
        where.append(f"GRPOConfig.generation_kwargs sets {from_gen}")
        settable = ", ".join(f"{k}={HF_NEUTRAL_OVERRIDES[k]!r}" for k in from_gen if k in HF_NEUTRAL_OVERRIDES)
        # dropping a key hands it to the model's generation_config: only where that one does not cut too
        model_gc = getattr(model, "generation_config", None)
        model_cuts = [k for k in from_gen if not is_neutral(k, getattr(model_gc, k, None))]
        if model_cuts and settable:
            fixes.append(f"set {settable} in generation_kwargs (the model's generation_config cuts too)")
        else:
            fixes.append(f"drop {', '.join(map(repr, from_gen))} from generation_kwargs"
                         + (f" (or set {settable} there)" if settable else ""))
    if from_model:
        model_where, model_fixes = model_generation_config_fixes(from_model)
        where.append(model_where)
        fixes.extend(model_fixes)
    names = ", ".join(k.replace("_cutoff", "").replace("_", "-") for k in bad)
    raise ValueError(
        f"TIMConfig.safe_vocab=True with TRL's transformers generation, where {' and '.join(where)}, is invalid: the "
        "safe vocabulary renormalises the trainer's log-probs over the sampler's kept set, which it finds with "
        f"top-k, top-p and min-p only, and transformers' {names} cut drops tokens by another rule (generate() "
        "applies it with them when sampling): the trainer's safe set would hold tokens the sampler never keeps. "
        f"Fix: {'; and '.join(fixes)}, or safe_vocab=False")


# hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__ (top_p, top_k, min_p, repetition_penalty,
# use_vllm, vllm_importance_sampling_correction, use_transformers_continuous_batching; the transformers path's
# generation settings, its own dict updated with GRPOConfig.generation_kwargs; features.EXACT_SAMPLER,
# features.LOSS_FACTOR)
def pipeline_config(trainer, config: TIMConfig, source: str, *, safe_vocab: bool, loss_factor: bool,
                    asynchronous: bool = False) -> PipelineConfig:
    """TIMConfig (+ the trainer's settings and what the installed TRL supports) -> the core pipeline's configuration;
    fails early on what TRL cannot combine."""
    if config.is_correction is not None:
        _check_rollout_logprobs(trainer, config, source)
    if source == "exact":
        args = getattr(trainer, "args", None)
        check_exact_sampler(trainer, generation_kwargs(args) if args is not None else {},
                            lambda: eos_token_ids(trainer))
    if config.is_correction is not None and loss_factor and trainer.use_vllm \
            and trainer.vllm_importance_sampling_correction:
        raise ValueError(
            f"TIMConfig.is_correction={config.is_correction!r} with vLLM rollouts while TRL's own correction is "
            "on (GRPOConfig.vllm_importance_sampling_correction=True): pick one. Set "
            "vllm_importance_sampling_correction=False to use ours, or is_correction=None to keep TRL's.")
    return core_pipeline_config(
        monitor=config.monitor, ratio_band=config.ratio_band, safe_vocab=safe_vocab,
        mask_boundary=config.mask_boundary_tokens,
        correction=config.is_correction_options if config.is_correction is not None else None,
        lr_decay=config.lr_decay_options if config.lr_decay else None,
        probe=config.parity_probe_options if config.parity_probe else None,
        dump=config.dump_options if config.dump_dir else None, strict=config.strict,
        histograms=config.log_histograms and "wandb" in (trainer.args.report_to or []),
        causes=config.causes_options if config.causes else None,
        setup=TrainingSetup(asynchronous=asynchronous, multi_turn=True, loss_factor=loss_factor))


def _unfollowed_decoding(trainer) -> tuple[str, list[str]] | None:
    """(the decoding mode, the generation_kwargs keys that select it) when TRL's transformers ``generate`` is set to
    a mode whose steps the log-prob recorder cannot follow (one call per step, every row extended by one token):
    beam search of any kind, assisted decoding. None for sampling and greedy decoding. Read from
    ``GRPOConfig.generation_kwargs``, which TRL lays over its GenerationConfig; a mode that shows only at generation
    (the model's own generation config) is counted there, ``tim/diag/unsupported_generation_mode``."""
    gen = generation_kwargs(trainer.args)
    beams = gen.get("num_beams")
    if isinstance(beams, int) and beams > 1:
        return f"beam search (num_beams={beams})", ["num_beams", *(k for k in ("num_beam_groups",) if k in gen)]
    constrained = [k for k in ("constraints", "force_words_ids") if gen.get(k) is not None]
    if constrained:
        return "constrained beam search", constrained
    assisted = [k for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
                if gen.get(k) is not None]
    if assisted:
        return "assisted decoding", assisted
    return None


def _check_rollout_logprobs(trainer, config: TIMConfig, source: str) -> None:
    """An IS correction weights each loss forward by the rollout log-probs: where TRL's generation can yield none,
    the attach refuses (the adapter's rule: with a correction on it raises rather than train uncorrected)."""
    what = f"TIMConfig.is_correction={config.is_correction!r}"
    rule = ("the correction weights the loss by the rollout log-probs and this generation yields none, so the loss "
            "would train uncorrected (with a correction on, the adapter refuses that)")
    if source == "unavailable":
        if getattr(trainer, "use_transformers_continuous_batching", False):
            raise ValueError(
                f"{what} with GRPOConfig.use_transformers_continuous_batching=True is invalid: continuous batching "
                f"returns no log-probs and the recorder cannot follow it; {rule}. Fix: "
                "use_transformers_continuous_batching=False (TRL's generate, its log-probs recorded), or "
                "use_vllm=True, or is_correction=None")
        raise ValueError(
            f"{what} is invalid here: the recorder of TRL's generate is switched off (its warning above names why); "
            f"{rule}. Fix: the fix that warning gives, or use_vllm=True, or is_correction=None")
    if source in ("hf", "inject"):
        unfollowed = _unfollowed_decoding(trainer)
        if unfollowed is not None:
            mode, keys = unfollowed
            raise ValueError(
                f"{what} with GRPOConfig.generation_kwargs={generation_kwargs(trainer.args)!r} is invalid: {mode} "
                f"does not extend every row by one sampled token per step, so the recorder cannot follow it; {rule}. "
                f"Fix: drop {', '.join(map(repr, keys))} from generation_kwargs (sampling or greedy decoding), or "
                "use_vllm=True, or is_correction=None")


def completion_lengths(batch: dict, pad_token_id: int | None) -> torch.Tensor:
    """[B] each completion's length as TRL's ``completions/mean_length`` counts it, from the batch alone (the LR
    decay's fallback where TRL logged no value for the batch): the tokens its loss sees (``response_mask``); a
    completion TRL masked whole (``mask_truncated_completions``: it does not end in EOS or padding) counts its
    generated tokens, up to its last token that is not padding (TRL right-pads with the padding token), tool tokens
    included (TRL zeroes a masked completion's ``tool_mask``; TRL counts its model tokens only). Without a padding
    token id, a masked completion counts 0."""
    lengths = response_mask(batch).sum(dim=1)
    ids = batch.get("completion_ids")
    if pad_token_id is None or ids is None:
        return lengths
    position = torch.arange(1, ids.shape[1] + 1, device=ids.device)
    generated = torch.where(ids != pad_token_id, position, 0).amax(dim=1)
    return torch.where(lengths > 0, lengths, generated.to(lengths.device))


def response_mask(batch: dict) -> torch.Tensor:
    """[B, T] tokens TRL's loss sees: completion tokens, minus tool-output tokens when TRL marks them."""
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask


def _label_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Which shifted positions TRL's fused head scores: labels != -100, labelled as in
    trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies and scored by
    trl/trainer/utils.py add_fused_lm_head (both guarded in tests/test_trl_hook_guards.py)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    return labels[:, 1:] != -100  # [b, L-1]


def map_safe_calls(arguments: dict, calls: list[SafeLogprobs]) -> SafeLogprobs | None:
    """The fused head's flat per-call fields of one ``_get_per_token_logps_and_entropies`` call (bound
    ``arguments``) as [B, logits_to_keep] tensors, sliced as TRL slices its log-probs; None when they do not map.

    TRL calls the head once per ``batch_size`` rows; on Triton devices it scores only the labelled positions, else
    every position (prompt and padding too)."""
    input_ids, attention_mask = arguments["input_ids"], arguments["attention_mask"]
    keep = arguments["logits_to_keep"]
    batch_size = arguments.get("batch_size") or input_ids.size(0)
    starts = list(range(0, input_ids.size(0), batch_size))
    if len(calls) != len(starts):
        return None
    grids: tuple[list, list, list] = ([], [], [])
    for start, call in zip(starts, calls):
        end = min(start + batch_size, input_ids.size(0))
        fields = (call.in_safe, call.pruned_mass, call.size)
        if tuple(call.in_safe.shape) == (end - start, keep):  # SafeLogSoftmax: already [b, logits_to_keep]
            for grid, x in zip(grids, fields):
                grid.append(x)
            continue
        lm = _label_mask(input_ids[start:end], attention_mask[start:end], keep).to(call.in_safe.device)
        if call.in_safe.numel() == lm.numel():  # every position scored
            fields = tuple(x.view(lm.shape) for x in fields)
        elif call.in_safe.numel() < lm.numel():  # only the labelled positions (their count: a host read per chunk)
            fields = tuple(x.new_zeros(lm.shape).masked_scatter(lm, x) for x in fields)
        else:
            return None
        for grid, x in zip(grids, fields):
            grid.append(x[:, -keep:])
    in_safe, pruned, size = (torch.cat(g, dim=0) for g in grids)
    return SafeLogprobs(None, in_safe, pruned, size)


def scale_policy_term(inputs: dict, factor: torch.Tensor, mask: torch.Tensor, loss_type: str) -> dict:
    """Make TRL's loss multiply its per-token policy term by ``factor`` [B, T] (>= 0), reading TRL's configuration
    as it is; returns {key: previous value} of the ``inputs`` entries changed, to put back after the loss.

    TRL multiplies its per-token loss by ``inputs["importance_sampling_ratio"]`` only under ``use_vllm and
    vllm_importance_sampling_correction`` (trl/trainer/grpo_trainer.py ``GRPOTrainer._compute_loss``). The same
    product is reached through an input TRL reads in every mode: ``_compute_loss`` accepts (B, T) advantages, and
    for every loss type but vespo the per-token policy term is positively homogeneous in them (-min(r·A,
    clip(r)·A), -sg(min(r, ε))·A·log p, sapo's soft gate · A, ...): with w >= 0, A·w gives exactly w × TRL's term,
    ahead of the same masks and the same KL term TRL's vLLM branch leaves unweighted. vespo folds the ratio into
    its sequence weight instead (``get_gamma_weights`` reads ``inputs["importance_sampling_ratio"]`` whether or not
    vLLM is used); there the factor's positive weights multiply that key, while a token it drops (factor 0) is
    dropped through the advantages: vespo's term -φ·A·log p is linear in each token's A and φ reads only A's sign,
    whereas a 0 in the ratio would clamp the sequence's log-weight to log 1e-8 and take the gradient of every token of
    the row (TRL then logs ``vespo/phi_seq_mean`` over tokens, its (B, T) form). Both routes take the factor as 1
    outside TRL's loss mask, as TRL's own ratio is there: the loss types mask those positions anyway, except TRL
    1.9's luspo, which aggregates ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` with the unmasked positions
    in it. ``tests/test_trl_hook_guards.py`` checks both routes against TRL's vLLM branch for every loss type, and a
    dropped token under vespo against a naive loss from TRL's own ``get_gamma_weights``.
    """
    factor = torch.where(mask.bool(), factor, torch.ones_like(factor))
    adv = inputs["advantages"]
    adv = adv if adv.dim() == 2 else adv.unsqueeze(1)
    if loss_type == "vespo":
        kept = factor > 0
        ratio = torch.where(kept, factor, torch.ones_like(factor))
        if inputs.get("importance_sampling_ratio") is not None:
            ratio = inputs["importance_sampling_ratio"] * ratio
        values = {"importance_sampling_ratio": ratio, "advantages": adv * kept.to(adv.dtype)}
    else:
        values = {"advantages": adv * factor.to(adv.dtype)}
    saved = {key: inputs.get(key) for key in values}
    inputs.update(values)
    return saved


def loss_pass_inputs(inputs: dict, current: torch.Tensor, step: int):
    """(rollout, old, lag) of one loss pass for ``StepPipeline.loss_pass``, or None without rollout log-probs.

    π_old is TRL's ``old_per_token_logps`` (the trainer at the rollout's weights) once an optimizer step has run
    since the batch was generated (``tim_generated_at``, per row); before that π_θ is π_old, and the staleness part
    is exactly 0. ``lag``: each token's optimizer steps since its row was generated."""
    rollout = inputs.get("sampling_per_token_logps")
    if rollout is None:
        return None
    generated_at = inputs.get("tim_generated_at")
    # rows sampled at this step have seen no optimizer step: per row, without a host sync
    fresh = (generated_at == step) if generated_at is not None else False
    old = old_logprobs(current, inputs.get("old_per_token_logps"), fresh)
    lag = lag_keys(step, generated_at, current.shape) if generated_at is not None else None
    return rollout, old, lag


def packed_rows(inputs: dict, log_probs: torch.Tensor) -> dict | None:
    """One rank's packed AsyncGRPOTrainer row -> [S, T] tensors, one row per sample (``segment_id``), a column per
    position after the sample's first trained token (tokens between two turns, not trained, are holes with mask
    False), or None without a trained token.

    The trained tokens are the columns with ``token_index >= 0``; ``log_probs`` the forward's per-position
    ``outputs.log_probs`` ([1, N], N the row's unpadded positions), read at ``token_index`` as TRL's loss reads them
    (trl/experimental/async_grpo/async_grpo_trainer.py ``compute_loss``; the layout is ``packing.TreeRow.pack``'s)."""
    selected = inputs["token_index"] >= 0
    token_index, segment = inputs["token_index"][selected], inputs["segment_id"][selected]
    if token_index.numel() == 0:
        return None
    unpadded = inputs["attention_mask"].bool()
    position = inputs["position_ids"][unpadded][token_index] + 1  # a token is scored off its predecessor's position
    last_sample, last_position = torch.stack([segment.max(), position.max()]).tolist()  # one host read
    first = torch.full((last_sample + 1,), last_position + 1, dtype=position.dtype, device=position.device)
    first = first.scatter_reduce(0, segment, position, reduce="amin")
    column = position - first[segment]
    shape = (last_sample + 1, int(column.max()) + 1)

    def lay(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full(shape, fill, dtype=values.dtype, device=values.device)
        out[segment, column] = values
        return out

    weights_step = inputs.get("tim_weights_step")
    return {"rollout": lay(inputs["old_log_probs"][selected].float(), 0.0),
            "current": lay(log_probs.reshape(-1)[token_index].float(), 0.0),
            "mask": lay(torch.ones_like(segment, dtype=torch.bool), False),
            "token_ids": lay(inputs["shift_labels"][unpadded][token_index], 0),
            "weights_step": lay(weights_step[selected], -1) if weights_step is not None
            else torch.full(shape, -1, dtype=torch.long, device=segment.device)}
