"""Safe-vocabulary log-probs over a vocabulary split across tensor-parallel ranks (``tim_plugins.safe_vocab_tp``):
two gloo processes, each holding one shard of the same logits, against a float64 reference written here on the
full logits (softmax; min-p; top-k; top-p by an ascending sort and vLLM's cumulative rule; the renormalised
log-prob and entropy: ``safe_vocab_reference``), and its autograd gradient sliced to each shard. The fused head
(``safe_linear_logprobs_vocab_parallel``: hidden states and each rank's rows of the lm_head weight) against the same
reference on ``hidden @ W.T`` and the gradients w.r.t. the hidden states (the ranks' parts summed, as Megatron's
mapping sums them) and each shard's weight rows. The replay of an engine's kept sets over the same shards
(``replay_logprobs_vocab_parallel`` and its fused head) against a float64 masked log-softmax over the sets. One spawn
runs every case."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tim_plugins import safe_vocab_tp
from tim_plugins.safe_vocab import safe_logprobs_from_logits
from tim_plugins.replay import KeptSets
from tim_plugins.safe_vocab import safe_logprobs_from_hidden
from tim_plugins.safe_vocab_tp import (replay_linear_logprobs_vocab_parallel, replay_logprobs_vocab_parallel,
                                       safe_linear_logprobs_vocab_parallel, safe_logprobs_vocab_parallel)
from tim_plugins.truncation import Truncation

from free_port import free_port
from safe_vocab_reference import dense_kept, replay_reference, safe_vocab_reference

N = 40
# name -> (Truncation kwargs, shard widths, how the logits are drawn, chunk rows, candidates of the first top-p round)
CASES = {
    "min_p": (dict(min_p=0.05), (500, 500), "randn", None, None),
    "top_k": (dict(top_k=20), (500, 501), "randn", 7, None),
    "top_p": (dict(top_p=0.9, temperature=0.7), (300, 701), "randn", None, None),
    "top_p_retry": (dict(top_p=0.8, min_p=0.001), (500, 501), "randn", 9, 4),
    "top_k_top_p_vllm": (dict(min_p=0.02, top_k=50, top_p=0.8), (500, 501), "randn", None, None),
    "top_k_top_p_hf": (dict(min_p=0.02, top_k=50, top_p=0.8, order="hf"), (500, 501), "randn", None, None),
    "top_p_min_p_hf": (dict(min_p=0.01, top_p=0.7, order="hf"), (600, 401), "randn", None, None),
    # quantised logits: the k-th is tied beyond the k in many rows (top-k keeps the tie; the count is the row's)
    "tied_top_k_top_p": (dict(top_k=10, top_p=0.9), (500, 501), "ties", None, None),
    "top_k_beyond_vocab": (dict(top_k=1200, top_p=0.9), (500, 501), "randn", None, None),  # top-k keeps every logit
    "bf16": (dict(min_p=0.02, top_k=30), (500, 501), "bf16", None, None),  # the dtype of Megatron's logits
    "empty": (dict(min_p=0.05, top_p=0.9), (500, 501), "randn", None, None),
}


LOGPROB_ONLY = ("top_k", "top_p_min_p_hf")

# The fused head: name -> (Truncation kwargs, shard widths (rows of W per rank), dtype, chunk rows)
HIDDEN = 24
HIDDEN_CASES = {
    "min_p": (dict(min_p=0.05), (251, 250), torch.float32, None),
    # several chunks, each with its own collectives; the rollout's temperature
    "top_k_top_p": (dict(min_p=0.001, top_k=20, top_p=0.8, temperature=0.7), (251, 250), torch.float32, 7),
    "top_p": (dict(top_p=0.9), (200, 301), torch.float32, 16),
    # Megatron's bf16 head; hidden and W on a grid of 1/4 with |x| <= 1/2, so every logit (a multiple of 1/16, at
    # most 24/4 in size) is exact in bf16 and the reference's logits are the head's
    "bf16": (dict(min_p=0.02, top_k=30), (251, 250), torch.bfloat16, 9),
    "empty": (dict(min_p=0.05, top_p=0.9), (251, 250), torch.float32, None),
}


def _inputs(name: str):
    kwargs, widths, draw, _, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    vocab = sum(widths)
    n = 0 if name == "empty" else N
    logits = torch.randn(n, vocab, generator=g) * 2.5
    if draw == "ties":
        logits = (logits * 2).round() / 2
    if draw == "bf16":
        logits = logits.bfloat16()
    tokens = torch.randint(0, vocab, (n,), generator=g)
    tokens[: n // 2] = logits[: n // 2].argmax(-1)  # half the rows sample their top token (inside S)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return Truncation(**kwargs), widths, logits, tokens, g_lp, g_ent


# The replay: name -> (shard widths, temperature, chunk rows, fused head?)
REPLAY_CASES = {
    "logits": ((500, 501), 1.0, None, False),
    "logits_chunked": ((300, 701), 0.7, 7, False),
    "hidden": ((251, 250), 0.8, 9, True),
    # rows whose replayed set lies >= 120 nats (at T = 0.25) under a token the trainer ranks first, on either shard:
    # e^(z − row max) of every kept token underflows in fp32
    "logits_far": ((250, 251), 0.25, None, False),
}


def _replay_inputs(name: str):
    """Logits (or hidden states and W), tokens and kept sets as an engine hands them out: per row the k most likely
    tokens under a perturbed copy of the logits (another engine's numbers), plus the sampled token in most rows; a
    row outside its set, and rows without a recorded set (the whole vocabulary)."""
    widths, temperature, _, fused = REPLAY_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, "replay" + name)))
    vocab = sum(widths)
    if fused:
        hidden, weight = torch.randn(N, HIDDEN, generator=g), torch.randn(vocab, HIDDEN, generator=g) * 0.5
        logits = hidden @ weight.T
    else:
        hidden = weight = None
        logits = torch.randn(N, vocab, generator=g) * 2.5
    tokens = torch.randint(0, vocab, (N,), generator=g)
    engine = logits + 0.05 * torch.randn(logits.shape, generator=g)
    lists = []
    for i in range(N):
        if i in (3, 17):
            lists.append([])
            continue
        k = int(torch.randint(2, 60, (1,), generator=g))
        ids = engine[i].topk(k).indices.tolist()
        if i != 5:  # row 5: the token lies outside the engine's set
            ids = sorted(set(ids) | {int(tokens[i])})
        lists.append(ids)
    tokens[5] = int(engine[5].argsort()[0])  # the least likely token: not among row 5's top k
    if name == "logits_far":
        for i, top in ((7, 3), (8, 400), (9, 249), (10, 250)):  # the trainer's new top token, outside the set
            if top in lists[i]:
                lists[i].remove(top)
            logits[i, top] = logits[i].max() + 30.0
    return widths, temperature, logits, hidden, weight, tokens, KeptSets.from_lists(lists)


def _replay_case(name: str, rank: int) -> dict:
    widths, temperature, logits, hidden, weight, tokens, kept = _replay_inputs(name)
    chunk, fused = REPLAY_CASES[name][2], REPLAY_CASES[name][3]
    start = sum(widths[:rank])
    kwargs = dict(group=dist.group.WORLD, vocab_start=start, temperature=temperature, compute_entropy=True,
                  chunk_size=chunk)
    g = torch.Generator().manual_seed(11)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    if fused:
        h = hidden.clone().requires_grad_(True)
        w = weight[start : start + widths[rank]].clone().requires_grad_(True)
        res = replay_linear_logprobs_vocab_parallel(h, w, tokens, kept, **kwargs)
        leaves = (h, w)
    else:
        shard = logits[:, start : start + widths[rank]].clone().requires_grad_(True)
        res = replay_logprobs_vocab_parallel(shard, tokens, kept, **kwargs)
        leaves = (shard,)
    ((res.logprobs * g_lp).sum() + (res.entropy * g_ent).sum()).backward()
    return {"logprobs": res.logprobs.detach(), "in_safe": res.in_safe, "pruned_mass": res.pruned_mass,
            "size": res.size, "entropy": res.entropy.detach(), "grads": [x.grad for x in leaves],
            "g_lp": g_lp, "g_ent": g_ent}


def _hidden_inputs(name: str):
    kwargs, widths, dtype, _ = HIDDEN_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, "hidden" + name)))
    vocab, n = sum(widths), 0 if name == "empty" else N
    if dtype == torch.bfloat16:
        hidden = torch.randint(-2, 3, (n, HIDDEN), generator=g) / 4
        weight = torch.randint(-2, 3, (vocab, HIDDEN), generator=g) / 4
    else:
        hidden = torch.randn(n, HIDDEN, generator=g)
        weight = torch.randn(vocab, HIDDEN, generator=g) * 0.5
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    tokens[: n // 2] = (hidden[: n // 2].double() @ weight.double().T).argmax(-1)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return Truncation(**kwargs), widths, hidden, weight, tokens, g_lp, g_ent


def _hidden_case(name: str, rank: int) -> dict:
    trunc, widths, hidden, weight, tokens, g_lp, g_ent = _hidden_inputs(name)
    start = sum(widths[:rank])
    h = hidden.clone().requires_grad_(True)
    w = weight[start : start + widths[rank]].clone().requires_grad_(True)
    res = safe_linear_logprobs_vocab_parallel(h, w, tokens, trunc, group=dist.group.WORLD, vocab_start=start,
                                              compute_entropy=True, chunk_size=HIDDEN_CASES[name][3])
    ((res.logprobs * g_lp).sum() + (res.entropy * g_ent).sum()).backward()
    # the logits path on this shard's logits, as the model's output layer would hand them over
    logits = torch.mm(hidden, w.detach().t())
    via_logits = safe_logprobs_vocab_parallel(logits, tokens, trunc, group=dist.group.WORLD, vocab_start=start,
                                              compute_entropy=True)
    return {"logprobs": res.logprobs.detach(), "in_safe": res.in_safe, "pruned_mass": res.pruned_mass,
            "size": res.size, "entropy": res.entropy.detach(), "grad_h": h.grad, "grad_w": w.grad,
            "via_logits": (via_logits.logprobs, via_logits.entropy)}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, (_, _, _, chunk, candidates) in CASES.items():
            trunc, widths, logits, tokens, g_lp, g_ent = _inputs(name)
            start = sum(widths[:rank])
            shard = logits[:, start : start + widths[rank]].clone().requires_grad_(True)
            if candidates:
                safe_vocab_tp._TOP_P_CANDIDATES = candidates
            try:
                res = safe_logprobs_vocab_parallel(shard, tokens, trunc, group=dist.group.WORLD, vocab_start=start,
                                                   compute_entropy=True, chunk_size=chunk)
            finally:
                safe_vocab_tp._TOP_P_CANDIDATES = 256
            ((res.logprobs * g_lp).sum() + (res.entropy * g_ent).sum()).backward()
            results[name] = {"logprobs": res.logprobs.detach(), "in_safe": res.in_safe,
                             "pruned_mass": res.pruned_mass, "size": res.size, "entropy": res.entropy.detach(),
                             "grad": shard.grad}
            if name in LOGPROB_ONLY:  # the training pass without entropy: the log-prob's gradient alone
                alone = shard.detach().clone().requires_grad_(True)
                res = safe_logprobs_vocab_parallel(alone, tokens, trunc, group=dist.group.WORLD, vocab_start=start)
                assert res.entropy is None
                (res.logprobs * g_lp).sum().backward()
                results[name]["grad_logprob_only"] = alone.grad
        for name in HIDDEN_CASES:
            results["hidden/" + name] = _hidden_case(name, rank)
        for name in REPLAY_CASES:
            results["replay/" + name] = _replay_case(name, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _both_ranks(two_ranks, key: str):
    """Both ranks' results of one case; every rank of the group gets the same values."""
    a, b = two_ranks[0][key], two_ranks[1][key]
    for field in ("logprobs", "in_safe", "pruned_mass", "size", "entropy"):
        assert torch.equal(a[field], b[field]), field
    return a, b


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("safe_vocab_tp")
    mp.start_processes(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_shards_equal_the_float64_reference(two_ranks, name):
    trunc, widths, logits, tokens, g_lp, g_ent = _inputs(name)
    a, b = _both_ranks(two_ranks, name)
    full = logits.double().requires_grad_(True)
    logp, ent, in_s, pruned, size, keep = safe_vocab_reference(full, tokens, trunc)
    assert torch.equal(a["in_safe"], in_s) and torch.equal(a["size"], size)
    torch.testing.assert_close(a["logprobs"], logp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["entropy"], ent.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["pruned_mass"], pruned.float(), rtol=0, atol=1e-5)
    if name == "empty":
        assert a["logprobs"].shape == (0,) and a["grad"].shape == (0, widths[0])
        return
    (grad,) = torch.autograd.grad((logp * g_lp.double()).sum() + (ent * g_ent.double()).sum(), full,
                                  retain_graph=True)
    ours = torch.cat([a["grad"], b["grad"]], dim=-1)
    assert ours.dtype == logits.dtype
    if logits.dtype == torch.float32:
        torch.testing.assert_close(ours, grad.float(), rtol=0, atol=1e-5)
    else:  # the fp32 gradient rounded to the logits' dtype, as the reference's is
        torch.testing.assert_close(ours, grad.to(logits.dtype))
    if name in LOGPROB_ONLY:
        (grad_lp,) = torch.autograd.grad((logp * g_lp.double()).sum(), full)
        torch.testing.assert_close(torch.cat([a["grad_logprob_only"], b["grad_logprob_only"]], dim=-1),
                                   grad_lp.float(), rtol=0, atol=1e-5)
    # the cases cut: S is a strict subset in every row, and some sampled tokens fall outside it (finite log-probs)
    assert bool((size < logits.shape[1]).all())
    assert bool((~a["in_safe"]).any()) and bool(a["in_safe"].any())
    assert bool(torch.isfinite(a["logprobs"]).all())
    if name == "tied_top_k_top_p":  # the k-th ties beyond the k (top-k keeps the tie) in some rows
        desc = logits.sort(-1, descending=True).values
        assert bool((desc[:, trunc.k] == desc[:, trunc.k - 1]).any())
    if name in ("top_p", "top_p_retry"):  # nuclei wider than the first candidate round
        assert int(size.max()) > 4


@pytest.mark.parametrize("name", list(HIDDEN_CASES))
def test_the_fused_head_equals_the_float64_reference(two_ranks, name):
    trunc, widths, hidden, weight, tokens, g_lp, g_ent = _hidden_inputs(name)
    a, b = _both_ranks(two_ranks, "hidden/" + name)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp, ent, in_s, pruned, size, _ = safe_vocab_reference(h64 @ w64.T, tokens, trunc)
    assert torch.equal(a["in_safe"], in_s) and torch.equal(a["size"], size)
    torch.testing.assert_close(a["logprobs"], logp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["entropy"], ent.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["pruned_mass"], pruned.float(), rtol=0, atol=1e-5)
    # the logits path on the same shards' logits: the same numbers
    torch.testing.assert_close(a["logprobs"], a["via_logits"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a["entropy"], a["via_logits"][1], rtol=0, atol=1e-6)
    if name == "empty":
        assert a["logprobs"].shape == (0,) and a["grad_w"].shape == (widths[0], HIDDEN)
        assert not bool(a["grad_h"].any()) and not bool(a["grad_w"].any())
        return
    grad_h, grad_w = torch.autograd.grad((logp * g_lp.double()).sum() + (ent * g_ent.double()).sum(), (h64, w64))
    ours_h = a["grad_h"].float() + b["grad_h"].float()  # each rank's part of the hidden gradient, summed
    ours_w = torch.cat([a["grad_w"], b["grad_w"]])
    assert a["grad_h"].dtype == ours_w.dtype == hidden.dtype
    if hidden.dtype == torch.float32:
        torch.testing.assert_close(ours_h, grad_h.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_w, grad_w.float(), rtol=1e-5, atol=1e-5)
        # one rank's part alone is not the gradient: the sum over the group is the caller's (Megatron's mapping)
        assert not torch.allclose(a["grad_h"], grad_h.float(), rtol=1e-2, atol=1e-2)
    else:  # the logit gradient rounded to bf16 per tile (as the model's head would), fp32 GEMM accumulation
        for ours, ref in ((ours_h, grad_h), (ours_w.float(), grad_w)):
            torch.testing.assert_close(ours, ref.float(), rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    assert bool((size < weight.shape[0]).all())  # the cases cut in every row
    assert bool((~a["in_safe"]).any()) and bool(a["in_safe"].any())


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replay_over_two_shards_equals_the_float64_reference(two_ranks, name):
    widths, temperature, logits, hidden, weight, tokens, kept = _replay_inputs(name)
    a, b = _both_ranks(two_ranks, "replay/" + name)
    fused = REPLAY_CASES[name][3]
    leaves = ((hidden.double().requires_grad_(True), weight.double().requires_grad_(True)) if fused
              else (logits.double().requires_grad_(True),))
    full = leaves[0] @ leaves[1].T if fused else leaves[0]
    keep = dense_kept(kept, logits.shape[1])
    _, ent, pruned, kept_mask = replay_reference(full, tokens, keep, temperature)
    in_s = kept_mask.gather(-1, tokens[:, None]).squeeze(-1)
    # z_a/T − log Σ_S e^(z/T): the masked log-softmax in S, and still finite (and a function of z_a) outside it
    z = full / temperature
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z.masked_fill(~kept_mask, -math.inf), -1)
    assert torch.equal(a["in_safe"], in_s) and torch.equal(a["size"], kept_mask.sum(-1))
    assert not bool(in_s[5]) and bool(in_s[3]) and int(a["size"][3]) == logits.shape[1]  # outside; no recorded set
    torch.testing.assert_close(a["logprobs"], logp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["entropy"], ent.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(a["pruned_mass"], pruned.float(), rtol=0, atol=1e-5)
    grads = torch.autograd.grad((logp * a["g_lp"].double()).sum() + (ent * a["g_ent"].double()).sum(), leaves)
    if fused:  # the hidden gradient's parts summed over the ranks; each rank's weight rows
        ours = [a["grads"][0] + b["grads"][0], torch.cat([a["grads"][1], b["grads"][1]])]
    else:
        ours = [torch.cat([a["grads"][0], b["grads"][0]], dim=-1)]
    for got, want in zip(ours, grads, strict=True):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    # the replayed sets differ from the top-k recomputed on the trainer's logits: a recompute would move tokens
    assert bool((keep != (logits >= logits.topk(5).values[:, -1:])).any())


def test_a_single_rank_replay_is_the_replay_module():
    widths, temperature, logits, hidden, weight, tokens, kept = _replay_inputs("logits")
    from tim_plugins.replay import replay_logprobs_from_logits

    got = replay_logprobs_vocab_parallel(logits, tokens, kept, temperature=temperature, compute_entropy=True)
    ref = replay_logprobs_from_logits(logits, tokens, kept, temperature=temperature, compute_entropy=True)
    for key in ("logprobs", "in_safe", "pruned_mass", "size", "entropy"):
        assert torch.equal(getattr(got, key), getattr(ref, key)), key
    with pytest.raises(ValueError, match=r"kept has 3 rows, the tokens 40"):
        replay_logprobs_vocab_parallel(logits, tokens, KeptSets.from_lists([[1], [2], [3]]))
    with pytest.raises(ValueError, match=r"temperature=0.0: must be a finite number > 0"):
        replay_logprobs_vocab_parallel(logits, tokens, kept, temperature=0.0)


@pytest.mark.parametrize("kwargs", [dict(min_p=0.05), dict(top_k=7, top_p=0.9, min_p=0.01, temperature=0.8)])
def test_a_single_rank_fused_head_is_safe_logprobs_from_hidden(kwargs):
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(11, 16, generator=g).requires_grad_(True)
    weight = torch.randn(301, 16, generator=g).requires_grad_(True)
    tokens = torch.randint(0, 301, (11,), generator=g)
    got = safe_linear_logprobs_vocab_parallel(hidden, weight, tokens, Truncation(**kwargs), compute_entropy=True)
    ref = safe_logprobs_from_hidden(hidden, weight, tokens, compute_entropy=True, **{"min_p": 0.0, **kwargs})
    for key in ("logprobs", "in_safe", "pruned_mass", "size", "entropy"):
        assert torch.equal(getattr(got, key), getattr(ref, key)), key
    g1 = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), (hidden, weight))
    g2 = torch.autograd.grad(ref.logprobs.sum() + ref.entropy.sum(), (hidden, weight))
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_a_token_outside_the_safe_set_keeps_a_finite_log_prob(two_ranks):
    r = two_ranks[0]["min_p"]
    out = ~r["in_safe"]
    assert int(out.sum()) >= 5
    assert bool(torch.isfinite(r["logprobs"][out]).all()) and bool((r["logprobs"][out] < r["logprobs"].max()).all())


@pytest.mark.parametrize("kwargs", [dict(min_p=0.05), dict(top_k=7, top_p=0.9, min_p=0.01, temperature=0.8),
                                    dict(top_p=0.85, order="hf", min_p=0.02)])
def test_a_single_rank_call_is_safe_logprobs_from_logits(kwargs):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(13, 301, generator=g) * 2).requires_grad_(True)
    tokens = torch.randint(0, 301, (13,), generator=g)
    trunc = Truncation(**kwargs)
    got = safe_logprobs_vocab_parallel(logits, tokens, trunc, compute_entropy=True)
    ref = safe_logprobs_from_logits(logits, tokens, compute_entropy=True, **{"min_p": 0.0, **kwargs})
    for key in ("logprobs", "in_safe", "pruned_mass", "size", "entropy"):
        assert torch.equal(getattr(got, key), getattr(ref, key)), key
    g1 = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), logits)[0]
    g2 = torch.autograd.grad(ref.logprobs.sum() + ref.entropy.sum(), logits)[0]
    assert torch.equal(g1, g2)


def test_bad_arguments_fail_with_the_rule():
    logits, tokens = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"vocab_start=3 without a tensor-parallel group"):
        safe_linear_logprobs_vocab_parallel(torch.zeros(2, 4), torch.zeros(5, 4), tokens, Truncation(min_p=0.1),
                                            vocab_start=3)
    with pytest.raises(ValueError, match=r"weight has shape \(5, 3\): expected \[V, H\] with H = 4"):
        safe_linear_logprobs_vocab_parallel(torch.zeros(2, 4), torch.zeros(5, 3), tokens, Truncation(min_p=0.1))
    with pytest.raises(ValueError, match=r"vocab_start=3 without a tensor-parallel group"):
        safe_logprobs_vocab_parallel(logits, tokens, Truncation(min_p=0.1), vocab_start=3)
    with pytest.raises(ValueError, match=r"trunc=0.1: expected"):
        safe_logprobs_vocab_parallel(logits, tokens, 0.1)
    with pytest.raises(ValueError, match=r"tokens has shape \(3,\)"):
        safe_logprobs_vocab_parallel(logits, torch.zeros(3, dtype=torch.long), Truncation(min_p=0.1))
