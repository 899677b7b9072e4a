"""The tim engine inside verl 0.9.1's real FSDP2 engine on CPU (world size 1, gloo): safe-vocab log-probs and the
monitor against the core functions on the same tensors, and stock numerics when nothing is configured."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import TIMVerlConfig  # noqa: E402
from tim_plugins.metrics import mismatch_metrics  # noqa: E402
from tim_plugins.safe_vocab import safe_logprobs_from_logits  # noqa: E402

VOCAB = 383
MIN_P = 0.05  # large on purpose: the toy model is near uniform on random tokens, so pruning must bite
FP32_TOL = 2e-5  # packed sdpa vs a per-sequence HF forward, fp32 (measured ~8e-6)


@pytest.fixture(scope="module")
def dist():
    H.init_dist(port=29571)
    yield


@pytest.fixture(scope="module")
def engines(dist, toy_model_path):
    return {rp: H.build_engine(toy_model_path, remove_padding=rp) for rp in (True, False)}


@pytest.fixture(scope="module")
def batch():
    return H.make_batch(VOCAB, batch=4, seed=1)


def reference(model_path, raw, *, min_p: float, temperature: float = 1.0):
    """Per-sequence HF forward (no padding) → response-token log-probs [B, R] from the core functions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    attn, ids, resp_mask = raw["attention_mask"], raw["input_ids"], raw["response_mask"]
    prompt_len = raw["prompts"].shape[1]
    out = torch.zeros(resp_mask.shape, dtype=torch.float32)
    in_safe = torch.ones(resp_mask.shape, dtype=torch.bool)
    for i in range(ids.shape[0]):
        keep = attn[i].bool()
        seq = ids[i][keep]
        n_prompt = int(attn[i, :prompt_len].sum())
        n_resp = int(attn[i, prompt_len:].sum())
        with torch.no_grad():
            logits = model(seq.unsqueeze(0)).logits[0].float()
        rows = logits[n_prompt - 1 : n_prompt - 1 + n_resp]
        toks = seq[n_prompt : n_prompt + n_resp]
        res = safe_logprobs_from_logits(rows, toks, min_p=min_p, temperature=temperature)
        out[i, :n_resp] = res.logprobs
        in_safe[i, :n_resp] = res.in_safe
    return out, in_safe


@pytest.mark.parametrize("remove_padding", [True, False])
def test_unconfigured_engine_is_stock_verl(engines, batch, remove_padding):
    """Registered but not configured (and configured with pruning off): log-probs equal verl's own engine class
    on the same weights, bit for bit."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    eng = engines[remove_padding]
    td, _ = batch
    ours = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    stock = FSDPEngineWithLMHead.prepare_model_outputs  # the parent's method, called on the same module
    eng_cls = type(eng)
    try:
        eng.__class__ = FSDPEngineWithLMHead
        plain = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    finally:
        eng.__class__ = eng_cls
    assert stock is not eng_cls.prepare_model_outputs
    assert torch.equal(ours, plain)
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))  # monitor on, pruning off
    try:
        monitored = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    finally:
        eng._tim = None
    assert torch.equal(monitored, plain)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_safe_vocab_logprobs_and_monitor_match_core(engines, batch, toy_model_path, remove_padding):
    eng = engines[remove_padding]
    td, raw = batch
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}))
    try:
        out = H.infer(eng, td, use_remove_padding=remove_padding)
        got = H.old_log_probs_padded(out, td)
        metrics = eng.tim_pop_metrics()
    finally:
        eng._tim = None
    ref, ref_in_safe = reference(toy_model_path, raw, min_p=MIN_P)
    mask = raw["response_mask"].bool()
    assert (~ref_in_safe & mask).any(), "the test needs boundary tokens: raise MIN_P"
    assert (got - ref)[mask].abs().max().item() < FP32_TOL
    # the full-vocabulary log-prob differs by log Σ_S p on kept tokens: the pruning really happened
    keep = mask & ref_in_safe
    full, _ = reference(toy_model_path, raw, min_p=0.0)
    assert ((got - full)[keep] > 1e-4).all()

    # monitor: engine's DP-merged metrics vs the core function on the same tensors (boundary tokens excluded)
    want = mismatch_metrics(raw["rollout_log_probs"], ref, keep)
    for key in ("tim/tokens", "tim/token/abs_diff_max", "tim/token/kl_k3", "tim/token/ratio_min",
                "tim/seq/log_ratio_abs_max", "tim/by_prob/0-0.01/count"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    n_valid = int(mask.sum())
    assert metrics["tim/safe_vocab/tokens"] == n_valid
    assert metrics["tim/safe_vocab/boundary_frac"] == pytest.approx(float((mask & ~ref_in_safe).sum()) / n_valid)
    assert 0.0 < metrics["tim/safe_vocab/pruned_mass_mean"] < metrics["tim/safe_vocab/pruned_mass_max"] < 1.0
    assert metrics["tim/safe_vocab/size_mean"] < VOCAB


def test_boundary_tokens_leave_the_loss(engines, batch):
    """Training pass with pruning: the gradient equals the one of a batch whose boundary tokens are masked by
    hand (so they contributed nothing), and the step stays finite."""
    eng = engines[True]
    td, raw = batch
    eng.tim_configure(TIMVerlConfig.from_node({"safe_vocab": {"min_p": MIN_P}}))
    try:
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        out, _ = H.train_step(eng, td, old)
    finally:
        eng._tim = None
    metrics = out["metrics"]
    assert math.isfinite(metrics["grad_norm"])
    # on-policy first step: ratio == 1 on every kept token, so the clip fraction is exactly 0
    assert float(torch.as_tensor(metrics["actor/ppo_kl"].values[0]).abs()) < 1e-6
