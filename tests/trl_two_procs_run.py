"""One rank of tests/test_trl_two_procs.py: TRL's GRPOTrainer on the toy model, HF generation, CPU, launched twice
by ``torch.distributed.run`` (gloo), with TIMCallback dumping every measured token of its rank.

Run by the test (bounded, in its own process group), never collected by pytest. ``--config`` names one or more
configurations (comma-separated); each is its own ``GRPOTrainer`` and ``train()``, one after the other in the same two
processes (one launch: the ranks' start-up, ~10 s each, is paid once), each writing to ``--out``/CONFIG. Each rank
writes ``rank_<r>.json`` there: its ``trainer.state.log_history``; for each ``trainer.log`` call, how many values
each ``tim/`` key held in ``trainer._metrics["train"]`` (TRL's ``log()`` averages that list, so more than one value
would be a mean of windows); per optimizer step, the response tokens and sequences of the generation batches TRL
built on this rank (completion_mask, a test-side wrapper installed before the callback attaches); per logging
window, this rank's own statistics read unmerged (``compute(sync=False)``) just before the callback merges them;
the process group's backend and world size; wall time and peak RSS. The callback's per-token dump goes to
``--out``/CONFIG/dump.

Rollouts are TRL's transformers generation with a controlled mismatch added to the logits (``rollout="inject"``):
TRL's own sampler against the fp32 trainer differs by ~1e-7 per token (KV-cache decode vs full forward), where k3
(~1e-13) is float32 rounding that no float64 reference reproduces; the injected mismatch is O(0.1) per token.
Configurations (``--config``):
- ``monitor``: the monitor only;
- ``mitigations``: safe vocabulary (``GRPOConfig(min_p=0.05)``, ``TIMConfig(safe_vocab=True)``) and the IcePop
  correction, so boundary tokens (sampled outside the trainer's safe set) and dropped tokens both occur;
- ``beam_on_rank1``: the monitor, with rank 1 generating by beam search (``generation_kwargs={"num_beams": 2}``),
  which the monitor does not measure: rank 1 only counts a problem (``tim/diag/unsupported_generation_mode``) and
  contributes no token;
- ``fsdp2_monitor``, ``fsdp2_mitigations``: ``monitor`` and ``mitigations`` with the model sharded by FSDP2 through
  transformers' own settings (``GRPOConfig(fsdp=True, fsdp_config={"version": 2})``: accelerate's
  ``fsdp2_prepare_model`` shards each decoder layer, the input embedding, [final norm, lm_head] and the root), which
  accelerate applies on a CPU launch only under tests/cpu_fsdp2.py (it drops the plugin there and wraps in DDP); that
  helper restores the ``ACCELERATE_USE_FSDP`` which ``Accelerator`` leaves set, so a DDP configuration may follow;
- ``fsdp1_monitor``, ``fsdp1_mitigations``: the same under FSDP1, as ``GRPOConfig(fsdp="full_shard auto_wrap",
  fsdp_config={"version": 1, "sync_module_states": False})`` sets it (accelerate wraps the model in
  ``FullyShardedDataParallel`` with the transformer auto-wrap policy: each decoder layer a unit, the root holding the
  embedding, final norm and lm_head in one flat parameter), ``use_orig_params=True`` (transformers' default);
  ``fsdp1flat_monitor``, ``fsdp1flat_mitigations``: with ``use_orig_params=False`` (accelerate's own plugin default),
  where the model's parameters are the flat parameters alone. tests/cpu_fsdp2.py applies them on the CPU too.
Each rank also writes what it trained: the accelerator's distributed type, FSDP version and ``use_orig_params``, the
wrapped model's class and FSDP units, what it holds of each parameter (its local size, a flat parameter or not), the
lm_head weight as the module holds it after training (class, placement, local shape, storage size), the whole weight
(gathered: ``full_tensor()``, FSDP1 ``summon_full_params``) and its largest change, and what each safe-vocabulary head
call received (the weight's class, shape and checksums, and the lm_head parameter's class and shape at that moment: a
test-side wrapper of the head's core call).
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

MIN_P = 0.05  # as tests/test_trl_mitigations.py: prunes the toy model's tail on most positions
# A controlled mismatch of O(0.1) per token (|d| up to ~1); with "mitigations" a larger one, so that the sampler's
# kept set (on the perturbed logits) differs from the trainer's safe set on some tokens (boundary tokens), and a
# band narrower than IcePop's default (0.5, 5) that drops some tokens.
INJECT = {"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}
INJECT_MITIGATIONS = {**INJECT, "scale": 2.0}
ICEPOP_BAND = (0.8, 1.25)


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


CONFIGS = ("monitor", "mitigations", "beam_on_rank1", "fsdp2_monitor", "fsdp2_mitigations", "fsdp1_monitor",
           "fsdp1_mitigations", "fsdp1flat_monitor", "fsdp1flat_mitigations")
# the prefixes of the configurations trained under FSDP (the rest of the name: what they run)
FSDP2, FSDP1, FSDP1_FLAT = "fsdp2_", "fsdp1_", "fsdp1flat_"
# transformers' own FSDP settings per prefix (GRPOConfig's fsdp, fsdp_config). FSDP1: sync_module_states=False, as
# accelerate's FSDP1 plugin raises on a machine without GPUs otherwise (accelerate/utils/dataclasses.py lines
# 1998-2016: it looks for the current accelerator device to build its param_init_fn); both ranks load the same
# weights, which is what syncing them from rank 0 would ensure.
FSDP1_ARGS = {"version": 1, "sync_module_states": False}
FSDP_ARGS = {FSDP2: (True, {"version": 2, "reshard_after_forward": True}),
             FSDP1: ("full_shard auto_wrap", FSDP1_ARGS),  # use_orig_params: transformers' default, True
             FSDP1_FLAT: ("full_shard auto_wrap", {**FSDP1_ARGS, "use_orig_params": False})}
CONFIG_MARK = "[two procs] configuration: "


def _configs(text: str) -> list[str]:
    names = text.split(",")
    if any(n not in CONFIGS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated names of {CONFIGS}")
    return names


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", type=_configs, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args(argv)
    t0 = time.time()

    import torch.distributed as dist

    for config in args.config:
        _train(args, config, Path(args.out) / config, t0)
        t0 = time.time()
    dist.destroy_process_group()


def _train(args, config: str, out: Path, t0: float) -> None:
    """One configuration's trainer, from its construction to its rank_<r>.json (``t0``: when its set-up began)."""
    with cpu_fsdp2() if config.startswith(tuple(FSDP_ARGS)) else contextlib.nullcontext():
        _train_one(args, config, out, t0)


def _train_one(args, config: str, out: Path, t0: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("RANK") == "0":  # where this configuration's lines of the launch's output begin
        # One write, starting a line of its own: both ranks write to the launch's one pipe, and under
        # PYTHONUNBUFFERED a print is two writes (the text, then its newline), so another process's output can land
        # in between, or leave its line unfinished before the mark.
        sys.stdout.write(f"\n{CONFIG_MARK}{config}\n")
        sys.stdout.flush()
    import datasets
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.staleness import staleness_metrics
    from tim_plugins.toy_model import synthetic_prompts

    fsdp = next((p for p in FSDP_ARGS if config.startswith(p)), None)  # FSDP2, FSDP1 or DDP (None)
    config = config.removeprefix(fsdp or "")  # what it runs
    extra = {"min_p": MIN_P} if config == "mitigations" else {}
    if fsdp:
        extra.update(fsdp=FSDP_ARGS[fsdp][0], fsdp_config=dict(FSDP_ARGS[fsdp][1]))
    if config == "beam_on_rank1" and os.environ.get("RANK") == "1":
        extra["generation_kwargs"] = {"num_beams": 2}  # unsupported by the monitor: counted, not measured
    grpo = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=args.tokens, max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
        gradient_checkpointing=False, learning_rate=1e-3, seed=0, disable_tqdm=True, **extra)
    ds = datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)})
    trainer = GRPOTrainer(model=args.model, reward_funcs=_reward, args=grpo, train_dataset=ds)
    rank = trainer.accelerator.process_index

    # Test-side wrappers of TRL's own methods, installed before the callback attaches (its wrappers wrap these).
    batches: list[dict] = []
    gen = trainer._generate_and_score_completions

    def _generate_and_score_completions(*a, **k):
        res = gen(*a, **k)
        if trainer.model.training:
            mask = res["completion_mask"].bool()
            batches.append({"step": trainer.state.global_step + 1, "tokens": int(mask.sum()),
                            "seqs": int(mask.any(-1).sum()), "rows": int(mask.shape[0])})
        return res

    trainer._generate_and_score_completions = _generate_and_score_completions
    windows: list[dict] = []
    log = trainer.log

    def _log(logs, *a, **k):
        windows.append({"step": trainer.state.global_step,
                        "tim_values": {key: len(v) for key, v in trainer._metrics["train"].items()
                                       if key.startswith("tim/")}})
        return log(logs, *a, **k)

    trainer.log = _log

    options = {"dump_dir": str(out / "dump"), "dump_options": {"sample_rate": 1.0, "max_sequences_per_step": 10**6},
               "rollout": "inject", "inject_options": dict(INJECT)}
    if config == "mitigations":
        options.update(safe_vocab=True, is_correction="icepop", is_correction_options={"icepop_band": ICEPOP_BAND},
                       inject_options=dict(INJECT_MITIGATIONS))
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, **options))
    trainer.add_callback(cb)
    # This rank's own statistics of each window, read without merging just before the callback merges them: the
    # per-rank values the merged (logged) ones must differ from.
    local: list[dict] = []
    pipeline, compute = cb.pipeline, cb.pipeline.compute

    def _compute(step, **k):
        values = {}
        for part in (pipeline.monitor, pipeline.safe_vocab_stats, pipeline.correction_stats, pipeline.split_stats,
                     pipeline.reused_split,
                     pipeline.by_lag, pipeline.by_position):
            if part is not None:
                values.update(part.compute(sync=False))
        if pipeline.staleness_monitor is not None:
            values.update(staleness_metrics(pipeline.staleness_monitor.compute(sync=False)))
        local.append({"step": step, "values": values, "diag": dict(pipeline.diag)})
        return compute(step, **k)

    pipeline.compute = _compute
    # What the safe-vocabulary head received at each call (the weight TRL's fused lm_head hands its kernel) and the
    # lm_head parameter at that moment: a wrapper of the head's core call, delegating to it.
    from tim_plugins.integrations.trl import hooks

    head_calls: list[dict] = []
    head_call = hooks.kept_set_logprobs

    def _kept_set_logprobs(*a, weight=None, **k):
        param = trainer.model.get_output_embeddings().weight
        head_calls.append({"weight": type(weight).__name__, "shape": list(weight.shape),
                           "lm_head_param": type(param).__name__, "lm_head_param_shape": list(param.shape),
                           "checksum": _checksum(weight)})
        return head_call(*a, weight=weight, **k)

    hooks.kept_set_logprobs = _kept_set_logprobs
    # Not wrapped yet (accelerate prepares the model in train()): the whole weight on every configuration.
    lm_head_before = trainer.model.get_output_embeddings().weight.detach().clone()
    numel = sum(p.numel() for p in trainer.model.parameters())
    t1 = time.time()
    try:
        trainer.train()
    finally:
        hooks.kept_set_logprobs = head_call
    train_s = time.time() - t1
    wrapped = trainer.model_wrapped
    lm_head = trainer.model.get_output_embeddings().weight  # as the module holds it outside forward
    with _full_params(trainer):
        full = _full(trainer.model.get_output_embeddings().weight).detach().clone()
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    from torch.distributed.fsdp import FlatParameter
    result = {
        "rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "rollout_source": cb.rollout_source, "log_history": trainer.state.log_history, "windows": windows,
        "batches": batches, "local": local, "diag": dict(cb.pipeline.diag), "init_s": t1 - t0,
        "train_s": train_s, "wall_s": time.time() - t0,
        "distributed_type": trainer.accelerator.distributed_type.value, "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "use_orig_params": getattr(plugin, "use_orig_params", None),
        "wrapped": type(wrapped).__name__,
        "fsdp_units": [_name(n) for n, m in wrapped.named_modules()
                       if type(m).__name__.startswith("FSDP") or type(m).__name__ == "FullyShardedDataParallel"],
        # what this rank holds of the parameters (FSDP1: shards of flat parameters), and the model's own count
        "params": [[_name(n), isinstance(p, FlatParameter), p.numel()] for n, p in wrapped.named_parameters()],
        "numel": numel,
        "lm_head": {"class": type(lm_head).__name__, "placements": str(getattr(lm_head, "placements", None)),
                    "local_shape": list((lm_head.to_local() if hasattr(lm_head, "to_local") else lm_head).shape),
                    "storage_bytes": (lm_head.to_local() if hasattr(lm_head, "to_local") else lm_head
                                      ).untyped_storage().nbytes(),
                    "shape": list(full.shape), "max_change": float((full - lm_head_before).abs().max()),
                    "checksum_before": _checksum(lm_head_before)},
        "head_calls": head_calls, "named_causes": [c.code for c in cb.pipeline.causes.named],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(result, default=float))
    # No collective after the last log: TRL's train() has returned on both ranks; wait for the other before the
    # next configuration (or the exit) so neither runs ahead of, or tears the group down under, the other.
    dist.barrier()


def _full(weight):
    """The whole tensor of a parameter, an FSDP2 shard (a DTensor) gathered: a collective, every rank calls it."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def _full_params(trainer):
    """FSDP1: the model's whole parameters in place of their flat shards (``summon_full_params``, a collective);
    otherwise nothing."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(trainer.model_wrapped, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(trainer.model_wrapped, writeback=False)
    return contextlib.nullcontext()


def _name(name: str) -> str:
    """A module's or parameter's name in the model, without DDP's (``module.``) or FSDP1's wrapper attribute
    (``_fsdp_wrapped_module.``)."""
    return name.removeprefix("module.").replace("_fsdp_wrapped_module.", "")


def _checksum(weight) -> list[float]:
    """Two float64 sums of a tensor (plain, and weighted by the element's flat index): equal tensors give equal
    sums; a shard, another parameter or a permutation of rows does not."""
    import torch

    w = weight.detach().double().reshape(-1)
    return [float(w.sum()), float((w * torch.arange(w.numel(), dtype=torch.float64)).sum())]


if __name__ == "__main__":
    main()
