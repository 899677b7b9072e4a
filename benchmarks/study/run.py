"""One study run (arm × seed): TRL's GRPOTrainer + TIMCallback + the policy evaluation, per-step records.

Rollout engines: the TIM callback's own (``exact``; ``inject``, which at scale 0 is the zero-mismatch control
on the same code path), or a real low-precision engine (`LowPrecisionRollout`: a bf16/fp16 copy of the policy,
refreshed from the fp32 weights before every generation, runs TRL's ``generate``), which is the only piece the
study adds around TRL.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
from pathlib import Path

__all__ = ["run_one", "save_run", "finished", "LowPrecisionRollout", "StepTimer", "write_csv", "read_csv"]


class StepTimer:
    """TrainerCallback recording the wall time of each optimizer step (generation + loss + update)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times: list[float] = []
                self._t0 = None

            def on_step_begin(self, args, state, control, **kw):
                self._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if self._t0 is not None:
                    self.times.append(time.perf_counter() - self._t0)

        return _Timer()


class LowPrecisionRollout:
    """A real low-precision engine for TRL's transformers generation: ``model.generate`` (an instance
    attribute, undone by `undo`) copies the fp32 weights into a ``dtype`` clone of the model and generates with
    it, weights and activations in that dtype, as an inference engine serving the policy in bf16/fp16 does.
    The logits processors TRL and the TIM recorder install on the fp32 model (``_get_logits_processor``) are
    forwarded, so the recorded log-probs are those of the low-precision engine's sampling distribution."""

    def __init__(self, model, dtype) -> None:
        import copy

        self.model = model
        self.engine = copy.deepcopy(model).to(dtype).eval()
        # accelerate's prepare() sets an instance ``forward`` wrapping the original model's forward; a deep copy
        # keeps that closure, which would run the fp32 model. The engine uses its class's forward.
        vars(self.engine).pop("forward", None)

        def generate(*args, **kwargs):
            import torch

            with torch.no_grad():
                self.engine.load_state_dict(model.state_dict())  # casts to the engine's dtype
            # TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor (looked up on
            # the instance by generate, so the processors installed on the fp32 model follow it to the engine)
            forwarded = vars(model).get("_get_logits_processor")
            if forwarded is not None:
                self.engine._get_logits_processor = forwarded
            try:
                return type(self.engine).generate(self.engine, *args, **kwargs)
            finally:
                if forwarded is not None:
                    del self.engine._get_logits_processor

        model.generate = generate

    def undo(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.model.generate


def _records(log_history: list[dict], times: list[float], base_lr: float) -> list[dict]:
    rows = []
    for entry in log_history:
        if "reward" not in entry or "step" not in entry:
            continue
        row = {"step": int(entry["step"])}
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                row[key] = float(value)
        if "learning_rate" in row:
            row["lr_scale"] = row["learning_rate"] / base_lr
        rows.append(row)
    for row in rows:
        i = row["step"] - 1
        row["step_time_s"] = times[i] if 0 <= i < len(times) else math.nan
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="")
        w.writeheader()
        for row in rows:
            w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    os.replace(tmp, path)  # atomic: a killed run leaves no CSV, so resume redoes it


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def run_one(arm, seed: int, cfg, model_path: str, profile: dict | None, work_dir: Path) -> dict:
    """Train one arm with one seed; returns {"rows", "eval_rows", "seconds", "eval_seconds", "tim_config"}."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig

    from .evaluate import EvalCallback
    from .task import make_prompts, reward_for, task_spec

    spec = task_spec(arm.task)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    held_out = make_prompts(cfg.eval_prompts, spec, seed=999_999)
    n_prompts = cfg.steps * cfg.prompts_per_step
    train = make_prompts(n_prompts, spec, seed=1000 + seed, exclude=frozenset(held_out))
    dataset = Dataset.from_dict({"prompt": train})
    args = GRPOConfig(
        output_dir=str(work_dir), max_steps=cfg.steps, per_device_train_batch_size=cfg.prompts_per_step *
        cfg.num_generations, num_generations=cfg.num_generations, max_completion_length=arm.budget,
        learning_rate=arm.learning_rate, max_grad_norm=arm.max_grad_norm, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=cfg.device == "cpu",
        bf16=False, gradient_checkpointing=False, seed=seed, beta=0.0, temperature=cfg.temperature,
        loss_type=cfg.loss_type, min_p=cfg.min_p if arm.safe_vocab else None, top_k=0, disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False,
    )
    reward = reward_for(arm.task, arm.budget, cfg.surge_after if arm.task == "chain_stop" else None)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tok)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # per-step log dicts on stdout would drown the progress bars
    tim_config = TIMConfig(**arm.tim_config_kwargs(cfg, profile, seed))
    timer = StepTimer()
    evaluator = EvalCallback(tok, held_out, arm.budget, cfg.eval_every)
    trainer.add_callback(TIMCallback(trainer, tim_config))
    trainer.add_callback(timer)
    trainer.add_callback(evaluator)
    patch = None
    if arm.rollout in ("bf16", "fp16"):
        patch = LowPrecisionRollout(trainer.model, {"bf16": torch.bfloat16, "fp16": torch.float16}[arm.rollout])
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if patch is not None:
            patch.undo()
    seconds = time.perf_counter() - t0
    rows = _records(trainer.state.log_history, timer.times, arm.learning_rate)
    return {"rows": rows, "eval_rows": evaluator.rows, "seconds": seconds, "eval_seconds": evaluator.seconds,
            "tim_config": tim_config.to_dict()}


def save_run(out_dir: Path, arm_name: str, seed: int, result: dict, fingerprint: str) -> Path:
    run_dir = out_dir / "runs" / arm_name
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {"arm": arm_name, "seed": seed, "seconds": result["seconds"], "eval_seconds": result["eval_seconds"],
            "fingerprint": fingerprint, "tim_config": result["tim_config"], "steps_logged": len(result["rows"])}
    (run_dir / f"seed{seed}.json").write_text(json.dumps(meta, indent=1, default=str))
    write_csv(run_dir / f"seed{seed}.eval.csv", result["eval_rows"])
    path = run_dir / f"seed{seed}.csv"
    write_csv(path, result["rows"])  # written last: its presence marks the run finished
    return path


def finished(out_dir: Path, arm_name: str, seed: int, fingerprint: str) -> bool:
    run_dir = out_dir / "runs" / arm_name
    meta, data = run_dir / f"seed{seed}.json", run_dir / f"seed{seed}.csv"
    if not (meta.exists() and data.exists() and (run_dir / f"seed{seed}.eval.csv").exists()):
        return False
    try:
        return json.loads(meta.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False
