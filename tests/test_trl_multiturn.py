"""Mismatch by turn of a multi-turn rollout through TRL's own GRPOTrainer (CPU, the toy model).

The rollout is TRL's documented ``rollout_func`` hook returning two model turns with an environment message between
them and ``env_mask`` (TRL turns it into ``tool_mask``: 1 for the model's tokens, 0 for the environment's), as an
environment / agent loop does. Each turn is sampled with the HF adapter's sampler from a copy of the policy;
the second turn's reported log-probs are shifted by DELTA (a turn-dependent mismatch of known size, as a serving
stack whose numerics drift with the context would give); the copy takes the trainer's weights at every call.

Reference, independent of tim's accumulators: per logged step, TRL's own tensors of the loss pass
(``sampling_per_token_logps``, the pass's per-token log-probs, ``completion_mask``, ``tool_mask``), each token's turn
counted in a plain Python loop over ``tool_mask``, and per turn the count, mean |d|, mean d, k3 and max |d| written
out in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from tim_plugins.by_key import turn_keys  # noqa: E402
from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from test_trl_callback import LR0, Capture, _logged, _loss_mask, _reward, make_trainer  # noqa: E402
from naive_turns import turns_naive  # noqa: E402

pytestmark = pytest.mark.trl

DELTA = 0.25  # added to the second turn's reported log-probs
ENV_TEXT = " ok then"  # the environment's message between the turns


class _TwoTurns:
    """``rollout_func``: turn 0, the environment's message, turn 1 conditioned on all of it."""

    def __init__(self, model_path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.calls = 0

    def _turn(self, ids: list[int], seed: int) -> tuple[list[int], list[float]]:
        from tim_plugins.integrations.hf.rollout import generate_with_logprobs

        x = torch.tensor([ids])
        out = generate_with_logprobs(self.model, x, torch.ones_like(x), max_new_tokens=4, temperature=1.0, seed=seed)
        keep = out.completion_mask[0].bool()
        return out.completion_ids[0][keep].tolist(), out.logprobs[0][keep].tolist()

    def __call__(self, prompts: list[str], trainer) -> dict:
        with torch.no_grad():  # the current policy's weights, as a serving engine holds them after a sync
            for dst, src in zip(self.model.parameters(), trainer.model.parameters()):
                dst.copy_(src.detach())
        tok = trainer.processing_class
        env = tok(ENV_TEXT, add_special_tokens=False)["input_ids"]
        prompt_ids, completion_ids, logprobs, env_mask = [], [], [], []
        for i, prompt in enumerate(prompts):
            ids = tok(prompt)["input_ids"]
            seed = 1000 * self.calls + i
            t0, lp0 = self._turn(ids, seed)
            t1, lp1 = self._turn(ids + t0 + env, seed + 500)
            prompt_ids.append(ids)
            completion_ids.append(t0 + env + t1)
            logprobs.append(lp0 + [0.0] * len(env) + [v + DELTA for v in lp1])
            env_mask.append([1] * len(t0) + [0] * len(env) + [1] * len(t1))
        self.calls += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                "env_mask": env_mask}


def test_turn_keys_count_environment_segments():
    m = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert turn_keys(m).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1], [0] * 8]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # property: the vectorised keys equal the token-by-token count
        m = (torch.rand(5, 17, generator=g) < 0.7).long()
        assert torch.equal(turn_keys(m), turns_naive(m))


def test_mismatch_by_turn_of_a_multi_turn_rollout_matches_trls_tensors(toy_model_path, tmp_path, monkeypatch):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.toy_model import synthetic_prompts

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's documented experimental hook
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1, report_to=[],
                      save_strategy="no", gradient_checkpointing=False, learning_rate=LR0, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(toy_model_path), reward_funcs=_reward, args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)}),
                          rollout_func=_TwoTurns(toy_model_path))
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()

    checked = 0
    for step, inputs, current in cap.losses:
        tool_mask = inputs.get("tool_mask")
        assert tool_mask is not None and not tool_mask.bool().all()  # TRL carried the env_mask as tool_mask
        mask = _loss_mask(inputs)
        turns = turns_naive(tool_mask)
        d = (current.double() - inputs["sampling_per_token_logps"].double())
        logged = _logged(trainer, step)
        want = {}
        for turn in sorted(set(turns[mask].tolist())):
            x = d[mask & (turns == turn)].numpy()
            p = f"tim/by_turn/{turn}"
            want.update({f"{p}/count": float(len(x)), f"{p}/abs_diff_mean": np.abs(x).mean(), f"{p}/mean": x.mean(),
                         f"{p}/kl_k3": np.mean(np.expm1(x) - x), f"{p}/abs_diff_max": np.abs(x).max()})
        assert {k for k in logged if k.startswith("tim/by_turn/")} == set(want), step
        for key, value in want.items():
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, key)
        # the second turn carries the shift: its mean d is about -DELTA, the first turn's about 0 (the same fp32
        # weights on both sides: generate's log-probs against the training forward)
        assert logged["tim/by_turn/1/mean"] == pytest.approx(-DELTA, abs=0.05), step
        assert abs(logged["tim/by_turn/0/mean"]) < 0.05 and logged["tim/by_turn/0/kl_k3"] < 1e-2, step
        assert logged["tim/by_turn/1/kl_k3"] > 10 * logged["tim/by_turn/0/kl_k3"], step
        assert not any(math.isnan(v) for k, v in logged.items() if k.startswith("tim/by_turn/")), step
        checked += 1
    assert checked == 2


def test_single_turn_batches_log_no_turn_keys(toy_model_path, tmp_path):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()
    row = _logged(trainer, 1)
    assert row["tim/tokens"] > 0 and not any(k.startswith("tim/by_turn/") for k in row)


def test_the_length_signal_of_truncated_multi_turn_completions_counts_the_models_tokens(toy_model_path, tmp_path,
                                                                                         monkeypatch):
    """``mask_truncated_completions=True`` with multi-turn completions (``env_mask``, TRL's ``tool_mask``): TRL's
    ``completions/mean_length`` counts each completion's model tokens (``sum(tool_mask)``), masked or not, and the
    LR decay's length signal is that value (what ``lr-replay`` reads). A truncated completion is masked whole, its
    ``tool_mask`` zeroed with it: the signal read its generated tokens instead, the environment's counted too."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from tim_plugins.toy_model import synthetic_prompts

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1, report_to=[],
                      save_strategy="no", gradient_checkpointing=False, learning_rate=LR0, seed=0, disable_tqdm=True,
                      mask_truncated_completions=True)
    rollout = _TwoTurns(toy_model_path)
    env_masks = []

    def recorded(prompts, trainer):
        out = rollout(prompts, trainer)
        env_masks.append(out["env_mask"])
        return out

    trainer = GRPOTrainer(model=str(toy_model_path), reward_funcs=_reward, args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": synthetic_prompts(64)}),
                          rollout_func=recorded)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, lr_decay=True,
                                                        lr_decay_options={"warmup_steps": 1, "window": 1})))
    trainer.train()
    rows = [_logged(trainer, step) for step in (1, 2)]
    assert all(h["completions/clipped_ratio"] > 0 for h in rows)  # truncated completions, masked whole
    for h, masks in zip(rows, env_masks):
        reference = float(np.mean([sum(m) for m in masks]))  # the model's tokens per completion
        assert h["completions/mean_length"] == pytest.approx(reference, rel=1e-6)
        assert h["tim/lr/window_length"] == pytest.approx(h["completions/mean_length"], rel=1e-12), h["step"]
