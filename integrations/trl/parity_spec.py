"""TRL `GRPOConfig` (+ model) → the two `PipelineSpec`s of a GRPO run (trl 1.16).

What TRL does, read in the installed sources:
- Trainer (grpo_trainer.py): log-probs from a fused lm_head that divides by ``temperature`` and applies no
  top-p/top-k/min-p nor penalties; policy weights in ``model_init_kwargs['dtype']`` (default float32), computed
  under autocast when ``bf16``/``fp16`` is set; ``cast_lm_head_to_fp32`` keeps the head in fp32.
- vLLM colocate (generation/vllm_generation.py ~L347): ``LLM(model=name_or_path, ..., logprobs_mode=
  "processed_logprobs", quantization="bitsandbytes" only for 4-bit bnb models)`` and **no** dtype (vLLM 'auto':
  fp32 checkpoints run bf16), no enable_prefix_caching / enable_chunked_prefill / enforce_eager (vLLM defaults:
  on, on, off). SamplingParams: temperature, top_p, top_k, min_p (None → 0), repetition_penalty, plus
  ``generation_kwargs``.
- vLLM server mode: the engine is configured by ``trl vllm-serve``; pass its args as ``server_args``.
- Without vLLM: HF generation with the same (unwrapped, dtype-cast) model; no sampler log-probs are kept. TRL's
  ``GenerationConfig`` is its sampler dict updated with ``generation_kwargs``: transformers-only settings there
  (n-gram bans, bad words, suppressed / forced tokens, sequence bias, typical/epsilon/eta cuts, ...) change the
  sampled distribution (``hf_sampler_processors``); vLLM's names (presence_penalty, logit_bias, ...) are ignored.
  transformers >= 5 fills every value that GenerationConfig leaves None from the model's own generation_config, then
  from its global defaults (``hf_generation_settings``): GRPOConfig(top_k=None) samples the top 50, or the model's
  top_k; GRPOConfig's default min_p=None takes the model's min_p. (TRL's ``unwrap_model_for_generation`` override
  of the model's generation_config, trl/models/utils.py ``_override_model_generation_config``, is a no-op there.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tim_plugins.parity.audit import GREEDY_T  # vLLM's greedy threshold (it resets top_p/top_k/min_p)
from tim_plugins.parity.spec import PipelineSpec, normalize_dtype
from tim_plugins.parity.vllm_spec import checkpoint_dtype_from_path, spec_from_engine_args

from .exact_settings import GENERATION_NEUTRAL, is_neutral, resolve_hf_settings

__all__ = ["trainer_spec_from_trl", "rollout_spec_from_trl", "specs_from_grpo_config", "specs_from_trainer",
           "load_grpo_config", "generation_kwargs", "greedy_decoding", "sampler_settings", "hf_sampler_processors",
           "hf_generation_settings"]


# sampler settings both engines know, read into PipelineSpec's own fields (do_sample: ``greedy_decoding``)
_SHARED_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM SamplingParams only: transformers' GenerationConfig keeps them as attributes no generation step reads
_VLLM_ONLY_KEYS = ("presence_penalty", "frequency_penalty", "logit_bias", "bad_words", "allowed_token_ids",
                   # processing no PipelineSpec field holds (vllm_spec.sampling_processors)
                   "min_tokens", "thinking_token_budget")
# transformers settings (exact_settings.GENERATION_NEUTRAL) that change no token's distribution given its prefix:
# how many sequences are returned and when generation stops (the trainer scores the tokens kept), and assisted
# decoding (speculative sampling / candidate verification keep the target model's processed distribution)
_HF_NOT_A_DISTRIBUTION = ("do_sample", "num_return_sequences", "max_time", "stop_strings", "assistant_model",
                          "prompt_lookup_num_tokens", "assistant_early_exit")
# transformers' warpers (GenerationMixin._get_logits_processor): applied under do_sample only
_HF_SAMPLING_ONLY = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def load_grpo_config(path: str | Path) -> Any:
    """A `trl.GRPOConfig` from a YAML or JSON file of its fields (unknown fields fail with their names)."""
    from trl import GRPOConfig

    if not Path(path).is_file():
        raise ValueError(f"{path}: {'a folder, not a file' if Path(path).is_dir() else 'no such file'}; pass a YAML "
                         "or JSON file of GRPOConfig fields (e.g. grpo.yaml holding top_p: 0.95 and use_vllm: true)")
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of GRPOConfig fields, got {type(data).__name__}")
    data.setdefault("output_dir", "tim-audit-unused")
    # A static audit reads the config on whatever machine it runs on (a GPU run's config on a CPU-only one too):
    # transformers refuses bf16 without a bf16 GPU unless use_cpu, and the audit places nothing on a device.
    data.setdefault("use_cpu", True)
    fields = set(GRPOConfig.__dataclass_fields__)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path}: not GRPOConfig fields: {unknown} (trl {__import__('trl').__version__})")
    return GRPOConfig(**data)


def _init_kwargs(args: Any) -> dict:
    kw = args.model_init_kwargs or {}
    return json.loads(kw) if isinstance(kw, str) else dict(kw)


def _param_dtype(args: Any, model: Any) -> Optional[str]:
    # The dtype of the model's weights; the autocast is its own field (_autocast_dtype): bf16=True / fp16=True
    # leave the weights TRL loaded (float32 for a model path unless model_init_kwargs['dtype'] says otherwise) and
    # only autocast the matmuls; embeddings, norms, residual stream and log-softmax stay in those weights' dtype.
    # fp32 weights under bf16 autocast are neither vLLM's bf16 model (the per-token gap stays:
    # tests/test_trl_vllm_dtype_fix.py) nor its fp32 one, which the audit's dtype rule reads from both fields.
    if model is not None and not isinstance(model, (str, Path)):
        return str(next(model.parameters()).dtype)
    dtype = _init_kwargs(args).get("dtype", "float32")  # TRL's documented default for a model path
    if dtype == "auto" or dtype is None:
        # transformers >= 5 then takes the checkpoint's own dtype (config.json); unknown without a local checkpoint
        return normalize_dtype(checkpoint_dtype_from_path(model)) if model is not None else None
    return normalize_dtype(dtype)


def _autocast_dtype(args: Any) -> Optional[str]:
    """The dtype accelerate autocasts the forward to (GRPOConfig bf16 / fp16), None when it does not."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return None


def _dtype_note(args: Any, model: Any) -> str:
    weights, autocast = _param_dtype(args, model), _autocast_dtype(args)
    note = f"weights {weights}, bf16={args.bf16}, fp16={args.fp16}"
    if autocast is not None and weights is not None and autocast != weights:
        note += (f": {autocast} autocast over {weights} weights (matmuls in {autocast}; embeddings, norms, residual "
                 f"stream and log-softmax in {weights}), which no single-dtype engine reproduces; {autocast} weights: "
                 f"GRPOConfig(model_init_kwargs={{'dtype': '{autocast}'}}"
                 # fp16 weights: fp16=True's GradScaler refuses their gradients, and bf16 left unset is True
                 + (", bf16=False, fp16=False)" if autocast == "float16" else ")"))
    return note


def _checkpoint_dtype(model: Any, args: Any) -> Optional[str]:
    """dtype of the checkpoint vLLM loads (config.json at name_or_path), which 'auto' resolves from."""
    path = getattr(model, "name_or_path", None) if model is not None and not isinstance(model, str) else model
    config = getattr(model, "config", None)
    return checkpoint_dtype_from_path(path) or str(getattr(config, "dtype", None) or "") or None


def generation_kwargs(args: Any) -> dict:
    """``GRPOConfig.generation_kwargs`` as a dict (TRL takes a dict or its JSON text)."""
    gen = args.generation_kwargs or {}
    return json.loads(gen) if isinstance(gen, str) else dict(gen)


def _model_generation_config(model: Any) -> Any:
    """The model's own ``generation_config`` (a live model's, or a local checkpoint's generation_config.json, the hub
    cache included), None when unknown (no model, or none stored on this machine)."""
    if model is None:
        return None
    if not isinstance(model, (str, Path)):
        return getattr(model, "generation_config", None)
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model), local_files_only=True)
    except (OSError, ValueError):  # no generation_config.json there (nor cached), or unreadable: none set
        return None


def hf_generation_settings(args: Any, model: Any = None, trl_settings: Optional[dict] = None) -> tuple[dict, dict]:
    """(the generation settings TRL's transformers generation runs with, {key: where a value TRL left None came
    from}). TRL's GenerationConfig: do_sample=True, temperature, top_p, top_k, min_p, repetition_penalty (GRPOConfig's),
    updated with ``generation_kwargs`` (trl/trainer/grpo_trainer.py ``GRPOTrainer.__init__``); generate() fills each
    value left None there from the model's generation_config, then transformers' defaults
    (``exact_settings.resolve_hf_settings``). ``model``: the model, or its path (None: its generation_config is
    unknown, and transformers' defaults are read). ``trl_settings``: TRL's own merged dict where a live trainer holds
    it (``GRPOTrainer.generation_kwargs``), read instead of its reconstruction from ``args``: it also holds what TRL
    adds beside GRPOConfig (``suppress_tokens`` for an image-text processing class), which a config cannot tell.
    Every key of ``exact_settings.GENERATION_NEUTRAL`` is in it."""
    if trl_settings is not None:
        return resolve_hf_settings(dict(trl_settings), _model_generation_config(model))
    trl = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
           "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
    return resolve_hf_settings({**trl, **generation_kwargs(args)}, _model_generation_config(model))


def greedy_decoding(args: Any, model: Any = None) -> Optional[str]:
    """The setting that makes TRL's sampler decode greedily, or None when it samples. Transformers generation:
    ``generation_kwargs['do_sample']`` false (TRL sets True and lays generation_kwargs over it); transformers then
    applies none of its sampling warpers (temperature, top-k, top-p, min-p: ``GenerationMixin._get_logits_processor``
    adds them under ``do_sample`` only). vLLM: a temperature below its greedy threshold, where vLLM resets top_p,
    top_k and min_p. Either way nothing is cut, and the rollout's log-probs (vLLM's processed ones, or those the
    adapter records from generate: TRL keeps none there) are the full softmax at T=1 after the penalties.
    ``generation_kwargs['do_sample']=None`` hands it to the ``model``'s generation_config, then to transformers' default
    False (``hf_generation_settings``)."""
    gen = generation_kwargs(args)
    if getattr(args, "use_vllm", False):
        t = gen.get("temperature", args.temperature)
        return f"temperature={t!r}" if t is not None and t < GREEDY_T else None
    if "do_sample" in gen:
        settings, origin = hf_generation_settings(args, model)
        if settings["do_sample"] is not True:
            filled = f", {origin['do_sample']}: do_sample={settings['do_sample']!r}" if "do_sample" in origin else ""
            return f"generation_kwargs['do_sample']={gen['do_sample']!r}{filled}"
    return None


def sampler_settings(args: Any, model: Any = None) -> dict:
    """The settings TRL's sampler runs with: GRPOConfig's temperature, top_p, top_k, min_p (None -> 0) and
    repetition_penalty, overridden by ``generation_kwargs`` (TRL updates its sampling kwargs with them, on the
    vLLM and the transformers path alike); with vLLM, the penalties and logit constraints generation_kwargs adds
    with them (transformers ignores those names; its own settings are ``hf_sampler_processors``'s). With
    transformers, a value left None is the one generate() fills in (``hf_generation_settings``: the ``model``'s
    generation_config, then transformers' defaults, top_k 50).
    Greedy decoding (``greedy_decoding``) cuts nothing: top_p 1, top_k 0, min_p 0, and temperature 0 (the audit's
    greedy, log-probs of T=1) where transformers decodes greedily. The parity audit reads the rollout side from it,
    and the safe vocabulary cuts where it says."""
    gen = generation_kwargs(args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "min_p": 0.0 if args.min_p is None else args.min_p, "repetition_penalty": args.repetition_penalty}
    if getattr(args, "use_vllm", False):
        sampling.update({k: v for k, v in gen.items() if k in _SHARED_KEYS + _VLLM_ONLY_KEYS})
    else:
        hf = hf_generation_settings(args, model)[0]
        sampling.update({k: hf[k] for k in _SHARED_KEYS}, min_p=0.0 if hf["min_p"] is None else hf["min_p"])
    if greedy_decoding(args, model) is not None:
        sampling.update(top_p=1.0, top_k=0, min_p=0.0)
        if not getattr(args, "use_vllm", False):
            sampling["temperature"] = 0.0
    return sampling


def hf_sampler_processors(args: Any, model: Any = None, trl_settings: Optional[dict] = None) -> tuple[str, ...]:
    """The transformers generation settings in ``generation_kwargs`` that change the distribution TRL's transformers
    generation samples from and that no `PipelineSpec` field holds, as ``"key=value"`` (() with vLLM, which takes
    none of them: SamplingParams refuses unknown names). TRL lays generation_kwargs over its sampler dict and builds
    one ``GenerationConfig`` of them; transformers then adds a logits processor for each such setting not at its
    neutral value (``exact_settings.GENERATION_NEUTRAL``, ``is_neutral``): n-gram bans, bad words, sequence bias,
    suppressed and forced tokens, minimum lengths, the EOS length penalty, encoder repetition penalty, guidance,
    watermarking, beam search, ... The typical-p, epsilon, eta and top-h cuts are truncations, but ones no trainer
    recomputes (the safe vocabulary applies min-p / top-p / top-k only): listed here too, so the audit reports them
    as processing to drop (sampler-penalties-unmatched), not as a truncation it could match on the trainer's side;
    under greedy decoding (``greedy_decoding``) transformers applies none of these warpers. A setting that TRL's
    GenerationConfig leaves unset is read from the ``model``'s generation_config (``hf_generation_settings``); with
    ``trl_settings`` (a live trainer's own dict), what TRL adds itself too (image-text models' ``suppress_tokens``)."""
    if getattr(args, "use_vllm", False):
        return ()
    greedy = greedy_decoding(args, model) is not None
    out = []
    for key, value in hf_generation_settings(args, model, trl_settings)[0].items():
        if key in _SHARED_KEYS or key in _HF_NOT_A_DISTRIBUTION or key not in GENERATION_NEUTRAL:
            continue  # a PipelineSpec field; no distribution; inert or not a transformers setting (ignored)
        if (greedy and key in _HF_SAMPLING_ONLY) or is_neutral(key, value):
            continue
        out.append(f"{key}={value!r}")
    return tuple(out)


def trainer_spec_from_trl(args: Any, model: Any = None) -> PipelineSpec:
    """What GRPOTrainer computes when it recomputes log-probs (temperature only, no truncation/penalties)."""
    attn = None
    if model is not None and not isinstance(model, str):
        # TRANSFORMERS_SOURCES transformers.configuration_utils:PreTrainedConfig._attn_implementation
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    attn = attn or _init_kwargs(args).get("attn_implementation") or "sdpa"
    compute = _param_dtype(args, model)
    head = "float32" if args.cast_lm_head_to_fp32 else None
    return PipelineSpec(
        side="trainer", framework="trl", dtype=compute, autocast=_autocast_dtype(args), lm_head_dtype=head,
        temperature=args.temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
        presence_penalty=0.0, frequency_penalty=0.0, logit_bias=False, bad_words=False,
        custom_logits_processors=(), weight_quantization="none", kv_cache_dtype="auto", prefix_caching=False,
        chunked_prefill=False, cudagraph=False, compile=bool(getattr(args, "torch_compile", False)),
        batch_invariant=False, attention_backend=attn,
        source="trl GRPOConfig" + (" + live model" if model is not None and not isinstance(model, str) else ""),
        notes={"dtype": _dtype_note(args, model)},
    )


def rollout_spec_from_trl(args: Any, model: Any = None, *, server_args: Any = None, device: str = "cuda",
                          llm: Any = None, trl_settings: Optional[dict] = None) -> PipelineSpec:
    """The rollout side: vLLM colocate/server (from what TRL passes to LLM()) or HF generation (``trl_settings``: a
    live trainer's own generation dict, ``hf_generation_settings``)."""
    if args.use_vllm:
        spec = _with_structured_outputs(_vllm_rollout_spec(args, model, server_args, device, llm), args)
        return spec.replace(notes={**spec.notes, **_greedy_notes(args)}) if greedy_decoding(args) else spec
    # TRL's generate() runs the trainer's own model, under the same accelerate autocast: the trainer's dtype
    gen_dtype = _param_dtype(args, model)
    processors, notes = hf_sampler_processors(args, model, trl_settings), _greedy_notes(args, model)
    if processors:
        notes["custom_logits_processors"] = (
            "transformers generation settings in GRPOConfig.generation_kwargs (TRL's GenerationConfig) or, where TRL "
            "leaves one unset, the model's generation_config, each a logits processor the trainer does not apply")
    if trl_settings is not None and trl_settings.get("suppress_tokens") is not None \
            and "suppress_tokens" not in generation_kwargs(args):
        # trl/trainer/grpo_trainer.py GRPOTrainer.__init__: a ProcessorMixin processing class adds
        # suppress_tokens=[model.config.image_token_id] to TRL's own dict, outside generation_kwargs
        notes["suppress_tokens"] = (
            f"TRL's own suppress_tokens={trl_settings['suppress_tokens']!r} (an image-text processing class: a "
            "sampled image token would mismatch the image features); generation_kwargs={'suppress_tokens': None} "
            "lifts it, at that risk")
    origin = hf_generation_settings(args, model)[1]
    known = _model_generation_config(model) is not None
    for key in _SHARED_KEYS:
        if key in origin:  # TRL passes None there: generate() fills it in (hf_generation_settings)
            unless = "" if known else " unless the model's generation_config sets it (pass the model to read it)"
            notes.setdefault(key, f"TRL leaves {key} None: generate() takes {origin[key]}{unless}")
    return PipelineSpec(
        side="rollout", framework="hf-generate (trl)", dtype=gen_dtype, autocast=_autocast_dtype(args),
        lm_head_dtype="float32" if args.cast_lm_head_to_fp32 else None, logprobs_mode=None,
        **_sampler_fields(sampler_settings(args, model)), custom_logits_processors=processors,
        weight_quantization="none",
        kv_cache_dtype="auto", prefix_caching=False, chunked_prefill=False, cudagraph=False, compile=False,
        batch_invariant=False, attention_backend=trainer_spec_from_trl(args, model).attention_backend,
        source="trl GRPOConfig (HF generation; TRL keeps no sampler log-probs)", notes=notes,
    )


def _vllm_rollout_spec(args: Any, model: Any, server_args: Any, device: str, llm: Any) -> PipelineSpec:
    sampling = sampler_settings(args)
    if llm is not None:  # live engine: the truth beats the reconstruction
        # the vLLM adapter's live reader (it reads vLLM's internals); imported here, as a live engine is only read
        # when TRL has one, so that importing this module does not import the vLLM adapter (its version note)
        from tim_plugins.integrations.vllm.parity_spec import spec_from_llm

        return spec_from_llm(llm, sampling=sampling, framework=f"vllm-{args.vllm_mode} (trl)")
    if args.vllm_mode == "colocate":
        engine = {"model": getattr(model, "name_or_path", model) if model is not None else None,
                  "logprobs_mode": "processed_logprobs"}
        spec = spec_from_engine_args(engine, sampling=sampling, checkpoint_dtype=_checkpoint_dtype(model, args),
                                     device=device, framework="vllm-colocate (trl)")
        return spec.replace(source="trl GRPOConfig → LLM(...) colocate kwargs (vllm_generation.py)")
    if server_args is None:
        return PipelineSpec(side="rollout", framework="vllm-server (trl)", **_sampler_fields(sampling),
                            source="trl server mode: engine args unknown (pass server_args)")
    return spec_from_engine_args(server_args, sampling=sampling, checkpoint_dtype=_checkpoint_dtype(model, args),
                                 device=device, framework="vllm-server (trl)")


def _greedy_notes(args: Any, model: Any = None) -> dict:
    greedy = greedy_decoding(args, model)
    if greedy is None:
        return {}
    return {"temperature": f"greedy decoding ({greedy}): no temperature, top-k, top-p nor min-p applies, the "
                           "rollout's log-probs are the full softmax at T=1"}


def _with_structured_outputs(spec: PipelineSpec, args: Any) -> PipelineSpec:
    """TRL constrains vLLM's sampler per request (vllm_generation.py ``generate``: ``StructuredOutputsParams``
    from ``vllm_structured_outputs_regex``, or ``generation_kwargs['structured_outputs']``); the trainer scores the
    unconstrained model. Listed with the rollout's processors, the audit's sampler-penalties-unmatched."""
    gen = generation_kwargs(args)
    if getattr(args, "vllm_structured_outputs_regex", None) is None and not gen.get("structured_outputs"):
        return spec
    return spec.replace(custom_logits_processors=(*(spec.custom_logits_processors or ()), "structured_outputs"))


def _sampler_fields(sampling: dict) -> dict:
    from tim_plugins.parity.vllm_spec import sampling_fields

    return sampling_fields(sampling)


def specs_from_grpo_config(args: Any, model: Any = None, **kwargs: Any) -> tuple[PipelineSpec, PipelineSpec]:
    """(rollout, trainer) specs of a GRPO run from its config (and the model when it is loaded)."""
    return rollout_spec_from_trl(args, model, **kwargs), trainer_spec_from_trl(args, model)


def specs_from_trainer(trainer: Any, *, llm: Any = None, rollout_source: Optional[str] = None,
                       device: Optional[str] = None, server_args: Any = None,
                       server_device: Optional[str] = None) -> tuple[PipelineSpec, PipelineSpec]:
    """(rollout, trainer) specs of a live GRPOTrainer; a live vLLM engine is read directly when given, and in
    server mode ``server_args`` (the running server's engine args, e.g. from its /server_info) on
    ``server_device``."""
    model = trainer.model
    if device is None:
        device = next(model.parameters()).device.type
    if trainer.args.use_vllm and trainer.args.vllm_mode == "server" and server_args is not None:
        rollout = rollout_spec_from_trl(trainer.args, model, server_args=server_args, device=server_device or device)
        rollout = rollout.replace(source="live vLLM server (/server_info)")
    else:
        # TRL's own generation dict (trl/trainer/grpo_trainer.py GRPOTrainer.__init__ sets self.generation_kwargs on
        # the transformers path): what it adds outside GRPOConfig (suppress_tokens for image-text models) is there
        trl_settings = None if trainer.args.use_vllm else getattr(trainer, "generation_kwargs", None)
        rollout = rollout_spec_from_trl(trainer.args, model, llm=llm, device=device,
                                        trl_settings=trl_settings if isinstance(trl_settings, dict) else None)
    if rollout_source and not trainer.args.use_vllm:
        # the tim_plugins TRL adapter records the processed log-probs of its own HF sampling
        rollout = rollout.replace(framework=f"hf-generate ({rollout_source})", logprobs_mode="processed_logprobs")
    return rollout, trainer_spec_from_trl(trainer.args, model)
