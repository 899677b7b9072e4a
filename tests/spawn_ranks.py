"""``target(rank, world, port, queue)`` in ``world`` spawned processes (a gloo group on a free port, CPU): what each
put on the queue, by rank. The distributed tests compare such a merge with one process that made every rank's calls."""

from __future__ import annotations

import torch.multiprocessing as mp
from free_port import free_port

__all__ = ["spawn_ranks"]


def spawn_ranks(target, world: int = 2, timeout: float = 120) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted([queue.get(timeout=timeout) for _ in procs], key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise AssertionError(f"rank process {p.name} exited with {p.exitcode}")
    return results
