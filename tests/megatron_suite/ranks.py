"""One rank of the Megatron suite's two-process runs (``conftest.py`` ``two_ranks``): verl's Megatron engine with
world size 2 over gloo, first tensor-parallel (TP2: ``scenarios.stock_vs_tim``, ``scenarios.lr_decay``,
``scenarios.fused_safe_vocab`` without and with sequence parallelism, ``scenarios.replay``), then, each after
Megatron's parallel state is torn down, data-parallel (DP2, TP1: ``scenarios.dp_monitor``) and pipeline-parallel
(PP2, TP1: ``scenarios.stock_vs_tim``, ``scenarios.lr_decay``, ``scenarios.fused_safe_vocab``, ``scenarios.replay``),
and PP2 with two virtual stages per rank on the 4-layer model (``--model-vpp``: ``scenarios.stock_vs_tim``,
``scenarios.fused_safe_vocab``, ``scenarios.replay_fallback``), in the same processes (a Python 3.12 process with verl and megatron-core takes
~20 s to start on the 2-core machine).

    RANK=r WORLD_SIZE=2 MASTER_PORT=p python tests/megatron_suite/ranks.py --model DIR --model-vpp DIR --out DIR

Writes ``rank<r>.pt`` (``torch.save`` of ``{"tp2": ..., "tp2_lr": ..., "tp2_fused": ..., "tp2_fused_sp": ...,
"tp2_replay": ..., "dp2": ..., "pp2": ..., "pp2_lr": ..., "pp2_fused": ..., "pp2_replay": ..., "vpp": ...,
"vpp_fused": ..., "vpp_replay_fallback": ...}``) to ``--out``, and the TP2, PP2 and VPP runs' per-token dumps to ``--out``/dump_tp2, dump_pp2 and
dump_vpp. Started by the test, never collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "cpu_site")]

import megatron_shims  # noqa: E402

megatron_shims.install()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-vpp", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch

    import harness as H
    import scenarios

    torch.set_num_threads(1)
    H.init_dist(rank=rank, world=world, port=int(os.environ["MASTER_PORT"]))
    result = {"tp2": scenarios.stock_vs_tim(args.model, tp=world, dump_dir=os.path.join(args.out, "dump_tp2")),
              "tp2_lr": scenarios.lr_decay(args.model, tp=world),
              "tp2_fused": scenarios.fused_safe_vocab(args.model, tp=world),
              "tp2_fused_sp": scenarios.fused_safe_vocab(args.model, tp=world, sequence_parallel=True),
              "tp2_replay": scenarios.replay(args.model, tp=world)}
    scenarios.reset_parallel_state()
    result["dp2"] = scenarios.dp_monitor(args.model, rank=rank, world=world)
    scenarios.reset_parallel_state()
    result["pp2"] = scenarios.stock_vs_tim(args.model, tp=1, pp=world, dump_dir=os.path.join(args.out, "dump_pp2"))
    # the grad norm as an extra signal: verl reports it on the last stage only, so the first stage's controller sees
    # it only through the engine's sharing of the holders' decision and state
    # and through verl's Megatron checkpoint: each stage's param groups carry its own states
    result["pp2_lr"] = scenarios.lr_decay(args.model, tp=1, pp=world, signals=("grad_norm",),
                                          ckpt_dir=os.path.join(args.out, "ckpt_pp2", "global_step_3"))
    result["pp2_fused"] = scenarios.fused_safe_vocab(args.model, tp=1, pp=world)
    result["pp2_replay"] = scenarios.replay(args.model, tp=1, pp=world)
    scenarios.reset_parallel_state()
    result["vpp"] = scenarios.stock_vs_tim(args.model_vpp, tp=1, pp=world, vpp=2,
                                           dump_dir=os.path.join(args.out, "dump_vpp"))
    result["vpp_fused"] = scenarios.fused_safe_vocab(args.model_vpp, tp=1, pp=world, vpp=2)
    result["vpp_replay_fallback"] = scenarios.replay_fallback(args.model_vpp, tp=1, pp=world, vpp=2)
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
