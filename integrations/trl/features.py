"""What the TRL adapter can do with the installed TRL and transformers: one `Feature` per capability, each naming the
upstream hooks (``hooks.TRL_SOURCES``, ``TRANSFORMERS_SOURCES``) it needs, checked when the callback attaches.

A feature whose hook moved is switched off on its own (one warning, ``tim/diag/feature_off/<name>``); the monitor
is the only one whose absence stops the callback (its measurement point is unreachable). What ``GRPOTrainer.__init__``
leaves on the trainer (the settings the adapter reads, the live vLLM engine) is checked on the trainer the callback is
given (``live(trainer)``), so a wrapped ``__init__``, a subclass or a class rebuilt by a patching library attaches
like TRL's own; source fragments remain only where the behaviour shows nowhere but in a forward, a generation or a
log, each saying so beside it (``tim-plugins doctor``, with no trainer, lists the live checks as done when
attaching). The safe vocabulary has one route per shape of TRL's log-prob computation; the first available one is
used:

- ``safe_vocab_fused_head`` (TRL >= 1.15): the fused lm_head's per-token kernel ``_ChunkedLogProbFunction``, looked
  up by ``add_fused_lm_head`` at call time;
- ``safe_vocab_logits`` (TRL 1.9 - 1.13): full logits divided by the temperature (in place on 1.9), then the
  module global ``selective_log_softmax(logits, completion_ids)``.

TRL 1.14 calls its chunked kernel from ``GRPOTrainer`` with positional arguments through ``*args``: neither route
applies there, so the safe vocabulary is off on 1.14 with the reason (the rest works); on 1.15 the fused route
needs TRL's Triton kernels (``trl.trainer.utils._ChunkedLogProbFunction`` is None without Triton: off with that
reason).

``GRPOConfig(use_liger_kernel=True)`` on TRL 1.9 - 1.13 trains through Liger's fused GRPO loss, which no hook of the
callback sees: what needs TRL's loss forward is switched off there with the reason (``liger_unsupported``).
"""

from __future__ import annotations

import re
import sys

from tim_plugins._optional import package_version
from tim_plugins.capabilities import (Feature, Hook, Problem, SourceProblem, Status, check, first_available,
                                      look_through, upstream_source)

__all__ = ["ASYNC_MONITOR", "ASYNC_UNSUPPORTED", "ENGINE_AUDIT", "EXACT_SAMPLER", "FEATURES", "HF_RECORDER",
           "KEPT_SET_REPLAY", "LIGER_LOSS_UNSUPPORTED", "LOSS_FACTOR", "LR_GRAD_NORM", "MONITOR",
           "SAFE_VOCAB_FUSED_HEAD", "SAFE_VOCAB_LOGITS", "SAFE_VOCAB_ROUTES", "SERVER_AUDIT", "SERVER_PROBE",
           "SYNC_CHECK", "async_unsupported", "feature", "liger_grpo_loss", "liger_unsupported", "live",
           "logits_route_module", "safe_vocab_route", "safe_vocab_status", "trl_features"]

_GRPO = "trl.trainer.grpo_trainer"
_UPGRADE = "pip install -U 'trl>=1.16'"

# trl/trainer/grpo_trainer.py: the three instance methods the callback wraps (hooks.TRL_SOURCES)
_LOGPS = Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies", params=("model",))
_LOGPS_NAMED = Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies",
                    params=("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"))


def _settings(*names: str) -> Hook:
    """The attributes GRPOTrainer.__init__ leaves on the trainer (copied from its args) that a feature reads
    (translate.py; hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__): checked on the live trainer the
    callback is given (``check(feature, live={"trainer": trainer})``), whoever built it (a wrapped ``__init__``, a
    subclass, a class rebuilt from edited source)."""
    return Hook(_GRPO, "GRPOTrainer.__init__", attrs=tuple(f"trainer.{n}" for n in names))


def live(trainer) -> dict:
    """The live objects the features' ``attrs`` are read on."""
    return {"trainer": trainer}


MONITOR = Feature(
    "monitor", "mismatch monitor (GRPOTrainer)", "trl", needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(_settings("use_vllm"),  # translate.rollout_source: vLLM or TRL's generate
           Hook(_GRPO, "GRPOTrainer._generate_and_score_completions"),
           Hook(_GRPO, "GRPOTrainer._compute_loss", params=("model", "inputs")),
           _LOGPS,
           # the callback appends its tim/ values to trainer._metrics["train"] (live), and TRL's log() averages those
           # lists into the logged values: a fragment, since log() shows that only when TRL logs (calling it to see
           # would write a log row)
           Hook(_GRPO, "GRPOTrainer.log", fragments=("self._metrics[mode]",), attrs=("trainer._metrics",))))

# The loss factor (IS corrections, safe-vocab boundary masking) reaches TRL's loss through (B, T) advantages
# (translate.scale_policy_term); TRL must read them from the inputs inside _compute_loss.
LOSS_FACTOR = Feature(
    "loss_factor", "IS corrections and boundary masking in TRL's loss", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE,
    # a fragment: that the loss reads the advantages from its inputs shows only in a loss forward and backward
    hooks=(Hook(_GRPO, "GRPOTrainer._compute_loss", fragments=('inputs["advantages"]',)),
                         # translate.pipeline_config (TRL's own IS correction), translate.scale_policy_term (loss_type)
                         _settings("use_vllm", "vllm_importance_sampling_correction", "loss_type")))

# translate.safe_truncation: the sampler's truncation and temperature, and vLLM's order of the processors or HF's
_TRUNCATION = _settings("use_vllm", "temperature", "top_p", "top_k")

# Fragments: the log-prob call reaches the kernel through the fused head, which looks the kernel up as a module global
# at call time; both show only in a policy forward.
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


def logits_route_module(trainer):
    """The module whose global ``selective_log_softmax`` the trainer's log-prob call looks up (TRL's grpo_trainer, or
    the module a patching library rebuilt the class into), or None when that namespace is no module in
    ``sys.modules`` (the stand-in, ``hooks.SafeLogSoftmax``, could not reach it). The nearest definition in the MRO
    (looked at through another library's wrapper) that names the global: a subclass that overrides the call and
    passes it on with ``super()`` looks nothing up in its own module."""
    name = "_get_per_token_logps_and_entropies"
    found = []
    for klass in type(trainer).__mro__:
        method = klass.__dict__.get(name)
        if method is not None:
            func, _ = look_through(method, name)
            found.append(getattr(func, "__func__", func))
    func = next((f for f in found if "selective_log_softmax" in getattr(getattr(f, "__code__", None), "co_names", ())),
                found[0] if found else None)
    scope = getattr(func, "__globals__", None) or {}
    module = sys.modules.get(scope.get("__name__", ""))
    return module if module is not None and vars(module) is scope else None


def _logits_route_holds(live=None) -> str | Problem | None:
    """None when TRL divides the logits by the temperature before its selective_log_softmax call (the stand-in then
    receives tempered logits) and, on the live trainer, that call's module global can be replaced; else why not.
    The order of two statements: a fragment check (it shows only in a forward)."""
    try:
        src = re.sub(r"\s+", "", upstream_source(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies"))
    except SourceProblem as err:
        return err.problem
    call = src.find("selective_log_softmax(logits,completion_ids)")
    if not any(0 <= src.find(re.sub(r"\s+", "", d)) < call for d in _TEMPERATURE_DIVISIONS):
        return (f"{_GRPO}:GRPOTrainer._get_per_token_logps_and_entropies no longer divides the logits by the "
                f"temperature ({' or '.join(_TEMPERATURE_DIVISIONS)}) before selective_log_softmax")
    trainer = (live or {}).get("trainer")
    if trainer is not None and not hasattr(logits_route_module(trainer), "selective_log_softmax"):
        return Problem(f"the {type(trainer).__name__}'s _get_per_token_logps_and_entropies looks selective_log_softmax "
                       "up in a namespace that is no module in sys.modules (a class rebuilt from source into it), so "
                       "the safe vocabulary cannot stand in for it",
                       "register the module the class was rebuilt into in sys.modules, or safe_vocab=False")
    return None


# Fragments: TRL's log-prob call looks selective_log_softmax up at call time, on tempered logits (a forward shows it).
SAFE_VOCAB_LOGITS = Feature(
    "safe_vocab_logits", "safe vocabulary (full logits, TRL 1.9 - 1.13)", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE,
    hooks=(_LOGPS_NAMED, _TRUNCATION,
           Hook(_GRPO, "GRPOTrainer._get_per_token_logps_and_entropies",
                fragments=("selective_log_softmax(logits, completion_ids)",)),
           Hook(_GRPO, "selective_log_softmax", params=("logits", "index"))),
    probe=_logits_route_holds)

SAFE_VOCAB_ROUTES = (SAFE_VOCAB_FUSED_HEAD, SAFE_VOCAB_LOGITS)

HF_RECORDER = Feature(
    "hf_recorder", "rollout log-probs of TRL's transformers generate (use_vllm=False)", "transformers",
    needs=("trl", "transformers"), extra="trl", fix="use vLLM (GRPOConfig(use_vllm=True)), or report it",
    hooks=(Hook(_GRPO, "GRPOTrainer._generate_single_turn"),
           # translate.rollout_source: a user's rollout_func or transformers' continuous batching is not generate
           Hook(_GRPO, "GRPOTrainer.__init__",
                attrs=("trainer.rollout_func", "trainer.use_transformers_continuous_batching")),
           # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor
           Hook("transformers.generation.utils", "GenerationMixin._get_logits_processor",
                params=("generation_config", "logits_processor")),
           # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin.generate (instance lookup): a fragment,
           # since generate looks the processors' builder up on the model only while it generates
           Hook("transformers.generation.utils", "GenerationMixin.generate", fragments=("self._get_logits_processor(",))))

# Where _generate_single_turn cuts completions, by the trainer's EOS attribute: GRPOTrainer.eos_token_ids (TRL >= 1.15)
# or, where the trainer has none, the tokenizer's one EOS (TRL 1.9 - 1.14). The cut is a fragment (it shows only in a
# generation); which one applies is read on the live trainer (without it, either will do).
_EOS_CUTS = {"the trainer's eos_token_ids": "torch.tensor(self.eos_token_ids",
             "the tokenizer's eos_token_id": "completion_ids == self._tokenizer.eos_token_id"}


def _completions_end_where_the_exact_sampler_ends(live=None) -> str | Problem | None:
    """None when TRL cuts its completions at the EOS ids ``translate.eos_token_ids`` hands the exact sampler, else
    why not."""
    try:
        single = re.sub(r"\s+", "", upstream_source(_GRPO, "GRPOTrainer._generate_single_turn"))
    except SourceProblem as err:
        return err.problem
    cuts = dict(_EOS_CUTS)
    trainer = (live or {}).get("trainer")
    if trainer is not None:
        cuts.pop("the tokenizer's eos_token_id" if getattr(trainer, "eos_token_ids", None) is not None
                 else "the trainer's eos_token_ids")
    if any(re.sub(r"\s+", "", cut) in single for cut in cuts.values()):
        return None
    return f"{_GRPO}:GRPOTrainer._generate_single_turn no longer ends completions at {' nor at '.join(cuts)}"


EXACT_SAMPLER = Feature(
    "exact_sampler", "exact sampler (rollout='exact', 'inject')", "trl", needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(Hook(_GRPO, "GRPOTrainer._generate_single_turn", params=("prompt_ids",)),
           # translate.pipeline_config's exact-mode check, generation._exact_generate, _exact_scoring.exact_scorer
           _settings("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")),
    probe=_completions_end_where_the_exact_sampler_ends)

# hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm: the live engine (colocate) and the
# server's client the audit reads (_parity.py). Each gates that read (callback.TIMCallback._live_audit_reads): when
# one moves, the audit reports the engine's settings as unknown and the feature is off. The colocate engine is read
# on the live trainer; the server's client stays a fragment: only the main process holds one, so its absence on the
# live trainer of another rank is no move.
_VLLM_GENERATION = "trl.generation.vllm_generation"
ENGINE_AUDIT = Feature(
    "parity_audit_engine", "parity audit of TRL's vLLM engine (use_vllm=True)", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE,
    hooks=(Hook(_VLLM_GENERATION, "VLLMGeneration._init_vllm", attrs=("trainer.vllm_generation.llm",)),))

SERVER_AUDIT = Feature(
    "parity_audit_server", "parity audit of a vLLM server's settings (vllm_mode='server')", "trl", needs=("trl",),
    extra="trl", fix=_UPGRADE,
    hooks=(Hook(_VLLM_GENERATION, "VLLMGeneration._init_vllm", fragments=("self.vllm_client = VLLMClient(",)),
           Hook("trl.generation.vllm_client", "VLLMClient.get_server_info")))

# kept_sets.py: the colocate engine built with return_sampling_mask (engine_kept_sets replaces the module global LLM
# that VLLMGeneration._init_vllm calls), its generate outputs captured (VLLMGeneration.generate calls self.llm.generate
# and takes the prompt and completion ids from the outputs) and replayed in the fused head's per-token kernel.
# Fragments: engine_kept_sets is checked before the trainer (and its engine) exists, and what generate does with the
# outputs shows only in a generation. At attach, the live engine's own config says whether it hands out its sets
# (kept_sets.engine_returns_kept_sets).
KEPT_SET_REPLAY = Feature(
    "kept_set_replay", "the engine's kept sets replayed (vLLM colocate, return_sampling_mask)", "trl",
    needs=("trl", "vllm"), extra="trl",  # without vLLM its hooks are missing: the fix installs vLLM, not TRL
    fix="vLLM installed (a GPU build: return_sampling_mask needs Model Runner V2) and " + _UPGRADE,
    hooks=(Hook(_VLLM_GENERATION, "VLLMGeneration._init_vllm", fragments=("self.llm = LLM(",)),
           Hook(_VLLM_GENERATION, "LLM"),
           Hook(_VLLM_GENERATION, "VLLMGeneration.generate", fragments=(
               "all_outputs = self.llm.generate(vllm_prompts, sampling_params=sampling_params",
               "all_prompt_ids = [output.prompt_token_ids for output in all_outputs]",
               "all_completion_ids = [output.token_ids for outputs in all_outputs for output in outputs.outputs]"))))

# sync_check.py: the colocate sync wrapped on the instance (whatever it is: a replaced or wrapped sync_weights is
# checked the same, so no statement of TRL's is required of it); what it streams sampled at the engine model's
# load_weights, where TRL's own sync writes
SYNC_CHECK = Feature(
    "sync_check", "weight-sync check of TRL's colocated vLLM engine", "trl", needs=("trl",), extra="trl",
    fix=_UPGRADE, hooks=(Hook(_VLLM_GENERATION, "VLLMGeneration._init_vllm", attrs=("trainer.vllm_generation.llm",)),
                         Hook(_VLLM_GENERATION, "VLLMGeneration.sync_weights"),
                         Hook(_VLLM_GENERATION, "VLLMGeneration._fix_param_name_to_vllm", params=("name",))))

# server_probe.py: TRL's sync in server mode (the probe scores after it returns) and the client's scoring of given
# token sequences (vLLM's prompt log-probs of each token; "actual_logprobs" is read from the result at run time)
SERVER_PROBE = Feature(
    "sync_probe_server", "lag-0 probe of TRL's vLLM server at its weight syncs (vllm_mode='server')", "trl",
    needs=("trl",), extra="trl", fix=_UPGRADE,
    hooks=(Hook(_VLLM_GENERATION, "VLLMGeneration._init_vllm", fragments=("self.vllm_client = VLLMClient(",)),
           Hook(_VLLM_GENERATION, "VLLMGeneration.sync_weights"),
           Hook("trl.generation.vllm_client", "VLLMClient.get_sequence_logprobs",
                params=("sequences", "prompt_lengths", "top_logprobs", "temperature"))))

# AsyncGRPOTrainer (TRL >= 1.16, trl.experimental): the policy lag of each trained token (async_grpo.py).
# Fragments: packing, the loss's token selection, the dataloader's queue and the collator's padding show only while
# it trains; the model version the packing wrapper reads is checked on the live trainer.
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
                fragments=("rollout_queue=self.rollout_queue", "model_version_fn=lambda: self.model_version"),
                attrs=("trainer.model_version",)),
           Hook(_ASYNC, "RolloutQueueDataset.__iter__",
                fragments=("sample = self.queue.get(", '"old_log_probs": sample.old_log_probs')),
           Hook(_ASYNC, "DataCollatorForRollout.torch_call",
                fragments=("padding.get(key, 0)) for key in packed[0]}",)),
           Hook(_ASYNC, "AsyncGRPOTrainer.log", fragments=("for key, val in self._metrics[mode].items():",
                                                           "self._metrics[mode].clear()"))))

# What the callback does not do on AsyncGRPOTrainer (its loss, sampler and vLLM server are not GRPOTrainer's): the
# TIMConfig field, its off value, and why. Each one set is switched off with that reason (tim/diag/feature_off/<name>).
ASYNC_UNSUPPORTED = {
    "safe_vocab": (False, "the safe vocabulary needs GRPOTrainer's log-prob call and sampler"),
    "is_correction": (None, "the IS corrections reach the loss through GRPOTrainer's advantages"),
    "parity_audit": (False, "the parity audit reads GRPOTrainer's vLLM engine or client"),
    "sync_check": (False, "the weight-sync check and the server probe wrap GRPOTrainer's VLLMGeneration.sync_weights "
                          "(AsyncGRPOTrainer syncs through its own weight transfer; the lag-0 stream rules still run)"),
}


def async_unsupported(name: str) -> Status:
    """The off status of TIMConfig field ``name`` on AsyncGRPOTrainer."""
    off, why = ASYNC_UNSUPPORTED[name]
    feature = Feature(f"async_{name}", f"{name} (AsyncGRPOTrainer)", "trl", needs=("trl",), extra="trl",
                      fix=f"TIMConfig({name}={off!r}) with AsyncGRPOTrainer, or train with GRPOTrainer")
    return Status(feature, False, why, feature.fix)


# GRPOConfig(use_liger_kernel=True) on TRL 1.9 - 1.13: GRPOTrainer.compute_loss hands the batch to
# self.compute_liger_loss (Liger's fused linear GRPO loss, over the last hidden states and lm_head.weight) instead of
# _compute_loss, so no log-prob of the loss forward reaches _get_per_token_logps_and_entropies. TRL 1.14 runs Liger's
# path through _get_per_token_logps_and_entropies (_chunked_logps), TRL >= 1.15 applies Liger's layer kernels only:
# neither has compute_liger_loss. What the callback cannot do there: the TIMConfig field, and why. Each one set is
# switched off with that reason (tim/diag/feature_off/liger_<name>).
LIGER_LOSS_UNSUPPORTED = {
    "safe_vocab": ("safe vocabulary", "the safe vocabulary renormalizes the log-probs of TRL's loss forward, which "
                   "Liger's fused GRPO loss computes inside its kernel"),
    "loss_factor": ("IS corrections and boundary masking", "they scale the policy term of TRL's _compute_loss, which "
                    "Liger's fused GRPO loss replaces"),
    "loss_pass": ("the loss forward's measurement", "the batches TRL scores only in its loss forward go unmeasured "
                  "(those it scores at generation, old_per_token_logps, are measured), and so does the staleness "
                  "split of each loss pass"),
}
_LIGER_FIX = ("GRPOConfig(use_liger_kernel=False), or pip install -U 'trl>=1.16' (whose use_liger_kernel applies "
              "Liger's layer kernels only, and its loss scores through the hooks the callback reads)")


def liger_grpo_loss(trainer) -> bool:
    """Whether ``trainer``'s loss runs in Liger's fused GRPO loss: its ``use_liger_kernel`` set, on a TRL whose
    ``compute_loss`` dispatches on it to ``compute_liger_loss`` (1.9 - 1.13; tests/test_trl_liger.py checks that
    TRL's own dispatch agrees)."""
    return bool(getattr(trainer, "use_liger_kernel", False)) and callable(getattr(trainer, "compute_liger_loss", None))


def liger_unsupported(name: str) -> Status:
    """The off status of what ``LIGER_LOSS_UNSUPPORTED`` names under Liger's fused GRPO loss."""
    what, reason = LIGER_LOSS_UNSUPPORTED[name]
    feature = Feature(f"liger_{name}", f"{what} (under Liger's GRPO loss: GRPOConfig(use_liger_kernel=True))", "trl",
                      needs=("trl",), extra="trl", fix=_LIGER_FIX)
    return Status(feature, False, reason, feature.fix, package_version("trl"))


# The LR decay's grad-norm signal (lr_decay_signals=("grad_norm",)): the pre-clip norm transformers computes at each
# optimizer step (TRANSFORMERS_SOURCES transformers.trainer:Trainer._get_grad_norm, called on the instance before
# on_step_end), read as it returns; without it the signal is the norm of the last logged step (on_log, which runs
# after on_step_end and only every logging_steps).
LR_GRAD_NORM = Feature(
    "lr_grad_norm", "the LR decay's grad-norm signal at each optimizer step", "transformers",
    needs=("trl", "transformers"), extra="trl", fix="report it (the signal then reads the last logged grad norm)",
    hooks=(Hook("transformers.trainer", "Trainer._get_grad_norm", params=("model", "grad_norm")),))

FEATURES = (MONITOR, LOSS_FACTOR, *SAFE_VOCAB_ROUTES, HF_RECORDER, EXACT_SAMPLER, ENGINE_AUDIT, SERVER_AUDIT,
            KEPT_SET_REPLAY, SYNC_CHECK, SERVER_PROBE, ASYNC_MONITOR, LR_GRAD_NORM)


def feature(name: str) -> Feature:
    """The feature called ``name`` (``hooks.TRL_SOURCE_FEATURES`` names them)."""
    for f in FEATURES:
        if f.name == name:
            return f
    raise KeyError(f"no TRL feature {name!r}; known: {[f.name for f in FEATURES]}")


def safe_vocab_route(trainer=None) -> tuple[Feature | None, list[Status]]:
    """The first safe-vocabulary route the installed TRL (and ``trainer``, when given) supports (None if none), and
    every route's status."""
    return first_available(SAFE_VOCAB_ROUTES, live(trainer) if trainer is not None else None)


def safe_vocab_status(trainer=None) -> Status:
    """The safe vocabulary as one feature: available through the first route that holds (named in the title), else
    off with every route's reason."""
    route, statuses = safe_vocab_route(trainer)
    if route is not None:
        status = next(s for s in statuses if s.feature is route)
        return Status(Feature("safe_vocab", f"safe vocabulary, TRL side (via {route.title.split('(', 1)[1][:-1]})",
                              "trl"), True, version=status.version, deferred=status.deferred)
    return Status(Feature("safe_vocab", "safe vocabulary, TRL side", "trl", fix=statuses[0].fix), False,
                  "; ".join(f"{s.feature.title}: {s.reason}" for s in statuses), statuses[0].fix, statuses[0].version)


def trl_features() -> list[Status]:
    """Every TRL feature's status (``tim-plugins doctor``), the safe-vocabulary routes as one."""
    out = [check(f) for f in FEATURES if f not in SAFE_VOCAB_ROUTES]
    out.insert(2, safe_vocab_status())
    return out
