"""Quickstart: TIMCallback on a GRPOTrainer run, the README's TRL example as a file that runs as it stands.

    python integrations/trl/examples/quickstart.py

Needs tim-plugins with its TRL extra (`pip install '.[trl]'` in a clone, docs/install.md); on CPU with the toy
model (built once, no download) it takes well under a minute. Everything between the two `quickstart` markers is
what the README shows (a test checks that they are the same text and runs this file).
"""

# --8<-- [start:quickstart]
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tim_plugins.integrations.trl import TIMCallback, TIMConfig
from tim_plugins.toy_model import build_toy_model, synthetic_prompts

model = str(build_toy_model())  # a small local model built once (no download); or your own model's path or name
dataset = Dataset.from_dict({"prompt": synthetic_prompts(16, kinds=("text",))})  # open-ended: answers vary in length


def reward_len(completions, **kwargs):  # a toy reward: completions of about 20 characters
    return [-abs(20 - len(c)) for c in completions]


args = GRPOConfig(output_dir="tim-quickstart", max_steps=3, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=16, logging_steps=1,
                  use_cpu=True, bf16=False)  # a CPU-only machine; drop this line's two on a GPU
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset)
trainer.add_callback(TIMCallback(trainer, TIMConfig()))  # monitor + parity audit; training unchanged
trainer.train()
# --8<-- [end:quickstart]

for entry in trainer.state.log_history:  # tim/... next to TRL's own metrics, at every logging step
    if "tim/tokens" in entry:
        print({k: entry[k] for k in ("step", "loss", "reward_std", "tim/tokens", "tim/token/kl_k3",
                                     "tim/token/abs_diff_p99")})
