"""Exact (zero-mismatch) rollout sampler for HF causal LMs: a TIM-free baseline, slow by design.

Every decoding step runs the *trainer's own forward* on the full, fixed-shape buffer [B, P + T] (left-padded
prompt + right-padded completion; future positions hold `pad_token_id` with attention mask 0), without a KV
cache, and samples from ``log_softmax(logits.float() / T)``. Because the causal mask hides every future
position with the same additive constant whatever token sits there, and every kernel sees the same shapes,
the logits at position i are bitwise those of the trainer's forward over the finished buffer. A trainer that
recomputes

    logits = model(input_ids=[prompt | completion], attention_mask=[prompt_mask | completion_mask]).logits
    logp   = log_softmax(logits[:, P-1:-1].float() / T).gather(completion)

at the same padded shape reproduces the rollout log-probs bitwise (k3 exactly 0.0). `exact_logprobs` is
that recomputation; sampler and recomputation share the forward and the op (``rollout.scoring``:
``completion_logits`` + ``tempered_log_softmax``, i.e. ``score_completions``). Cost: T full forwards over
P + T tokens, i.e. O(T) times an incremental decode.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tim_plugins.rollout.scoring import completion_logits, score_completions, tempered_log_softmax

__all__ = ["exact_generate", "exact_logprobs", "left_padded"]


@torch.no_grad()
def exact_logprobs(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Trainer-side recomputation at the padded shape [B, P + T] (the same ops the sampler ran).

    Args:
        prompt_ids, prompt_mask: [B, P], left-padded.
        completion_ids, completion_mask: [B, T], right-padded.
    Returns:
        [B, T] float32 log-probs of the completion tokens (masked positions hold the value of the pad token).
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return score_completions(model, ids, mask, completion_ids.shape[1], temperature=temperature).logprobs


@torch.no_grad()
def exact_generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    pad_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions whose log-probs a trainer forward at shape [B, P + T] reproduces bitwise.

    Args:
        model: an HF causal LM in the trainer's dtype (its forward is the trainer's forward).
        input_ids, attention_mask: [B, P] left-padded prompts (mask defaults to all ones).
        max_new_tokens: T; the buffer shape [B, P + T] is fixed for the whole generation.
        temperature: sampling temperature; log-probs are those of softmax(logits / T). 0 = greedy.
        seed: the Gumbel noise comes from a CPU generator with this seed (deterministic).
        pad_token_id, eos_token_id: default to the model's generation config / config.
    Returns:
        (completion_ids [B, T] long, completion_mask [B, T] long, logprobs [B, T] float32). Positions after EOS
        have mask 0, token `pad_token_id` and log-prob 0.0. EOS itself is included with mask 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"exact_generate(max_new_tokens={max_new_tokens}): must be >= 1")
    if temperature < 0:
        raise ValueError(f"exact_generate(temperature={temperature}): must be >= 0 (0 = greedy)")
    cfg = getattr(model, "generation_config", None) or getattr(model, "config", None)
    if pad_token_id is None:
        pad_token_id = getattr(cfg, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None)
    if eos_token_id is None:
        eos_token_id = getattr(cfg, "eos_token_id", None)
    if isinstance(eos_token_id, (list, tuple)):
        eos_set = torch.tensor(list(eos_token_id), dtype=torch.long)
    else:
        eos_set = torch.tensor([] if eos_token_id is None else [eos_token_id], dtype=torch.long)
    if pad_token_id is None:
        pad_token_id = int(eos_set[0]) if eos_set.numel() else 0
    device = input_ids.device
    b, p = input_ids.shape
    t_max = int(max_new_tokens)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    ids = torch.full((b, p + t_max), int(pad_token_id), dtype=torch.long, device=device)
    mask = torch.zeros((b, p + t_max), dtype=attention_mask.dtype, device=device)
    ids[:, :p] = input_ids
    mask[:, :p] = attention_mask
    logprobs = torch.zeros((b, t_max), dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    eos_set = eos_set.to(device)
    for t in range(t_max):
        # The whole buffer every step, the trainer's forward, slice and op (log_softmax over [B, T, V], as
        # exact_logprobs computes it); keep only column t.
        step_logp = tempered_log_softmax(completion_logits(model, ids, mask, t_max), temperature)[:, t]
        if temperature == 0:
            tok = step_logp.argmax(dim=-1)
        else:
            # Gumbel-max: argmax(log p + G) ~ Categorical(p); noise drawn on CPU for determinism.
            u = torch.rand(step_logp.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
            gumbel = (-torch.log(-torch.log(u))).to(device)
            tok = (step_logp.double() + gumbel).argmax(dim=-1)
        tok = torch.where(done, torch.full_like(tok, int(pad_token_id)), tok)
        lp = step_logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        logprobs[:, t] = torch.where(done, torch.zeros_like(lp), lp)
        ids[:, p + t] = tok
        mask[:, p + t] = (~done).to(mask.dtype)
        if eos_set.numel():
            done = done | torch.isin(tok, eos_set)
        if bool(done.all()):
            break
    return ids[:, p:], mask[:, p:].long(), logprobs


def left_padded(prompt_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (id lists) as (ids, attention mask) [B, L], left-padded as transformers' generation pads them (what
    ``exact_generate`` takes)."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    return ids, attn
