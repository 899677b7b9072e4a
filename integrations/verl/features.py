"""What the verl adapter can do with the installed verl: one `Feature` per capability, each naming the
``VERL_SOURCES`` entries its hooks need. ``plugin.register`` checks them in every verl process: a feature whose
hook moved is not registered (one line on stderr with the reason and the fix); the others are. ``tim-plugins
doctor`` prints them. Importing this module imports nothing from verl.
"""

from __future__ import annotations

from tim_plugins.capabilities import Feature, check, registered_hooks

from .sources import VERL_SOURCES

__all__ = ["ASYNC_LAG", "ENGINE", "FEATURES", "LR_DECAY", "TRAINER_MODES", "verl_features"]

_TI = "verl.workers.engine.fsdp.transformer_impl"
_TB = "verl.trainer.ppo.v1.trainer_base"
_FIX = "pip install 'verl>=0.9,<0.10' (the tested range), or report it with `tim-plugins doctor`'s output"


_hook = registered_hooks(VERL_SOURCES, "VERL_SOURCES")

# The FSDP actor engine subclass (engine.py): the monitor, the safe vocabulary and the boundary mask run in it.
ENGINE = Feature(
    "verl_engine", "monitor + safe vocabulary in verl's FSDP actor engine", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        _hook(_TI, "FSDPEngineWithLMHead.prepare_model_outputs",
              params=("output", "output_args", "micro_batch", "logits_processor_func")),
        _hook(_TI, "FSDPEngineWithLMHead.forward_step", params=("micro_batch", "loss_function", "forward_only")),
        _hook(_TI, "FSDPEngine.forward_backward_batch", params=("data", "loss_function", "forward_only")),
        _hook(_TI, "FSDPEngine.get_data_parallel_group"),
        _hook("verl.workers.engine.base", "BaseEngine.train_batch", params=("data", "loss_function")),
        _hook("verl.workers.engine.base", "EngineRegistry.register",
              params=("model_type", "backend", "device", "vendor")),
    ))

# The tim_* V1 trainer modes (trainer.py): the startup audit, the parity probe, checkpoint on stop.
TRAINER_MODES = Feature(
    "verl_trainer_modes", "tim_* trainer modes (audit, parity probe)", "verl", needs=("verl",), extra="verl",
    fix=_FIX, hooks=(
        _hook(_TB, "register_trainer"),
        _hook(_TB, "PPOTrainer._compute_old_log_prob", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._update_actor", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._compute_metrics", params=("batch", "metrics")),
        _hook(_TB, "PPOTrainer._init_resource_pool_mgr"),
    ))

# The optimizer route (optim.py) selected by actor.optim.optimizer_impl.
LR_DECAY = Feature(
    "verl_lr_decay", "length-triggered LR decay (actor.optim.optimizer_impl)", "verl", needs=("verl",),
    extra="verl", fix=_FIX, hooks=(_hook("verl.workers.config.optimizer", "build_optimizer",
                                         fragments=("optimizer_impl",)),))

# The asynchronous modes' per-sample policy lag (trainer.py _tim_put_lag): verl's weight-version tags, carried to the
# workers as a TransferQueue field. Off: the async modes' tokens are counted (tim/diag/async_lag_unknown), not keyed.
ASYNC_LAG = Feature(
    "verl_async_lag", "policy lag of each sample in the asynchronous trainer modes", "verl", needs=("verl",),
    extra="verl", fix=_FIX, hooks=(
        _hook(_TB, "PPOTrainer._compute_metrics", fragments=('tag["min_global_steps"]',)),
        _hook("transfer_queue", "kv_batch_put", params=("keys", "partition_id", "fields")),
    ))

FEATURES = (ENGINE, TRAINER_MODES, LR_DECAY, ASYNC_LAG)


def verl_features():
    """Every verl feature's status."""
    return [check(f) for f in FEATURES]
