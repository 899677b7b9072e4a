"""What the TRL adapter can do with the installed TRL and transformers: one `Feature` per capability, each naming the
upstream hooks (``hooks.TRL_SOURCES``, ``TRANSFORMERS_SOURCES``) it needs, checked when the callback attaches.

A feature whose hook moved is switched off on its own (one warning, ``tim/diag/feature_off/<name>``); the monitor
is the only one whose absence stops the callback (its measurement point is unreachable). The safe vocabulary has
one route per shape of TRL's log-prob computation; the first available one is used:

- ``safe_vocab_fused_head`` (TRL >= 1.15): the fused lm_head's per-token kernel ``_ChunkedLogProbFunction``, looked
  up by ``add_fused_lm_head`` at call time;
- ``safe_vocab_logits`` (TRL 1.9 - 1.13): full logits divided by the temperature (in place on 1.9), then the
  module global ``selective_log_softmax(logits, completion_ids)``.

TRL 1.14 calls its chunked kernel from ``GRPOTrainer`` with positional arguments through ``*args``: neither route
applies there, so the safe vocabulary is off on 1.14 with the reason (the rest works); on 1.15 the fused route
needs TRL's Triton kernels (``trl.trainer.utils._ChunkedLogProbFunction`` is None without Triton: off with that
reason).
"""

from __future__ import annotations

import re

from tim_plugins.capabilities import Feature, Hook, Status, check

__all__ = ["ASYNC_MONITOR", "ASYNC_UNSUPPORTED", "ENGINE_AUDIT", "EXACT_SAMPLER", "FEATURES", "HF_RECORDER",
           "KEPT_SET_REPLAY", "LOSS_FACTOR", "MONITOR", "SAFE_VOCAB_FUSED_HEAD", "SAFE_VOCAB_LOGITS",
           "SAFE_VOCAB_ROUTES", "SERVER_AUDIT", "async_unsupported", "feature", "safe_vocab_route", "safe_vocab_status",
           "trl_features"]

_GRPO = "trl.trainer.grpo_trainer"
_UPGRADE = "pip install -U 'trl>=1.16'"

# trl/trainer/grpo_trainer.py: the three instance methods the callback wraps (hooks.TRL_SOURCES)
_LOGPS = Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies", params=("model",))
_LOGPS_NAMED = Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies",
                    params=("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"))


def _settings(*names: str) -> Hook:
    """The attributes GRPOTrainer.__init__ copies from its args (``self.<name> = args.<name>``) that a feature reads
    (translate.py; hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__)."""
    return Hook(_GRPO, "GRPOTrainer.__init__", fragments=tuple(f"self.{n} = args.{n}" for n in names))


MONITOR = Feature(
    "monitor", "mismatch monitor (GRPOTrainer)", "trl", needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(_settings("use_vllm"),  # translate.rollout_source: vLLM or TRL's generate
           Hook(_GRPO, "GRPOTrainer._generate_and_score_completions"),
           Hook(_GRPO, "GRPOTrainer._compute_loss", params=("model", "inputs")),
           _LOGPS,
           # TRL's log() averages self._metrics[mode] lists into the logged values (where tim/ values are appended)
           Hook(_GRPO, "GRPOTrainer.log", fragments=("self._metrics[mode]",))))

# The loss factor (IS corrections, safe-vocab boundary masking) reaches TRL's loss through (B, T) advantages
# (translate.scale_policy_term); TRL must read them from the inputs inside _compute_loss.
LOSS_FACTOR = Feature(
    "loss_factor", "IS corrections and boundary masking in TRL's loss", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE, hooks=(Hook(_GRPO, "GRPOTrainer._compute_loss", fragments=('inputs["advantages"]',)),
                         # translate.pipeline_config (TRL's own IS correction), translate.scale_policy_term (loss_type)
                         _settings("use_vllm", "vllm_importance_sampling_correction", "loss_type")))

# translate.safe_truncation: the sampler's truncation and temperature, and vLLM's order of the processors or HF's
_TRUNCATION = _settings("use_vllm", "temperature", "top_p", "top_k")

SAFE_VOCAB_FUSED_HEAD = Feature(
    "safe_vocab_fused_head", "safe vocabulary (TRL's fused lm_head, TRL >= 1.15)", "trl", needs=("trl",),
    extra="trl", fix=_UPGRADE,
    hooks=(_LOGPS_NAMED, _TRUNCATION,
           Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies", fragments=("fused_lm_head=True",)),
           Hook("trl.trainer.utils", "add_fused_lm_head", fragments=("_ChunkedLogProbFunction.apply(",)),
           Hook("trl.trainer.utils", "_ChunkedLogProbFunction.forward",
                params=("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                        "final_logit_softcapping", "logit_scale", "outputs"))))

# TRL 1.9 divides the logits in place (logits.div_(self.temperature)), 1.10 - 1.13 into a new tensor
_TEMPERATURE_DIVISIONS = ("logits.div_(self.temperature)", "logits = logits / self.temperature")


def _logits_tempered_before_selective_log_softmax() -> str | None:
    """None when TRL divides the logits by the temperature before its selective_log_softmax call (the stand-in then
    receives tempered logits), else why not."""
    import inspect

    from tim_plugins.capabilities import resolve

    src = re.sub(r"\s+", "", inspect.getsource(resolve(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies")))
    call = src.find("selective_log_softmax(logits,completion_ids)")
    if any(0 <= src.find(re.sub(r"\s+", "", d)) < call for d in _TEMPERATURE_DIVISIONS):
        return None
    return ("trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies no longer divides the logits by "
            f"the temperature ({' or '.join(_TEMPERATURE_DIVISIONS)}) before selective_log_softmax")


SAFE_VOCAB_LOGITS = Feature(
    "safe_vocab_logits", "safe vocabulary (full logits, TRL 1.9 - 1.13)", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE,
    hooks=(_LOGPS_NAMED, _TRUNCATION,
           Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies",
                fragments=("selective_log_softmax(logits, completion_ids)",)),
           Hook(_GRPO, "selective_log_softmax", params=("logits", "index"))),
    probe=_logits_tempered_before_selective_log_softmax)

SAFE_VOCAB_ROUTES = (SAFE_VOCAB_FUSED_HEAD, SAFE_VOCAB_LOGITS)

HF_RECORDER = Feature(
    "hf_recorder", "rollout log-probs of TRL's transformers generate (use_vllm=False)", "transformers",
    needs=("trl", "transformers"), extra="trl", fix="use vLLM (GRPOConfig(use_vllm=True)), or report it",
    hooks=(Hook(_GRPO, "GRPOTrainer._generate_single_turn"),
           # translate.rollout_source: a user's rollout_func or transformers' continuous batching is not generate
           Hook(_GRPO, "GRPOTrainer.__init__", fragments=(
               "self.rollout_func = rollout_func",
               "self.use_transformers_continuous_batching = args.use_transformers_continuous_batching")),
           # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor
           Hook("transformers.generation.utils", "GenerationMixin._get_logits_processor",
                params=("generation_config", "logits_processor")),
           # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin.generate (instance lookup)
           Hook("transformers.generation.utils", "GenerationMixin.generate", fragments=("self._get_logits_processor(",))))


def _completions_end_where_the_exact_sampler_ends() -> str | None:
    """None when TRL cuts its completions at the EOS ids ``translate.eos_token_ids`` hands the exact sampler:
    ``self.eos_token_ids`` set in ``GRPOTrainer.__init__`` (TRL >= 1.15) or the tokenizer's one EOS (TRL 1.9 -
    1.14); else why not."""
    import inspect

    from tim_plugins.capabilities import resolve

    trainer = resolve(_GRPO, "GRPOTrainer")
    init = re.sub(r"\s+", "", inspect.getsource(trainer.__init__))
    single = re.sub(r"\s+", "", inspect.getsource(trainer._generate_single_turn))
    if "self.eos_token_ids=eos_token_ids" in init and "torch.tensor(self.eos_token_ids" in single:
        return None
    if "self.eos_token_ids" not in init and "completion_ids==self._tokenizer.eos_token_id" in single:
        return None
    return (f"{_GRPO}:GRPOTrainer._generate_single_turn no longer ends completions at GRPOTrainer.eos_token_ids "
            "(set in __init__) nor at the tokenizer's eos_token_id")


EXACT_SAMPLER = Feature(
    "exact_sampler", "exact sampler (rollout='exact', 'inject')", "trl", needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(Hook(_GRPO, "GRPOTrainer._generate_single_turn", params=("prompt_ids",)),
           # translate.pipeline_config's exact-mode check, callback._exact_generate, _exact_scoring.exact_scorer
           _settings("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")),
    probe=_completions_end_where_the_exact_sampler_ends)

# hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm: the live engine (colocate) and the
# server's client the audit reads (_parity.py). Each gates that read (callback.TIMCallback._live_audit_reads): when
# one moves, the audit reports the engine's settings as unknown and the feature is off.
_INIT_VLLM = Hook("trl.generation.vllm_generation", "VLLMGeneration._init_vllm",
                  fragments=("self.llm = LLM(", "self.vllm_client = VLLMClient("))

ENGINE_AUDIT = Feature(
    "parity_audit_engine", "parity audit of TRL's vLLM engine (use_vllm=True)", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE, hooks=(_INIT_VLLM,))

SERVER_AUDIT = Feature(
    "parity_audit_server", "parity audit of a vLLM server's settings (vllm_mode='server')", "trl", needs=("trl",),
    extra="trl", fix=_UPGRADE, hooks=(_INIT_VLLM, Hook("trl.generation.vllm_client", "VLLMClient.get_server_info")))

# kept_sets.py: the colocate engine built with return_sampling_mask (engine_kept_sets replaces the module global LLM
# that VLLMGeneration._init_vllm calls), its generate outputs captured (VLLMGeneration.generate calls self.llm.generate
# and takes the prompt and completion ids from the outputs) and replayed in the fused head's per-token kernel
_VLLM_GENERATION = "trl.generation.vllm_generation"
KEPT_SET_REPLAY = Feature(
    "kept_set_replay", "the engine's kept sets replayed (vLLM colocate, return_sampling_mask)", "trl",
    needs=("trl",), extra="trl",
    fix="vLLM installed (a GPU build: return_sampling_mask needs Model Runner V2) and " + _UPGRADE,
    hooks=(_INIT_VLLM, Hook(_VLLM_GENERATION, "LLM"),
           Hook(_VLLM_GENERATION, "VLLMGeneration.generate", fragments=(
               "all_outputs = self.llm.generate(vllm_prompts, sampling_params=sampling_params",
               "all_prompt_ids = [output.prompt_token_ids for output in all_outputs]",
               "all_completion_ids = [output.token_ids for outputs in all_outputs for output in outputs.outputs]"))))

# AsyncGRPOTrainer (TRL >= 1.16, trl.experimental): the policy lag of each trained token (async_grpo.py)
_ASYNC = "trl.experimental.async_grpo.async_grpo_trainer"
ASYNC_MONITOR = Feature(
    "async_monitor", "mismatch by policy lag (AsyncGRPOTrainer)", "trl", needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(Hook("trl.experimental.async_grpo.packing", "TreeRow.pack",
                fragments=("old_log_probs.append(logps[p])", "segment_id.append(i)")),
           Hook(_ASYNC, "AsyncGRPOTrainer.compute_loss", params=("model", "inputs"),
                fragments=('selected = inputs["token_index"] >= 0', 'old_log_probs = inputs["old_log_probs"][selected]',
                           'segment_id = inputs["segment_id"][selected]', "fused_lm_head=True",
                           "log_probs = outputs.log_probs.flatten()[token_index]")),
           Hook(_ASYNC, "AsyncGRPOTrainer.get_train_dataloader",
                fragments=("rollout_queue=self.rollout_queue", "model_version_fn=lambda: self.model_version")),
           Hook(_ASYNC, "RolloutQueueDataset.__iter__",
                fragments=("sample = self.queue.get(", '"old_log_probs": sample.old_log_probs')),
           Hook(_ASYNC, "DataCollatorForRollout.torch_call",
                fragments=("padding.get(key, 0)) for key in packed[0]}",)),
           Hook(_ASYNC, "AsyncGRPOTrainer.log", fragments=("for key, val in self._metrics[mode].items():",
                                                           "self._metrics[mode].clear()"))))

# What the callback does not do on AsyncGRPOTrainer (its loss, sampler and vLLM server are not GRPOTrainer's): the
# TIMConfig field, and why. Each one set is switched off with that reason (tim/diag/feature_off/<name>).
ASYNC_UNSUPPORTED = {
    "safe_vocab": "the safe vocabulary needs GRPOTrainer's log-prob call and sampler",
    "is_correction": "the IS corrections reach the loss through GRPOTrainer's advantages",
    "parity_audit": "the parity audit reads GRPOTrainer's vLLM engine or client",
}


def async_unsupported(name: str) -> Status:
    """The off status of TIMConfig field ``name`` on AsyncGRPOTrainer."""
    feature = Feature(f"async_{name}", f"{name} (AsyncGRPOTrainer)", "trl", needs=("trl",), extra="trl",
                      fix=f"TIMConfig({name}=...) off for AsyncGRPOTrainer, or train with GRPOTrainer")
    return Status(feature, False, ASYNC_UNSUPPORTED[name], feature.fix)


FEATURES = (MONITOR, LOSS_FACTOR, *SAFE_VOCAB_ROUTES, HF_RECORDER, EXACT_SAMPLER, ENGINE_AUDIT, SERVER_AUDIT,
            KEPT_SET_REPLAY, ASYNC_MONITOR)


def feature(name: str) -> Feature:
    """The feature called ``name`` (``hooks.TRL_SOURCE_FEATURES`` names them)."""
    for f in FEATURES:
        if f.name == name:
            return f
    raise KeyError(f"no TRL feature {name!r}; known: {[f.name for f in FEATURES]}")


def safe_vocab_route() -> tuple[Feature | None, list[Status]]:
    """The first safe-vocabulary route the installed TRL supports (None if none), and every route's status."""
    statuses = [check(f) for f in SAFE_VOCAB_ROUTES]
    for status in statuses:
        if status.available:
            return status.feature, statuses
    return None, statuses


def safe_vocab_status() -> Status:
    """The safe vocabulary as one feature: available through the first route that holds (named in the title), else
    off with every route's reason."""
    route, statuses = safe_vocab_route()
    if route is not None:
        return Status(Feature("safe_vocab", f"safe vocabulary, TRL side (via {route.title.split('(', 1)[1][:-1]})",
                              "trl"), True, version=statuses[0].version)
    return Status(Feature("safe_vocab", "safe vocabulary, TRL side", "trl", fix=statuses[0].fix), False,
                  "; ".join(f"{s.feature.title}: {s.reason}" for s in statuses), statuses[0].fix, statuses[0].version)


def trl_features() -> list[Status]:
    """Every TRL feature's status (``tim-plugins doctor``), the safe-vocabulary routes as one."""
    out = [check(f) for f in FEATURES if f not in SAFE_VOCAB_ROUTES]
    out.insert(2, safe_vocab_status())
    return out
