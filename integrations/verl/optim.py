"""Optimizers for ``actor_rollout_ref.actor.optim.optimizer_impl=tim_plugins.integrations.verl.optim``.

verl builds the actor's optimizer as ``getattr(import_module(optimizer_impl), optimizer)(params, lr=...,
weight_decay=..., betas=...)`` (VERL_SOURCES verl.workers.config.optimizer:build_optimizer), so each class here
takes torch's arguments. verl rebuilds every param group's LR from its LambdaLR each step (VERL_SOURCES
verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_lr_scheduler), so a scale written from outside is
lost. These classes apply the LR decay controller's scale inside ``step()``
(``tim_plugins.lr_scaling.ScaledLROptimizerMixin``) and keep the controller's state in ``param_groups[0]``, so
verl's own checkpoint save/load carries it.
Without ``tim.lr_decay.enable`` they behave exactly like the torch class they wrap (scale 1.0).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tim_plugins.lr_control import LengthTriggeredLRDecay
from tim_plugins.lr_scaling import (
    CONTROLLER_STATE_KEY,
    ScaledLROptimizerMixin,
    restore_controller_state,
    scaled_optimizer_class,
    store_controller_state,
)

__all__ = ["TIMLRDecayMixin", "AdamW", "Adam", "SGD"]


class TIMLRDecayMixin(ScaledLROptimizerMixin):
    """Holds a ``LengthTriggeredLRDecay`` fed once per ``step()`` with the DP-mean response length."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tim_controller: LengthTriggeredLRDecay | None = None
        self._tim_length: float | None = None
        self._tim_stored: Any = None

    # -- set by the engine --------------------------------------------------------------------------------------
    def tim_configure(self, controller: LengthTriggeredLRDecay) -> None:
        """Apply ``controller`` (the engine's pipeline's) from now on; picks up a state loaded earlier."""
        self._tim_controller = controller
        restore_controller_state(self, self._tim_controller)
        self._tim_stored = self.param_groups[0].get(CONTROLLER_STATE_KEY)
        self.set_lr_scale(self._tim_controller.scale)

    def tim_deconfigure(self) -> None:
        """Drop the controller: ``step()`` is the torch class's again (scale 1.0). A stored controller state
        stays in ``param_groups[0]`` for a later ``tim_configure`` to pick up."""
        self._tim_controller = None
        self._tim_length = None
        self.set_lr_scale(1.0)

    def tim_observe_length(self, mean_response_length: float) -> None:
        """The mean response length of the mini-batch this step trains on (already all-reduced over DP)."""
        self._tim_length = float(mean_response_length)

    @property
    def tim_controller(self) -> LengthTriggeredLRDecay | None:
        return self._tim_controller

    # -- torch.optim.Optimizer ------------------------------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        ctrl = self._tim_controller
        if ctrl is not None:
            stored = self.param_groups[0].get(CONTROLLER_STATE_KEY)
            if stored is not None and stored is not self._tim_stored:
                # a checkpoint was loaded into the param groups (by any load path): continue from it
                restore_controller_state(self, ctrl)
            length = self._tim_length if self._tim_length is not None else math.nan
            self.set_lr_scale(ctrl.observe(None, length))  # NaN is counted as skipped, never raised
            self._tim_length = None
            store_controller_state(self, ctrl)
            self._tim_stored = self.param_groups[0][CONTROLLER_STATE_KEY]
        return super().step(closure)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self._tim_controller is not None:
            restore_controller_state(self, self._tim_controller)
            self._tim_stored = self.param_groups[0].get(CONTROLLER_STATE_KEY)


def _make(cls: type) -> type:
    base = scaled_optimizer_class(cls)
    return type(cls.__name__, (TIMLRDecayMixin, base), {
        "__module__": __name__,
        "__doc__": f"torch.optim.{cls.__name__} with the tim LR decay applied inside step().",
    })


AdamW = _make(torch.optim.AdamW)
Adam = _make(torch.optim.Adam)
SGD = _make(torch.optim.SGD)
