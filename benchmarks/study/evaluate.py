"""Evaluation of the trained policy itself: greedy and T = 1 completions of held-out prompts from the trainer's
own fp32 weights, every k optimizer steps, apart from the training reward (which is measured on the rollout
engine's samples, mismatched or not).

The evaluation never touches the training run's randomness: it saves and restores the global RNG state and
samples under its own fixed seed, so every arm is evaluated with the same random numbers at the same steps
(paired by construction), and calls the model class's ``generate``, so an engine patched onto the instance
(the bf16/fp16 rollout, the injector) is bypassed.
"""

from __future__ import annotations

import math
import time

__all__ = ["evaluate_policy", "EvalCallback", "EVAL_KEYS"]

# The per-evaluation metrics (prefix eval/<mode>/, mode greedy | sample).
EVAL_KEYS = ("reward", "error_frac", "length", "entropy")


def evaluate_policy(model, tokenizer, prompts: list[str], budget: int, *, temperature: float, seed: int,
                    batch_size: int = 64) -> dict[str, float]:
    """reward (valid prefix / budget, mean), error_frac (completions ended by a wrong token), length (tokens
    before EOS), entropy (mean per-token entropy of the policy over the completion tokens) of ``prompts``."""
    import torch

    from .task import VOCAB, chain_stats

    was_training = model.training
    model.eval()
    rng = torch.get_rng_state()
    rewards, errors, lengths, ent_sum, ent_n = [], [], [], 0.0, 0
    try:
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True).to(next(model.parameters()).device)
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
                dict(do_sample=False)
            with torch.no_grad():
                out = type(model).generate(model, **enc, max_new_tokens=budget, min_new_tokens=0,
                                           pad_token_id=tokenizer.pad_token_id, output_logits=True,
                                           return_dict_in_generate=True, **kw)
            comp = out.sequences[:, enc["input_ids"].shape[1]:].cpu()
            logits = torch.stack(out.logits, 1).float().cpu()  # raw (untempered) logits of the policy
            logp = torch.log_softmax(logits, -1)
            ent = -(logp.exp() * logp).sum(-1)  # [B, T]
            for i, prompt in enumerate(chunk):
                toks = [VOCAB[t] for t in comp[i].tolist()]
                n, _total, err, length = chain_stats(prompt, toks)
                rewards.append(n / budget)
                errors.append(float(err))
                lengths.append(length)
                upto = min(length + 1, ent.shape[1])
                ent_sum += float(ent[i, :upto].sum())
                ent_n += upto
    finally:
        torch.set_rng_state(rng)
        model.train(was_training)
    n = max(1, len(rewards))
    return {"reward": sum(rewards) / n, "error_frac": sum(errors) / n, "length": sum(lengths) / n,
            "entropy": ent_sum / ent_n if ent_n else math.nan}


class EvalCallback:
    """TrainerCallback: `evaluate_policy` (greedy and T = 1) before training and every ``every`` steps and at
    the last step; results in ``self.rows`` ([{"step", "eval/greedy/reward", ...}])."""

    def __new__(cls, tokenizer, prompts: list[str], budget: int, every: int, seed: int = 4321):
        from transformers import TrainerCallback

        class _Eval(TrainerCallback):
            def __init__(self):
                self.rows: list[dict] = []
                self.seconds = 0.0

            def _run(self, model, step: int) -> None:
                t0 = time.perf_counter()
                row = {"step": step}
                for mode, temp in (("greedy", 0.0), ("sample", 1.0)):
                    res = evaluate_policy(model, tokenizer, prompts, budget, temperature=temp, seed=seed)
                    row.update({f"eval/{mode}/{k}": v for k, v in res.items()})
                self.rows.append(row)
                self.seconds += time.perf_counter() - t0

            def on_train_begin(self, args, state, control, model=None, **kw):
                self._run(model, 0)

            def on_step_end(self, args, state, control, model=None, **kw):
                s = state.global_step
                if s % every == 0 or s == state.max_steps:
                    self._run(model, s)

        return _Eval()
