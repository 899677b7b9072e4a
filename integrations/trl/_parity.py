"""Parity audit at train begin: read both sides (GRPOConfig + model, and the live vLLM engine when present),
run ``tim_plugins.parity.audit``, log the findings as a table, raise in strict mode."""

from __future__ import annotations

import logging

from .parity_spec import specs_from_trainer

__all__ = ["collect_specs", "main_process_value", "run_audit", "server_engine_args", "server_sampler"]

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
    # hooks.TRL_SOURCES trl.generation.vllm_client:VLLMClient.get_server_info
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
    if client is None or not hasattr(client, "get_server_info"):
        return None
    # the vLLM adapter reads the reply (imported here, as parity_spec.rollout_spec_from_trl imports it: only with a
    # vLLM to read, so that importing this module does not import the vLLM adapter and its version note)
    from tim_plugins.integrations.vllm.parity_spec import engine_args_from_server_info

    try:
        return engine_args_from_server_info(client.get_server_info())
    except Exception as err:  # an audit problem never stops training
        logger.info("tim_plugins: could not read the vLLM server's configuration: %r", err)
        return None


def server_sampler(trainer) -> dict:
    """What a server-mode trainer's vLLM server does to every request on its own, from its /server_info:
    ``min_p``, the cut of tim-plugins' min-p processor registered at start-up (``--logits-processors
    tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor --additional-config '{"tim_min_p": x}'``; 0 without
    one), and ``logprobs_mode`` (None when unknown). Empty in colocate mode and when the server does not answer.
    The main process alone holds TRL's client: it reads the server and every rank gets its reading (a collective:
    every rank calls this, as every rank builds its TIMCallback), so all ranks cut alike and refuse alike."""
    # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.__init__ (use_vllm, vllm_mode)
    args = trainer.args
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "server":
        return {}
    reading = _server_sampler_here(trainer) if trainer.accelerator.is_main_process else None
    return main_process_value(trainer, reading) or {}


def main_process_value(trainer, value):
    """The main process's ``value`` on every rank (a collective: every rank calls it; one process: ``value``). What
    only the main process can read (TRL's vLLM client) then decides alike on all ranks."""
    if trainer.accelerator.num_processes <= 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def _server_sampler_here(trainer) -> dict:
    """``server_sampler``'s reading by this process's client (the main process's)."""
    server = server_engine_args(trainer)
    if server is None:
        return {}
    from tim_plugins.rollout.vllm_min_p_config import processor_min_p

    engine = server[0]
    return {"min_p": processor_min_p(engine.get("logits_processors"), engine.get("additional_config")),
            "logprobs_mode": engine.get("logprobs_mode")}


def collect_specs(trainer, rollout_source: str, *, engine: bool = True, server: bool = True):
    """(rollout_spec, trainer_spec) for this trainer, read by ``parity_spec.specs_from_trainer`` from its
    GRPOConfig, its model and the live vLLM engine (``engine``) or server (``server``) when there is one."""
    server = server_engine_args(trainer) if server else None
    return specs_from_trainer(trainer, llm=_live_llm(trainer) if engine else None, rollout_source=rollout_source,
                              server_args=server[0] if server else None,
                              server_device=server[1] if server else None)


_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def run_audit(trainer, rollout_source: str, truncation=None, *, strict: bool = False, engine: bool = True,
              server: bool = True):
    """Audit the rollout side against TRL's trainer side (``tim_plugins.parity.report.audit_and_report``); log the
    findings as a table at the level of the worst one (INFO when there is none) and to wandb when it is active.
    Returns (findings, (rollout_spec, trainer_spec), counts by severity). ``truncation``: the safe-vocab head's
    ``Truncation``, which makes the trainer apply the sampler's min_p / top_p / top_k. ``engine`` / ``server``:
    whether the live vLLM engine / server may be read (``features.ENGINE_AUDIT`` / ``SERVER_AUDIT`` hold). Raises
    ``ParityError`` on an error-level finding when ``strict``."""
    from tim_plugins.parity.report import audit_and_report
    from tim_plugins.parity.table import FINDINGS_COLUMNS, findings_rows

    rollout_spec, trainer_spec = collect_specs(trainer, rollout_source, engine=engine, server=server)
    if truncation is not None:
        trainer_spec = trainer_spec.replace(min_p=truncation.min_p, top_p=truncation.top_p, top_k=truncation.top_k)

    def emit(report) -> None:
        logger.log(_LEVELS.get(report.worst, logging.INFO), "%s", report.text)
        args = trainer.args
        if args.report_to and "wandb" in args.report_to:
            try:
                import wandb

                if wandb.run is not None:
                    wandb.log({"tim/parity/findings": wandb.Table(
                        columns=list(FINDINGS_COLUMNS), data=findings_rows(report.findings, framework="trl"))},
                        commit=False)
            except ImportError:
                pass

    report = audit_and_report(rollout_spec, trainer_spec, framework="trl", emit=emit, strict=strict,
                              title=f"tim_plugins parity audit ({rollout_source} rollouts vs TRL trainer)",
                              strict_off="set TIMConfig(parity_strict=False)")
    return report.findings, (rollout_spec, trainer_spec), report.counts
