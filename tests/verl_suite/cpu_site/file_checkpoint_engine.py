"""Test-only checkpoint engine (never shipped): verl's disaggregated weight sync on a CPU, through a file.

verl's own backends for a rollout on other workers than the actor (``nccl``, ``nixl``, ``hccl``, ``mooncake``) need
accelerators. This one registers ``tim_test_file`` in verl's ``CheckpointEngineRegistry`` through verl's documented
plug-in setting (``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=file_checkpoint_engine``, which
verl imports in every worker before it builds the backend) and moves the weights through a directory
(``checkpoint_engine.engine_kwargs.tim_test_file.dir``): the actor's first rank writes every tensor the actor engine
streams to one file per sync, each rollout worker reads it back and hands the tensors to verl's server adapter, which
loads them into its vLLM engine as with any backend. Every actor rank consumes the stream (the FSDP engine gathers
each tensor collectively).

With ``TIM_TEST_FILE_ENGINE_SKIP=<name prefix>`` set, the receiving side drops every tensor whose name starts with
the prefix (a transfer that loses a layer): the rollout keeps what that layer held (verl starts it on dummy weights).
``TIM_TEST_FILE_ENGINE_SKIP_FROM=<n>`` (default 0) starts dropping at the n-th sync: the syncs before it are whole, and
from it on the layer keeps the values the last whole sync loaded (a transfer that breaks during the run).

Syncs are numbered by each engine instance (one per worker, kept for the run): the n-th send of the actor and the
n-th receive of each rollout worker are the same sync.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

__all__ = ["BACKEND", "SKIP_ENV", "SKIP_FROM_ENV", "FileCheckpointEngine"]

BACKEND = "tim_test_file"
SKIP_ENV = "TIM_TEST_FILE_ENGINE_SKIP"
SKIP_FROM_ENV = "TIM_TEST_FILE_ENGINE_SKIP_FROM"
WAIT_S = 600.0


# verl.checkpoint_engine.base.CheckpointEngine: the abstract interface a backend implements
@CheckpointEngineRegistry.register(BACKEND)
class FileCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, dir: str, is_master: bool = False) -> None:  # noqa: A002 (verl's kwarg)
        self.bucket_size, self.dir = bucket_size, Path(dir)
        self.rank, self.sends, self.receives = None, 0, 0

    def prepare(self) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        return {"dir": str(self.dir)}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return ({"rank": list(range(actor_wg_world_size))},
                {"rank": list(range(actor_wg_world_size, actor_wg_world_size + rollout_world_size))})

    def init_process_group(self, rank: int, **kwargs) -> None:
        self.rank = rank

    def finalize(self) -> None:
        pass

    def _path(self, n: int) -> Path:
        return self.dir / f"sync{n}.pt"

    async def send_weights(self, weights, global_steps: int | None = None):
        n, self.sends = self.sends, self.sends + 1
        held = {}
        for name, tensor in weights:  # every rank consumes the stream; the first writes it
            if self.rank == 0:
                held[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            tmp = self._path(n).with_suffix(".tmp")
            torch.save(held, tmp)
            os.replace(tmp, self._path(n))  # whole or absent: a reader never sees half a file
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        n, self.receives = self.receives, self.receives + 1
        path, deadline = self._path(n), time.monotonic() + WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{BACKEND}: no weights at {path} after {WAIT_S:.0f} s")
            await asyncio.sleep(0.05)
        skip = os.environ.get(SKIP_ENV) or None
        if n < int(os.environ.get(SKIP_FROM_ENV) or 0):
            skip = None
        for name, tensor in torch.load(path, weights_only=True).items():
            if skip is None or not name.startswith(skip):
                yield name, tensor
