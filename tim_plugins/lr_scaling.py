"""Apply an LR scale (from :class:`~tim_plugins.lr_control.LengthTriggeredLRDecay`) to a torch optimizer.

Two ways, for two kinds of framework:

1. :func:`apply_lr_scale` — for trainers that let you touch the optimizer and scheduler between steps (TRL /
   transformers callbacks). A ``LambdaLR``-style scheduler recomputes every param group's LR from its
   ``base_lrs`` at each ``scheduler.step()``, so editing ``param_groups[i]["lr"]`` alone lasts one step. We
   scale what the scheduler reads (``base_lrs`` and the scheduler's other absolute LR attributes), the current
   param-group LRs, and the scheduler's ``_last_lr`` (what trainers log), so the framework's own LR logging
   shows the decayed value. The helper stores the scale it has applied in every param group
   (``"tim_lr_applied_scale"``, saved by ``optimizer.state_dict()``) and multiplies each group only by the ratio
   new/applied of that group: calling it twice with the same scale changes nothing, and a group added since the
   last call (``optimizer.add_param_group``, its LR the unscaled one) is brought to the scale by the next call.

2. :class:`ScaledLROptimizerMixin` — for frameworks that own the LR schedule and overwrite outside edits
   (verl builds the optimizer from ``optim.optimizer_impl`` / ``optim.optimizer``). The optimizer multiplies
   each group's LR by ``group["tim_lr_scale"]`` just for the duration of ``step()`` and restores it afterwards,
   so the scheduler never sees the scaled value. The scale lives in the param groups, hence in the
   optimizer's checkpoint. The classes users configure are verl's adapter's
   (``optimizer_impl=tim_plugins.integrations.verl.optim optimizer=AdamW``), built on this mixin through
   :func:`scaled_optimizer_class`. Logged LRs (``actor/lr``) then show the unscaled schedule: log
   ``tim/lr/scale`` next to it.

:func:`store_controller_state` / :func:`restore_controller_state` keep a controller's ``state_dict()`` in the
optimizer's first param group, so any checkpointing that saves the optimizer saves the controller too;
:class:`ControllerCheckpoint` is the one rule that keeps a live controller and that stored state in step (verl's
FSDP optimizers and its Megatron engine use it; under another ``key``, verl's engines carry the cause tracker's state
the same way).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

__all__ = [
    "APPLIED_SCALE_KEY",
    "LR_SCALE_KEY",
    "CONTROLLER_STATE_KEY",
    "ControllerCheckpoint",
    "apply_lr_scale",
    "get_applied_lr_scale",
    "ScaledLROptimizerMixin",
    "scaled_optimizer_class",
    "store_controller_state",
    "restore_controller_state",
]

APPLIED_SCALE_KEY = "tim_lr_applied_scale"
LR_SCALE_KEY = "tim_lr_scale"
CONTROLLER_STATE_KEY = "tim_lr_controller"

# Absolute LR values a scheduler keeps and reuses (scaled together with base_lrs). Relative quantities
# (lambdas, gamma, factors) need no change. eta_min: CosineAnnealingLR / CosineAnnealingWarmRestarts;
# max_lrs: CyclicLR (and transformers' GreedyLR); min_lrs: ReduceLROnPlateau (and GreedyLR); _init_lrs: GreedyLR,
# which resets the groups to it at the end of a plateau; _last_lr: what get_last_lr() returns (trainers log it).
_SCHEDULER_LIST_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "_init_lrs", "_last_lr")
_SCHEDULER_SCALAR_ATTRS = ("eta_min",)
# Absolute LR values kept in param groups: initial_lr (any LRScheduler, read when a scheduler is rebuilt),
# max_lr / min_lr (OneCycleLR).
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def _check_scale(scale: float, where: str) -> float:
    s = float(scale)
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"{where}: scale={scale!r} must be a finite number > 0 (1.0 = the scheduled LR).")
    return s


def _mul(value: Any, ratio: float) -> Any:
    # Out of place: a scheduler's base_lrs may alias the param groups' initial_lr objects (tensor LRs).
    return value * ratio


def _group_scale(group: dict) -> float:
    # a group apply_lr_scale has not seen yet (added since its last call) runs at its own, unscaled LR
    return float(group.get(APPLIED_SCALE_KEY, 1.0))


def get_applied_lr_scale(optimizer: torch.optim.Optimizer) -> float:
    """The scale :func:`apply_lr_scale` has applied to ``optimizer`` so far (1.0 if never): the first param
    group's; every group's after a call (a group added since then is at 1.0 until the next call)."""
    return _group_scale(optimizer.param_groups[0])


def _scale_scheduler(scheduler: Any, ratios: list[float], seen: set[int]) -> None:
    """Multiply the scheduler's per-group LR lists entry i by ``ratios[i]`` (the ratio of param group i) and its
    scalar LRs, shared by all groups, by the first group's ratio."""
    if scheduler is None or id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    for attr in _SCHEDULER_LIST_ATTRS:
        values = getattr(scheduler, attr, None)
        if isinstance(values, (list, tuple)):
            setattr(scheduler, attr, type(values)(
                _mul(v, ratios[i] if i < len(ratios) else ratios[0]) for i, v in enumerate(values)))
    for attr in _SCHEDULER_SCALAR_ATTRS:
        value = getattr(scheduler, attr, None)
        if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            setattr(scheduler, attr, _mul(value, ratios[0]))
    for child in getattr(scheduler, "_schedulers", ()) or ():  # SequentialLR, ChainedScheduler
        _scale_scheduler(child, ratios, seen)
    inner = getattr(scheduler, "scheduler", None)  # wrappers: accelerate's AcceleratedScheduler
    if inner is not None and not isinstance(inner, (int, float, str)):
        _scale_scheduler(inner, ratios, seen)


def apply_lr_scale(optimizer: torch.optim.Optimizer, scale: float, scheduler: Any = None) -> float:
    """Make the optimizer run at ``scale`` × the LR its scheduler would give, from now on.

    Multiplies each param group's ``lr`` / ``initial_lr`` / ``max_lr`` / ``min_lr`` by its ratio = scale / applied
    (applied = the group's scale set by a previous call, 1.0 for a group no call has seen: at first, or added
    since with ``optimizer.add_param_group``); and, when ``scheduler`` is given, its ``base_lrs``, ``max_lrs``,
    ``min_lrs``, ``_last_lr`` (entry i by group i's ratio), ``eta_min`` (by the first group's) (and those of its
    sub-schedulers and of a wrapped ``.scheduler``, e.g. accelerate's ``AcceleratedScheduler``).
    For a schedule lr_t = f(base_lr, t) that is linear in the absolute LRs (LambdaLR, cosine with warm-up,
    CosineAnnealingLR, StepLR, ...), every later LR equals scale × the unscaled schedule's LR (up to float
    rounding of one extra multiplication).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (or a wrapper exposing ``param_groups``).
        scale: the total scale wanted (> 0), e.g. ``controller.scale``.
        scheduler: the LR scheduler attached to ``optimizer`` (None for a constant LR).

    Returns:
        The ratio multiplied into the first param group (1.0 when ``scale`` was already applied to it).
    """
    s = _check_scale(scale, "apply_lr_scale")
    ratios = [s / _group_scale(group) for group in optimizer.param_groups]
    if all(r == 1.0 for r in ratios):
        return 1.0
    for group, ratio in zip(optimizer.param_groups, ratios):
        if ratio != 1.0:
            for key in _GROUP_KEYS:
                if key in group and group[key] is not None:
                    group[key] = _mul(group[key], ratio)
        group[APPLIED_SCALE_KEY] = s
    _scale_scheduler(scheduler, ratios, set())
    return ratios[0]


class ScaledLROptimizerMixin:
    """Mix in *before* a ``torch.optim.Optimizer`` class: ``class C(ScaledLROptimizerMixin, torch.optim.AdamW)``.

    ``step()`` runs with ``lr × group["tim_lr_scale"]`` and then restores each group's LR object exactly, so
    a scheduler that rewrites LRs every step (verl's LambdaLR) keeps working on unscaled values and the
    effective LR is scale × schedule. The scale is stored per param group and travels with
    ``optimizer.state_dict()``. Accepts ``lr_scale=`` at construction (default 1.0).
    """

    def __init__(self, *args: Any, lr_scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = _check_scale(lr_scale, f"{type(self).__name__}(lr_scale=...)")
        self.defaults[LR_SCALE_KEY] = s
        for group in self.param_groups:
            group.setdefault(LR_SCALE_KEY, s)

    @property
    def lr_scale(self) -> float:
        return float(self.param_groups[0].get(LR_SCALE_KEY, 1.0))

    def add_param_group(self, param_group: dict) -> None:
        # A group added after construction runs at the scale in force (the one set_lr_scale / a loaded state put in
        # the groups), not the construction-time default torch would fill in; during construction the defaults
        # have no scale yet and __init__ sets it.
        if LR_SCALE_KEY in self.defaults and self.param_groups and LR_SCALE_KEY not in param_group:
            param_group[LR_SCALE_KEY] = self.lr_scale  # in the caller's dict, as torch fills in its defaults
        super().add_param_group(param_group)  # type: ignore[misc]

    def set_lr_scale(self, scale: float) -> None:
        """Set the scale used by the following ``step()`` calls (all param groups)."""
        s = _check_scale(scale, f"{type(self).__name__}.set_lr_scale")
        for group in self.param_groups:
            group[LR_SCALE_KEY] = s

    def step(self, closure: Any = None) -> Any:
        saved = []
        for group in self.param_groups:
            lr = group["lr"]
            saved.append(lr)
            s = float(group.get(LR_SCALE_KEY, 1.0))
            if s != 1.0:
                # lr_eff = lr_scheduled · s; a new object, so the scheduler's value is untouched
                group["lr"] = lr * s if not isinstance(lr, torch.Tensor) else lr.mul(s)
        try:
            return super().step(closure)  # type: ignore[misc]
        finally:
            for group, lr in zip(self.param_groups, saved):
                group["lr"] = lr


_SCALED_CLASSES: dict[type, type] = {}


def scaled_optimizer_class(optimizer_cls: type) -> type:
    """Return (and cache) ``Scaled<Name>``: ``optimizer_cls`` with :class:`ScaledLROptimizerMixin` mixed in."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"scaled_optimizer_class needs a torch.optim.Optimizer subclass, got {optimizer_cls!r}.")
    if issubclass(optimizer_cls, ScaledLROptimizerMixin):
        return optimizer_cls
    if optimizer_cls not in _SCALED_CLASSES:
        _SCALED_CLASSES[optimizer_cls] = type(
            f"Scaled{optimizer_cls.__name__}", (ScaledLROptimizerMixin, optimizer_cls),
            {"__module__": __name__, "__doc__": f"{optimizer_cls.__name__} whose step() applies a LR scale."})
    return _SCALED_CLASSES[optimizer_cls]


def store_controller_state(optimizer: torch.optim.Optimizer, controller: Any, key: str = CONTROLLER_STATE_KEY) -> None:
    """Keep ``controller.state_dict()`` in ``optimizer.param_groups[0][key]`` so optimizer checkpoints carry it."""
    optimizer.param_groups[0][key] = controller.state_dict()


def restore_controller_state(optimizer: torch.optim.Optimizer, controller: Any,
                             key: str = CONTROLLER_STATE_KEY) -> bool:
    """Load the state stored by :func:`store_controller_state` (after ``optimizer.load_state_dict``).
    Returns False, changing nothing, when the optimizer holds none (a fresh run)."""
    state = optimizer.param_groups[0].get(key)
    if state is None:
        return False
    controller.load_state_dict(copy.deepcopy(state))
    return True


class ControllerCheckpoint:
    """A live LR controller (or any object with ``state_dict`` / ``load_state_dict``) kept in step with its state in
    ``optimizer.param_groups[0][key]``, which the framework's own optimizer checkpoint saves and restores. The rule:

    - ``attach``: continue from a state loaded before the controller was attached (a resumed run);
    - ``sync``, before the controller is fed: continue from a state loaded since the last ``store``, by whatever
      path the framework loads it (the stored object is then not the one written last);
    - ``store``, after each decision: the controller's state goes where the next checkpoint saves it.

    ``detach`` drops the controller; the stored state stays in the param group for a later ``attach``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, controller: Any, key: str = CONTROLLER_STATE_KEY) -> None:
        self.optimizer, self.controller, self.key = optimizer, controller, key
        restore_controller_state(optimizer, controller, key)
        self._stored = optimizer.param_groups[0].get(key)

    def detach(self) -> None:
        self.controller = None

    def sync(self) -> None:
        stored = self.optimizer.param_groups[0].get(self.key)
        if self.controller is not None and stored is not None and stored is not self._stored:
            restore_controller_state(self.optimizer, self.controller, self.key)
            self._stored = stored

    def store(self) -> None:
        if self.controller is not None:
            store_controller_state(self.optimizer, self.controller, self.key)
            self._stored = self.optimizer.param_groups[0][self.key]
