"""Optimizers for ``actor_rollout_ref.actor.optim.optimizer_impl=tim_plugins.integrations.verl.optim``.

verl builds the actor's optimizer as ``getattr(import_module(optimizer_impl), optimizer)(params, lr=...,
weight_decay=..., betas=...)`` (VERL_SOURCES verl.workers.config.optimizer:build_optimizer), so each class here
takes torch's arguments. verl rebuilds every param group's LR from its LambdaLR each step (VERL_SOURCES
verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_lr_scheduler), so a scale written from outside is
lost. These classes apply the scale the engine hands them (``tim_apply_scale``: the per-step pipeline's decision,
``StepPipeline.end_step``) inside ``step()`` (``tim_plugins.lr_scaling.ScaledLROptimizerMixin``) and keep the
controller's state in ``param_groups[0]``, so verl's own checkpoint save/load carries it.
Without ``tim.lr_decay.enable`` they behave exactly like the torch class they wrap (scale 1.0).
"""

from __future__ import annotations

from typing import Any

import torch

from tim_plugins.lr_control import LengthTriggeredLRDecay
from tim_plugins.lr_scaling import ControllerCheckpoint, ScaledLROptimizerMixin, scaled_optimizer_class

__all__ = ["OPTIMIZERS", "TIMLRDecayMixin", "AdamW", "Adam", "SGD"]

OPTIMIZERS = ("AdamW", "Adam", "SGD")  # the names ``actor_rollout_ref.actor.optim.optimizer`` may take here


class TIMLRDecayMixin(ScaledLROptimizerMixin):
    """Applies the scale of the engine's pipeline and carries its ``LengthTriggeredLRDecay`` state in checkpoints
    (``tim_plugins.lr_scaling.ControllerCheckpoint``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tim_checkpoint: ControllerCheckpoint | None = None

    # -- set by the engine --------------------------------------------------------------------------------------
    def tim_configure(self, controller: LengthTriggeredLRDecay) -> None:
        """Apply ``controller`` (the engine's pipeline's) from now on; picks up a state loaded earlier."""
        self._tim_checkpoint = ControllerCheckpoint(self, controller)
        self.set_lr_scale(controller.scale)

    def tim_deconfigure(self) -> None:
        """Drop the controller: ``step()`` is the torch class's again (scale 1.0). A stored controller state
        stays in ``param_groups[0]`` for a later ``tim_configure`` to pick up."""
        if self._tim_checkpoint is not None:
            self._tim_checkpoint.detach()
        self.set_lr_scale(1.0)

    def tim_sync_state(self) -> None:
        """Before the engine feeds the controller: continue from a checkpoint loaded into the param groups since the
        last step (by any load path)."""
        if self._tim_checkpoint is not None:
            self._tim_checkpoint.sync()

    def tim_apply_scale(self, scale: float) -> None:
        """The scale the pipeline decided for the coming ``step()``; stores the controller's state with it."""
        self.set_lr_scale(scale)
        if self._tim_checkpoint is not None:
            self._tim_checkpoint.store()

    @property
    def tim_controller(self) -> LengthTriggeredLRDecay | None:
        return self._tim_checkpoint.controller if self._tim_checkpoint is not None else None

    # -- torch.optim.Optimizer ------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.tim_controller is None:
            # a checkpoint's scale is its controller's decision: with none attached (LR decay off in this run) the
            # torch class's numerics, scale 1.0; the stored controller state stays for a later tim_configure
            self.set_lr_scale(1.0)
        self.tim_sync_state()


def _make(cls: type) -> type:
    base = scaled_optimizer_class(cls)
    return type(cls.__name__, (TIMLRDecayMixin, base), {
        "__module__": __name__,
        "__doc__": f"torch.optim.{cls.__name__} with the tim LR decay applied inside step().",
    })


AdamW, Adam, SGD = (_make(getattr(torch.optim, name)) for name in OPTIMIZERS)
