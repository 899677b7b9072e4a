"""vLLM logits processor for TIM injection (imports vLLM at import time: import only when you use vLLM).

Register it when the engine is built and activate it per request::

    llm = LLM(model, logits_processors=[TailNoiseLogitsProcessor])
    # or logits_processors=["tim_plugins.integrations.vllm.inject:TailNoiseLogitsProcessor"]
    params = SamplingParams(..., extra_args=injector.to_extra_args())  # {"tim_inject": {"scale", "tau", "mode", ...}}

Requests without ``extra_args["tim_inject"]`` are untouched. A request with bad settings is refused at admission
(``validate_params``) by ``InjectorConfig``'s own rules; a row whose perturbation fails inside the engine step keeps
its logits, counted in the processor's ``skipped_rows`` and logged once. vLLM applies custom (non-argmax-invariant)
processors before penalties and temperature (``sources.VLLM_SOURCES``
vllm.v1.sample.sampler:Sampler.apply_logits_processors), as HF does, so the same calibrated scale applies to both.
With ``logprobs_mode="processed_logprobs"`` the reported log-probs are those of the perturbed distribution.
Noise is deterministic: each step's draw is seeded from (seed, a hash of the prompt, the tokens generated so
far), so it does not depend on batch composition or scheduling.

``TailNoiseLogitsProcessor`` is the V1 runner's processor (vLLM's ``AdapterLogitsProcessor``, which hands each row
its prompt and output ids) wherever vLLM has that runner, and `TailNoiseV2LogitsProcessor` from vLLM 0.34 on, where
the V2 runner is the only one (``sources.VLLM_UNTIL``). The V2 runner calls custom processors before temperature
too, but after logit bias, penalties and bad words (VLLM_SOURCES
vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params): the same distribution for requests without
penalties or a logit bias, as the injector's runs use. It hands no token lists: each row's prompt and outputs are
read from the request's committed tokens (``req_states.all_token_ids`` up to the row's position, whose own token is
the row's input id), one device read per perturbed row and step (the injector is a study tool; nothing else pays
for it). The same prompt and outputs draw the same noise in both. Speculative decoding's draft rows are not
modelled there (their earlier drafts are not committed tokens).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch
from vllm import SamplingParams

from tim_plugins.rollout.inject import EXTRA_ARGS_KEY, InjectorConfig, noise_seed, perturb_tail

try:  # the V1 model runner (vLLM < 0.34, sources.VLLM_UNTIL)
    # VLLM_SOURCES vllm.v1.sample.logits_processor:AdapterLogitsProcessor
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
except ImportError:
    AdapterLogitsProcessor = None

try:  # the V2 model runner's interface (vLLM >= 0.31, sources.VLLM_SINCE)
    # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2LogitsProcessor
except ImportError:
    _V2LogitsProcessor = None

logger = logging.getLogger("tim_plugins.vllm")

# What ``TailNoiseInjector.to_extra_args`` sends: InjectorConfig's fields but the profile, which this processor
# does not apply (a key it would ignore is refused rather than silently dropped).
_KEYS = ("scale", "tau", "mode", "seed", "bias_sign")


def _settings(params: SamplingParams) -> Optional[dict]:
    """A request's injector settings, checked by ``InjectorConfig`` (the HF injector's own rules), or None."""
    extra = getattr(params, "extra_args", None) or {}
    raw = extra.get(EXTRA_ARGS_KEY)
    if raw is None or (isinstance(raw, Mapping) and not raw):  # absent, or an empty dict: scale 0, off
        return None
    where = f"SamplingParams.extra_args[{EXTRA_ARGS_KEY!r}]"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}={raw!r}: must be a dict of {', '.join(_KEYS)} "
                         "(TailNoiseInjector.to_extra_args() builds it)")
    unknown = sorted(map(str, set(raw) - set(_KEYS)))
    if unknown:
        raise ValueError(f"{where} has keys {unknown} this processor does not read: it takes {', '.join(_KEYS)} "
                         "(a profiled injector runs with HF generate only)")
    try:
        cfg = InjectorConfig(**raw)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}={dict(raw)!r}: {err}") from None
    return {key: getattr(cfg, key) for key in _KEYS}


def _step_seed(seed: int, prompt_digest: bytes, output_ids: list) -> int:
    h = hashlib.blake2b(prompt_digest, digest_size=8)
    h.update(noise_seed(seed).to_bytes(8, "little"))
    h.update(len(output_ids).to_bytes(4, "little"))
    h.update(",".join(map(str, output_ids)).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _validate(sampling_params: SamplingParams) -> None:
    _settings(sampling_params)  # raises ValueError (HTTP 400 in a server) on a bad setting


def _active(params: SamplingParams) -> Optional[dict]:
    """The request's settings when it is perturbed (a non-zero scale), else None."""
    cfg = _settings(params)
    return None if cfg is None or cfg["scale"] == 0.0 else cfg


def _prompt_digest(prompt_ids) -> bytes:
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=16).digest()


def _perturbed(cfg: dict, digest: bytes, output_ids: list, logits: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_step_seed(cfg["seed"], digest, output_ids))
    return perturb_tail(logits, cfg["scale"], tau=cfg["tau"], mode=cfg["mode"], bias_sign=cfg["bias_sign"],
                        generator=gen)


def _skipped(processor: Any, err: Exception) -> None:
    """A row whose perturbation failed keeps its logits: an error raised inside vLLM's engine step would stop the
    engine (an in-process one hangs). Counted in ``processor.skipped_rows``; the first one is logged."""
    processor.skipped_rows += 1
    if processor.skipped_rows == 1:
        logger.warning("tim_plugins: the TIM injector left a row unperturbed (%r); %s.skipped_rows counts such rows, "
                       "this warning is not repeated", err, type(processor).__name__)


if AdapterLogitsProcessor is not None:
    class TailNoiseLogitsProcessor(AdapterLogitsProcessor):
        """Per-request tail perturbation (see `tim_plugins.rollout.inject` for the formula); the V1 runner's."""

        skipped_rows = 0  # rows left unperturbed because their perturbation failed (_skipped)

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            _validate(sampling_params)

        def is_argmax_invariant(self) -> bool:
            # it changes which token is most likely:
            # VLLM_SOURCES vllm.v1.sample.sampler:Sampler.apply_logits_processors
            return False

        def new_req_logits_processor(self, params: SamplingParams) -> Any:
            cfg = _active(params)
            if cfg is None:
                return None
            digest: dict[str, bytes] = {}

            # three parameters: vLLM passes the prompt ids too (VLLM_SOURCES
            # vllm.v1.sample.logits_processor:AdapterLogitsProcessor)
            def apply(prompt_ids: list, output_ids: list, logits: torch.Tensor) -> torch.Tensor:
                try:
                    if "d" not in digest:
                        digest["d"] = _prompt_digest(prompt_ids)
                    return _perturbed(cfg, digest["d"], output_ids, logits)
                except Exception as err:
                    _skipped(self, err)
                    return logits

            return apply

if _V2LogitsProcessor is not None:
    class TailNoiseV2LogitsProcessor(_V2LogitsProcessor):
        """The same perturbation in the V2 runner (``TailNoiseLogitsProcessor`` from vLLM 0.34 on)."""

        skipped_rows = 0  # rows left unperturbed because their perturbation failed (_skipped)

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            _validate(sampling_params)

        # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsProcRequestState (all_token_ids [slots,
        # max_model_len] committed tokens, .gpu; prompt_len [slots], .np)
        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            self._req_states = req_states
            self._cfg: dict[int, dict] = {}  # slot -> settings of a perturbed request
            self._digest: dict[int, bytes] = {}  # slot -> hash of its prompt, once read

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            cfg = _active(sampling_params)
            self._digest.pop(req_idx, None)  # a recycled slot: its previous request's prompt
            if cfg is None:
                self._cfg.pop(req_idx, None)
                return False
            self._cfg[req_idx] = cfg
            return True

        # VLLM_SOURCES vllm.v1.worker.gpu.sample.logits_processor:LogitsContext (idx_mapping_np per request, on the
        # host; expanded_idx_mapping, pos, input_ids per logits row)
        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            if not any(int(slot) in self._cfg for slot in ctx.idx_mapping_np):  # host-side: no device read
                return logits
            slots, positions, inputs = ctx.expanded_idx_mapping.tolist(), ctx.pos.tolist(), ctx.input_ids.tolist()
            tokens = self._req_states.all_token_ids.gpu
            for row, slot in enumerate(slots):
                cfg = self._cfg.get(slot)
                if cfg is None:
                    continue
                try:
                    prompt_len, pos = int(self._req_states.prompt_len.np[slot]), positions[row]
                    if slot not in self._digest:
                        self._digest[slot] = _prompt_digest(tokens[slot, :prompt_len].tolist())
                    # the row samples position pos + 1: its outputs are the tokens from the prompt's end through
                    # pos, whose own token is the row's input (read there: whether all_token_ids holds it yet is the
                    # runner's timing, not a contract)
                    outputs = tokens[slot, prompt_len:pos].tolist() + [inputs[row]] if pos >= prompt_len else []
                    logits[row] = _perturbed(cfg, self._digest[slot], outputs, logits[row])
                except Exception as err:
                    _skipped(self, err)
            return logits

if AdapterLogitsProcessor is None:
    if _V2LogitsProcessor is None:
        raise ImportError("tim_plugins.integrations.vllm.inject: the installed vLLM has neither model runner's "
                          "logits-processor interface; `tim-plugins doctor` says what moved")
    TailNoiseLogitsProcessor = TailNoiseV2LogitsProcessor

__all__ = ["TailNoiseLogitsProcessor", "EXTRA_ARGS_KEY"] + (["TailNoiseV2LogitsProcessor"] if _V2LogitsProcessor
                                                             else [])
