"""A user's first GRPOTrainer run with the monitor, in the user-stack environments of `make test-wheel`
(scripts/user_stack_check): run with the interpreter of a fresh virtualenv holding the user's TRL and transformers
and the built wheel, from outside the source tree, with no TIM_PLUGINS_SKIP_VERSION_CHECK in the environment.

The model is the package's toy model (built locally; the model hub is not reachable from CI). Asserts that tim/*
keys appear in ``trainer.state.log_history`` and prints one line `LABEL: 1 passed, 0 failed` (or `0 passed, 1
failed` with the reason) for scripts/suite to count. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

label = sys.argv[1] if len(sys.argv) > 1 else "user-stack grpo"


def main() -> None:
    if os.environ.get("TIM_PLUGINS_SKIP_VERSION_CHECK") and not os.environ.get("TIM_USER_STACK_ALLOW_SKIP"):
        raise SystemExit("TIM_PLUGINS_SKIP_VERSION_CHECK is set: this check must run without any override")

    import tim_plugins

    if "site-packages" not in str(Path(tim_plugins.__file__).resolve()):
        raise SystemExit(f"tim_plugins was imported from {tim_plugins.__file__}, not from the installed wheel")

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.integrations.trl import TIMCallback, TIMConfig
    from tim_plugins.toy_model import build_toy_model, synthetic_prompts

    def reward_digits(completions, **kwargs):
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    with tempfile.TemporaryDirectory(prefix="tim-user-stack-") as out:
        config = GRPOConfig(
            output_dir=out, max_steps=2, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, bf16=False, gradient_checkpointing=False,
        )
        trainer = GRPOTrainer(model=str(build_toy_model()), reward_funcs=reward_digits, args=config,
                              train_dataset=Dataset.from_dict({"prompt": synthetic_prompts(16)}))
        trainer.add_callback(TIMCallback(trainer, TIMConfig()))
        trainer.train()
    logged = sorted({k for h in trainer.state.log_history for k in h if k.startswith("tim/")})
    if not logged:
        raise SystemExit(f"no tim/* key in trainer.state.log_history: {trainer.state.log_history}")
    print(f"{label}: {len(logged)} tim/* keys logged, e.g. {logged[:3]}")


if __name__ == "__main__":
    try:
        main()
    except BaseException as err:  # one countable line whatever happened; the traceback above it
        import traceback

        traceback.print_exc()
        print(f"{label}: 0 passed, 1 failed ({type(err).__name__}: {str(err)[:300]})", flush=True)
        sys.exit(1)
    print(f"{label}: 1 passed, 0 failed", flush=True)
