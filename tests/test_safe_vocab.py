"""Safe-vocabulary log-probs against naive references: values, gradients, truncation order, HF generate."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.safe_vocab import (
    DEFAULT_MIN_P,
    safe_logprobs_from_hidden,
    safe_logprobs_from_logits,
    safe_loss_mask,
    safe_vocab_metrics,
)
from tim_plugins import safe_vocab as safe_vocab_module
from tim_plugins.truncation import Truncation, hf_generate_kwargs, truncation_threshold

# Per-dtype tolerances: (log-prob atol, gradient atol relative to the largest reference gradient entry).
TOL = {
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (2e-5, 1.6e-2),  # log-probs are computed in fp32 from the bf16 logits: only fp32 noise
    torch.float16: (2e-5, 2e-3),
}
HIDDEN_TOL = {  # hidden path: the logits themselves are rounded to the dtype on both sides
    torch.float32: (5e-5, 1e-4),
    torch.bfloat16: (5e-2, 3e-2),
    torch.float16: (5e-3, 4e-3),
}


def naive_keep(z: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's order written out on fp64 probabilities: min_p, then top_k, then top_p (sort ascending, cumsum)."""
    p = torch.softmax(z, -1)
    keep = p >= min_p * p.amax(-1, keepdim=True)
    if top_k > 0:
        kth = z.sort(-1, descending=True).values[:, min(top_k, z.shape[1]) - 1 : min(top_k, z.shape[1])]
        keep &= z >= kth
    if top_p < 1.0:
        for i in range(z.shape[0]):
            zi = z[i].masked_fill(~keep[i], -math.inf)
            order = zi.argsort()  # ascending, as vLLM
            cum = torch.softmax(zi[order], -1).cumsum(-1)
            drop = cum <= 1 - top_p
            drop[-1] = False
            # documented semantics: a tie at the cut is kept whole (the engines' unstable sort may split it)
            cut = zi[order[~drop]].min()
            keep[i] &= z[i] >= cut
    return keep


def naive_safe(logits, tokens, *, min_p, temperature=1.0, top_k=0, top_p=1.0):
    """Masked log_softmax + gather, on a float64 copy (autograd through it is the reference gradient)."""
    z = logits.double() / temperature
    with torch.no_grad():
        keep = naive_keep(z, min_p, top_k, top_p)
    lp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    in_safe = keep.gather(-1, tokens[:, None]).squeeze(-1)
    q = lp.exp()
    entropy = -(q * lp.masked_fill(~keep, 0.0)).sum(-1)
    pruned = 1 - torch.softmax(z, -1).masked_fill(~keep, 0).sum(-1)
    return lp.gather(-1, tokens[:, None]).squeeze(-1), in_safe, keep, entropy, pruned


def sample_tokens(logits, keep, temperature, gen):
    """Tokens drawn from the kept set (what a truncating sampler emits), every third one from anywhere."""
    probs = torch.softmax(logits.double() / temperature, -1).masked_fill(~keep, 0)
    inside = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    anywhere = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=gen)
    return torch.where(torch.arange(logits.shape[0]) % 3 == 0, anywhere, inside)


def exact_hidden_inputs(n, hdim, vocab, dtype, *, temperature=1.0, min_p=0.0, seed=0):
    """(hidden, weight, tokens, generator) with integer hidden states and weights in eighths: every product and
    partial sum is exact in fp32, so each logit is the same whatever GEMM shape and algorithm computes it (the
    Triton folds, the torch folds and a reference tile differently), and the safe sets compare exactly. Logits
    of std ~5 in steps of 1/8, exact in bf16 / fp16 below 32; a third of the tokens drawn from anywhere."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (n, hdim), generator=gen).to(dtype)
    weight = (torch.randint(-6, 7, (vocab, hdim), generator=gen) / 8).to(dtype)
    logits = hidden.double() @ weight.double().t()
    tokens = sample_tokens(logits, naive_keep(logits / temperature, min_p, 0, 1.0), temperature, gen)
    return hidden, weight, tokens, gen


def run_hidden(backend, hidden, weight, tokens, g, ge, **kw):
    """(SafeLogprobs, grad hidden, grad weight) of Σ g·logp over in-S tokens (+ Σ ge·entropy) with ``backend``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_logprobs_from_hidden(h, w, tokens, backend=backend, **kw)
    loss = (out.logprobs.masked_fill(~out.in_safe, 0) * g.float()).sum()
    if ge is not None:
        loss = loss + (out.entropy * ge.float()).sum()
    loss.backward()
    return out, h.grad, w.grad


def assert_folds_match(fused, plain, hidden, weight, tokens, g, ge, *, min_p, temperature, entropy_atol):
    """The Triton folds' (SafeLogprobs, grad hidden, grad weight) against a float64 reference on the logits as
    the model's lm_head rounds them (autograd through it for the gradients), and against the torch folds: the
    same S, values to float32 rounding (the fast exp, another summation order), gradients to one rounding of the
    gradient tile to the dtype."""
    (out, fh, fw), (other, ph, pw) = fused, plain
    dtype = hidden.dtype
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_in, keep, ref_ent, ref_pruned = naive_safe(h2 @ w2.t(), tokens, min_p=min_p, temperature=temperature)
    ((ref_lp.masked_fill(~ref_in, 0) * g).sum() + ((ref_ent * ge).sum() if ge is not None else 0)).backward()
    assert torch.equal(out.in_safe, ref_in) and torch.equal(out.size, keep.sum(-1).to(out.size.device))
    torch.testing.assert_close(out.logprobs.double()[ref_in], ref_lp.detach()[ref_in], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.pruned_mass.double(), ref_pruned.detach(), atol=1e-6, rtol=0)
    if ge is not None:
        torch.testing.assert_close(out.entropy.double(), ref_ent.detach(), atol=entropy_atol, rtol=0)
    g_tol = HIDDEN_TOL[dtype][1]
    for mine, ref in ((fh, h2.grad), (fw, w2.grad)):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.double(), ref.double(), atol=g_tol * ref.abs().max().item(), rtol=0)
    assert torch.equal(out.in_safe, other.in_safe) and torch.equal(out.size, other.size)
    torch.testing.assert_close(out.logprobs, other.logprobs, atol=2e-6, rtol=1e-6)
    rel = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    for mine, theirs in ((fh, ph), (fw, pw)):
        torch.testing.assert_close(mine.double(), theirs.double(), atol=2 * rel * theirs.abs().max().item(), rtol=0)
    return ref_in


def make_logits(n, v, seed, scale=4.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).to(dtype), gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [383, 1001])
@pytest.mark.parametrize(
    "min_p,temperature,top_k,top_p",
    [(0.0, 1.0, 0, 1.0), (DEFAULT_MIN_P, 1.0, 0, 1.0), (0.05, 0.7, 0, 1.0), (0.01, 1.3, 20, 0.9), (0.0, 0.8, 0, 0.8)],
)
def test_logits_path_matches_naive_masked_log_softmax(dtype, vocab, min_p, temperature, top_k, top_p):
    logits, gen = make_logits(29, vocab, seed=vocab + int(min_p * 1e4), dtype=dtype)
    with torch.no_grad():
        keep0 = naive_keep(logits.double() / temperature, min_p, top_k, top_p)
    tokens = sample_tokens(logits, keep0, temperature, gen)
    ref_lp, ref_in, keep, ref_ent, ref_pruned = naive_safe(
        logits.detach().requires_grad_(), tokens, min_p=min_p, temperature=temperature, top_k=top_k, top_p=top_p)
    x = logits.clone().requires_grad_()
    out = safe_logprobs_from_logits(x, tokens, min_p=min_p, temperature=temperature, top_k=top_k, top_p=top_p,
                                    compute_entropy=True, chunk_size=7)
    lp_tol, g_tol = TOL[dtype]
    assert torch.equal(out.in_safe, ref_in)
    assert torch.equal(out.size, keep.sum(-1))
    torch.testing.assert_close(out.logprobs.double()[ref_in], ref_lp.detach()[ref_in], atol=lp_tol, rtol=0)
    assert torch.isfinite(out.logprobs).all()  # boundary tokens are finite, masked later
    torch.testing.assert_close(out.entropy.double(), ref_ent.detach(), atol=lp_tol * 5, rtol=0)
    torch.testing.assert_close(out.pruned_mass.double(), ref_pruned, atol=1e-6, rtol=0)
    if min_p == 0.0 and top_k == 0 and top_p == 1.0:
        plain = torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(out.logprobs, plain, atol=4e-6, rtol=0)
        assert float(out.pruned_mass.max()) == 0.0

    # gradient of an arbitrary loss on the in-S tokens plus the entropy, against autograd through the reference
    g = torch.randn(29, generator=gen, dtype=torch.float64)
    ge = torch.randn(29, generator=gen, dtype=torch.float64)
    ref_grad = naive_grad(logits, tokens, g, ge, min_p=min_p, temperature=temperature, top_k=top_k, top_p=top_p)
    loss = (out.logprobs.masked_fill(~out.in_safe, 0) * g.float()).sum() + (out.entropy * ge.float()).sum()
    loss.backward()
    assert x.grad.dtype == dtype
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), ref_grad, atol=g_tol * scale, rtol=0)


def naive_grad(logits, tokens, g, ge, **kw):
    leaf = logits.detach().double().requires_grad_()
    lp, in_safe, _, ent, _ = naive_safe(leaf, tokens, **kw)
    ((lp.masked_fill(~in_safe, 0) * g).sum() + (ent * ge).sum()).backward()
    return leaf.grad


@pytest.mark.parametrize("vocab_tile", [None, 100])  # 100: half-precision GEMMs over several ragged vocab tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,temperature,min_p", [(383, 1.0, 0.0), (1001, 0.7, 0.02), (383, 1.3, DEFAULT_MIN_P)])
def test_hidden_path_matches_logits_path_and_naive_gradients(dtype, vocab, temperature, min_p, vocab_tile,
                                                             monkeypatch):
    if vocab_tile is not None:
        monkeypatch.setattr(safe_vocab_module, "_GRAD_VOCAB_TILE", vocab_tile)
    gen = torch.Generator().manual_seed(vocab)
    n, hdim = 23, 24
    hidden = (torch.randn(n, hdim, generator=gen) * 0.7).to(dtype)
    weight = (torch.randn(vocab, hdim, generator=gen) * 0.5).to(dtype)
    logits = hidden @ weight.t()  # what the model's own lm_head computes, rounded to dtype
    with torch.no_grad():
        keep = naive_keep(logits.double() / temperature, min_p, 0, 1.0)
    tokens = sample_tokens(logits, keep, temperature, gen)
    g = torch.randn(n, generator=gen, dtype=torch.float64)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_logprobs_from_hidden(h, w, tokens, min_p=min_p, temperature=temperature, chunk_size=5)
    (out.logprobs.masked_fill(~out.in_safe, 0) * g.float()).sum().backward()
    via_logits = safe_logprobs_from_logits(logits, tokens, min_p=min_p, temperature=temperature)
    # the hidden path rounds the logits to dtype exactly as `hidden @ weight.T` does: identical selection and values
    assert torch.equal(out.in_safe, via_logits.in_safe)
    torch.testing.assert_close(out.logprobs, via_logits.logprobs, atol=2e-5, rtol=0)

    # reference gradient: autograd through hidden @ weight.T in dtype, then the fp64 masked log-softmax
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, in_safe, *_ = naive_safe(h2 @ w2.t(), tokens, min_p=min_p, temperature=temperature)
    (lp.masked_fill(~in_safe, 0) * g).sum().backward()
    lp_tol, g_tol = HIDDEN_TOL[dtype]
    for mine, ref in ((h.grad, h2.grad), (w.grad, w2.grad)):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.double(), ref.double(), atol=g_tol * ref.abs().max().item(), rtol=0)


def test_chunk_size_does_not_change_results():
    logits, gen = make_logits(50, 1001, seed=3)
    tokens = torch.randint(0, 1001, (50,), generator=gen)
    a = safe_logprobs_from_logits(logits, tokens, min_p=0.01, top_p=0.95, chunk_size=1)
    b = safe_logprobs_from_logits(logits, tokens, min_p=0.01, top_p=0.95, chunk_size=50)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.in_safe, b.in_safe)


def test_fully_pruned_rows_and_no_grad_needed():
    # min_p = 0.5 keeps only the argmax of the first row (the next is e^-2 of it); a flat row keeps everything
    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = safe_logprobs_from_logits(logits, torch.tensor([0, 4]), min_p=0.5)
    assert out.size.tolist() == [1, 5]
    torch.testing.assert_close(out.logprobs, torch.tensor([0.0, -math.log(5)]))
    assert out.in_safe.tolist() == [True, True]
    assert out.logprobs.grad_fn is None


@pytest.mark.parametrize("min_p,top_k,top_p", [(0.05, 0, 0.7), (0.02, 12, 0.9), (0.1, 0, 1.0), (0.0, 8, 0.6)])
def test_hf_order_matches_transformers_warpers(min_p, top_k, top_p):
    """order='hf' reproduces transformers' own warpers (temperature → top-k → top-p → min-p) on the same scores."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    logits, gen = make_logits(40, 383, seed=11, scale=3.0)
    temperature = 0.8
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    scores = procs(None, logits.clone())
    hf_keep = torch.isfinite(scores)
    trunc = Truncation(min_p=min_p, top_k=top_k, top_p=top_p, temperature=temperature, order="hf")
    tau = truncation_threshold(logits / temperature, trunc)
    assert torch.equal(logits / temperature >= tau[:, None], hf_keep)
    tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).squeeze(-1)
    out = safe_logprobs_from_logits(logits, tokens, min_p=min_p, top_k=top_k, top_p=top_p, temperature=temperature,
                                    order="hf")
    hf_lp = torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, hf_lp, atol=2e-5, rtol=0)
    if min_p and top_p < 1:
        # vLLM's order (top-p of the min-p-renormalised distribution) keeps a different set on some rows
        tau_v = truncation_threshold(logits / temperature, Truncation(min_p=min_p, top_k=top_k, top_p=top_p,
                                                                       temperature=temperature, order="vllm"))
        assert (tau_v > tau).any() and (tau_v >= tau).all()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4), v=st.integers(2, 60), seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.1, 12.0), min_p=st.sampled_from([0.0, 1e-6, 1e-3, 0.05, 0.3, 0.9]),
    temperature=st.floats(0.3, 2.0), top_k=st.integers(0, 10), top_p=st.sampled_from([1.0, 0.95, 0.5]),
)
def test_property_against_naive_reference(n, v, seed, scale, min_p, temperature, top_k, top_p):
    logits, gen = make_logits(n, v, seed, scale=scale, dtype=torch.float64)
    tokens = torch.randint(0, v, (n,), generator=gen)
    out = safe_logprobs_from_logits(logits, tokens, min_p=min_p, temperature=temperature, top_k=top_k, top_p=top_p)
    z = logits / temperature
    keep = naive_keep(z, min_p, top_k, top_p)
    lp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1).gather(-1, tokens[:, None]).squeeze(-1)
    # rows whose kept set depends on fp32-vs-fp64 rounding at the threshold are not informative; skip them
    tau = truncation_threshold(z.float(), Truncation(min_p=min_p, top_k=top_k, top_p=top_p, temperature=1.0))
    margin = (z.float() - tau[:, None]).abs().masked_fill(~torch.isfinite(tau)[:, None], math.inf).amin(-1)
    ok = margin > 1e-4
    assert torch.equal(out.in_safe[ok], keep.gather(-1, tokens[:, None]).squeeze(-1)[ok])
    assert torch.equal(out.size[ok], keep.sum(-1)[ok])
    inside = ok & out.in_safe
    torch.testing.assert_close(out.logprobs.double()[inside], lp[inside], atol=3e-5, rtol=0)
    # the kept probabilities renormalise to 1, the pruned mass is what is missing
    assert ((out.pruned_mass >= 0) & (out.pruned_mass < 1)).all()
    if min_p == 0 and top_k == 0 and top_p == 1.0:
        assert float(out.pruned_mass.max()) == 0.0


def test_loss_mask_and_metrics():
    from tim_plugins.metrics import mismatch_metrics

    logits, gen = make_logits(12, 383, seed=5)
    tokens = sample_tokens(logits, naive_keep(logits.double(), 0.05, 0, 1.0), 1.0, gen)
    out = safe_logprobs_from_logits(logits, tokens, min_p=0.05)
    mask = torch.ones(3, 4, dtype=torch.float32)
    mask[2, 2:] = 0
    in_safe = out.in_safe.reshape(3, 4)
    loss_mask, n_boundary = safe_loss_mask(mask, in_safe)
    assert loss_mask.dtype == torch.float32
    expect = (mask.bool() & in_safe).float()
    assert torch.equal(loss_mask, expect)
    assert int(n_boundary) == int((mask.bool() & ~in_safe).sum()) > 0

    rollout = out.logprobs.detach().reshape(3, 4) + 0.01 * torch.randn(3, 4, generator=gen)
    rollout[~in_safe] = -30.0  # boundary tokens: would dominate k3 if they were not masked out
    full = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1).reshape(3, 4)
    m = safe_vocab_metrics(out, mask, rollout_logprobs=rollout, full_logprobs=full)
    valid = mask.bool().flatten()
    assert m["tim/safe_vocab/pruned_mass_mean"] == pytest.approx(out.pruned_mass[valid].double().mean().item())
    assert m["tim/safe_vocab/pruned_mass_max"] == pytest.approx(out.pruned_mass[valid].max().item())
    assert m["tim/safe_vocab/size_mean"] == pytest.approx(out.size[valid].double().mean().item())
    assert m["tim/safe_vocab/boundary_frac"] == pytest.approx(int(n_boundary) / int(valid.sum()))
    d = (out.logprobs.detach().reshape(3, 4) - rollout)[expect.bool()].double()
    k3_naive = (torch.exp(d) - 1 - d).mean().item()  # k3 of KL(rollout ‖ train) on rollout samples, ρ = e^d
    assert m["tim/safe_vocab/kl_k3"] == pytest.approx(k3_naive, rel=1e-4, abs=1e-9)
    assert m["tim/safe_vocab/kl_k3"] == pytest.approx(
        mismatch_metrics(rollout, out.logprobs.detach().reshape(3, 4), expect)["tim/token/kl_k3"])
    df = (full - rollout)[expect.bool()].double()  # the full-vocabulary trainer, on the same (loss-mask) tokens
    assert m["tim/safe_vocab/kl_k3_full"] == pytest.approx((torch.exp(df) - 1 - df).mean().item(), rel=1e-4)
    assert m["tim/safe_vocab/kl_k3_full"] > 10 * m["tim/safe_vocab/kl_k3"]  # full-vocab values disagree with processed

    # No valid token: every statistic is undefined (NaN), as the monitor's are for an empty set.
    empty = safe_vocab_metrics(out, torch.zeros(3, 4), rollout_logprobs=rollout, full_logprobs=full)
    assert set(empty) == set(m) and empty.pop("tim/safe_vocab/invalid_tokens") == 0  # a count: 0, not NaN
    assert all(math.isnan(v) for v in empty.values())


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=1.0), dict(top_p=0.0), dict(top_k=-3),
                                 dict(temperature=0.0), dict(order="sglang")])
def test_config_errors_quote_the_value(bad):
    key, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        Truncation(**bad)


def test_shape_errors():
    with pytest.raises(ValueError, match="tokens has shape"):
        safe_logprobs_from_logits(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long), min_p=0.1)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        safe_logprobs_from_logits(torch.zeros(3, 5), torch.tensor([0, 1, 5]), min_p=0.1)
    with pytest.raises(ValueError, match="weight has shape"):
        safe_logprobs_from_hidden(torch.zeros(3, 4), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long), min_p=0.1)


@pytest.mark.parametrize("min_p,top_k,top_p", [(0.05, 0, 1.0), (0.02, 15, 0.9), (DEFAULT_MIN_P, 0, 1.0)])
def test_hf_generate_processed_logprobs_match(toy_model_path, min_p, top_k, top_p):
    """HF generate's processed scores (log_softmax of output_scores) = safe log-probs of an fp32 forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    model = AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()
    trunc = Truncation(min_p=min_p, top_k=top_k, top_p=top_p, temperature=0.9, order="hf")
    checked = 0
    for i, text in enumerate(["the cat sat on", "a b c d e"]):
        enc = tok(text, return_tensors="pt")  # one prompt per call: no padding to reproduce in the forward
        torch.manual_seed(i)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=16, **hf_generate_kwargs(trunc))
        prompt_len = enc["input_ids"].shape[1]
        new = gen.sequences[0, prompt_len:]
        scores = torch.cat(gen.scores, 0)  # [T, V] processed (post-warper) scores, batch of one
        hf_lp = torch.log_softmax(scores.float(), -1).gather(-1, new[:, None]).squeeze(-1)
        with torch.no_grad():
            logits = model(input_ids=gen.sequences).logits[0, prompt_len - 1 : -1]
        out = safe_logprobs_from_logits(logits, new, min_p=min_p, temperature=0.9, top_k=top_k, top_p=top_p,
                                        order="hf")
        assert out.in_safe.all()  # the trainer's S contains every sampled token (fp32 on both sides)
        torch.testing.assert_close(out.logprobs, hf_lp, atol=1e-4, rtol=0)
        assert float(out.pruned_mass.max()) > 0.0
        checked += new.numel()
    assert checked >= 4


@pytest.mark.parametrize("min_p,top_k,top_p", [(0.0, 5, 0.8), (0.01, 20, 0.6), (0.0, 1, 0.5), (0.2, 12, 0.95)])
def test_top_p_after_top_k_with_ties_at_the_kth_value(min_p, top_k, top_p):
    """Top-p after top-k looks only at the k largest logits, except on rows where the k-th value is tied with
    logits beyond the k (top-k keeps the whole tie): integer logits make such ties on most rows; both kinds of row
    keep the set of the full-sort reference."""
    gen = torch.Generator().manual_seed(top_k)
    z = torch.randint(-6, 7, (200, 301), generator=gen).float() / 2
    # half the rows without ties: distinct offsets far below the grid's step of 0.5
    z[::2] += torch.stack([torch.randperm(301, generator=gen) for _ in range(100)]).float() * 1e-4
    tau = truncation_threshold(z, Truncation(min_p=min_p, top_k=top_k, top_p=top_p))
    keep = naive_keep(z.double(), min_p, top_k, top_p)
    tied = (z >= z.topk(top_k, -1).values[:, -1:]).sum(-1) > top_k
    assert tied[1::2].float().mean() > 0.5 and not tied[::2].any()
    assert torch.equal(z >= tau[:, None], keep)
