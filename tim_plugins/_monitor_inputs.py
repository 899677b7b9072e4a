"""The monitor's API boundary: shape and type checks that raise, done once per micro-batch and cheaply.

Value problems (NaN, inf, placeholders) are not checked here: the pass counts them, it never raises.
"""

from __future__ import annotations

import torch

__all__ = ["check_inputs"]


def check_inputs(rollout, train, mask, is_weights):
    """Shape/type checks at the API boundary (raise); value problems are counted later, never raised."""
    if not isinstance(rollout, torch.Tensor) or not isinstance(train, torch.Tensor):
        raise TypeError(
            f"rollout_logprobs and train_logprobs must be torch.Tensor, got {type(rollout).__name__} and "
            f"{type(train).__name__}"
        )
    shape = rollout.shape
    if len(shape) == 1 and train.dim() == 1:  # one sequence
        rollout, train = rollout.unsqueeze(0), train.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
        is_weights = None if is_weights is None else is_weights.reshape(1, -1)
        shape = rollout.shape
    if len(shape) != 2 or train.shape != shape:
        raise ValueError(
            f"rollout_logprobs {tuple(shape)} and train_logprobs {tuple(train.shape)} must both have "
            "shape [B, T] (batch, response tokens)."
        )
    if mask is None:
        mask = torch.ones(shape, dtype=torch.bool, device=rollout.device)
    elif mask.shape != shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the log-probs' shape {tuple(shape)}.")
    if is_weights is not None and is_weights.shape != shape:
        raise ValueError(
            f"is_weights {tuple(is_weights.shape)} must have the log-probs' shape {tuple(shape)}."
        )
    if not rollout.is_floating_point() or not train.is_floating_point():
        raise TypeError(f"log-probs must be floating point, got {rollout.dtype} and {train.dtype}")
    # Half-precision inputs are upcast inside the fused pass (statistics are always computed in >= fp32), and
    # any mask dtype is read there as "non-zero = response token": no conversion copies here.
    # Statistics never need autograd; detach and move only when needed (this runs at every micro-batch).
    device = rollout.device
    if rollout.requires_grad:
        rollout = rollout.detach()
    if train.requires_grad:
        train = train.detach()
    if train.device != device:
        train = train.to(device)
    if mask.device != device:
        mask = mask.to(device)
    if is_weights is not None:
        is_weights = is_weights.detach().to(device)
    return rollout, train, mask, is_weights
