"""Test helper: the safe vocabulary's float64 reference on full logits, written naively from the engines' rules
(softmax; min-p as p >= min_p * p_max; top-k as the k-th largest and its ties; top-p by an ascending sort and vLLM's
cumulative rule, the cut's ties kept; vLLM order min-p, top-k, top-p or HF order top-k, top-p, min-p), and the
replay of an engine's kept sets (a masked log-softmax). Used by ``tests/test_safe_vocab_tp.py``,
``tests/test_replay.py`` and the Megatron suite (``tests/megatron_suite``)."""

from __future__ import annotations

import math

import torch

__all__ = ["dense_kept", "replay_reference", "safe_vocab_reference"]


def replay_reference(logits, tokens, keep, temperature):
    """float64 masked log-softmax over ``keep`` (a dense [N, V] bool; empty rows keep everything), autograd-able:
    (log-prob, entropy, pruned mass, the kept mask)."""
    keep = keep | ~keep.any(-1, keepdim=True)
    z = logits.double() / temperature
    lp_all = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    lp = lp_all.gather(-1, tokens[:, None]).squeeze(-1)
    ent = -(lp_all.exp() * lp_all.masked_fill(~keep, 0)).sum(-1)
    pruned = 1 - torch.softmax(z, -1).masked_fill(~keep, 0).sum(-1)
    return lp, ent, pruned, keep


def dense_kept(kept, vocab: int) -> torch.Tensor:
    """A ``KeptSets`` as a dense [N, V] bool mask (an empty row stays all False)."""
    m = torch.zeros(len(kept), vocab, dtype=torch.bool)
    for i, ids in enumerate(kept.to_lists()):
        m[i, ids] = True
    return m


def safe_vocab_reference(logits: torch.Tensor, tokens: torch.Tensor, trunc):
    """float64, the engines' rules on the full rows: (log-prob, entropy, in S, pruned mass, |S|, the kept mask), the
    first two differentiable w.r.t. ``logits``."""
    z = logits.double() / trunc.temperature
    zd = z.detach()
    keep = torch.ones_like(zd, dtype=torch.bool)

    def min_p():
        if trunc.min_p > 0:
            p = zd.softmax(-1)
            keep.logical_and_(p >= trunc.min_p * p.amax(-1, keepdim=True))

    def top_k():
        if 0 < trunc.k < zd.shape[1]:
            kth = zd.sort(-1, descending=True).values[:, trunc.k - 1 : trunc.k]
            keep.logical_and_(zd >= kth)

    def top_p():
        if trunc.top_p < 1:
            masked = zd.masked_fill(~keep, -math.inf)
            asc = masked.sort(-1).values
            cum = asc.softmax(-1).cumsum(-1)
            drop = cum <= 1 - trunc.top_p
            drop[:, -1] = False
            cut = asc.gather(-1, drop.sum(-1, keepdim=True))  # the smallest kept value: its ties are kept too
            keep.logical_and_(zd >= cut)

    for step in ((min_p, top_k, top_p) if trunc.order == "vllm" else (top_k, top_p, min_p)):
        step()
    logq = z - z.masked_fill(~keep, -math.inf).logsumexp(-1, keepdim=True)
    q = torch.where(keep, logq.exp(), 0.0)
    entropy = -torch.where(keep, q * logq, 0.0).sum(-1)
    logp = logq.gather(-1, tokens[:, None]).squeeze(-1)
    pruned = 1 - torch.where(keep, zd.softmax(-1), 0.0).sum(-1)
    return logp, entropy, keep.gather(-1, tokens[:, None]).squeeze(-1), pruned, keep.sum(-1), keep
