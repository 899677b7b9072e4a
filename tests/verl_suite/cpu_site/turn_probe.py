"""Test-only instrumentation (never shipped): with ``TIM_TEST_TURN_PROBE=<file.jsonl>`` set, verl's driver appends,
after each actor old-log-prob pass, the tensors verl itself stored for the step's batch: per sample the
``response_mask``, the rollout's ``rollout_log_probs`` (after ``inject_mismatch.py``'s shift when that is on as
well), the ``old_log_probs`` the actor just computed (what tim's monitor measures against the rollout), verl's
``num_turns`` and whether the sample is batch padding. One JSON line per global step.

It reads them through verl's TransferQueue calls as the trainer does (trainer/ppo/v1/trainer_base.py
``PPOTrainer._compute_old_log_prob`` writes ``old_log_probs``; ``_compute_metrics`` reads ``num_turns``), so it is
independent of tim's engine hooks and accumulators: the reference the multi-turn test recomputes the per-turn
mismatch from. Installed by ``sitecustomize.py`` through the CPU shims' after-import hook on verl's V1 trainer module,
chained after any hook already registered there (``inject_mismatch.py``), so it wraps outermost and reads the batch
after the pass.
"""

from __future__ import annotations

import json
import os

__all__ = ["ENV", "install"]

ENV = "TIM_TEST_TURN_PROBE"
MODULE = "verl.trainer.ppo.v1.trainer_base"
FIELDS = ["response_mask", "rollout_log_probs", "old_log_probs", "num_turns"]


def _rows(x) -> list[list[float]]:
    """A response field (nested jagged [B, j] or dense [B, R]) as one exact float list per sample."""
    if x.is_nested:
        return [t.double().tolist() for t in x.unbind()]
    return x.double().tolist()


def _wrap(module) -> None:
    path = os.environ[ENV]
    tq = module.tq
    original = module.PPOTrainer._compute_old_log_prob

    def _compute_old_log_prob(self, batch, metrics):
        out = original(self, batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        masks, rollout, train = (_rows(data[k]) for k in ("response_mask", "rollout_log_probs", "old_log_probs"))
        num_turns = data.pop("num_turns")  # as _compute_metrics reads it (a non-tensor field)
        num_turns = [int(v) for v in (num_turns.tolist() if hasattr(num_turns, "tolist") else num_turns)]
        padding = [bool((tag or {}).get("is_padding", False)) for tag in batch.tags]
        rows = [{"mask": [int(v) for v in m], "rollout": r, "train": t, "num_turns": n, "padding": p}
                for m, r, t, n, p in zip(masks, rollout, train, num_turns, padding, strict=True)]
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(self.global_steps), "rows": rows}) + "\n")
        return out

    module.PPOTrainer._compute_old_log_prob = _compute_old_log_prob


def install() -> None:
    """Register the hook (the CPU shims' after-import finder must be installed as well), after any hook already
    registered on the same module."""
    import cpu_shims

    previous = cpu_shims.HOOKS.get(MODULE)

    def hook(module) -> None:
        if previous is not None:
            previous(module)
        _wrap(module)

    cpu_shims.HOOKS[MODULE] = hook
