"""verl Hydra config → the two `PipelineSpec`s of a PPO/GRPO run (verl 0.9.1, vLLM rollout, FSDP actor).

Composes verl's own ``ppo_trainer`` config (the installed ``verl/trainer/config`` directory) with the user's
overrides, then reads:
- rollout (``actor_rollout_ref.rollout.*``, passed to vLLM by vllm_async_server.py ~L323): dtype, logprobs_mode,
  enable_prefix_caching, enable_chunked_prefill, enforce_eager (else ``cudagraph_mode`` FULL_AND_PIECEWISE),
  quantization, temperature/top_p/top_k, full_determinism (VLLM_BATCH_INVARIANT=1), and
  ``engine_kwargs.vllm.*`` (forwarded verbatim: hf_overrides, kv_cache_dtype, attention_backend, ...). verl's agent
  loop sends repetition_penalty=1.0 whatever the config says (noted when it says otherwise).
- trainer (FSDP engine, transformer_impl.py): autocast dtype = ``fsdp_config.mixed_precision.param_dtype``
  (default bf16, fp32 = no autocast); logits divided by ``rollout.temperature``; no top-k/top-p (verl #6240);
  ``model.override_config.attn_implementation`` (default flash_attention_2); ``actor.use_torch_compile``.
- ``algorithm.rollout_correction`` is returned in the trainer spec's notes (it mitigates, it does not fix).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Optional

from tim_plugins.parity.spec import PipelineSpec, normalize_dtype
from tim_plugins.parity.vllm_spec import spec_from_engine_args

__all__ = ["compose_ppo_config", "specs_from_config", "specs_from_overrides", "rollout_spec_from_config",
           "trainer_spec_from_config", "parse_overrides"]

_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_overrides(overrides: Any) -> list[str]:
    """A Hydra command line ("a.b=1 +c=2", possibly with a leading `python -m verl.trainer.main_ppo`) → list."""
    if overrides is None:
        return []
    items = shlex.split(overrides) if isinstance(overrides, str) else [str(o) for o in overrides]
    return [o for o in items if "=" in o and not o.startswith("-")]


def compose_ppo_config(overrides: Any = None, config_name: str = "ppo_trainer") -> Any:
    """verl's own `ppo_trainer` config composed with `overrides` (Hydra compose API; needs verl installed)."""
    from tim_plugins._optional import require

    require("verl", "tim-plugins audit --verl")
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=parse_overrides(overrides))


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(node, dotted, default=default)
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def rollout_spec_from_config(config: Any, *, device: str = "cuda", env: Optional[dict] = None) -> PipelineSpec:
    r = "actor_rollout_ref.rollout"
    name = _get(config, f"{r}.name")
    engine_kwargs = dict(_get(config, f"{r}.engine_kwargs.vllm", {}) or {})
    compilation = engine_kwargs.pop("compilation_config", None) or {}
    if isinstance(compilation, dict):
        compilation = dict(compilation)
        compilation.setdefault("cudagraph_mode", "FULL_AND_PIECEWISE")  # what verl sets (vllm_async_server.py)
    args = {
        "model": _get(config, "actor_rollout_ref.model.path"),
        "dtype": _get(config, f"{r}.dtype"), "logprobs_mode": _get(config, f"{r}.logprobs_mode"),
        "enable_prefix_caching": _get(config, f"{r}.enable_prefix_caching"),
        "enable_chunked_prefill": _get(config, f"{r}.enable_chunked_prefill"),
        "enforce_eager": _get(config, f"{r}.enforce_eager"), "quantization": _get(config, f"{r}.quantization"),
        "compilation_config": compilation,
    }
    args.update({k: v for k, v in engine_kwargs.items() if v is not None})
    # VERL_SOURCES verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ.generate_sequences (repetition_penalty=1.0)
    sampling = {"temperature": _get(config, f"{r}.temperature"), "top_p": _get(config, f"{r}.top_p"),
                "top_k": _get(config, f"{r}.top_k"), "repetition_penalty": 1.0}
    env = dict(os.environ if env is None else env)
    if _get(config, f"{r}.full_determinism"):
        env["VLLM_BATCH_INVARIANT"] = "1"  # verl sets it for the rollout workers
    # verl's rollout.yaml leaves name mandatory (???): an unset name reads as None, which names no engine
    framework = "verl" if name is None else f"verl-{name}"
    spec = spec_from_engine_args(args, sampling=sampling, device=device, env=env, framework=framework)
    notes = dict(spec.notes)
    if name is None:
        notes["engine"] = (f"{r}.name is unset (verl requires it: e.g. {r}.name=vllm): read with vLLM semantics; "
                           "other engines may differ")
    elif name != "vllm":
        notes["engine"] = f"rollout.name={name}: read with vLLM semantics; other engines may differ"
    configured_penalty = _get(config, f"{r}.repetition_penalty", 1.0)
    if configured_penalty != 1.0:
        notes["repetition_penalty"] = (f"{r}.repetition_penalty={configured_penalty!r} is not applied: verl's agent "
                                       "loop sends repetition_penalty=1.0 with every request")
    if not _get(config, f"{r}.calculate_log_probs", True):
        notes["calculate_log_probs"] = "False: no rollout log-probs are recorded, the mismatch cannot be measured"
    extra = {}
    # tim-plugins' min-p processor, loaded through the engine args: the rollout samples with its min_p
    # (config.rollout_min_p_overrides)
    from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY, PROCESSOR_FQCN

    processors = {str(p) for p in (engine_kwargs.get("logits_processors") or [])}
    tim_min_p = (engine_kwargs.get("additional_config") or {}).get(CONFIG_KEY)
    if PROCESSOR_FQCN in processors and isinstance(tim_min_p, (int, float)) and not isinstance(tim_min_p, bool):
        extra["min_p"] = float(tim_min_p)
    return spec.replace(source="verl composed config (actor_rollout_ref.rollout)", notes=notes, **extra)


def trainer_spec_from_config(config: Any) -> PipelineSpec:
    a = "actor_rollout_ref.actor"
    if _get(config, f"{a}.strategy") == "megatron":
        # the Megatron engine computes in its engine config's dtype (actor.megatron.dtype, VERL_MEGATRON_CONFIG_KEYS):
        # VERL_MEGATRON_SOURCES verl.workers.engine.megatron.transformer_impl:MegatronEngine._build_tf_config
        param = _get(config, f"{a}.megatron.dtype") or "bfloat16"
    else:
        mp = _get(config, f"{a}.fsdp_config.mixed_precision") or {}
        param = mp.get("param_dtype") if isinstance(mp, dict) else None
    dtype = _PRECISION.get(str(param), param) if param else "bfloat16"  # transformer_impl.py default autocast
    override = _get(config, "actor_rollout_ref.model.override_config", {}) or {}
    attn = override.get("attn_implementation", "flash_attention_2")
    compile_ = bool(_get(config, f"{a}.use_torch_compile", False) or _get(config, f"{a}.fsdp_config.use_torch_compile", False))
    notes = {"rollout_correction": str(_get(config, "algorithm.rollout_correction", {})),
             "model_dtype": str(_get(config, f"{a}.fsdp_config.model_dtype"))}
    # with the safe vocabulary the actor applies the rollout's truncation: tim's min_p, the rollout's top-p / top-k
    # (engine_mixin.TIMEngineMixin.tim_configure, ActorContext.truncation)
    # (config.SafeVocabSettings: on with a min_p > 0, or with tim.safe_vocab.enable over the sampler's cut alone)
    tim_min_p = _get(config, "tim.safe_vocab.min_p", 0.0) or 0.0
    tim_min_p = float(tim_min_p) if isinstance(tim_min_p, (int, float)) and not isinstance(tim_min_p, bool) else 0.0
    truncation = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}
    if tim_min_p > 0 or _get(config, "tim.safe_vocab.enable", False) is True:
        top_k = _get(config, "actor_rollout_ref.rollout.top_k", 0)
        truncation = {"top_p": _get(config, "actor_rollout_ref.rollout.top_p", 1.0),
                      "top_k": int(top_k) if top_k and int(top_k) > 0 else 0,  # verl's -1 is "off", as 0
                      "min_p": tim_min_p}
    return PipelineSpec(
        side="trainer", framework="verl-fsdp", dtype=normalize_dtype(dtype), lm_head_dtype=None,
        temperature=_get(config, "actor_rollout_ref.rollout.temperature"), **truncation,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=False, bad_words=False,
        custom_logits_processors=(), weight_quantization="none", kv_cache_dtype="auto", prefix_caching=False,
        chunked_prefill=False, cudagraph=False, compile=compile_,
        # fsdp_config.full_determinism makes runs repeatable, not log-probs independent of the micro-batch.
        batch_invariant=False,
        attention_backend=attn, source="verl composed config (actor_rollout_ref.actor, FSDP engine)", notes=notes,
    )


def specs_from_config(config: Any, *, device: str = "cuda") -> tuple[PipelineSpec, PipelineSpec]:
    """(rollout, trainer) specs of a composed verl config (OmegaConf DictConfig)."""
    return rollout_spec_from_config(config, device=device), trainer_spec_from_config(config)


def specs_from_overrides(overrides: Any = None, *, device: str = "cuda") -> tuple[PipelineSpec, PipelineSpec]:
    """Compose verl's ppo_trainer with Hydra `overrides` (string or list) and read both specs."""
    return specs_from_config(compose_ppo_config(overrides), device=device)
