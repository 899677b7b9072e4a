"""The one trainer-scoring function (``tim_plugins.rollout.scoring``) against references computed here: each row
alone and unpadded through the model, log-softmax in float64, the entropy as −Σ p log p."""

from __future__ import annotations

import pytest
import torch

from tim_plugins.rollout.scoring import score_completions

pytest.importorskip("transformers")

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model(toy_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()


def _batch(vocab: int):
    """Left-padded prompts of lengths 5, 3, 1 (pad id 0) and a 6-token completion per row."""
    g = torch.Generator().manual_seed(7)
    lengths, P, T = (5, 3, 1), 5, 6
    prompt = torch.zeros(3, P, dtype=torch.long)
    prompt_mask = torch.zeros(3, P, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompt[b, P - n:] = torch.randint(3, vocab, (n,), generator=g)
        prompt_mask[b, P - n:] = 1
    completion = torch.randint(3, vocab, (3, T), generator=g)
    return prompt, prompt_mask, completion


def _reference(model, prompt, prompt_mask, completion):
    """Per row: the unpadded sequence alone, float64 tempered log-softmax at the completion positions."""
    rows = []
    for b in range(prompt.shape[0]):
        ids = torch.cat([prompt[b][prompt_mask[b].bool()], completion[b]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        p = int(prompt_mask[b].sum())
        rows.append(torch.log_softmax(logits[p - 1: p - 1 + completion.shape[1]] / TEMPERATURE, dim=-1))
    return torch.stack(rows)


def test_generate_positions_score_each_row_as_if_alone(model):
    """With ``positions_from_mask`` a left-padded row scores as the same sequence alone (fp32 vs float64 ref)."""
    prompt, prompt_mask, completion = _batch(model.config.vocab_size)
    ids = torch.cat([prompt, completion], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
    with torch.no_grad():
        s = score_completions(model, ids, mask, completion.shape[1], temperature=TEMPERATURE,
                              positions_from_mask=True, entropy=True, full=True)
    ref = _reference(model, prompt, prompt_mask, completion)
    sampled = ref.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == completion.shape
    torch.testing.assert_close(s.logprobs.double(), sampled, rtol=0, atol=2e-5)
    torch.testing.assert_close(s.full_logprobs.double(), ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(s.entropy.double(), -(ref.exp() * ref).sum(-1), rtol=0, atol=2e-5)


def test_default_positions_match_for_an_unpadded_row_and_grads_flow(model):
    """The exact sampler's positions (the model's default) equal generate's on a row without padding; the scores
    carry gradients when they are on (the TRL adapter's loss forward goes through this function)."""
    prompt, prompt_mask, completion = _batch(model.config.vocab_size)
    ids = torch.cat([prompt, completion], dim=1)[:1]
    mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)[:1]
    plain = score_completions(model, ids, mask, completion.shape[1], temperature=TEMPERATURE)
    with torch.no_grad():
        generate = score_completions(model, ids, mask, completion.shape[1], temperature=TEMPERATURE,
                                     positions_from_mask=True)
    assert torch.equal(plain.logprobs.detach(), generate.logprobs)
    assert plain.entropy is None and plain.full_logprobs is None
    plain.logprobs.sum().backward()
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    model.zero_grad(set_to_none=True)
