"""``tim-plugins demo``: training-inference mismatch inside a real GRPO run (TRL ``GRPOTrainer`` on CPU).

A short GRPO run of the toy model (fp32 policy, AdamW) with `TIMCallback` attached in its default
configuration (monitor + parity audit; the per-token dump switched on). Rollouts are sampled in bfloat16: TRL's
documented (experimental) ``rollout_func`` hook returns completions and their processed log-probs from a
bf16 copy of the current policy, re-synchronised after every optimizer step, with the core HF sampler
(``tim_plugins.rollout.hf.generate_with_logprobs``) — the shape of a real stack, where an inference engine in
bf16 samples for an fp32 trainer. TRL hands those log-probs to the loss as ``sampling_per_token_logps``; the
callback compares them with the trainer's own log-probs of the same tokens at every step.

Writes ``OUT/report.html``, ``OUT/summary.json`` and the per-token dump ``OUT/dump/``; prints a verdict.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tim_plugins._config import field_help
from tim_plugins.apps.cli import UsageError, add_config_options, config_from_args

__all__ = ["DemoConfig", "run_demo", "register", "toy_reward"]

_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class DemoConfig:
    model: str | None = field(default=None, metadata=field_help(
        "local HF checkpoint folder for the policy; default: the locally built toy model"))
    steps: int = field(default=40, metadata=field_help("GRPO optimizer steps"))
    rollout_dtype: str = field(default="bfloat16", metadata=field_help(
        f"dtype of the rollout copy of the policy, one of {_DTYPES} (the trainer stays float32)"))
    prompts_per_step: int = field(default=4, metadata=field_help("prompts per optimizer step"))
    num_generations: int = field(default=8, metadata=field_help("completions per prompt (the GRPO group)"))
    max_completion_length: int = field(default=48, metadata=field_help("tokens sampled per completion at most"))
    temperature: float = field(default=1.0, metadata=field_help("sampling temperature (the trainer divides by it too)"))
    learning_rate: float = field(default=5e-4, metadata=field_help("AdamW learning rate of the policy"))
    seed: int = field(default=0, metadata=field_help("seed of prompts, sampling and training"))
    out: str = field(default="tim-out/demo", metadata=field_help("output folder"))

    def __post_init__(self) -> None:
        from tim_plugins.apps.measure_rollouts import check_model_path

        for name in ("steps", "prompts_per_step", "num_generations", "max_completion_length"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= 1.")
        if self.num_generations < 2:
            raise UsageError(f"--num-generations {self.num_generations} is invalid: GRPO needs >= 2 completions per "
                             "prompt to compare them (e.g. 8).")
        if self.rollout_dtype not in _DTYPES:
            raise UsageError(f"--rollout-dtype {self.rollout_dtype!r} is unknown: use one of {', '.join(_DTYPES)}.")
        if not self.temperature > 0:
            raise UsageError(f"--temperature {self.temperature} is invalid: it must be > 0 (sampled rollouts).")
        if not self.learning_rate > 0:
            raise UsageError(f"--learning-rate {self.learning_rate} is invalid: it must be > 0, e.g. 5e-4.")
        check_model_path(self.model)


# ----------------------------------------------------------------------------------------------- the task
_SUM = re.compile(r"^Q: (\d+) \+ (\d+) = \? A:$")
_SORT = re.compile(r"^sort ([\d ]+) ->$")


def toy_reward(prompts, completions, **kwargs) -> list[float]:
    """A graded reward for the toy prompts, so that completions of one prompt differ (GRPO learns from the
    spread inside a group): sums score by how close the first number is to the answer, sorting by the share of
    digits in their sorted place, free text by sentence length up to 8 words when it ends with a full stop."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        text = completion.strip()
        if m := _SUM.match(prompt):
            truth = int(m.group(1)) + int(m.group(2))
            got = re.match(r"\d+", text)
            rewards.append(max(0.0, 1.0 - abs(int(got.group()) - truth) / max(truth, 1)) if got else 0.0)
        elif m := _SORT.match(prompt):
            want = sorted(m.group(1).split())
            got = re.findall(r"\d", text)[: len(want)]
            rewards.append(sum(a == b for a, b in zip(got, want)) / len(want))
        else:
            words = text.rstrip(".").split()
            rewards.append(min(len(words), 8) / 8 if text.endswith(".") else 0.0)
    return rewards


class _BF16Rollouts:
    """TRL ``rollout_func``: sample with a low-precision copy of the current policy, return processed log-probs.

    The copy's parameters are re-copied from the trainer's policy whenever the optimizer step changed (the
    copy is loaded from the checkpoint in the rollout dtype, so its non-parameter buffers are what a serving
    engine would hold).
    """

    def __init__(self, model_path: str, dtype, tokenizer, cfg: DemoConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.synced_step = None
        self.calls = 0
        self.seconds = 0.0
        self.tokens = 0

    def _sync(self, trainer) -> None:
        import torch

        step = trainer.state.global_step
        if step == self.synced_step:
            return
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), trainer.model.parameters()):
                dst.copy_(src.detach())
        self.synced_step = step

    def __call__(self, prompts: list[str], trainer) -> dict:
        from tim_plugins.rollout.hf import generate_with_logprobs

        self._sync(trainer)
        t0 = time.perf_counter()
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        batch = generate_with_logprobs(
            self.model, enc["input_ids"], enc["attention_mask"], max_new_tokens=self.cfg.max_completion_length,
            temperature=self.cfg.temperature, seed=self.cfg.seed * 1_000_003 + self.calls)
        self.calls += 1
        prompt_ids, completion_ids, logprobs = [], [], []
        for ids, pmask, comp, cmask, lps in zip(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                                batch.completion_mask.bool(), batch.logprobs):
            prompt_ids.append(ids[pmask.bool()].tolist())
            completion_ids.append(comp[cmask].tolist())
            logprobs.append(lps[cmask].tolist())
        self.seconds += time.perf_counter() - t0
        self.tokens += int(batch.completion_mask.sum())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def _progress_callback(total: int):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        """One bar over optimizer steps, with the latest k3 and reward (instead of TRL's printed log dicts)."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total, desc="GRPO steps", unit="step", dynamic_ncols=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "tim/token/kl_k3" in logs:
                self.bar.set_postfix(k3=f"{logs['tim/token/kl_k3']:.2e}", reward=f"{logs.get('reward', 0):.2f}")

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return Progress()


def run_demo(cfg: DemoConfig) -> dict:
    """Run the GRPO demo; returns the summary also written to ``OUT/summary.json``."""
    from tim_plugins._optional import require

    require("trl", "tim-plugins demo")
    require("datasets", "tim-plugins demo")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import build_toy_model, synthetic_prompts

    hf_logging = transformers.utils.logging
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # weight-loading chatter; restored below
    out = Path(cfg.out)
    dump_dir = out / "dump"
    if dump_dir.exists():
        shutil.rmtree(dump_dir)
    t_start = time.perf_counter()
    model_path = cfg.model or str(build_toy_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = cfg.prompts_per_step * cfg.num_generations
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=cfg.steps, per_device_train_batch_size=batch,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, learning_rate=cfg.learning_rate, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False, seed=cfg.seed,
    )
    rollouts = _BF16Rollouts(model_path, getattr(torch, cfg.rollout_dtype), tokenizer, cfg)
    prompts = synthetic_prompts(max(64, cfg.steps * cfg.prompts_per_step), cfg.seed)
    trainer = GRPOTrainer(model=model_path, reward_funcs=toy_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollouts)
    # every sequence is dumped (the dump keeps 5 % by default), so the per-token figures cover every step
    tim = TIMCallback(trainer, TIMConfig(dump_dir=str(dump_dir),
                                         dump_options={"sample_rate": 1.0, "max_sequences_per_step": batch}))
    trainer.add_callback(tim)
    attached = _attached_recorder(tim)
    trainer.add_callback(attached)
    for default in (ProgressCallback, PrinterCallback):  # they print every step's log dict
        trainer.remove_callback(default)
    trainer.add_callback(_progress_callback(cfg.steps))
    quiet = logging.getLogger("tim_plugins.trl")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the audit table and diagnostics go to the report instead of the console
    try:
        t_train = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - t_train
    finally:
        quiet.setLevel(level)
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    summary = _summary(cfg, trainer, tim, attached, rollouts, model_path, train_seconds,
                       time.perf_counter() - t_start)
    from tim_plugins.report import build_report, verdict_for
    from tim_plugins.report.disagreements import dump_disagreements
    from tim_plugins.report.tokens import has_dump

    if has_dump(dump_dir):
        summary["disagreements"] = dump_disagreements(dump_dir, lambda ids: tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    summary["verdict"] = verdict_for(summary, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["report"] = str(build_report(out, out / "report.html", summary=summary))
    return summary


def _attached_recorder(tim):
    """A callback that lists what TIMCallback installed, right after its ``on_train_begin`` (the hooks are
    removed again at train end)."""
    from transformers import TrainerCallback

    class Attached(TrainerCallback):
        hooks: list[str] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.hooks = tim.installed

    return Attached()


def _summary(cfg, trainer, tim, attached, rollouts, model_path, train_seconds, total_seconds) -> dict:
    from tim_plugins.integrations.trl import TIMConfig

    history = [h for h in trainer.state.log_history if "loss" in h or "tim/tokens" in h]
    steps = [h for h in history if "step" in h]
    rollout_spec, trainer_spec = getattr(tim, "parity_specs", (None, None))
    defaults = TIMConfig().to_dict()
    config = tim.config.to_dict()
    # The demo's rollout copy runs in another dtype than the trainer on purpose: that is the mismatch it shows.
    why = (f"the {cfg.rollout_dtype} rollout is deliberate in this demo (--rollout-dtype {cfg.rollout_dtype}: a "
           f"{cfg.rollout_dtype} copy of the float32 policy samples)")
    deliberate = {} if cfg.rollout_dtype == "float32" else {"dtype-mismatch": why, "lm-head-precision-mismatch": why}
    return {
        "kind": "training",
        "title": f"TIM inside a GRPO run: {cfg.rollout_dtype} rollouts, float32 trainer",
        "framework": "trl",
        "deliberate": deliberate,
        "settings": {**asdict(cfg), "model_path": model_path, "trl_version": tim.trl_version,
                     "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
                     "optimizer_steps": trainer.state.global_step},
        "log_history": steps,
        "findings": [f.to_dict() for f in getattr(tim, "findings", [])],
        "own_audit": _own_audit(rollouts.model, trainer_spec),
        "attached": {
            "rollout_source": tim.rollout_source,
            "hooks": attached.hooks,
            "config_changed": {k: v for k, v in config.items() if v != defaults.get(k)},
            "config": config,
            "diagnostics": dict(tim.pipeline.diag),
            "parity_specs": {"rollout": _spec_dict(rollout_spec), "trainer": _spec_dict(trainer_spec)},
        },
        "timing": {"train_seconds": train_seconds, "total_seconds": total_seconds,
                   "rollout_seconds": rollouts.seconds, "rollout_tokens": rollouts.tokens},
        "dumps": {"all steps": "dump"},
    }


def _spec_dict(spec) -> dict | None:
    if spec is None:
        return None
    try:
        return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                for k, v in asdict(spec).items()}
    except TypeError:
        return {"spec": str(spec)}


def _own_audit(rollout_model, trainer_spec) -> list[dict]:
    """The parity audit of the rollout model this demo actually samples with against the callback's trainer
    spec: a custom ``rollout_func`` is opaque to the callback, which describes the rollout side as TRL's own."""
    if trainer_spec is None:
        return []
    from tim_plugins.parity.audit import audit
    from tim_plugins.parity.spec import spec_from_hf_model

    rollout = spec_from_hf_model(rollout_model, side="rollout", framework="hf-generate (demo rollout_func)",
                                 temperature=trainer_spec.temperature, logprobs_mode="processed_logprobs")
    return [f.to_dict() for f in audit(rollout, trainer_spec)]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="TIM inside a real GRPO run: TRL GRPOTrainer + TIMCallback on CPU, bf16 rollouts (~1-2 min).",
        description="A short TRL GRPOTrainer run on CPU with TIMCallback attached; writes OUT/report.html, "
                    "OUT/summary.json and OUT/dump/ and prints a verdict.")
    add_config_options(p, DemoConfig, {"rollout_dtype": _DTYPES})
    p.set_defaults(func=_main)


def _main(args) -> int:
    summary = run_demo(config_from_args(args, DemoConfig))
    v = summary["verdict"]
    print(f"\n{v['headline']}")
    for status, text, _ in v["lines"]:
        print(f"  [{status.upper():5}] {text}")
    for line in v.get("extra", []):
        print(f"  {line}")
    rows = summary.get("disagreements")
    if rows:
        from tim_plugins.report.disagreements import disagreements_text

        print("\nLargest disagreements (p rollout → p trainer, Δ log p, the token in ⟦ ⟧; the report lists more):")
        for line in disagreements_text(rows[:5]):
            print(f"  {line}")
    print(f"\nreport: {summary['report']}\nsummary: {Path(summary['report']).parent / 'summary.json'}")
    return 0
