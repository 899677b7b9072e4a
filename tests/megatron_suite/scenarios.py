"""What one rank runs for the Megatron suite's tests: each function builds verl's Megatron engines with the harness,
drives them like verl's worker and returns plain tensors and numbers (the test compares them). Run in the pytest
process (TP1, one rank) or by ``ranks.py`` in two processes (TP2, DP2).
"""

from __future__ import annotations

import torch

import harness as H

__all__ = ["MONITOR", "stock_vs_tim", "dp_monitor"]

MONITOR = {"monitor": {"enable": True}}
TRAIN_SEEDS = (1, 2)  # one optimizer step on each batch
MONITOR_SEED = 3


def _run(engine, seeds) -> dict:
    """Two PPO steps: per step the old log-probs, verl's per-micro-batch pg_loss, the grad norm (verl reports it on the
    output-holding rank only) and the LR; then
    this rank's parameter shards."""
    steps = []
    for seed in seeds:
        td, _ = H.make_batch(H.VOCAB, batch=4, seed=seed)
        old = H.old_log_probs_padded(H.infer(engine, td), td)
        out, lr = H.train_step(engine, td, old)
        metrics = H.tensors_of(out)
        steps.append({"old": old, "pg_loss": metrics["actor/pg_loss"], "grad_norm": metrics.get("grad_norm"), "lr": lr})
    return {"steps": steps, "params": H.params_of(engine)}


def stock_vs_tim(model_path: str, *, tp: int, dump_dir: str) -> dict:
    """The engine verl's registry picks (ours) and verl's own ``MegatronEngineWithLMHead``, built alike from the same
    checkpoint, trained alike: two PPO steps each. Then ours with the monitor and the per-token dump (every sequence,
    to ``dump_dir``) on, on a third batch: its old log-probs (configured and not), its metrics, whether this rank
    holds Megatron's outputs, the batch's tensors, and the training pass's split."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from tim_plugins.integrations.verl.config import TIMVerlConfig

    result = {}
    engines = {}
    for name, cls in (("ours", None), ("stock", MegatronEngineWithLMHead)):
        engines[name] = H.build_engine(model_path, tp=tp, engine_cls=cls)
        result[name] = _run(engines[name], TRAIN_SEEDS)
        result[name]["class"] = type(engines[name]).__name__
    ours = engines["ours"]
    td, raw = H.make_batch(H.VOCAB, batch=4, seed=MONITOR_SEED)
    plain = H.old_log_probs_padded(H.infer(ours, td), td)
    ours.tim_configure(TIMVerlConfig.from_node({**MONITOR, "dump": {"dir": dump_dir, "sample_rate": 1.0}}))
    try:
        monitored = H.old_log_probs_padded(H.infer(ours, td), td)
        metrics = ours.tim_pop_metrics()
        # the training pass of the same batch: the split of log pi_theta - log pi_rollout (tim/staleness, tim/by_lag)
        out, _ = H.train_step(ours, td, monitored)
        split = ours.tim_pop_metrics()
    finally:
        ours.tim_deconfigure()
    result["monitor"] = {"plain": plain, "old": monitored, "metrics": metrics, "holds": ours._tim_holds_outputs(),
                         "rollout": raw["rollout_log_probs"], "mask": raw["response_mask"], "split": split,
                         "pg_loss": H.tensors_of(out)["actor/pg_loss"]}
    return result


def dp_monitor(model_path: str, *, rank: int, world: int) -> dict:
    """Data parallelism over ``world`` ranks (TP1): each rank infers its rows of one batch with the monitor on; the
    merged metrics, and this rank's rows' old log-probs, rollout log-probs and mask."""
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    engine = H.build_engine(model_path)
    batch = 4 * world
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    td, raw = H.make_batch(H.VOCAB, batch=batch, seed=MONITOR_SEED + 1, rows=rows)
    engine.tim_configure(TIMVerlConfig.from_node(MONITOR))
    try:
        old = H.old_log_probs_padded(H.infer(engine, td), td)
        metrics = engine.tim_pop_metrics()
    finally:
        engine.tim_deconfigure()
    return {"old": old, "metrics": metrics, "rollout": raw["rollout_log_probs"], "mask": raw["response_mask"],
            "dp_size": engine.get_data_parallel_size(), "holds": engine._tim_holds_outputs()}


def reset_parallel_state() -> None:
    """Megatron's model-parallel groups are process-global: torn down between scenarios of another layout."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
