"""``tim_plugins.safe_head.kept_set_logprobs``: the one rule every adapter's safe-vocabulary head follows (the engine's
kept sets replayed where given, else the sampler's cut recomputed), for each head shape: full logits or hidden states
times the weight, on one device or over a tensor-parallel group (one rank here: the kernels' own multi-rank tests are
tests/test_safe_vocab_tp.py). References: a float64 log-softmax over the kept set written here, and the kernels the
adapters called before (bitwise, values and gradients)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from free_port import free_port
from tim_plugins.replay import KeptSets, replay_logprobs_from_hidden, replay_logprobs_from_logits
from tim_plugins.safe_head import kept_set_logprobs
from tim_plugins.safe_vocab import safe_linear_logprobs, safe_logprobs_from_logits
from tim_plugins.safe_vocab_tp import (replay_linear_logprobs_vocab_parallel, replay_logprobs_vocab_parallel,
                                       safe_linear_logprobs_vocab_parallel, safe_logprobs_vocab_parallel)
from tim_plugins.truncation import Truncation

N, H, V, T = 9, 8, 53, 0.7  # odd vocabulary
TRUNC = Truncation(min_p=0.05, top_k=11, top_p=0.9, temperature=1.3)  # its own temperature is not the head's
FIELDS = ("logprobs", "in_safe", "pruned_mass", "size", "entropy")


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group: the vocabulary-parallel kernels' collectives over a single shard."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    sets = [sorted({int(labels[i]), *torch.randperm(V, generator=g)[:4 + i].tolist()}) for i in range(N)]
    return hidden, weight, labels, KeptSets.from_lists(sets), sets


def _same(got, ref, wrt):
    for key in FIELDS:
        assert torch.equal(getattr(got, key), getattr(ref, key)), key
    g1 = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), wrt, retain_graph=True)
    g2 = torch.autograd.grad(ref.logprobs.sum() + ref.entropy.sum(), wrt, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("head", ["logits", "hidden"])
@pytest.mark.parametrize("replayed", [True, False], ids=["replay", "recompute"])
@pytest.mark.parametrize("tp", [False, True], ids=["one-device", "vocab-parallel"])
def test_each_head_follows_the_rule(head, replayed, tp, request):
    hidden, weight, labels, kept, sets = _inputs()
    group = request.getfixturevalue("one_rank_group") if tp else None
    shard = dict(group=group, vocab_start=0) if tp else {}
    cut = dataclasses.replace(TRUNC, temperature=T)
    logits = hidden @ weight.t()
    source = dict(logits=logits) if head == "logits" else dict(hidden=hidden, weight=weight)
    got = kept_set_logprobs(labels, TRUNC, kept if replayed else None, temperature=T, compute_entropy=True,
                            **source, **shard)
    if head == "logits":
        if replayed:
            kernel = replay_logprobs_vocab_parallel if tp else replay_logprobs_from_logits
            ref = kernel(logits, labels, kept, temperature=T, compute_entropy=True, **shard)
        elif tp:
            ref = safe_logprobs_vocab_parallel(logits, labels, cut, compute_entropy=True, **shard)
        else:
            ref = safe_logprobs_from_logits(logits, labels, min_p=cut.min_p, temperature=T, top_p=cut.top_p,
                                            top_k=cut.top_k, order=cut.order, compute_entropy=True)
    else:
        if replayed:
            kernel = replay_linear_logprobs_vocab_parallel if tp else replay_logprobs_from_hidden
            ref = kernel(hidden, weight, labels, kept, temperature=T, compute_entropy=True, **shard)
        elif tp:
            ref = safe_linear_logprobs_vocab_parallel(hidden, weight, labels, cut, compute_entropy=True, **shard)
        else:
            ref = safe_linear_logprobs(hidden, weight, labels, cut, compute_entropy=True)
    _same(got, ref, (hidden, weight))
    # and what the rule means, in float64: replayed, a log-softmax over the engine's set
    if replayed:
        z = (logits.detach().double() / T)
        for i, s in enumerate(sets):
            want = z[i, labels[i]] - torch.logsumexp(z[i, s], 0)
            assert abs(float(got.logprobs[i].detach()) - float(want)) < 1e-5 and int(got.size[i]) == len(s)


def test_a_head_needs_logits_or_hidden_states_with_the_weight():
    hidden, weight, labels, kept, _ = _inputs()
    for bad in (dict(), dict(hidden=hidden), dict(logits=hidden @ weight.t(), hidden=hidden, weight=weight)):
        with pytest.raises(ValueError, match="takes logits, or hidden states with the output weight"):
            kept_set_logprobs(labels, TRUNC, kept, **bad)
