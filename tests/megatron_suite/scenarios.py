"""What one rank runs for the Megatron suite's tests: each function builds verl's Megatron engines with the harness,
drives them like verl's worker and returns plain tensors and numbers (the test compares them). Run in the pytest
process (TP1, one rank) or by ``ranks.py`` in two processes (TP2, DP2, PP2, PP2 with virtual stages).
"""

from __future__ import annotations

import torch

import harness as H

__all__ = ["LR", "LR_OPTIONS", "MONITOR", "SAFE_CASES", "dp_monitor", "fused_safe_vocab", "kept_sets", "lr_decay",
           "mean_length", "replay", "safe_vocab", "stock_vs_tim"]

MONITOR = {"monitor": {"enable": True}}
TRAIN_SEEDS = (1, 2)  # one optimizer step on each batch
MONITOR_SEED = 3
LR = 1e-3
# as tests/verl_suite/test_verl_lr_decay.py: two short batches set the baseline, a long one triggers one decay
LR_OPTIONS = {"warmup_steps": 2, "window": 1, "patience": 1, "margin": 0.25, "cooldown": 0,
              "decay_factor": 0.5, "min_lr_ratio": 0.1, "baseline_ema": 0.01}
LR_BATCHES = ((4, 2), (4, 2), (12, 3))  # (response length, seed)
# the safe vocabulary's cases: name -> (tim.safe_vocab, the rollout's top-k / top-p as the driver hands them over)
SAFE_CASES = {"min_p": ({"min_p": 0.1}, {}), "top_k_top_p": ({"min_p": 0.001}, {"top_k": 20, "top_p": 0.8})}
SAFE_SEED = 5
SAFE_TEMPERATURE = 0.7


def _run(engine, seeds) -> dict:
    """Two PPO steps: per step the old log-probs, verl's per-micro-batch pg_loss (None before the last pipeline
    stage), the grad norm (verl reports it on the output-holding rank only) and the LR; then this rank's parameter
    shards."""
    steps = []
    for seed in seeds:
        td, _ = H.make_batch(H.VOCAB, batch=4, seed=seed)
        old = H.old_log_probs_padded(H.infer(engine, td), td)
        out, lr = H.train_step(engine, td, old)
        metrics = H.tensors_of(out)
        # verl's loss runs on the last pipeline stage only: a stage before it has no pg_loss
        steps.append({"old": old, "pg_loss": metrics.get("actor/pg_loss"), "grad_norm": metrics.get("grad_norm"),
                      "lr": lr})
    return {"steps": steps, "params": H.params_of(engine)}


def stock_vs_tim(model_path: str, *, tp: int, dump_dir: str, pp: int = 1, vpp: int | None = None) -> dict:
    """The engine verl's registry picks (ours) and verl's own ``MegatronEngineWithLMHead``, built alike from the same
    checkpoint, trained alike: two PPO steps each. Then ours with the monitor and the per-token dump (every sequence,
    to ``dump_dir``) on, on a third batch: its old log-probs (configured and not), its metrics, whether this rank
    holds Megatron's outputs, its report to the driver, the batch's tensors, and the training pass's split."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from tim_plugins.integrations.verl.config import TIMVerlConfig

    result = {}
    engines = {}
    for name, cls in (("ours", None), ("stock", MegatronEngineWithLMHead)):
        engines[name] = H.build_engine(model_path, tp=tp, pp=pp, vpp=vpp, engine_cls=cls)
        result[name] = _run(engines[name], TRAIN_SEEDS)
        result[name]["class"] = type(engines[name]).__name__
    ours = engines["ours"]
    td, raw = H.make_batch(H.VOCAB, batch=4, seed=MONITOR_SEED)
    plain = H.old_log_probs_padded(H.infer(ours, td), td)
    ours.tim_configure(TIMVerlConfig.from_node({**MONITOR, "dump": {"dir": dump_dir, "sample_rate": 1.0}}))
    try:
        monitored = H.old_log_probs_padded(H.infer(ours, td), td)
        report = ours.tim_report()  # what the worker hands verl's driver (its tim_pop_metrics)
        metrics = report["metrics"]
        # the training pass of the same batch: the split of log pi_theta - log pi_rollout (tim/staleness, tim/by_lag)
        out, _ = H.train_step(ours, td, monitored)
        split = ours.tim_pop_metrics()
    finally:
        ours.tim_deconfigure()
    result["monitor"] = {"plain": plain, "old": monitored, "metrics": metrics, "report": report,
                         "holds": ours._tim_holds_outputs(),
                         "rollout": raw["rollout_log_probs"], "mask": raw["response_mask"], "split": split,
                         "pg_loss": H.tensors_of(out).get("actor/pg_loss")}
    result["safe_vocab"] = safe_vocab(ours)  # the same engine (no second build): its weights are whatever they are
    return result


def _record_processor(engine) -> list:
    """A test-only wrapper of the engine's logits processor (an instance attribute over the class's method, which
    verl's forward_step binds per micro-batch): after each call, the call's logits as the processor scaled them (in
    place, as verl does) with the tensor-parallel shards all_gathered, its labels, and where the micro-batch's
    response tokens sit among the [b, S] positions (verl's own ``no_padding_2_padding`` of the position indices)."""
    from megatron.core import parallel_state as mpu
    from verl.workers.utils.padding import no_padding_2_padding

    from tim_plugins.integrations.verl.micro_batch import padded_response

    records = []
    method = engine._lm_head_logits_processor

    def recorded(logits, label, temperature, **kwargs):
        out = method(logits, label, temperature, **kwargs)
        scaled = logits.detach().float()
        group = mpu.get_tensor_model_parallel_group()
        world = torch.distributed.get_world_size(group)
        if world > 1:
            parts = [torch.empty_like(scaled) for _ in range(world)]
            torch.distributed.all_gather(parts, scaled.contiguous(), group=group)
            scaled = torch.cat(parts, dim=-1)
        batch = kwargs["batch"]
        rows, seq = label.shape[:2]
        lengths = batch["input_ids"].offsets().diff().tolist()
        flat = torch.cat([i * seq + torch.arange(n) for i, n in enumerate(lengths)]).float()
        cells = no_padding_2_padding(flat, batch).long()
        mask = padded_response(batch["response_mask"], cells.shape[1]).bool()
        records.append({"logits": scaled.reshape(rows * seq, -1), "label": label.reshape(-1).clone(),
                        "cells": cells, "mask": mask})
        return out

    engine._lm_head_logits_processor = recorded
    return records


def _loss_recorder(seen: list):
    """verl's loss wrapped to record what it is called with: the response mask it aggregates over and the
    log-probs (both [b, R], as ppo_loss lays them out)."""
    from verl.workers.utils.padding import no_padding_2_padding

    from tim_plugins.integrations.verl.micro_batch import padded_response

    def wrap(loss_fn):
        def call(model_output, data, dp_group=None):
            log_probs = no_padding_2_padding(model_output["log_probs"], data).detach()
            seen.append({"mask": padded_response(data["response_mask"], log_probs.shape[1]).bool(),
                         "log_probs": log_probs})
            return loss_fn(model_output=model_output, data=data, dp_group=dp_group)
        return call

    return wrap


def _entropy(inferred, td):
    """[B, R] entropy of an old-log-prob pass, or None on a pipeline stage before the last (no outputs there)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(inferred["model_output"]["entropy"], td) if "model_output" in inferred else None


def safe_vocab(engine) -> dict:
    """The safe vocabulary on ``engine`` for each of ``SAFE_CASES``: the old-log-prob pass (log-probs, entropy,
    metrics) and one training step (what verl's loss was called with), with every call of the logits processor
    recorded (``_record_processor``) for the test's reference."""
    from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig

    records = _record_processor(engine)
    out = {}
    try:
        for name, (safe, sampler) in SAFE_CASES.items():
            td, raw = H.make_batch(H.VOCAB, batch=4, seed=SAFE_SEED, temperature=SAFE_TEMPERATURE)
            engine.tim_configure(TIMVerlConfig.from_node({**MONITOR, "safe_vocab": safe}),
                                 context=ActorContext(**sampler))
            try:
                records.clear()
                inferred = H.infer(engine, td)
                old = H.old_log_probs_padded(inferred, td)
                entropy = _entropy(inferred, td)
                metrics = engine.tim_pop_metrics()
                infer_records = list(records)
                records.clear()
                seen = []
                H.train_step(engine, td, old, loss_wrapper=_loss_recorder(seen))
                engine.tim_pop_metrics()
            finally:
                engine.tim_deconfigure()
            out[name] = {"old": old, "entropy": entropy, "metrics": metrics, "infer": infer_records,
                         "train": list(records), "loss": seen, "mask": raw["response_mask"],
                         "keys": sorted(inferred.get("model_output", {}).keys()),
                         "holds": engine._tim_holds_outputs()}
    finally:
        del engine._lm_head_logits_processor
    return out


def fused_safe_vocab(model_path: str, *, tp: int, sequence_parallel: bool = False, pp: int = 1,
                     vpp: int | None = None) -> dict:
    """The safe vocabulary with verl's fused kernels against the same without them, for each of ``SAFE_CASES``: two
    engines from one checkpoint, both in verl's packed thd layout (``remove_padding``: the same decoder numerics) and
    both with or without Megatron's ``sequence_parallel``, one with ``use_fused_kernels``; per engine the
    old-log-prob pass (log-probs, entropy, metrics) and one training step on the same batch and old log-probs (what
    verl's loss saw, verl's grad norm and pg_loss, this rank's parameter shards after the step), and the micro-batches
    the fused head computed (a test-only record around ``_FusedSafeHead.__call__``: the labels' shape and the
    hidden states' rows this rank was handed). With ``pp`` > 1 (and ``vpp`` virtual stages per rank) a stage before
    the last has no outputs, loss or head calls: only its parameters after the step (the head's hidden gradient
    crossed the stage boundary) and the old log-probs verl hands over."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (verl's plugin import registers the engines first)
    from tim_plugins.integrations.verl import megatron_engine

    calls = []
    head_call = megatron_engine._FusedSafeHead.__call__

    def counted(self, **kwargs):
        calls.append((tuple(kwargs["labels"].shape), kwargs["hidden_states"].shape[0]))
        return head_call(self, **kwargs)

    megatron_engine._FusedSafeHead.__call__ = counted
    try:
        return _fused_safe_vocab(model_path, tp, sequence_parallel, pp, vpp, calls)
    finally:
        megatron_engine._FusedSafeHead.__call__ = head_call


def _fused_safe_vocab(model_path: str, tp: int, sequence_parallel: bool, pp: int, vpp: int | None,
                      calls: list) -> dict:
    from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig

    out = {}
    engines = {name: H.build_engine(model_path, tp=tp, pp=pp, vpp=vpp, remove_padding=True, fused=name == "fused",
                                    sequence_parallel=sequence_parallel)
               for name in ("fused", "unfused")}
    out["use_fused_kernels"] = {k: bool(e.engine_config.use_fused_kernels) for k, e in engines.items()}
    # what Megatron's modules were built with (mbridge's transformer config), not only what was asked
    out["sequence_parallel"] = {k: bool(e.module[0].config.sequence_parallel) for k, e in engines.items()}
    for case, (safe, sampler) in SAFE_CASES.items():
        td, raw = H.make_batch(H.VOCAB, batch=4, seed=SAFE_SEED, temperature=SAFE_TEMPERATURE)
        old = None
        for name, engine in engines.items():
            calls.clear()
            engine.tim_configure(TIMVerlConfig.from_node({**MONITOR, "safe_vocab": safe}),
                                 context=ActorContext(**sampler))
            try:
                inferred = H.infer(engine, td)
                mine = H.old_log_probs_padded(inferred, td)
                old = mine if old is None else old  # both train from the fused engine's old log-probs
                entropy = _entropy(inferred, td)
                metrics = engine.tim_pop_metrics()
                seen = []
                result, _ = H.train_step(engine, td, old, loss_wrapper=_loss_recorder(seen))
                train_metrics = engine.tim_pop_metrics()
            finally:
                engine.tim_deconfigure()
            out[(case, name)] = {
                "old": mine, "entropy": entropy, "metrics": metrics, "train_metrics": train_metrics,
                "loss_mask": torch.cat([x["mask"] for x in seen]) if seen else None,
                "loss_log_probs": torch.cat([x["log_probs"] for x in seen]) if seen else None,
                "params": H.params_of(engine), "head_calls": list(calls),
                "pg_loss": H.tensors_of(result).get("actor/pg_loss"),
                "grad_norm": H.tensors_of(result).get("grad_norm"), "mask": raw["response_mask"],
                "keys": sorted(inferred.get("model_output", {}).keys()), "holds": engine._tim_holds_outputs()}
    return out


REPLAY_SEED = 7


def kept_sets(raw, vocab: int, seed: int = REPLAY_SEED) -> list[list[list[int]]]:
    """Test-made engine kept sets, one per response token of each sample: 40 random ids with the sampled token
    among them (the safe vocabulary's own rule at min-p 0.1 would cut most of these random tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(raw["responses"].shape[0]):
        n = int(raw["response_mask"][i].sum())
        lists = []
        for j in range(n):
            tok = int(raw["responses"][i, j])
            ids = torch.randperm(vocab, generator=g)[:40].tolist()
            lists.append(sorted(set(ids) | {tok}))
        out.append(lists)
    return out


def _extras(sets) -> list[dict]:
    """Each sample's ``extra_fields`` as the rollout server writes them (``rollout.TIMvLLMHttpServer``)."""
    import numpy as np

    from tim_plugins.integrations.verl.config import KEPT_SETS_KEY

    out = []
    for lists in sets:
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
        ids = np.array([t for x in lists for t in x], dtype=np.int32)
        out.append({KEPT_SETS_KEY: {"ids": ids, "offsets": offsets}})
    return out


def replay(model_path: str, *, tp: int, pp: int = 1) -> dict:
    """The engine's kept sets replayed (``extra_fields``, as verl's V1 trainer carries them from the rollout server)
    in three engines from one checkpoint: bshd through the logits processor (every call recorded for the test's
    reference), and thd without and with fused kernels; per engine the old-log-prob pass and one training step on
    the same batch, with the safe vocabulary's min-p case configured (which the replay replaces). With ``pp`` > 1 a
    stage before the last records no processor call and sees no loss."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (verl's plugin import registers the engines first)
    from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig

    safe, sampler = SAFE_CASES["min_p"]
    _, raw = H.make_batch(H.VOCAB, batch=4, seed=SAFE_SEED, temperature=SAFE_TEMPERATURE)
    sets = kept_sets(raw, H.VOCAB)
    td = H.to_v1_layout(raw, temperature=SAFE_TEMPERATURE, extra_fields=_extras(sets))
    out = {"sets": sets, "mask": raw["response_mask"], "responses": raw["responses"]}
    for name, kwargs in (("bshd", {}), ("thd", {"remove_padding": True}),
                         ("fused", {"remove_padding": True, "fused": True})):
        engine = H.build_engine(model_path, tp=tp, pp=pp, **kwargs)
        records = _record_processor(engine) if name == "bshd" else None
        engine.tim_configure(TIMVerlConfig.from_node({**MONITOR, "safe_vocab": safe}), context=ActorContext(**sampler))
        try:
            inferred = H.infer(engine, td)
            old = H.old_log_probs_padded(inferred, td)
            metrics = engine.tim_pop_metrics()
            infer_records = list(records) if records is not None else None
            seen = []
            result, _ = H.train_step(engine, td, old, loss_wrapper=_loss_recorder(seen))
            engine.tim_pop_metrics()
        finally:
            engine.tim_deconfigure()
            if records is not None:
                del engine._lm_head_logits_processor
        width = raw["responses"].shape[1]  # the V1 layout's micro-batches are as wide as their longest response
        loss_mask = (torch.cat([torch.nn.functional.pad(x["mask"], (0, width - x["mask"].shape[1])) for x in seen])
                     if seen else None)
        out[name] = {"old": old, "entropy": _entropy(inferred, td),
                     "metrics": metrics, "infer": infer_records, "loss_mask": loss_mask,
                     "grad_norm": H.tensors_of(result).get("grad_norm"), "params": H.params_of(engine),
                     "holds": engine._tim_holds_outputs()}
    return out


def replay_fallback(model_path: str, *, tp: int, pp: int = 1, vpp: int | None = None) -> dict:
    """Kept sets that never fit (each sample's one set short of its response): every micro-batch of the old-log-prob
    pass falls back to the trainer's own kept set, counted once per micro-batch under ``tim/diag/kept_sets_fallback``
    on the rank that holds the outputs, however many model chunks (virtual stages) its forward_step runs for it."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (verl's plugin import registers the engines first)
    from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig

    safe, sampler = SAFE_CASES["min_p"]
    _, raw = H.make_batch(H.VOCAB, batch=4, seed=SAFE_SEED, temperature=SAFE_TEMPERATURE)
    sets = [s[:-1] for s in kept_sets(raw, H.VOCAB)]
    td = H.to_v1_layout(raw, temperature=SAFE_TEMPERATURE, extra_fields=_extras(sets))
    engine = H.build_engine(model_path, tp=tp, pp=pp, vpp=vpp)
    engine.tim_configure(TIMVerlConfig.from_node({**MONITOR, "safe_vocab": safe}), context=ActorContext(**sampler))
    try:
        H.old_log_probs_padded(H.infer(engine, td), td)
        return {"metrics": engine.tim_pop_metrics(), "holds": engine._tim_holds_outputs(), "rows": len(sets),
                "chunks": len(engine.module)}
    finally:
        engine.tim_deconfigure()


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


def _lr_config(signals: tuple = (), monitor: bool = False):
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    # every window judged by the floor rule (these batches hold fewer lag-0 tokens than its default minimum), so the
    # cause tracker's checkpointed state holds one floor per step
    return TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": {**LR_OPTIONS, "signals": list(signals)}},
                                    **({"monitor": {"enable": True}, "causes": {"floor_min_tokens": 1}}
                                       if monitor else {})})


def lr_decay(model_path: str, *, tp: int, ckpt_dir: str | None = None, pp: int = 1, signals: tuple = ()) -> dict:
    """The LR decay through verl's Megatron optimizer and scheduler (constant schedule): the LR each step returns
    (actor/lr), every param group's LR, verl's grad norm of each step (None where verl does not report it), the
    controller's state and metrics after three steps (short, short, long); ``signals``: the controller's extra
    signals (the grad norm: verl reports it on the output-holding rank only). With ``ckpt_dir``: verl's checkpoint
    save, a fresh engine that loads it (configured before the load, as verl's worker is), and one more step on
    both; the monitor on, so the cause tracker's state rides in the checkpoint too (its state before the save, what
    the fresh engine's param groups hold after the load, both trackers' states after the step)."""
    def engine():
        return H.build_engine(model_path, tp=tp, pp=pp, lr=LR, optim_overrides={"lr_decay_style": "constant"})

    config = _lr_config(signals, monitor=ckpt_dir is not None)
    ours = engine()
    ours.tim_configure(config)
    batches = [H.make_batch(H.VOCAB, batch=4, response=r, seed=s) for r, s in LR_BATCHES]
    lrs, grad_norms = [], []
    for td, _ in batches:
        out, lr = H.train_step(ours, td, H.old_log_probs_padded(H.infer(ours, td), td))
        lrs.append(lr)
        grad_norms.append(H.tensors_of(out).get("grad_norm"))
    result = {"lrs": lrs, "grad_norms": grad_norms, "lengths": [mean_length(raw) for _, raw in batches],
              "group_lrs": [float(g["lr"]) for g in ours.optimizer.param_groups],
              "state": ours._tim_lr_controller.state_dict(), "metrics": ours.tim_pop_metrics(),
              "holds": ours._tim_holds_outputs()}
    if ckpt_dir is not None:
        result["causes_state"] = ours._tim_pipeline.causes.state_dict()
        ours.save_checkpoint(ckpt_dir, global_step=3)
        fresh = engine()
        # a torch Adam that never stepped has no state for Megatron's distributed optimizer to load into
        # (megatron/core/optimizer/distrib_optimizer.py:839 asserts one 'step' per param): one stock step first
        td, _ = batches[0]
        H.train_step(fresh, td, H.old_log_probs_padded(H.infer(fresh, td), td))
        fresh.tim_configure(config)
        fresh.load_checkpoint(ckpt_dir, del_local_after_load=False)
        result["loaded_state"] = fresh.optimizer.param_groups[0].get("tim_lr_controller")
        # imported once an engine is built: verl's import loads the plugin, which imports this module's engine
        from tim_plugins.integrations.verl.engine_mixin import CAUSES_STATE_KEY, GRAD_NORM_STATE_KEY

        result["loaded_causes"] = fresh.optimizer.param_groups[0].get(CAUSES_STATE_KEY)
        result["loaded_grad_norm"] = fresh.optimizer.param_groups[0].get(GRAD_NORM_STATE_KEY)
        after = []
        for eng in (fresh, ours):
            after.append(H.train_step(eng, td, H.old_log_probs_padded(H.infer(eng, td), td))[1])
        result["after_lrs"] = after
        result["after_states"] = [e._tim_lr_controller.state_dict() for e in (fresh, ours)]
        result["after_causes"] = [e._tim_pipeline.causes.state_dict() for e in (fresh, ours)]
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
