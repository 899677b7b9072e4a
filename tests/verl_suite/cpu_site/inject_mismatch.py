"""Test-only instrumentation (never shipped), for the main_ppo run with an injected mismatch: with
``TIM_TEST_INJECT_MISMATCH=<from_step>:<delta>`` set, verl's driver shifts the rollout's log-probs of every response
token by +delta and -delta alternately (token by token over the batch) from global step ``from_step`` on, before the
actor's old-log-prob pass reads them. Both verl's own metrics (``rollout_corr/*``, computed by the driver from the
same stored ``rollout_log_probs``) and tim's monitor (inside the actor workers) see the shifted values, so the run
has a mismatch of known size that starts at a known step: k3 = E[exp(d) - 1 - d] with d = ±delta (plus the fp32
noise of the run), i.e. between exp(-delta) - 1 + delta and exp(delta) - 1 - delta.

Installed by ``sitecustomize.py`` through the CPU shims' after-import hook on verl's V1 trainer module; it reads and
writes the batch through verl's TransferQueue calls, as the trainer does (trainer/ppo/v1/trainer_base.py
``PPOTrainer._compute_old_log_prob``, bypass branch).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "install", "parse"]

ENV = "TIM_TEST_INJECT_MISMATCH"
MODULE = "verl.trainer.ppo.v1.trainer_base"


def parse(value: str) -> tuple[int, float]:
    """``"<from_step>:<delta>"`` -> (from_step, delta)."""
    step, _, delta = value.partition(":")
    return int(step), float(delta)


def _alternating(n: int, delta: float, dtype, device):
    import torch

    signs = 1.0 - 2.0 * (torch.arange(n, device=device) % 2)
    return (delta * signs).to(dtype)


def _inject(module) -> None:
    import torch

    from_step, delta = parse(os.environ[ENV])
    tq = module.tq
    original = module.PPOTrainer._compute_old_log_prob

    def _compute_old_log_prob(self, batch, metrics):
        if self.global_steps >= from_step:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["rollout_log_probs"])
            x = data["rollout_log_probs"]
            if x.is_nested:
                values = x.values()
                shifted = torch.nested.nested_tensor_from_jagged(
                    values + _alternating(values.numel(), delta, values.dtype, values.device), x.offsets())
            else:
                shifted = x + _alternating(x.numel(), delta, x.dtype, x.device).view_as(x)
            data["rollout_log_probs"] = shifted
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data)
        return original(self, batch, metrics)

    module.PPOTrainer._compute_old_log_prob = _compute_old_log_prob


def install() -> None:
    """Register the hook (the CPU shims' after-import finder must be installed as well)."""
    import cpu_shims

    cpu_shims.HOOKS[MODULE] = _inject
