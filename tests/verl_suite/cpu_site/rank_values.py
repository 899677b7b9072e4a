"""Test-only instrumentation (never shipped), for the two-rank main_ppo test: with ``TIM_TEST_RANK_VALUES_DIR`` set,
every process that runs the per-step pipeline appends, at each merge (``StepPipeline.compute``), its own unmerged
statistics and the merged ones to ``<dir>/rank_values-<pid>.jsonl``: the per-rank values the logged (merged) ones
must differ from, read where nothing else can see them (inside verl's Ray workers).

Installed by ``sitecustomize.py`` through the CPU shims' after-import hook, so ``tim_plugins.pipeline`` is patched
right after it is first imported and nothing is imported early.
"""

from __future__ import annotations

import json
import os

__all__ = ["ENV", "install"]

ENV = "TIM_TEST_RANK_VALUES_DIR"
MODULE = "tim_plugins.pipeline"


def _record(module) -> None:
    import torch

    original = module.StepPipeline.compute

    def compute(self, step, *, sync=True, group=None, **options):
        local = {}
        for part in (self.monitor, self.safe_vocab_stats, self.correction_stats):
            if part is not None:
                local.update(part.compute(sync=False))
        out = original(self, step, sync=sync, group=group, **options)
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        record = {"pid": os.getpid(), "rank": torch.distributed.get_rank() if dist else 0,
                  "group_rank": torch.distributed.get_rank(group) if dist else 0,
                  "group_size": torch.distributed.get_world_size(group) if dist else 1, "sync": sync,
                  "local": local, "merged": out[0]}
        path = os.path.join(os.environ[ENV], f"rank_values-{os.getpid()}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    module.StepPipeline.compute = compute


def install() -> None:
    """Register the hook (the CPU shims' after-import finder must be installed as well)."""
    import cpu_shims

    cpu_shims.HOOKS[MODULE] = _record
