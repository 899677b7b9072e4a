"""The safe-vocab head from hidden states in row chunks (what verl's fused-kernel mode runs): values and gradients
against the unfused path on materialised logits, a float64 reference and verl's own ``FusedLinearForPPO``."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from free_port import free_port
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_safe_vocab import naive_keep

from tim_plugins import safe_vocab as sv
from tim_plugins.safe_vocab import (full_weight, safe_linear_logprobs, safe_logprobs_from_hidden,
                                     safe_logprobs_from_logits)
from tim_plugins.truncation import Truncation

ATOL = 1e-5  # fp32, the bar: the chunked path against the unfused one


def exact_inputs(n, hdim, vocab, seed, *, scale=1):
    """Hidden states in {-2..2}·scale and weights in eighths: every logit is exact in fp32 whatever the GEMM's
    shape, so the chunked path and the materialised logits see bit-identical logits (and the same kept sets)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randint(-2, 3, (n, hdim), generator=gen) * scale).float()
    weight = torch.randint(-6, 7, (vocab, hdim), generator=gen).float() / 8
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, weight, tokens, gen


def loss_of(out, g, ge):
    """Σ g·logp over tokens in S, + Σ ge·entropy: the shape of a PPO loss with an entropy bonus."""
    loss = (out.logprobs.masked_fill(~out.in_safe, 0) * g).sum()
    return loss + (out.entropy * ge).sum() if ge is not None else loss


def chunked(hidden, weight, tokens, trunc, g, ge, chunk):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_linear_logprobs(h, w, tokens, trunc, compute_entropy=True, chunk_size=chunk)
    loss_of(out, g, ge).backward()
    return out, h.grad, w.grad


def unfused(hidden, weight, tokens, trunc, g, ge):
    """The same quantities from the materialised [N, V] logits (autograd through ``hidden @ weight.T``)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_logprobs_from_logits(h @ w.t(), tokens, min_p=trunc.min_p, temperature=trunc.temperature,
                                    top_p=trunc.top_p, top_k=trunc.top_k, order=trunc.order, compute_entropy=True)
    loss_of(out, g, ge).backward()
    return out, h.grad, w.grad


def assert_same(a, b, atol=ATOL):
    (oa, ha, wa), (ob, hb, wb) = a, b
    assert torch.equal(oa.in_safe, ob.in_safe) and torch.equal(oa.size, ob.size)
    for x, y in ((oa.logprobs, ob.logprobs), (oa.entropy, ob.entropy), (oa.pruned_mass, ob.pruned_mass),
                 (ha, hb), (wa, wb)):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


TRUNCATIONS = [
    Truncation(),  # nothing cut: the full distribution
    Truncation(min_p=1e-5),
    Truncation(min_p=0.02, temperature=0.7),
    Truncation(top_p=0.8),
    Truncation(top_k=20),
    Truncation(min_p=0.01, top_k=20, top_p=0.8, temperature=1.3),
    Truncation(min_p=0.05, top_k=7, top_p=0.9, order="hf"),
]


@pytest.mark.parametrize("vocab", [1001, 4099])  # odd sizes; 4099 > the chunk's rows × anything aligned
@pytest.mark.parametrize("trunc", TRUNCATIONS, ids=lambda t: f"minp{t.min_p}-k{t.top_k}-p{t.top_p}-T{t.temperature}"
                                                             f"-{t.order}")
def test_chunked_hidden_path_equals_the_unfused_path(vocab, trunc):
    hidden, weight, tokens, gen = exact_inputs(37, 24, vocab, seed=vocab)
    g = torch.randn(37, generator=gen)
    ge = torch.randn(37, generator=gen)
    fused = chunked(hidden, weight, tokens, trunc, g, ge, chunk=8)  # 5 chunks, the last one ragged
    assert_same(fused, unfused(hidden, weight, tokens, trunc, g, ge))
    # and against float64 autograd through the masked log-softmax written out (vLLM's order for the set)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = (h @ w.t()) / trunc.temperature
    with torch.no_grad():
        if trunc.order == "vllm":
            keep = naive_keep(z, trunc.min_p, trunc.k, trunc.top_p)
        else:
            from tim_plugins.truncation import truncation_threshold

            keep = z >= truncation_threshold(z.float(), trunc).double()[:, None]
    lp_all = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    lp = lp_all.gather(-1, tokens[:, None]).squeeze(-1)
    ent = -(lp_all.exp() * lp_all.masked_fill(~keep, 0)).sum(-1)
    in_s = keep.gather(-1, tokens[:, None]).squeeze(-1)
    ((lp.masked_fill(~in_s, 0) * g.double()).sum() + (ent * ge.double()).sum()).backward()
    out, gh, gw = fused
    assert torch.equal(out.in_safe, in_s) and torch.equal(out.size, keep.sum(-1))
    torch.testing.assert_close(out.logprobs.double()[in_s], lp[in_s].detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(gh.double(), h.grad, atol=5e-5, rtol=0)
    torch.testing.assert_close(gw.double(), w.grad, atol=5e-5, rtol=0)


def test_rows_with_one_kept_token_and_rows_out_of_the_loss():
    """Rows whose kept set is the argmax alone (entropy 0, log-prob 0 for it, a finite value for any other label),
    a zero hidden state (all logits tie: top-k keeps the whole tie), and rows with no gradient (masked out of the
    loss): the same values and gradients as the unfused path, all finite."""
    hidden, weight, tokens, gen = exact_inputs(12, 16, 509, seed=5, scale=4)
    hidden[3] = 0.0  # every logit 0
    tokens[1] = int((hidden[1] @ weight.t()).argmax())  # the argmax itself (kept alone under top_k=1)
    g = torch.randn(12, generator=gen)
    g[6:] = 0.0  # out of the loss
    ge = torch.randn(12, generator=gen)
    ge[6:] = 0.0
    # min-p just below 1 (1 itself is refused: greedy, options.MIN_P_RULE) keeps the argmax and its exact ties
    for trunc in (Truncation(top_k=1), Truncation(min_p=1 - 1e-6), Truncation(top_p=1e-6)):
        a = chunked(hidden, weight, tokens, trunc, g, ge, chunk=5)
        assert_same(a, unfused(hidden, weight, tokens, trunc, g, ge))
        out = a[0]
        assert out.size[3] == 509 and out.size[1] == 1  # the tie is kept whole; a strict argmax alone
        assert float(out.logprobs[1].detach()) == 0.0 and float(out.entropy[1].detach()) == 0.0
        assert torch.isfinite(out.logprobs).all() and all(torch.isfinite(x).all() for x in a[1:])
        one = out.size == 1  # rows kept to their strict argmax: the label is in S exactly when it is that argmax
        assert torch.equal(out.in_safe[one], (tokens == (hidden @ weight.t()).argmax(-1))[one])
        assert (a[1][6:] == 0).all()  # no gradient from rows out of the loss


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 9), v=st.integers(2, 70), hdim=st.integers(1, 6), chunk=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1), min_p=st.sampled_from([0.0, 1e-4, 0.05, 0.5]),
    top_k=st.sampled_from([0, 1, 3, 20]), top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]),
    temperature=st.sampled_from([0.5, 1.0, 1.7]), order=st.sampled_from(["vllm", "hf"]),
)
def test_property_chunked_equals_unfused(n, v, hdim, chunk, seed, min_p, top_k, top_p, temperature, order):
    trunc = Truncation(min_p=min_p, top_k=top_k, top_p=top_p, temperature=temperature, order=order)
    hidden, weight, tokens, gen = exact_inputs(n, hdim, v, seed, scale=3)
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    assert_same(chunked(hidden, weight, tokens, trunc, g, ge, chunk), unfused(hidden, weight, tokens, trunc, g, ge))


def _verl_torch_functional():
    """verl's ``verl/utils/experimental/torch_functional.py`` from the installed distribution, loaded by path: its
    fused torch backend is plain torch, and importing the ``verl`` package itself would start its plugin loading."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "experimental" / "torch_functional.py"
    mod_spec = importlib.util.spec_from_file_location("_verl_fused_torch_functional", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_no_truncation_equals_verls_fused_linear_for_ppo(temperature):
    """With nothing cut, the safe head is verl's fused head: same log-probs, entropy and gradients (3-D input, as
    verl's ``forward_with_torch_backend`` passes [B, T, H])."""
    verl = _verl_torch_functional()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 32, generator=gen)
    weight = torch.randn(1003, 32, generator=gen) * 0.3
    labels = torch.randint(0, 1003, (3, 11), generator=gen)
    g, ge = torch.randn(3, 11, generator=gen), torch.randn(3, 11, generator=gen)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_v, ent_v = verl.FusedLinearForPPO(chunk_size=7).forward(h1, w1, labels, temperature=temperature)
    ((lp_v * g).sum() + (ent_v * ge).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_linear_logprobs(h2, w2, labels, Truncation(), temperature=temperature, chunk_size=7)
    ((out.logprobs * g).sum() + (out.entropy * ge).sum()).backward()
    assert out.logprobs.shape == labels.shape and out.in_safe.all() and (out.size == 1003).all()
    for mine, theirs in ((out.logprobs, lp_v), (out.entropy, ent_v), (h2.grad, h1.grad), (w2.grad, w1.grad)):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


def test_backward_keeps_no_vocabulary_sized_tensor():
    """What autograd saves for backward is the inputs and per-row statistics: nothing of [N, V] (the point of
    the chunked head; the unfused path saves the logits)."""
    hidden, weight, tokens, _ = exact_inputs(64, 8, 3001, seed=2)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        safe_linear_logprobs(h, w, tokens, Truncation(min_p=0.01, top_k=50, top_p=0.9), chunk_size=16)
    assert saved and max(saved) <= weight.numel() < 64 * 3001
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        safe_logprobs_from_logits(h @ w.t(), tokens, min_p=0.01, top_k=50, top_p=0.9)
    assert max(saved) == 64 * 3001  # the reference does hold the logits


def test_linear_interface_shapes_and_errors():
    hidden, weight, tokens, _ = exact_inputs(12, 8, 101, seed=1)
    trunc = Truncation(min_p=0.02, top_p=0.9, temperature=1.5)
    flat = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, top_p=0.9, temperature=0.5,
                                     compute_entropy=True)
    nd = safe_linear_logprobs(hidden.view(3, 4, 8), weight, tokens.view(3, 4), trunc, temperature=0.5)
    assert nd.logprobs.shape == (3, 4) and nd.entropy.shape == (3, 4) and nd.size.shape == (3, 4)
    assert torch.equal(nd.logprobs.reshape(-1), flat.logprobs) and torch.equal(nd.entropy.reshape(-1), flat.entropy)
    with pytest.raises(ValueError, match=r"labels has shape \(12,\): expected hidden's leading shape \(3, 4\)"):
        safe_linear_logprobs(hidden.view(3, 4, 8), weight, tokens, trunc)
    with pytest.raises(ValueError, match="expected a tim_plugins.truncation.Truncation"):
        safe_linear_logprobs(hidden, weight, tokens, {"min_p": 0.1})
    with pytest.raises(ValueError, match=r"weight has shape \(101, 7\): expected \[V, H\] with H = 8"):
        safe_linear_logprobs(hidden, weight[:, :7], tokens, trunc)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_weight_is_refused_and_its_full_weight_trains_the_shard(one_rank_group):
    """An FSDP2 lm_head weight is a DTensor: passed as is, the call fails early with the fix (verl's own fused
    backend fails there with "mixed torch.Tensor and DTensor", verl #5633); ``full_weight(weight)`` works and
    its gradient comes back to the sharded parameter, equal to the plain weight's (one rank; two ranks, where the
    gradient is averaged over them: tests/verl_suite/test_verl_fused_safe_vocab.py)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden, weight, tokens, gen = exact_inputs(10, 8, 257, seed=9)
    trunc = Truncation(min_p=0.01, top_k=30)
    sharded = torch.nn.Parameter(distribute_tensor(weight.clone(), one_rank_group, [Shard(0)]))
    with pytest.raises(ValueError, match=r"weight is a DTensor.*full_weight\(weight\)"):
        safe_linear_logprobs(hidden, sharded, tokens, trunc)
    assert full_weight(weight) is weight  # a plain tensor as it is
    g = torch.randn(10, generator=gen)
    out = safe_linear_logprobs(hidden, full_weight(sharded), tokens, trunc, compute_entropy=False)
    (out.logprobs * g).sum().backward()
    w = weight.clone().requires_grad_()
    ref = safe_linear_logprobs(hidden, w, tokens, trunc, compute_entropy=False)
    (ref.logprobs * g).sum().backward()
    assert torch.equal(out.logprobs, ref.logprobs)
    torch.testing.assert_close(sharded.grad.full_tensor(), w.grad, atol=0, rtol=0)


def test_a_fold_failure_falls_back_for_that_call_only(monkeypatch):
    """A failing Triton fold is counted and that call runs the torch folds; the next call tries the folds again
    (not a process-wide switch)."""
    calls = []

    class Failing:
        @staticmethod
        def apply(*args):
            calls.append(len(args))
            raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(sv, "SafeFromHiddenFused", Failing)
    monkeypatch.setattr(sv, "_fused_by_default", lambda x: True)
    monkeypatch.setattr(sv, "_fused_failures", 0)
    hidden, weight, tokens, _ = exact_inputs(6, 8, 101, seed=3)
    want = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="torch")
    for i in (1, 2):
        with pytest.warns(UserWarning, match="this call uses the torch folds"):
            got = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02)
        assert torch.equal(got.logprobs, want.logprobs)
        assert len(calls) == i and sv.fused_failure_count() == i  # tried again on the second call
    with pytest.raises(RuntimeError, match="no compiler"):
        safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="triton")
