"""GRPO with TIMCallback: mismatch metrics (and optional mitigations) on a TRL run.

    python integrations/trl/examples/grpo_with_tim.py                 # toy model, CPU, ~1 min
    python integrations/trl/examples/grpo_with_tim.py --model PATH    # a real local model
    python integrations/trl/examples/grpo_with_tim.py --safe-vocab --lr-decay --is-correction token_tis

Prints the tim/* metrics of each logged step; with --report-to wandb (WANDB_MODE=offline works) they and the
|Δ log p| / ratio histograms go to wandb.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local model path (default: the tim_plugins toy model)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output-dir", default="grpo_with_tim_out")
    p.add_argument("--use-vllm", action="store_true", help="vLLM colocate rollouts (GPU vLLM build)")
    p.add_argument("--safe-vocab", action="store_true", help="prune the tail on both sides (sets min_p=1e-4)")
    p.add_argument("--lr-decay", action="store_true", help="length-triggered LR decay")
    p.add_argument("--is-correction", default=None, help="token_tis | token_mis | icepop | seq_tis | seq_mis | geo_rs")
    p.add_argument("--report-to", default="none")
    args = p.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import build_toy_model, synthetic_prompts

    model = args.model or str(build_toy_model())
    prompts = synthetic_prompts(64)

    def reward_digits(completions, **kwargs):  # a toy reward: completions that contain digits
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, learning_rate=1e-4, logging_steps=1, save_strategy="no",
        report_to=[] if args.report_to == "none" else [args.report_to], use_cpu=not args.use_vllm,
        bf16=False, gradient_checkpointing=False, use_vllm=args.use_vllm,
        min_p=1e-4 if args.safe_vocab else None,
        vllm_importance_sampling_correction=args.is_correction is None,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_digits, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    # The three lines a user adds (import, config, add_callback):
    tim = TIMConfig(safe_vocab=args.safe_vocab, lr_decay=args.lr_decay, is_correction=args.is_correction)
    trainer.add_callback(TIMCallback(trainer, tim))
    trainer.train()

    keys = ("tim/tokens", "tim/token/abs_diff_p99", "tim/token/kl_k3", "tim/token/ratio_outside_frac")
    rows = [{k: h.get(k) for k in ("step",) + keys} for h in trainer.state.log_history if "tim/tokens" in h]
    for row in rows:
        print(row)
    return {"rows": rows, "trainer": trainer}


if __name__ == "__main__":
    main()
