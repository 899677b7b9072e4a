"""Exact sampler: a plain trainer forward at the padded shape reproduces the rollout log-probs bitwise."""

from __future__ import annotations

import pytest
import torch

from tim_plugins.metrics import mismatch_metrics
from tim_plugins.rollout.exact import exact_generate, exact_logprobs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(toy_model_path):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(toy_model_path)
    t.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def prompts(tok):
    from tim_plugins.toy_model import synthetic_prompts

    return tok(synthetic_prompts(6, seed=4), return_tensors="pt", padding=True)


_MODELS: dict = {}


def _load(path, dtype):
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype)
    if key not in _MODELS:  # one load per dtype for the module
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return _MODELS[key]


def _trainer_logprobs(model, prompt_ids, prompt_mask, completion, completion_mask, temperature):
    """What a trainer computes (written here independently): one forward over [B, P + T], then log_softmax."""
    ids = torch.cat([prompt_ids, completion], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    p = prompt_ids.shape[1]
    return torch.log_softmax(logits[:, p - 1:-1].float() / temperature, dim=-1).gather(
        -1, completion.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_recompute_is_bitwise_equal(toy_model_path, prompts, dtype):
    model = _load(toy_model_path, dtype)
    completion, cmask, logp = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=12,
                                             temperature=0.9, seed=7, eos_token_id=-1)  # no EOS: all 20 tokens
    assert completion.shape == (6, 12) and cmask.sum() == 72
    train = _trainer_logprobs(model, prompts.input_ids, prompts.attention_mask, completion, cmask, 0.9)
    assert torch.equal(train, logp)
    metrics = mismatch_metrics(logp, train, cmask.bool())
    assert metrics["tim/token/kl_k3"] == 0.0
    assert metrics["tim/token/abs_diff_max"] == 0.0
    assert metrics["tim/tokens"] == 72
    assert torch.equal(exact_logprobs(model, prompts.input_ids, prompts.attention_mask, completion, cmask,
                                      temperature=0.9), logp)


def test_incremental_decoding_is_not_bitwise(toy_model_path, prompts):
    """The contrast the exact mode removes: re-scoring the same tokens with a KV cache (as HF generate does)."""
    model = _load(toy_model_path, torch.bfloat16)
    completion, cmask, logp = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=10,
                                             temperature=1.0, seed=1, eos_token_id=-1)
    with torch.no_grad():
        out = model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask, use_cache=True)
        past, mask, steps = out.past_key_values, prompts.attention_mask, [out.logits[:, -1]]
        for t in range(completion.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(input_ids=completion[:, t:t + 1], attention_mask=mask, past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[:, -1])
    inc = torch.log_softmax(torch.stack(steps, 1).float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    k3 = mismatch_metrics(inc, logp, cmask.bool())["tim/token/kl_k3"]
    assert k3 > 0.0  # bf16 incremental decoding does not reproduce the full forward bitwise


def test_deterministic_under_seed_and_eos_masking(toy_model_path, prompts):
    model = _load(toy_model_path, torch.float32)
    a = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=12, temperature=1.0, seed=3)
    b = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=12, temperature=1.0, seed=3)
    c = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=12, temperature=1.0, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    completion, cmask, logp = a
    eos = model.generation_config.eos_token_id
    for row in range(completion.shape[0]):
        hits = (completion[row] == eos).nonzero()
        if len(hits):
            first = int(hits[0])
            assert cmask[row, : first + 1].all() and not cmask[row, first + 1:].any()
            assert (logp[row, first + 1:] == 0).all()
    train = _trainer_logprobs(model, prompts.input_ids, prompts.attention_mask, completion, cmask, 1.0)
    assert mismatch_metrics(logp, train, cmask.bool())["tim/token/kl_k3"] == 0.0


def test_samples_follow_the_model_distribution(toy_model_path, tok):
    """One step from 3000 copies of a prompt: token frequencies match softmax(logits / T) (chi-square)."""
    model = _load(toy_model_path, torch.float32)
    enc = tok(["Q: 3 + 4 = ? A:"], return_tensors="pt")
    n = 3000
    ids, mask = enc.input_ids.repeat(n, 1), enc.attention_mask.repeat(n, 1)
    completion, _, _ = exact_generate(model, ids, mask, max_new_tokens=1, temperature=1.5, seed=0)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=enc.input_ids).logits[0, -1].double() / 1.5, -1)
    counts = torch.bincount(completion[:, 0], minlength=probs.numel()).double()
    keep = probs * n >= 5  # chi-square over well-populated cells, the rest pooled
    expected = torch.cat([probs[keep] * n, (probs[~keep].sum() * n).view(1)])
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = int(keep.sum())
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 sigma above the mean of chi2(dof)


def test_greedy_is_argmax(toy_model_path, prompts):
    model = _load(toy_model_path, torch.float32)
    completion, cmask, logp = exact_generate(model, prompts.input_ids, prompts.attention_mask, max_new_tokens=1,
                                             temperature=0.0)
    with torch.no_grad():
        logits = model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask).logits[:, -1]
    assert torch.equal(completion[:, 0], logits.argmax(-1))


def test_rejects_bad_arguments(toy_model_path, prompts):
    model = _load(toy_model_path, torch.float32)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        exact_generate(model, prompts.input_ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        exact_generate(model, prompts.input_ids, max_new_tokens=2, temperature=-1)
