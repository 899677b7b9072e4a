"""Regenerate the lr-replay sample logs (deterministic): python tests/data/make_lr_replay_samples.py

One synthetic run, 200 steps, written in three trainer/export formats:
- steps 1-120: mean response length flat around 350 tokens (±4 % noise), with 1-step spikes (×3) at 30 and 75,
  a 2-step burst (×2.5) at 50-51, and missing values at 40 and 90-92;
- steps 121-200: a surge, +2.5 % per step (the pre-collapse pattern);
- k3 flat ~2e-4 then ×1.08 per step from step 111 (mismatch leads the length); grad norm ~0.3, ×1.05 from 126.
Files: lr_replay_trl.jsonl (TRL log_history rows, eval rows without a length interleaved),
lr_replay_verl.jsonl (verl FileLogger rows {"step", "data"}), lr_replay_wandb.csv (wandb UI CSV export).
"""

import csv
import json
import math
import random
from pathlib import Path

HERE = Path(__file__).parent
N, RAMP_START = 200, 121
GAPS = {40, 90, 91, 92}


def series():
    rng = random.Random(20240607)
    rows = []
    for step in range(1, N + 1):
        length = 350.0 * (1 + rng.gauss(0, 0.04))
        if step >= RAMP_START:
            length *= 1.025 ** (step - RAMP_START + 1)
        if step in (30, 75):
            length *= 3.0
        if step in (50, 51):
            length *= 2.5
        k3 = 2e-4 * (1 + rng.gauss(0, 0.15)) * (1.08 ** max(0, step - 110))
        grad = 0.3 * (1 + rng.gauss(0, 0.08)) * (1.05 ** max(0, step - 125))
        rows.append({"step": step, "length": None if step in GAPS else round(length, 2),
                     "k3": float(f"{k3:.5g}"), "grad_norm": float(f"{grad:.5g}")})
    return rows


def main():
    rows = series()
    with open(HERE / "lr_replay_trl.jsonl", "w") as fh:
        for r in rows:
            row = {"loss": 0.01, "grad_norm": r["grad_norm"], "learning_rate": 1e-6, "num_tokens": 1000.0 * r["step"],
                   "completions/mean_length": r["length"], "completions/min_length": None if r["length"] is None
                   else round(r["length"] * 0.3, 1), "epoch": r["step"] / N, "step": r["step"]}
            if r["length"] is None:
                del row["completions/mean_length"]
            fh.write(json.dumps(row) + "\n")
            if r["step"] % 50 == 0:  # an eval row at the same step, no length
                fh.write(json.dumps({"eval_loss": 0.5, "epoch": r["step"] / N, "step": r["step"]}) + "\n")
    with open(HERE / "lr_replay_verl.jsonl", "w") as fh:
        for r in rows:
            data = {"response_length/mean": r["length"] if r["length"] is not None else math.nan,
                    "actor/grad_norm": r["grad_norm"], "rollout_corr/k3_kl": r["k3"], "actor/lr": 1e-6}
            fh.write(json.dumps({"step": r["step"], "data": data}) + "\n")  # NaN written as a JSON NaN literal
    with open(HERE / "lr_replay_wandb.csv", "w", newline="") as fh:
        run = "grpo-qwen3-4b"
        cols = ["Step", f"{run} - train/completions/mean_length", f"{run} - train/completions/mean_length__MIN",
                f"{run} - train/completions/mean_length__MAX", f"{run} - train/grad_norm"]
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            L = r["length"]
            w.writerow([r["step"], "" if L is None else L, "" if L is None else round(L * 0.9, 2),
                        "" if L is None else round(L * 1.1, 2), r["grad_norm"]])


if __name__ == "__main__":
    main()
