"""The script tests/test_trl_colocate_two_procs.py launches: TRL's ``GRPOTrainer.train()``, vLLM colocate mode, on two
CPU processes (``torch.distributed.run``, gloo), each rank with its own vLLM engine (the CPU build), TIMCallback's
weight-sync check on each.

Run by the test (bounded, in its own process group), never collected by pytest. ``--config`` names the configurations
(comma-separated), each its own ``GRPOTrainer`` and ``train()``, one after the other in the same two processes:

- ``ddp_clean``: DDP (accelerate's MULTI_CPU), no fault;
- ``ddp_fault``: DDP; rank 1's engine loader drops layer ``SKIPPED``'s tensors at the sync after optimizer step
  ``FAULT_STEP`` (rank 0's syncs are untouched), with ``TIMConfig(parity_probe=True, action="stop")``;
- ``fsdp2_clean``, ``fsdp2_fault``: the same under FSDP2 (``GRPOConfig(fsdp=True, fsdp_config={"version": 2})``,
  applied on a CPU launch through tests/cpu_fsdp2.py): TRL streams ``param.full_tensor()`` per parameter;
- ``fsdp1_clean``: no fault, under FSDP1 (``GRPOConfig(fsdp="full_shard auto_wrap", fsdp_config={"version": 1,
  "sync_module_states": False})``, as tests/trl_two_procs_run.py sets it): TRL's ``_iter_fsdp1_params`` streams
  each module's parameters under ``summon_full_params``, post-order. No faulty FSDP1 run: the probe's stop saves a
  checkpoint, and FSDP1's full state dict on this CPU launch killed rank 0 (SIGSEGV) in the flat parameters'
  all-gather (torch 2.13 ``_flat_param.py`` ``_all_gather_flat_param``);
- ``tp2_clean``, ``tp2_fault``: DDP with ``GRPOConfig(vllm_tensor_parallel_size=2)``: both ranks one tensor-parallel
  group of one engine (TRL's ``new_subgroups_by_enumeration`` for its prompts, vLLM's own TP group on the torchrun
  world), each rank holding its shard in-process; TRL's sync has each rank load full tensors, vLLM's weight loaders
  keep the rank's shard. vLLM sets its process groups once per process: these two run in a launch of their own.

Each rank builds its engine with TRL's own ``LLM(...)`` call (``distributed_executor_backend="external_launcher"``,
``seed=process_index // tensor_parallel_size``) at its first trainer; later trainers of the launch get that rank's
engine back (test-side, tests/trl_cpu_vllm.py ``one_plain_engine``: one engine start per rank, not four; each run's
first sync loads its own initial weights; the global RNG vLLM samples from seeded again as a new engine seeds it).
Test-side shims, documented in tests/trl_cpu_vllm.py: ``keep_plain_linear_weights`` (TRL 1.16's
``model.load_weights`` fails on the CPU build's packed linear weights, vllm_generation.py L511) and the engine's KV
cache size (``kv_cache_memory_bytes``; TRL passes ``gpu_memory_utilization``, which the CPU build does not read).

The fault is installed on the rank's engine model's ``load_weights`` and a snapshot taken in TRL's
``VLLMGeneration.sync_weights`` before the callback attaches (under its wrappers: it sees what TRL sent, the engine
keeps what the fault left). Each rank writes to ``--out``/CONFIG: ``rank_<r>.json`` (its sync check's reports, the
names its fault dropped, ``trainer.state.log_history``, the causes it named and the console lines of them, the
probe's trips, the step training ended at, its engine's seed and vLLM's process groups, timings) and
``rank_<r>.pt`` (the trainer's parameters at each sync, whole: FSDP2 shards gathered; the engine model's parameters
after training, read directly: with TP=2, this rank's shards). The callback's dump goes to ``--out``/CONFIG/dump.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

from cpu_fsdp2 import cpu_fsdp2

# fsdp1_clean first: its engine is built from the checkpoint (the run's initial weights), which the tensors its sync
# leaves out keep (a later run would find the previous run's there)
CONFIGS = ("fsdp1_clean", "ddp_clean", "ddp_fault", "fsdp2_clean", "fsdp2_fault")
TP2_CONFIGS = ("tp2_clean", "tp2_fault")  # one engine shared by both ranks: a launch of their own
FSDP2, FSDP1, TP2 = "fsdp2_", "fsdp1_", "tp2_"
# transformers' FSDP settings (GRPOConfig's fsdp_config): FSDP1 without sync_module_states, which accelerate's plugin
# refuses on a machine without GPUs (tests/trl_two_procs_run.py FSDP1_ARGS)
FSDP_EXTRA = {FSDP2: {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}},
              FSDP1: {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1, "sync_module_states": False}}}
COLUMNS_TP2 = 1  # the tp2 runs' columns_per_tensor, below the engine's 2 ranks
CONFIG_MARK = "[colocate two procs] configuration: "
SKIPPED = "model.layers.1."  # the layer whose tensors rank 1's engine loader drops
FAULT_RANK = 1
FAULT_STEP = 1  # global_step at the faulty sync (it precedes step 2's generation: named in step 2's window)
STEPS = 3  # fault-free runs; a faulty one gets STEPS + 1 and stops at FAULT_STEP + 1
PROBE = {"action": "stop", "kl_k3_max": None, "seq_log_ratio_abs_max": 1e9}  # trips on a named cause only
KV_CACHE_BYTES = 64 * 2**20


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def _configs(text: str) -> list[str]:
    names = text.split(",")
    if not (set(names) <= set(CONFIGS) or set(names) <= set(TP2_CONFIGS)):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated names of {CONFIGS}, or of {TP2_CONFIGS}")
    return names


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", type=_configs, required=True)
    args = ap.parse_args(argv)
    t0 = time.time()

    import pytest
    import torch.distributed as dist

    from trl_cpu_vllm import one_plain_engine

    mp = pytest.MonkeyPatch()
    engine = one_plain_engine(mp, kv_cache_memory_bytes=KV_CACHE_BYTES)
    for config in args.config:
        with cpu_fsdp2() if config.startswith((FSDP2, FSDP1)) else contextlib.nullcontext():
            _train(args, config, Path(args.out) / config, t0)
        t0 = time.time()
    # vLLM's engine shuts down at exit (a weakref finalizer) and destroys its groups of the default process group
    # then: the default group must still exist, so it is not destroyed here; the engine goes first.
    engine.clear()
    dist.barrier()


class Faults:
    """This rank's fault and the trainer's parameters at each sync, installed on TRL's ``sync_weights`` and on the
    engine model's ``load_weights`` before the callback attaches (under its wrappers)."""

    def __init__(self, trainer, schedule: dict):
        self.trainer, self.schedule = trainer, schedule
        self.snapshots: list[tuple[int, dict]] = []  # (global_step, {name: tensor}) per sync
        self.dropped: dict[int, list[str]] = {}
        gen = trainer.vllm_generation
        sync = gen.sync_weights

        def sync_weights():
            # whole parameters (an FSDP2 shard gathered, FSDP1's flat shards summoned: collectives, every rank is in
            # the sync)
            with _full_params(trainer):
                model = trainer.accelerator.unwrap_model(trainer.model)
                self.snapshots.append((trainer.state.global_step, {
                    gen._fix_param_name_to_vllm(n.replace("_fsdp_wrapped_module.", "")): _full(p).detach().clone()
                    for n, p in model.named_parameters()}))
            return sync()

        gen.sync_weights = sync_weights
        model = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model
        load = model.load_weights

        def load_weights(weights, *args, **kwargs):
            step, kept = trainer.state.global_step, []
            for name, tensor in weights:
                if self.schedule.get(step) == "skip_layer" and name.startswith(SKIPPED):
                    self.dropped.setdefault(step, []).append(name)
                    continue
                kept.append((name, tensor))
            return load(kept, *args, **kwargs)

        model.load_weights = load_weights
        self.undo = lambda: model.__dict__.pop("load_weights", None)  # the next trainer's Faults wraps the original


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full_params(trainer):
    """FSDP1: the model's whole parameters in place of their flat shards (``summon_full_params``, a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(trainer.model_wrapped, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(trainer.model_wrapped, writeback=False)
    return contextlib.nullcontext()


def _train(args, config: str, out: Path, t0: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("RANK") == "0":  # one write, on a line of its own (both ranks share the launch's pipe)
        sys.stdout.write(f"\n{CONFIG_MARK}{config}\n")
        sys.stdout.flush()
    import datasets
    import torch
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import synthetic_prompts
    from trl_cpu_vllm import CauseLines

    fault = config.endswith("_fault")
    extra = next((v for k, v in FSDP_EXTRA.items() if config.startswith(k)), {})
    if config.startswith(TP2):
        extra["vllm_tensor_parallel_size"] = 2
    grpo = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=STEPS + 1 if fault else STEPS, logging_steps=1, report_to=[],
        save_strategy="no", gradient_checkpointing=False, learning_rate=1e-3, seed=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128,
        loss_type="grpo", **extra)
    ds = datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)})
    trainer = GRPOTrainer(model=args.model, reward_funcs=_reward, args=grpo, train_dataset=ds)
    rank = trainer.accelerator.process_index
    faults = Faults(trainer, {FAULT_STEP: "skip_layer"} if fault and rank == FAULT_RANK else {})
    options = {"dump_dir": str(out / "dump"), "log_detail": True}
    if config.startswith(TP2):  # one column: the check samples as many as the engine has shards (for_tensor_parallel)
        options["sync_check_options"] = {"columns_per_tensor": COLUMNS_TP2}
    if fault:
        options.update(parity_probe=True, parity_probe_options=dict(PROBE))
    cb = TIMCallback(trainer, TIMConfig(**options))
    trainer.add_callback(cb)
    t1 = time.time()
    with CauseLines() as lines:
        try:
            trainer.train()
        finally:
            faults.undo()
    train_s = time.time() - t1
    llm = trainer.vllm_generation.llm
    engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    reports = [{"step": r.step, "statuses": dict(r.statuses), "not_sent": list(r.not_sent), "bad": r.bad_tensors,
                "checked": r.checked_tensors,
                "causes": [{"code": c.code, "tensors": list(c.tensors), "message": c.message} for c in r.causes]}
               for r in cb.sync_watch.check.reports]
    probe = cb.pipeline.probe
    from vllm.distributed import parallel_state as ps

    groups = {"world": ps.get_world_group(), "tp": ps.get_tp_group(), "dp": ps.get_dp_group()}
    result = {
        "rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "distributed_type": trainer.accelerator.distributed_type.value, "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "fsdp_version": getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "lm_head_class": type(trainer.model.get_output_embeddings().weight).__name__,
        "engine": {"reader_is_this_engine": cb.sync_watch._reader.model is engine_model,
                   "seed": llm.llm_engine.vllm_config.model_config.seed,
                   "dtype": str(llm.llm_engine.model_config.dtype),
                   "executor_backend": llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
                   # vLLM's process groups on the torchrun world: [size, this rank's rank in it]
                   "groups": {k: [g.world_size, g.rank_in_group] for k, g in groups.items()}},
        "check_grid": [cb.sync_watch.check.config.columns_per_tensor, cb.sync_watch.check.config.elements_per_tensor],
        "reports": reports, "dropped": {str(k): v for k, v in faults.dropped.items()},
        "log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
        "named": [{"code": c.code, "step": c.step, "tensors": list(c.tensors), "message": c.message}
                  for c in cb.pipeline.causes.named],
        "cause_lines": list(lines), "diag": dict(cb.pipeline.diag),
        "trips": [] if probe is None else [{"key": t.key, "step": t.step} for t in probe.trips],
        "init_s": t1 - t0, "train_s": train_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result, default=float))
    torch.save({"snapshots": faults.snapshots,
                "engine": {n: p.detach().clone() for n, p in engine_model.named_parameters()}},
               out / f"rank_{rank}.pt")
    dist.barrier()  # neither rank runs ahead into the next configuration (or the exit)


if __name__ == "__main__":
    main()
