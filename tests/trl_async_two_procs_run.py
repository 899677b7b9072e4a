"""One rank of tests/test_trl_async_two_procs.py: TRL's AsyncGRPOTrainer on the toy model, CPU, launched twice by
``torch.distributed.run`` (gloo), with the stand-in engine of tests/async_standin.py on the main process (TRL keeps
the rollout worker, its queue and ``model_version`` there) and TIMCallback on both.

Run by the test (bounded, in its own process group), never collected by pytest. Each rank writes
``rank_<r>.json`` to ``--out``: its ``trainer.state.log_history``; per loss call, the optimizer step and each
trained sample's rollout log-probs (float32, hex: the sample's key); per logging window, this rank's own ``tim/by_lag``
statistics read unmerged (``compute(sync=False)``) just before the callback merges them; the main process also
writes every sample it generated (key -> policy version) and the step each version was synced at.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)

    import numpy as np
    import torch.distributed as dist
    from async_standin import install_cpu_shims, make_trainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig

    install_cpu_shims()
    trainer, engine = make_trainer(args.model, out / "trainer", args.steps)
    rank = trainer.accelerator.process_index

    passes, original = [], trainer.compute_loss

    def compute_loss(model, inputs, *a, **k):
        sel = inputs["token_index"] >= 0
        segment, old = inputs["segment_id"][sel], inputs["old_log_probs"][sel]
        passes.append({"step": trainer.state.global_step,
                       "samples": [np.asarray(old[segment == s].numpy(), dtype=np.float32).tobytes().hex()
                                   for s in segment.unique().tolist()]})
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, parity_audit=False, sync_check=False))
    trainer.add_callback(cb)
    local: list[dict] = []
    pipeline, compute = cb.pipeline, cb.pipeline.compute

    def _compute(step, **k):
        local.append({"step": step, "values": pipeline.by_lag.compute(sync=False)})
        return compute(step, **k)

    pipeline.compute = _compute
    t1 = time.time()
    trainer.train()
    result = {"rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
              "log_history": trainer.state.log_history, "passes": passes, "local": local,
              "diag": dict(cb.pipeline.diag), "init_s": t1 - t0, "train_s": time.time() - t1,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if rank == 0:
        result["samples"] = {np.asarray(s["engine"][s["mask"]].numpy(), dtype=np.float32).tobytes().hex(): s["version"]
                             for s in engine.samples}
        result["synced_at"] = engine.synced_at
    (out / f"rank_{rank}.json").write_text(json.dumps(result, default=float))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
