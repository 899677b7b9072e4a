"""Kernel-parity enforcer: static audit of rollout vs trainer settings, enforce, live probe, batch-invariance
check. The exact sampler and the TIM injector live in `tim_plugins.rollout.exact` / `.inject`. The readers of live
framework objects live in the adapters: ``tim_plugins.integrations.hf.parity_spec.spec_from_hf_model`` (a
transformers model) and ``tim_plugins.integrations.vllm.parity_spec.spec_from_llm`` (a vLLM engine)."""

from tim_plugins.parity.audit import DEFAULT_FIXES, Change, EnforceResult, audit, enforce, has_errors
from tim_plugins.parity.findings import CODES, Finding, ParityError
from tim_plugins.parity.probe import ParityProbe, ParityProbeConfig, ProbeDecision
from tim_plugins.parity.spec import PipelineSpec

__all__ = [
    "PipelineSpec",
    "Finding",
    "CODES",
    "ParityError",
    "audit",
    "enforce",
    "has_errors",
    "Change",
    "EnforceResult",
    "DEFAULT_FIXES",
    "ParityProbe",
    "ParityProbeConfig",
    "ProbeDecision",
    "check_batch_invariance",
    "BatchInvarianceReport",
]


def __getattr__(name: str):
    # The batch-invariance check runs a model (torch): imported on first use, so that reading the probe's and the
    # audit's settings (the report) does not import torch.
    if name in ("BatchInvarianceReport", "check_batch_invariance"):
        from tim_plugins.parity import batch_invariance

        return getattr(batch_invariance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
