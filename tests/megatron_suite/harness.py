"""Test helper: verl 0.9.1's Megatron LM-head engine on CPU (gloo; one process, or two for TP2 / DP2 / PP2), built from
verl's own dataclasses (``McoreEngineConfig``, ``McoreOptimizerConfig``, ``HFModelConfig``, ``CheckpointConfig``)
and driven as verl's ``TrainingWorker`` drives it: ``infer_batch`` for the old log-probs, ``train_batch`` with
``partial(ppo_loss, config=McoreActorConfig)``, then ``lr_scheduler_step``.

The batches are the FSDP suite's (``tests/verl_suite/harness.py`` ``make_batch``: left/right padded rows as after a
rollout, converted by verl's ``left_right_2_no_padding`` as its trainer does), on the tiny Qwen2's vocabulary.
The CPU shims (``cpu_site/megatron_shims.py``) must be installed before this module imports verl.
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import torch
from tiny_qwen2 import VOCAB

__all__ = ["MICRO", "VOCAB", "init_dist", "build_engine", "make_batch", "infer", "old_log_probs_padded", "train_step",
           "tensors_of", "params_of", "to_v1_layout", "Rollout", "checked_sync", "assert_left_out_layer_named_stale",
           "recording_ppo_loss"]

MICRO = 2  # micro_batch_size_per_gpu of every pass
_VERL_HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "verl_suite", "harness.py")


def _verl_suite_harness():
    spec = importlib.util.spec_from_file_location("_verl_suite_harness", _VERL_HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FSDP_HARNESS = _verl_suite_harness()
make_batch = _FSDP_HARNESS.make_batch
to_v1_layout = _FSDP_HARNESS.to_v1_layout
Rollout = _FSDP_HARNESS.Rollout  # the weight-sync check's stand-in rollout engine, and one checked sync into it
checked_sync = _FSDP_HARNESS.checked_sync
assert_left_out_layer_named_stale = _FSDP_HARNESS.assert_left_out_layer_named_stale
recording_ppo_loss = _FSDP_HARNESS.recording_ppo_loss


def old_log_probs_padded(out, td):
    """[B, R] response log-probs from the engine's output, on every rank. With pipeline parallelism only the last
    stage has outputs (``{}`` elsewhere); verl's driver takes the old log-probs from the rank that holds them and
    hands the next pass's batch, them included, to every rank: here a broadcast from the last stage over the
    pipeline group."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return _FSDP_HARNESS.old_log_probs_padded(out, td)
    held = [_FSDP_HARNESS.old_log_probs_padded(out, td) if mpu.is_pipeline_last_stage() else None]
    torch.distributed.broadcast_object_list(held, src=mpu.get_pipeline_model_parallel_last_rank(),
                                            group=mpu.get_pipeline_model_parallel_group())
    return held[0]


def init_dist(rank: int = 0, world: int = 1, port: int = 29611) -> None:
    if torch.distributed.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def build_engine(model_path: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                 distributed_optimizer: bool = True, lr: float = 1e-3, total_steps: int = 10,
                 engine_cls: type | None = None, optim_overrides: dict | None = None, remove_padding: bool = False,
                 fused: bool = False, sequence_parallel: bool = False):
    """The engine verl's registry picks for backend "megatron" (ours once the plugin is loaded), or ``engine_cls``
    built the same way; bf16 parameters (McoreEngineConfig accepts bfloat16 and float16 only), verl's defaults otherwise
    (distributed optimizer on). ``remove_padding``: verl's packed thd layout (the CPU shim 12) instead of bshd;
    ``fused``: ``use_fused_kernels`` (verl needs remove-padding for it); ``sequence_parallel``: Megatron's sequence
    parallelism (TP > 1; the CPU shim 13), as mbridge sets it by default at TP > 1; ``vpp``: virtual pipeline stages
    per pipeline rank (Megatron's interleaved schedule; the model's layers split over pp x vpp chunks)."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (registrations, as the entry point does)
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=str(model_path))
    engine_config = McoreEngineConfig(
        vanilla_mbridge=True, use_remove_padding=remove_padding, use_fused_kernels=fused,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel, dtype="bfloat16",
        use_distributed_optimizer=distributed_optimizer,
        # the local (torch) layer spec: no TE/Apex fusions; see cpu_site/megatron_shims.py
        override_transformer_config=dict(
            use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            persist_layer_norm=False, attention_backend="local", sequence_parallel=sequence_parallel))
    optim_config = McoreOptimizerConfig(lr=lr, total_training_steps=total_steps, clip_grad=1.0,
                                        **(optim_overrides or {}))
    engine_cls = engine_cls or EngineRegistry.get_engine_cls("language_model", "megatron")
    engine = engine_cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim_config,
                        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def _pass_settings(td, engine=None, **extra) -> None:
    """The pass's settings as verl's worker sets them: remove-padding and fused kernels as the engine has them."""
    from verl.utils import tensordict_utils as tu

    cfg = engine.engine_config if engine is not None else None
    tu.assign_non_tensor(td, use_remove_padding=bool(cfg and cfg.use_remove_padding), use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=MICRO, max_token_len_per_gpu=4096,
                         use_fused_kernels=bool(cfg and cfg.use_fused_kernels), **extra)


def infer(engine, td):
    """The actor's old-log-prob pass (verl asks for the entropy there)."""
    td = td.copy()
    _pass_settings(td, engine, calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        return engine.infer_batch(td, loss_function=None)


def train_step(engine, td, old_log_probs, *, actor_overrides: dict | None = None, loss_wrapper=None):
    """One optimizer step on ``td`` with verl's ppo_loss (one mini-batch; ``loss_wrapper(loss)`` in its place when
    given), then the scheduler step."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    td = td.copy()
    if td["response_mask"].is_nested and not old_log_probs.is_nested:  # V1 layout: responses are ragged rows
        old_log_probs = _FSDP_HARNESS.response_nested(old_log_probs, td)
    td["old_log_probs"] = old_log_probs
    cfg = {"strategy": "megatron", "rollout_n": 1, "ppo_micro_batch_size_per_gpu": MICRO,
           "ppo_mini_batch_size": td.batch_size[0], "use_dynamic_bsz": False, **(actor_overrides or {})}
    actor_config = McoreActorConfig(**cfg)
    _pass_settings(td, engine, calculate_entropy=False, global_batch_size=td.batch_size[0])
    tu.assign_non_tensor(td, update_lr_scheduler=True)
    with engine.train_mode():
        loss = partial(ppo_loss, config=actor_config)
        out = engine.train_batch(td, loss_function=loss_wrapper(loss) if loss_wrapper else loss)
        lr = engine.lr_scheduler_step()
    return out, lr


def tensors_of(out) -> dict:
    """The plain values of a train_batch output's metrics (verl keeps per-micro-batch lists)."""
    metrics = out.get("metrics", {}) if isinstance(out, dict) else {}
    return {k: (list(v.values) if hasattr(v, "values") and not isinstance(v, dict) else v) for k, v in metrics.items()}


def params_of(engine) -> dict[str, torch.Tensor]:
    """This rank's parameter shards, cloned."""
    return {f"{i}.{k}": v.detach().clone() for i, chunk in enumerate(engine.module)
            for k, v in chunk.named_parameters()}
