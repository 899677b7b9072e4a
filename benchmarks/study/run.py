"""One study run (arm × seed): TRL's GRPOTrainer + TIMCallback, per-step records from ``log_history``.

Rollout choices are the callback's own (``exact``, ``hf``, ``inject``); the realistic arm runs TRL's HF
generation under bf16 autocast (the trainer stays fp32), which is the only piece the study adds around TRL.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
from pathlib import Path

__all__ = ["run_one", "calibrate", "Bf16Rollout", "StepTimer"]


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


class Bf16Rollout:
    """Run the policy's ``generate`` under bf16 autocast: a realistic low-precision engine (weights stay fp32,
    matmuls run in bf16), while the trainer recomputes in fp32. Reversible instance attribute."""

    def __init__(self, model) -> None:
        import torch

        self.model = model
        original = model.generate
        device_type = next(model.parameters()).device.type

        def generate(*args, **kwargs):
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                return original(*args, **kwargs)

        model.generate = generate

    def undo(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.model.generate


def calibrate(model_path: str, cfg, prompts: list[str], log=print) -> dict[str, float]:
    """Injector scale per k3 target, found once on the warm-started policy (same for every arm and seed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tim_plugins.rollout.inject import calibrate_injector

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(cfg.device).eval()
    enc = tok(prompts, return_tensors="pt", padding=True).to(cfg.device)
    out = {}
    for target in cfg.inject_targets:
        _inj, res = calibrate_injector(
            model, enc["input_ids"], enc["attention_mask"], target_k3=float(target),
            max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, tau=cfg.inject_tau,
            mode=cfg.inject_mode, seed=0)
        out[repr(float(target))] = res.scale
        log(f"calibrated k3 target {target:g}: scale {res.scale:.4g} (probe k3 {res.k3:.3g})")
    return out


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
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="")
        w.writeheader()
        for row in rows:
            w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    os.replace(tmp, path)  # atomic: a killed run leaves no CSV, so resume redoes it


def run_one(arm, seed: int, cfg, model_path: str, scales: dict, work_dir: Path) -> dict:
    """Train one arm with one seed; returns {"rows": [...], "seconds": float, "tim_config": {...}}."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig

    from .task import TaskSpec, make_prompts, sort_reward

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    n_prompts = cfg.steps * cfg.prompts_per_step
    dataset = Dataset.from_dict({"prompt": make_prompts(n_prompts, TaskSpec(), seed=1000 + seed)})
    args = GRPOConfig(
        output_dir=str(work_dir), max_steps=cfg.steps, per_device_train_batch_size=cfg.prompts_per_step *
        cfg.num_generations, num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        learning_rate=cfg.learning_rate, max_grad_norm=cfg.max_grad_norm, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=cfg.device == "cpu", bf16=False,
        gradient_checkpointing=False, seed=seed, beta=0.0, temperature=cfg.temperature, loss_type=cfg.loss_type,
        min_p=cfg.min_p if arm.safe_vocab else None, top_k=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=sort_reward, args=args, train_dataset=dataset,
                          processing_class=tok)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # per-step log dicts on stdout would drown the progress bars
    kw = arm.tim_config_kwargs(cfg)
    if arm.rollout == "inject":
        kw["inject_options"] = {"scale": scales[repr(float(arm.target_k3))], "tau": cfg.inject_tau,
                                "mode": cfg.inject_mode, "seed": seed}
    tim_config = TIMConfig(**kw)
    timer = StepTimer()
    trainer.add_callback(TIMCallback(trainer, tim_config))
    trainer.add_callback(timer)
    patch = None
    if arm.rollout == "bf16":
        patch = Bf16Rollout(trainer.model)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if patch is not None:
            patch.undo()
    seconds = time.perf_counter() - t0
    rows = _records(trainer.state.log_history, timer.times, cfg.learning_rate)
    return {"rows": rows, "seconds": seconds, "tim_config": tim_config.to_dict()}


def save_run(out_dir: Path, arm_name: str, seed: int, result: dict, fingerprint: str) -> Path:
    run_dir = out_dir / "runs" / arm_name
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {"arm": arm_name, "seed": seed, "seconds": result["seconds"], "fingerprint": fingerprint,
            "tim_config": result["tim_config"], "steps_logged": len(result["rows"])}
    (run_dir / f"seed{seed}.json").write_text(json.dumps(meta, indent=1, default=str))
    path = run_dir / f"seed{seed}.csv"
    write_csv(path, result["rows"])  # written last: its presence marks the run finished
    return path


def finished(out_dir: Path, arm_name: str, seed: int, fingerprint: str) -> bool:
    run_dir = out_dir / "runs" / arm_name
    meta, data = run_dir / f"seed{seed}.json", run_dir / f"seed{seed}.csv"
    if not (meta.exists() and data.exists()):
        return False
    try:
        return json.loads(meta.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError):
        return False
