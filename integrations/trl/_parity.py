"""Parity audit at train begin: read both sides (GRPOConfig + model, and the live vLLM engine when present),
run ``tim_plugins.parity.audit``, log the findings as a table, raise in strict mode."""

from __future__ import annotations

import logging

from .parity_spec import specs_from_trainer

__all__ = ["collect_specs", "run_audit", "server_engine_args"]

logger = logging.getLogger("tim_plugins.trl")


def _live_llm(trainer):
    # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm (trainer.vllm_generation.llm)
    gen = getattr(trainer, "vllm_generation", None)
    return getattr(gen, "llm", None) if gen is not None else None


def server_engine_args(trainer) -> tuple[dict, str] | None:
    """(engine args, device) of the vLLM server a server-mode trainer generates with, read live through TRL's
    own client (``VLLMClient.get_server_info``: GET /server_info of ``trl vllm-serve``); None without a server
    or when the server does not answer (the audit then says the engine args are unknown)."""
    # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm (vllm_client) and
    # hooks.TRL_SOURCES trl.generation.vllm_client:VLLMClient.get_server_info; the keys read below:
    # VLLM_SOURCES vllm.entrypoints.serve.dev.server_info.api_router:show_server_info
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
    if client is None or not hasattr(client, "get_server_info"):
        return None
    try:
        info = client.get_server_info()
        model, cache, sched = info["model_config"], info["cache_config"], info["scheduler_config"]
        dtype = model.get("dtype")
        args = {
            "model": model.get("model"), "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "logprobs_mode": model.get("logprobs_mode"), "enforce_eager": model.get("enforce_eager"),
            "quantization": model.get("quantization"), "kv_cache_dtype": cache.get("cache_dtype"),
            "enable_prefix_caching": cache.get("enable_prefix_caching"),
            "enable_chunked_prefill": sched.get("enable_chunked_prefill"),
        }
        device = str((info.get("device_config") or {}).get("device") or "cuda")
    except Exception as err:  # an audit problem never stops training
        logger.info("tim_plugins: could not read the vLLM server's configuration: %r", err)
        return None
    return {k: v for k, v in args.items() if v is not None}, device


def collect_specs(trainer, rollout_source: str):
    """(rollout_spec, trainer_spec) for this trainer, read by ``parity_spec.specs_from_trainer`` from its
    GRPOConfig, its model and the live vLLM engine or server when there is one."""
    server = server_engine_args(trainer)
    return specs_from_trainer(trainer, llm=_live_llm(trainer), rollout_source=rollout_source,
                              server_args=server[0] if server else None,
                              server_device=server[1] if server else None)


_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def _log_level(findings) -> int:
    """The level of the worst finding (INFO when there is none): an info-only audit is not a warning."""
    from tim_plugins.parity.findings import max_severity

    return _LEVELS.get(max_severity(findings), logging.INFO)


def run_audit(trainer, rollout_source: str, truncation=None, *, strict: bool = False):
    """Audit the rollout side against TRL's trainer side; log the findings as a table (and to wandb when it is
    active). Returns (findings, (rollout_spec, trainer_spec), counts by severity). ``truncation``: the safe-vocab
    head's ``Truncation``, which makes the trainer apply the sampler's min_p / top_p / top_k. Raises
    ``ParityError`` on an error-level finding when ``strict``."""
    from tim_plugins.parity.audit import audit, has_errors
    from tim_plugins.parity.findings import ParityError, severity_counts
    from tim_plugins.parity.table import FINDINGS_COLUMNS, findings_rows

    rollout_spec, trainer_spec = collect_specs(trainer, rollout_source)
    if truncation is not None:
        trainer_spec = trainer_spec.replace(min_p=truncation.min_p, top_p=truncation.top_p, top_k=truncation.top_k)
    findings = audit(rollout_spec, trainer_spec)
    columns, rows = list(FINDINGS_COLUMNS), findings_rows(findings, framework="trl")
    text = "\n".join(" | ".join(r) for r in [columns] + rows) if rows else "no findings"
    logger.log(_log_level(findings), "tim_plugins parity audit (%s rollouts vs TRL trainer):\n%s", rollout_source,
               text)
    args = trainer.args
    if args.report_to and "wandb" in args.report_to:
        try:
            import wandb

            if wandb.run is not None:
                wandb.log({"tim/parity/findings": wandb.Table(columns=columns, data=rows)}, commit=False)
        except ImportError:
            pass
    if strict and has_errors(findings):
        errors = [f for f in findings if f.severity == "error"]
        raise ParityError(
            "tim_plugins parity audit (strict): "
            + "; ".join(f"{f.code}: {f.message}" for f in errors)
            + ". Fix the settings named in each finding, or set TIMConfig(parity_strict=False) to only log them.",
            findings=findings,
        )
    return findings, (rollout_spec, trainer_spec), severity_counts(findings)
