"""vLLM V1 logits processor for TIM injection (imports vLLM at import time: import only when you use vLLM).

Register it when the engine is built and activate it per request::

    llm = LLM(model, logits_processors=[TailNoiseLogitsProcessor])
    # or logits_processors=["tim_plugins.integrations.vllm.inject:TailNoiseLogitsProcessor"]
    params = SamplingParams(..., extra_args=injector.to_extra_args())  # {"tim_inject": {"scale", "tau", "mode", ...}}

Requests without ``extra_args["tim_inject"]`` are untouched. vLLM applies custom (non-argmax-invariant)
processors before penalties and temperature (``sources.VLLM_SOURCES``
vllm.v1.sample.sampler:Sampler.apply_logits_processors), as HF does, so the same calibrated scale applies to both.
With ``logprobs_mode="processed_logprobs"`` the reported log-probs are those of the perturbed distribution.
Noise is deterministic: each step's draw is seeded from (seed, a hash of the prompt, the tokens generated so
far), so it does not depend on batch composition or scheduling.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
from vllm import SamplingParams

# VLLM_SOURCES vllm.v1.sample.logits_processor:AdapterLogitsProcessor
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from tim_plugins.rollout.inject import EXTRA_ARGS_KEY, INJECT_MODES, perturb_tail

__all__ = ["TailNoiseLogitsProcessor", "EXTRA_ARGS_KEY"]


def _settings(params: SamplingParams) -> Optional[dict]:
    extra = getattr(params, "extra_args", None) or {}
    cfg = extra.get(EXTRA_ARGS_KEY)
    if not cfg:
        return None
    return {"scale": float(cfg.get("scale", 0.0)), "tau": float(cfg.get("tau", 0.1)),
            "mode": str(cfg.get("mode", "noise")), "seed": int(cfg.get("seed", 0)),
            "bias_sign": float(cfg.get("bias_sign", 1.0))}


def _step_seed(seed: int, prompt_digest: bytes, output_ids: list) -> int:
    h = hashlib.blake2b(prompt_digest, digest_size=8)
    h.update(int(seed).to_bytes(8, "little", signed=True))
    h.update(len(output_ids).to_bytes(4, "little"))
    h.update(",".join(map(str, output_ids)).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class TailNoiseLogitsProcessor(AdapterLogitsProcessor):
    """Per-request tail perturbation (see `tim_plugins.rollout.inject` for the formula)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        cfg = _settings(sampling_params)
        if cfg is None:
            return
        if cfg["mode"] not in INJECT_MODES:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]['mode']={cfg['mode']!r}: must be one of {INJECT_MODES}")
        if not 0.0 < cfg["tau"] <= 1.0 or cfg["scale"] < 0:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]: tau must be in (0, 1] and scale >= 0, got {cfg}")

    def is_argmax_invariant(self) -> bool:
        # it changes which token is most likely: VLLM_SOURCES vllm.v1.sample.sampler:Sampler.apply_logits_processors
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        cfg = _settings(params)
        if cfg is None or cfg["scale"] == 0.0:
            return None
        digest: dict[str, bytes] = {}

        # three parameters: vLLM passes the prompt ids too (VLLM_SOURCES
        # vllm.v1.sample.logits_processor:AdapterLogitsProcessor)
        def apply(prompt_ids: list, output_ids: list, logits: torch.Tensor) -> torch.Tensor:
            if "d" not in digest:
                digest["d"] = hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=16).digest()
            gen = torch.Generator().manual_seed(_step_seed(cfg["seed"], digest["d"], output_ids))
            return perturb_tail(logits, cfg["scale"], tau=cfg["tau"], mode=cfg["mode"],
                                bias_sign=cfg["bias_sign"], generator=gen)

        return apply
