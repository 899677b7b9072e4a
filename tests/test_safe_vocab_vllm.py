"""vLLM CPU build: processed sampled-token log-probs equal the trainer's safe log-probs (fp32, toy model)."""

from __future__ import annotations

import pytest
import torch

from tim_plugins.safe_vocab import DEFAULT_MIN_P, safe_logprobs_from_logits
from tim_plugins.truncation import Truncation, truncation_threshold

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm")
from tim_plugins.integrations.vllm.sampling import (  # noqa: E402
    check_vllm_engine,
    make_vllm_sampling_params,
    validate_vllm_pruning,
)

PROMPTS = ["the cat sat on the", "a b c d e f", "hello world, this is", "once upon a time"]


@pytest.fixture(scope="module")
def hf_model(toy_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    return tok, AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "min_p,top_k,top_p,temperature",
    [(0.05, 0, 1.0, 1.0), (DEFAULT_MIN_P, 0, 1.0, 0.8), (0.02, 20, 0.9, 0.7), (0.0, 0, 0.85, 1.0)],
)
def test_vllm_processed_logprobs_equal_safe_logprobs(vllm_llm, hf_model, min_p, top_k, top_p, temperature):
    tok, model = hf_model
    trunc = Truncation(min_p=min_p, top_k=top_k, top_p=top_p, temperature=temperature, order="vllm")
    assert check_vllm_engine(vllm_llm, trunc) == "processed_logprobs"
    sp = make_vllm_sampling_params(trunc, logprobs_mode="processed_logprobs", max_tokens=24, logprobs=0, seed=1,
                                   ignore_eos=True)
    prompts = [{"prompt_token_ids": tok(p)["input_ids"]} for p in PROMPTS]
    outs = vllm_llm.generate(prompts, sp, use_tqdm=False)
    worst, n_tokens, pruned_rows = 0.0, 0, 0
    for prompt, out in zip(prompts, outs):
        ids = list(prompt["prompt_token_ids"])
        comp = out.outputs[0]
        new = torch.tensor(comp.token_ids)
        engine_lp = torch.tensor([step[t].logprob for step, t in zip(comp.logprobs, comp.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + list(comp.token_ids)])).logits[0, len(ids) - 1 : -1]
        mine = safe_logprobs_from_logits(logits, new, min_p=min_p, temperature=temperature, top_k=top_k,
                                         top_p=top_p, order="vllm")
        assert mine.in_safe.all(), "vLLM sampled a token outside the trainer's fp32 safe set"
        worst = max(worst, (mine.logprobs - engine_lp).abs().max().item())
        n_tokens += new.numel()
        pruned_rows += int((mine.pruned_mass > 0).sum())
        # the comparison is informative: the full-vocab log-prob differs from what vLLM reports
        full = torch.log_softmax(logits / temperature, -1).gather(-1, new[:, None]).squeeze(-1)
        if min_p >= 0.02 or top_p < 1:
            assert (full - engine_lp).abs().max().item() > 1e-3
    print(f"vLLM processed vs safe: min_p={min_p} top_k={top_k} top_p={top_p} T={temperature}: "
          f"max |diff| {worst:.3g} over {n_tokens} tokens, {pruned_rows} rows pruned")
    assert n_tokens == 24 * len(PROMPTS)
    assert pruned_rows > 0
    assert worst < 1e-4, f"max |vLLM processed − safe| = {worst:.3g}"


def test_vllm_min_p_and_top_k_top_p_ops_match_threshold():
    """vLLM's own top-k/top-p op (``apply_top_k_top_p_pytorch``) after the min-p rule keeps {z >= tau}."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, 1001, generator=gen) * 3
    for min_p, k, p in [(0.01, 30, 0.8), (0.0, 50, 0.95), (0.1, 0, 0.5), (0.001, 5, 1.0)]:
        x = z.clone()
        probs = x.softmax(-1)  # vLLM MinPLogitsProcessor.apply, as written in builtin.py
        x.masked_fill_(probs < probs.amax(-1, keepdim=True) * min_p, -float("inf"))
        kt = torch.full((64,), k, dtype=torch.long) if k else None
        pt = torch.full((64,), p) if p < 1 else None
        kept = torch.isfinite(apply_top_k_top_p_pytorch(x, kt, pt, allow_cpu_sync=True))
        tau = truncation_threshold(z, Truncation(min_p=min_p, top_k=k, top_p=p))
        assert torch.equal(z >= tau[:, None], kept), (min_p, k, p)


def test_pruning_with_raw_logprobs_is_refused(vllm_llm):
    trunc = Truncation(min_p=0.05)
    with pytest.raises(ValueError, match=r"logprobs_mode='raw_logprobs'.*processed_logprobs"):
        validate_vllm_pruning(trunc, "raw_logprobs")
    with pytest.raises(ValueError, match="processed_logprobs"):
        make_vllm_sampling_params(trunc, logprobs_mode="raw_logits", max_tokens=4)
    with pytest.raises(ValueError, match="order='vllm'"):
        validate_vllm_pruning(Truncation(min_p=0.05, order="hf"), "processed_logprobs")
    # no truncation at T = 1: raw log-probs are fine (nothing to renormalise)
    validate_vllm_pruning(Truncation(), "raw_logprobs")
    # a temperature alone: raw log-probs are log_softmax(z), the sampled distribution log_softmax(z / T)
    with pytest.raises(ValueError, match=r"temperature=0.7.*processed_logprobs"):
        validate_vllm_pruning(Truncation(temperature=0.7), "raw_logprobs")
    validate_vllm_pruning(Truncation(temperature=0.7), "processed_logprobs")
    sp = make_vllm_sampling_params(trunc, logprobs_mode="processed_logprobs", max_tokens=4)
    assert (sp.min_p, sp.top_p, sp.top_k, sp.temperature) == (0.05, 1.0, 0, 1.0)
