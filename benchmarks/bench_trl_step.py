"""One GRPO step with vs without TIMCallback (default config: monitor + parity audit), same run, same data.

Both trainers use the same seed, so they sample the same tokens (tests/test_trl_callback.py checks the
numerics are identical): the difference is the callback's own cost (HF processed-log-prob recording, monitor
update, one host sync at each logging step). Rounds alternate plain / callback to share machine noise.
Goal: ratio (callback / plain, median seconds per optimizer step) <= 1.02.

    python -m benchmarks.bench_trl_step [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks._common import write_results


def _run(model_path: str, with_callback: bool, steps: int, batch: int, length: int, workdir: str) -> float:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import synthetic_prompts

    def reward(completions, **kwargs):
        return [float(len(c)) / 10.0 for c in completions]

    args = GRPOConfig(
        output_dir=workdir, use_cpu=True, bf16=False, per_device_train_batch_size=batch, num_generations=batch,
        max_completion_length=length, max_steps=steps + 1, logging_steps=1, report_to=[], save_strategy="no",
        gradient_checkpointing=False, learning_rate=1e-5, seed=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": synthetic_prompts(64)}))
    if with_callback:
        trainer.add_callback(TIMCallback(trainer, TIMConfig()))
    stamps = []

    from transformers import TrainerCallback

    class _Clock(TrainerCallback):  # wall time between optimizer-step ends, callbacks and logging included
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer.add_callback(_Clock())
    trainer.train()
    # the first step (warm-up, parity audit) is excluded: steps 2..steps+1
    per_step = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
    return statistics.median(per_step)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--model", default=None, help="model path (default: the toy model)")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    from tim_plugins.toy_model import build_toy_model

    model = args.model or str(build_toy_model())
    rounds, steps, batch, length = (2, 4, 8, 16) if args.quick else (4, 8, 8, 32)
    plain, tim = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = [(False, plain), (True, tim)] if r % 2 == 0 else [(True, tim), (False, plain)]
            for with_cb, sink in order:
                sink.append(_run(model, with_cb, steps, batch, length, os.path.join(tmp, f"r{r}{with_cb}")))
    result = {
        "plain_s_per_step": statistics.median(plain),
        "tim_s_per_step": statistics.median(tim),
        "ratio": statistics.median(tim) / statistics.median(plain),
        "goal": "ratio <= 1.02",
        "rounds": rounds, "steps_per_round": steps, "batch": batch, "max_completion_length": length,
        "plain_runs": plain, "tim_runs": tim, "device": "cpu",
    }
    result["meets_goal"] = result["ratio"] <= 1.02
    write_results("trl_step", result)
    print({k: result[k] for k in ("plain_s_per_step", "tim_s_per_step", "ratio", "meets_goal")})
    return result


if __name__ == "__main__":
    main()
