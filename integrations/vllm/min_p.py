"""vLLM logits processor: tim-plugins' safe-vocabulary (min-p) rule on every sampled request.

Imports vLLM at import time: only vLLM users import it (its settings live in the core's
``tim_plugins.rollout.vllm_min_p_config``, vLLM-free, which the verl adapter reads too).

Rule (vLLM's own ``min_p``, and the trainer's ``tim_plugins.truncation.truncation_threshold``), in logit space:
    p_T = softmax(z / T),  S = {a : p_T(a) >= min_p · max_b p_T(b)}  <=>  z_a/T >= max_b z_b/T + log(min_p)
Tokens outside S are set to -inf, so with ``logprobs_mode="processed_logprobs"`` vLLM reports log-probs
renormalised over S (log p_T(a) − log Σ_S p_T) — what ``safe_logprobs_from_logits`` computes on the trainer.

Use::

    LLM(model, logprobs_mode="processed_logprobs", **vllm_engine_kwargs(1e-4))
    # = logits_processors=["tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor"],
    #   additional_config={"tim_min_p": 1e-4}; per request: SamplingParams(extra_args={"tim_min_p": x})

Where vLLM calls it (the two model runners differ, and each loader rejects the other's interface, so this one class
implements both from vLLM 0.31 on; the constructor's arguments tell which runner built it). Before 0.31 the V2
runner has no custom processors: a configuration with one runs in the V1 runner
(VLLM_SOURCES vllm.config:VllmConfig._get_v2_model_runner_unsupported_features), and the class is V1 only. vLLM
0.34 removed the V1 runner: from then on the class is V2 only.
* V1 runner (``vllm/v1/sample/sampler.py`` ``Sampler.sample``; vLLM < 0.34: CPU, and GPUs where the V2 runner is
  not used):
  argmax-invariant processors run after temperature, after the built-in min-p and before top-k/top-p; processed
  log-probs are taken after top-k/top-p. The logits are already z/T: cut = log(min_p).
* V2 runner (``vllm/v1/worker/gpu/sample/sampler.py`` ``Sampler.apply_sampling_params``): custom processors run
  *before* temperature. We use the equivalent test on raw logits, z_a >= max_b z_b + T·log(min_p), with each
  request's own T (rounding can differ from the tempered test only for a logit within an ulp of the cut: a
  boundary token, masked by the trainer like any other).
Each vLLM internal used here is an entry of ``sources.VLLM_SOURCES``, named where it is used.
Greedy requests (T < 1e-5) are left alone (vLLM skips min-p for them too). Combined with
``SamplingParams.min_p`` both cuts apply: the larger min_p wins.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams

from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY, check_min_p, engine_min_p

try:  # the V1 model runner's interface (vLLM < 0.34, sources.VLLM_UNTIL); later versions have only V2
    # VLLM_SOURCES vllm.v1.sample.logits_processor:BatchUpdate
    # VLLM_SOURCES vllm.v1.sample.logits_processor:LogitsProcessor
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor import LogitsProcessor as _V1LogitsProcessor

    # VLLM_SOURCES vllm.v1.sample.logits_processor.builtin:process_dict_updates
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:
    _V1LogitsProcessor = None

try:  # the V2 model runner's interface (vLLM >= 0.31, sources.VLLM_SINCE); older versions have only V1
    # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2LogitsProcessor
except ImportError:
    _V2LogitsProcessor = None

__all__ = ["TIMMinPLogitsProcessor"]

# vLLM samples greedily below this temperature and skips min-p: VLLM_SOURCES vllm.v1.sample.sampler:_SAMPLING_EPS
_GREEDY_EPS = 1e-5
# Loaded by its "<module>:<Class>" name in either runner, each of which wants its own base class:
# VLLM_SOURCES vllm.v1.sample.logits_processor:_load_logitsprocs_by_fqcns
# VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor.loader:_load_v2_logitsprocs_by_fqcns
_BASES = tuple(base for base in (_V1LogitsProcessor, _V2LogitsProcessor) if base is not None)
if not _BASES:
    raise ImportError("tim_plugins.integrations.vllm.min_p: the installed vLLM has neither model runner's logits-"
                      "processor interface (vllm.v1.sample.logits_processor, vllm.v1.worker.gpu.sample."
                      "logits_processor); `tim-plugins doctor` says what moved")


def _request_min_p(params: SamplingParams, default: float) -> float:
    extra = params.extra_args or {}
    if CONFIG_KEY in extra:
        return check_min_p(extra[CONFIG_KEY], f"SamplingParams.extra_args[{CONFIG_KEY!r}]")
    return default


def _log_cut(params: SamplingParams, default: float) -> float | None:
    """log(min_p) for a request, or None when nothing is cut (min_p = 0 or greedy)."""
    min_p = _request_min_p(params, default)
    if min_p == 0.0 or params.temperature < _GREEDY_EPS:
        return None
    return math.log(min_p)


def _mask_below(logits: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (in place), cut [n] (−inf = keep all): z_a < max_b z_b + cut  ->  −inf."""
    return logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + cut[:, None], -math.inf)


class TIMMinPLogitsProcessor(*_BASES):
    """min-p from the engine config (``additional_config["tim_min_p"]``) or per request (``extra_args``)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _request_min_p(sampling_params, 0.0)  # raises ValueError (HTTP 400 in a server) on a bad value

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        # VLLM_SOURCES vllm.config:VllmConfig (additional_config)
        self.default_min_p = engine_min_p(getattr(vllm_config, "additional_config", None))
        # V1: VLLM_SOURCES vllm.v1.sample.logits_processor:build_logitsprocs (ctor(vllm_config, device, pin));
        # V2: VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor.loader:build_custom_logits_processors
        if len(args) == 2:  # V1: (device, is_pin_memory); state per batch row
            self._v2 = False
            self._device = torch.device(args[0])
            self._rows: dict[int, float] = {}  # row -> log(min_p)
            self._cut: torch.Tensor | None = None  # [batch] on device, None = no row is pruned
        elif len(args) == 1:  # V2: (req_states); state per persistent request slot
            # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsProcRequestState
            self._v2 = True
            req_states = args[0]
            self._device = torch.device(req_states.device)
            self._slot_cut = np.full(req_states.max_num_reqs, -np.inf, dtype=np.float32)
            self._slot_active = np.zeros(req_states.max_num_reqs, dtype=bool)
            self._slot_cut_dev = torch.from_numpy(self._slot_cut).to(self._device)
            self._dirty = False
        else:
            raise TypeError(f"TIMMinPLogitsProcessor: unexpected constructor arguments {args!r}")

    # ------------------------------------------------------------------------------------------------ V1 runner
    def is_argmax_invariant(self) -> bool:
        # the most likely token is always kept: V1 applies it after temperature, on sampled rows
        # VLLM_SOURCES vllm.v1.sample.sampler:Sampler.sample
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self._rows, batch_update,
                                       lambda params, _prompt, _out: _log_cut(params, self.default_min_p))
        size = batch_update.batch_size if batch_update is not None else (0 if self._cut is None else len(self._cut))
        if not self._rows:
            self._cut = None
        elif changed or self._cut is None or len(self._cut) != size:
            cut = torch.full((size,), -math.inf, dtype=torch.float32)
            for row, value in self._rows.items():
                if row < size:
                    cut[row] = value
            self._cut = cut.to(self._device)

    # ------------------------------------------------------------------------------------------------ V2 runner
    # VLLM_SOURCES vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params (called before temperature)
    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        log_cut = _log_cut(sampling_params, self.default_min_p)
        # V2 calls us before temperature: z_a/T >= m/T + log(min_p)  <=>  z_a >= m + T·log(min_p)
        self._slot_cut[req_idx] = -np.inf if log_cut is None else sampling_params.temperature * log_cut
        self._slot_active[req_idx] = log_cut is not None
        self._dirty = True
        return log_cut is not None

    def apply_staged_writes(self) -> None:
        if self._dirty:  # a fresh tensor: an in-flight step may still read the previous one
            self._slot_cut_dev = torch.from_numpy(self._slot_cut.copy()).to(self._device)
            self._dirty = False

    # ------------------------------------------------------------------------------------------------ both
    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if not self._v2:
            return logits if self._cut is None else _mask_below(logits, self._cut[: logits.shape[0]])
        # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsContext
        if not self._slot_active[ctx.idx_mapping_np].any():
            return logits
        return _mask_below(logits, self._slot_cut_dev[ctx.expanded_idx_mapping])
