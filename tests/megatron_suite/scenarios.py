"""What one rank runs for the Megatron suite's tests: each function builds verl's Megatron engines with the harness,
drives them like verl's worker and returns plain tensors and numbers (the test compares them). Run in the pytest
process (TP1, one rank) or by ``ranks.py`` in two processes (TP2, DP2).
"""

from __future__ import annotations

import torch

import harness as H

__all__ = ["LR", "LR_OPTIONS", "MONITOR", "dp_monitor", "lr_decay", "mean_length", "stock_vs_tim"]

MONITOR = {"monitor": {"enable": True}}
TRAIN_SEEDS = (1, 2)  # one optimizer step on each batch
MONITOR_SEED = 3
LR = 1e-3
# as tests/verl_suite/test_verl_lr_decay.py: two short batches set the baseline, a long one triggers one decay
LR_OPTIONS = {"warmup_steps": 2, "window": 1, "patience": 1, "margin": 0.25, "cooldown": 0,
              "decay_factor": 0.5, "min_lr_ratio": 0.1, "baseline_ema": 0.01}
LR_BATCHES = ((4, 2), (4, 2), (12, 3))  # (response length, seed)


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


def mean_length(raw) -> float:
    """What the engine hands the controller: the batch's mean response length (the DP mean over equal halves)."""
    return raw["response_mask"].sum().item() / raw["response_mask"].shape[0]


def _lr_config():
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    return TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": LR_OPTIONS}})


def lr_decay(model_path: str, *, tp: int, ckpt_dir: str | None = None) -> dict:
    """The LR decay through verl's Megatron optimizer and scheduler (constant schedule): the LR each step returns
    (actor/lr), every param group's LR, the controller's state and metrics after three steps (short, short, long).
    With ``ckpt_dir``: verl's checkpoint save, a fresh engine that loads it (configured before the load, as verl's
    worker is), and one more step on both."""
    def engine():
        return H.build_engine(model_path, tp=tp, lr=LR, optim_overrides={"lr_decay_style": "constant"})

    ours = engine()
    ours.tim_configure(_lr_config())
    batches = [H.make_batch(H.VOCAB, batch=4, response=r, seed=s) for r, s in LR_BATCHES]
    lrs = []
    for td, _ in batches:
        lrs.append(H.train_step(ours, td, H.old_log_probs_padded(H.infer(ours, td), td))[1])
    result = {"lrs": lrs, "lengths": [mean_length(raw) for _, raw in batches],
              "group_lrs": [float(g["lr"]) for g in ours.optimizer.param_groups],
              "state": ours._tim_lr_controller.state_dict(), "metrics": ours.tim_pop_metrics(),
              "holds": ours._tim_holds_outputs()}
    if ckpt_dir is not None:
        ours.save_checkpoint(ckpt_dir, global_step=3)
        fresh = engine()
        # a torch Adam that never stepped has no state for Megatron's distributed optimizer to load into
        # (megatron/core/optimizer/distrib_optimizer.py:839 asserts one 'step' per param): one stock step first
        td, _ = batches[0]
        H.train_step(fresh, td, H.old_log_probs_padded(H.infer(fresh, td), td))
        fresh.tim_configure(_lr_config())
        fresh.load_checkpoint(ckpt_dir, del_local_after_load=False)
        result["loaded_state"] = fresh.optimizer.param_groups[0].get("tim_lr_controller")
        after = []
        for eng in (fresh, ours):
            after.append(H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))[1])
        result["after_lrs"] = after
        result["after_states"] = [e._tim_lr_controller.state_dict() for e in (fresh, ours)]
        fresh.tim_deconfigure()
    ours.tim_deconfigure()
    _, result["stock_lr"] = H.train_step(ours, td := batches[0][0], H.old_log_probs_padded(H.infer(ours, td), td))
    result["stock_group_lrs"] = [float(g["lr"]) for g in ours.optimizer.param_groups]
    return result


def reset_parallel_state() -> None:
    """Megatron's model-parallel groups are process-global: torn down between scenarios of another layout."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
