"""One TRL GRPO step: plain vs TIMCallback(TIMConfig()) vs TIMCallback(TIMConfig(safe_vocab=True)), same seed.

Arms (the same GRPOConfig, with ``min_p = DEFAULT_MIN_P`` so every arm samples from the same pruned
distribution; only the callback differs):
  plain  no callback
  tim    ``TIMCallback(trainer, TIMConfig())``: HF processed log-prob recording, monitor, parity audit
  safe   ``TIMCallback(trainer, TIMConfig(safe_vocab=True))``: the above + the safe-vocab lm_head log-probs
Models:
  cpu    the toy model (``tim_plugins.toy_model``: Qwen2, H 64, V 383, fp32), 8 completions × 32 tokens
  cuda   a Qwen2-0.5B-shaped model with random weights in bf16 (``Qwen2Config`` with Qwen2-0.5B's sizes:
         24 layers, H 896, FFN 4864, 14 heads, 2 KV heads, V 151,936, tied embeddings) and a synthetic word-level
         tokenizer of exactly 151,936 tokens (no hub access needed); HF bf16 generation; 8 prompts × 8
         completions × 256 tokens per step
Method: rounds interleave the arms (order rotated each round); every run is a fresh trainer from the same seed;
step time = wall time between optimizer-step ends (CUDA synchronised; the process CPU time too), the first
``--skip`` steps of each run excluded (warm-up, parity audit); a run's figure is its median step. CPU runs use
one torch thread (``--threads``). Ratios: median over rounds of each arm / median of plain, and the per-round
paired ratios for their spread. Phases: TRL times its own blocks (``trl.extras.profiling.ProfilingContext``,
which reports only to wandb / mlflow / trackio); the benchmark records those durations per step, so a step
splits into generation (``transformers.generate``) and the rest (scoring, loss, backward, optimizer, callbacks).
Host-bound HF generation varies by ±15 % between steps on a shared machine, which hides a 2 % effect in the
step ratio; the rest of the step is GPU-bound and steadier, and the callback adds work in both.
Goals (issue 25): tim / plain <= 1.02, safe / plain <= 1.05; (issue 31) the safe arm's TRL
``_get_per_token_logps_and_entropies`` phase (every scoring forward of the step) <= 1.10 × plain's.

    python -m benchmarks.bench_trl_step [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import spread, write_results

ARMS = ("plain", "tim", "safe")
GOALS = {"tim": 1.02, "safe": 1.05}
# TRL's profiled log-prob phase (every forward that scores tokens: old/ref log-probs and the loss forward), and the
# goal for the safe arm's phase over plain's (issue 31: safe vocabulary adds no forward of its own)
LOGPS_PHASE = "._get_per_token_logps_and_entropies"
LOGPS_GOAL = 1.10
# Qwen2-0.5B (Qwen/Qwen2-0.5B config.json)
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
# per device: rounds, measured steps per run, prompts per step, completions per prompt, completion tokens
SETTINGS = {
    "cpu": dict(rounds=7, steps=30, prompts=1, generations=8, length=32),
    "cuda": dict(rounds=5, steps=3, prompts=8, generations=8, length=256),
}
QUICK = {
    "cpu": dict(rounds=2, steps=3, prompts=1, generations=4, length=8),
    "cuda": dict(rounds=2, steps=2, prompts=8, generations=8, length=128),
}


def build_qwen2_05b_shaped(path: Path, *, vocab_size: int = QWEN2_05B["vocab_size"], num_layers: int | None = None,
                           seed: int = 0) -> Path:
    """Save a random-weight bf16 Qwen2-0.5B-shaped model and a word-level tokenizer of ``vocab_size`` tokens.

    Token i is the word ``t{i}`` (0 = end of text, 1 = padding), so prompts and completions round-trip through
    the tokenizer whatever ids the random model samples.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {"<|endoftext|>": 0, "<|pad|>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf_tok.padding_side = "left"
    sizes = dict(QWEN2_05B, vocab_size=vocab_size)
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    config = Qwen2Config(**sizes, eos_token_id=0, pad_token_id=1, bos_token_id=0)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 1
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    del model
    return path


def _prompts(n: int, vocab_size: int, words: int = 16, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, vocab_size)}" for _ in range(words)) for _ in range(n)]


def _run(model_path: str, arm: str, steps: int, skip: int, settings: dict, device: str, workdir: str,
         prompts: list[str]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras.profiling import ProfilingContext

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.safe_vocab import DEFAULT_MIN_P

    def reward(completions, **kwargs):
        return [float(len(c)) / 10.0 for c in completions]

    cuda = device == "cuda"
    batch = settings["prompts"] * settings["generations"]
    args = GRPOConfig(
        output_dir=workdir, use_cpu=not cuda, bf16=cuda, per_device_train_batch_size=batch,
        num_generations=settings["generations"], max_completion_length=settings["length"],
        max_steps=steps + skip, logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=False,
        learning_rate=1e-6 if cuda else 1e-5, seed=0, disable_tqdm=True, min_p=DEFAULT_MIN_P,
        model_init_kwargs={"dtype": "bfloat16"} if cuda else None,
    )
    # the tokenizer by its own class: AutoTokenizer would map the Qwen2 config to Qwen2's BPE tokenizer class
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    if arm != "plain":
        trainer.add_callback(TIMCallback(trainer, TIMConfig(safe_vocab=arm == "safe")))
    stamps, cpu_stamps, phases, pending = [], [], [], {}

    class _Clock(TrainerCallback):  # time between optimizer-step ends, callbacks and logging included
        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())
            phases.append(dict(pending))
            pending.clear()

    def record(ctx, duration):  # TRL's profiled blocks of this step, by name ("GRPOTrainer.transformers.generate")
        pending[ctx.name] = pending.get(ctx.name, 0.0) + duration
        pending[ctx.name + " calls"] = pending.get(ctx.name + " calls", 0) + 1
        return log_metrics(ctx, duration)

    trainer.add_callback(_Clock())
    # BENCHMARK_SOURCES trl.extras.profiling:ProfilingContext._log_metrics (every profiled block's duration)
    log_metrics = ProfilingContext._log_metrics
    ProfilingContext._log_metrics = record
    try:
        trainer.train()
    finally:
        ProfilingContext._log_metrics = log_metrics
    # stamps[i] ends step i + 1; the first step has no start stamp, so the diffs are steps 2, 3, ...
    per_step = [b - a for a, b in zip(stamps[:-1], stamps[1:])][skip - 1:]
    cpu_per_step = [b - a for a, b in zip(cpu_stamps[:-1], cpu_stamps[1:])][skip - 1:]
    gen_per_step = [sum(v for k, v in ph.items() if k.endswith(".generate")) for ph in phases[1:]][skip - 1:]
    logps_per_step = [sum(v for k, v in ph.items() if k.endswith(LOGPS_PHASE)) for ph in phases[1:]][skip - 1:]
    logps_calls = [sum(v for k, v in ph.items() if k.endswith(LOGPS_PHASE + " calls")) for ph in phases[1:]][skip - 1:]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    out = {"step_s": statistics.median(per_step), "steps_s": per_step,
           "cpu_step_s": statistics.median(cpu_per_step), "cpu_steps_s": cpu_per_step,
           "generate_s": statistics.median(gen_per_step), "generate_steps_s": gen_per_step,
           "rest_s": statistics.median([a - b for a, b in zip(per_step, gen_per_step)]),
           "logps_s": statistics.median(logps_per_step), "logps_steps_s": logps_per_step,
           "logps_calls_per_step": sorted(set(logps_calls)),  # scoring forwards TRL ran per step
           "phases_s": phases[1:][skip - 1:],
           "completion_length": statistics.mean(h.get("completions/mean_length", float("nan")) for h in logged),
           # what the arm logged of its own: none for plain, tim/... for the callback arms
           "tim_keys_logged": sorted({k for h in logged for k in h if k.startswith("tim/")})}
    if cuda:
        out["max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if arm == "safe":
        pm = [h["tim/safe_vocab/pruned_mass_mean"] for h in logged if "tim/safe_vocab/pruned_mass_mean" in h]
        out["safe_vocab_pruned_mass_mean"] = statistics.mean(pm) if pm else None
        from tim_plugins import safe_vocab

        # which folds the safe head ran: Triton on CUDA unless they failed (then a warning, and torch)
        out["safe_vocab_folds"] = "torch" if not cuda or safe_vocab.fused_failure_count() else "triton"
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, steps and tokens")
    parser.add_argument("--model", default=None, help="model path (default: toy model on cpu, built on cuda)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run")
    parser.add_argument("--skip", type=int, default=1, help="steps excluded at the start of each run (>= 1)")
    parser.add_argument("--length", type=int, default=None, help="completion tokens")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on cpu: 1; the toy model's ops are too small for more, and "
                             "OpenMP barriers stall when other jobs share the cores)")
    parser.add_argument("--output", default=None, help="results path (default benchmarks/results/trl_step[_cuda].json)")
    args = parser.parse_args(argv)
    if args.skip < 1:
        parser.error(f"--skip={args.skip}: must be >= 1 (the first step includes the warm-up and parity audit)")
    os.environ.setdefault("WANDB_MODE", "offline")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    settings = dict((QUICK if args.quick else SETTINGS)[args.device])
    for key in ("rounds", "steps", "length"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    arms = ["plain", *[a for a in args.arms if a != "plain"]]
    runs = {arm: [] for arm in arms}
    load_start = os.getloadavg()
    name = "trl_step" + ("_cuda" if args.device == "cuda" else "") + ("_quick" if args.quick else "")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model, vocab = args.model, None
        elif args.device == "cuda":
            t0 = time.perf_counter()
            model = str(build_qwen2_05b_shaped(Path(tmp) / "qwen2-0.5b-shaped"))
            vocab = QWEN2_05B["vocab_size"]
            print(f"built the Qwen2-0.5B-shaped model in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            from tim_plugins.toy_model import build_toy_model

            model, vocab = str(build_toy_model()), None
        if vocab is None:
            from tim_plugins.toy_model import synthetic_prompts

            prompts = synthetic_prompts(64)
        else:
            prompts = _prompts(64, vocab)
        for r in range(settings["rounds"]):
            order = arms[r % len(arms):] + arms[: r % len(arms)]  # rotated: each arm takes each slot in turn
            for arm in order:
                res = _run(model, arm, settings["steps"], args.skip, settings, args.device,
                           os.path.join(tmp, f"r{r}{arm}"), prompts)
                runs[arm].append(res)
                print(f"round {r + 1} {arm:5s} {res['step_s']:.4f} s/step "
                      f"(steps {', '.join(f'{x:.4f}' for x in res['steps_s'])}; generation "
                      f"{', '.join(f'{x:.4f}' for x in res['generate_steps_s'])})", flush=True)
            # a run cut short keeps the rounds it finished
            _save(name, _summary(args, settings, arms, runs, load_start), args.output, complete=False)
    result = _summary(args, settings, arms, runs, load_start)
    path = _save(name, result, args.output, complete=True)
    print(json.dumps({k: result[k] for k in ("s_per_step", "ratios", "meets")}, indent=1, default=float))
    print(f"wrote {path}")
    return result


def _summary(args, settings: dict, arms: list[str], runs: dict, load_start) -> dict:
    import torch

    done = min(len(runs[arm]) for arm in arms)
    med = {arm: [x["step_s"] for x in runs[arm][:done]] for arm in arms}
    cpu = {arm: [x["cpu_step_s"] for x in runs[arm][:done]] for arm in arms}
    result = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": "toy (tim_plugins.toy_model)" if args.device == "cpu" and not args.model else (
            args.model or "Qwen2-0.5B-shaped, random bf16 weights, word-level tokenizer of 151,936 tokens"),
        "settings": settings, "skip": args.skip, "arms": arms,
        "torch_threads": torch.get_num_threads(),
        "s_per_step": {arm: spread(med[arm]) for arm in arms},
        "cpu_s_per_step": {arm: spread(cpu[arm]) for arm in arms},
        "ratios": {}, "runs": runs, "quick": bool(args.quick),
        "goals": {f"{arm}_over_plain": f"<= {g}" for arm, g in GOALS.items() if arm in arms},
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
    }
    gen = {arm: [x["generate_s"] for x in runs[arm][:done]] for arm in arms}
    rest = {arm: [x["rest_s"] for x in runs[arm][:done]] for arm in arms}
    logps = {arm: [x["logps_s"] for x in runs[arm][:done]] for arm in arms}
    result["logps_phase_s_per_step"] = {arm: spread(logps[arm]) for arm in arms}
    # how many scoring forwards each arm's steps ran (the same in every arm: the callback adds none)
    result["logps_calls_per_step"] = {arm: sorted({n for x in runs[arm][:done] for n in x["logps_calls_per_step"]})
                                      for arm in arms}
    result["generate_s_per_step"] = {arm: spread(gen[arm]) for arm in arms}
    result["rest_s_per_step"] = {arm: spread(rest[arm]) for arm in arms}
    for arm in arms[1:]:
        result["ratios"][f"{arm}_over_plain"] = statistics.median(med[arm]) / statistics.median(med["plain"])
        # by phase: the added time of each as a fraction of plain's whole step (they sum to the step's overhead)
        plain_step = statistics.median(med["plain"])
        result["ratios"][f"{arm}_generate_over_plain"] = statistics.median(gen[arm]) / statistics.median(gen["plain"])
        result["ratios"][f"{arm}_rest_over_plain"] = statistics.median(rest[arm]) / statistics.median(rest["plain"])
        result["ratios"][f"{arm}_rest_added_over_plain_step"] = (
            statistics.median(rest[arm]) - statistics.median(rest["plain"])) / plain_step
        result["ratios"][f"{arm}_generate_added_over_plain_step"] = (
            statistics.median(gen[arm]) - statistics.median(gen["plain"])) / plain_step
        result["ratios"][f"{arm}_over_plain_paired"] = spread([a / b for a, b in zip(med[arm], med["plain"])])
        result["ratios"][f"{arm}_logps_phase_over_plain"] = (
            statistics.median(logps[arm]) / statistics.median(logps["plain"]))
        result["ratios"][f"{arm}_logps_phase_over_plain_paired"] = spread(
            [a / b for a, b in zip(logps[arm], logps["plain"])])
        result["ratios"][f"{arm}_over_plain_cpu_time"] = statistics.median(cpu[arm]) / statistics.median(cpu["plain"])
        result["ratios"][f"{arm}_over_plain_cpu_time_paired"] = spread(
            [a / b for a, b in zip(cpu[arm], cpu["plain"])])
    result["meets"] = {f"{arm}_over_plain": result["ratios"][f"{arm}_over_plain"] <= GOALS[arm] for arm in arms[1:]}
    if "safe" in arms:
        result["goals"]["safe_logps_phase_over_plain"] = f"<= {LOGPS_GOAL}"
        result["meets"]["safe_logps_phase_over_plain"] = result["ratios"]["safe_logps_phase_over_plain"] <= LOGPS_GOAL
    # the flat headline key of earlier versions of this file (benchmarks/run_all.py reads *ratio* keys)
    if "tim" in arms:
        result["ratio"] = result["ratios"]["tim_over_plain"]
    return result


def _save(name: str, result: dict, output: str | None, *, complete: bool) -> Path:
    result["complete"] = complete
    return write_results(name, result, output)


if __name__ == "__main__":
    main()
