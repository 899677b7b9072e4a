"""The safe-vocab head's Triton folds without a GPU: run on the CPU by Triton's interpreter against the float64
reference and the torch folds, and compiled ahead of time for sm_90.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the interpreted tests run in a pytest
subprocess (``test_folds_under_the_interpreter``); in the main run they are skipped. On a GPU the same folds
run in ``benchmarks/bench_safe_vocab.py``, whose sanity check compares them with a float64 reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_metrics_triton import compile_for_hopper, run_interpreted
from test_safe_vocab import (
    TOL,
    assert_folds_match,
    exact_hidden_inputs,
    make_logits,
    naive_grad,
    naive_keep,
    naive_safe,
    run_hidden,
    sample_tokens,
)

from tim_plugins import safe_vocab as sv
from tim_plugins.safe_vocab import DEFAULT_MIN_P, safe_logprobs_from_hidden, safe_logprobs_from_logits

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_folds_under_the_interpreter's subprocess")

# (dtype, vocab, temperature, min_p, entropy): vocab 5003 > the fold's 4096-entry block and odd; 383 < it
_CASES = [
    (torch.float32, 5003, 1.0, DEFAULT_MIN_P, False),
    (torch.float32, 383, 0.7, 0.02, True),
    (torch.bfloat16, 5003, 1.0, DEFAULT_MIN_P, True),
    (torch.bfloat16, 1001, 1.3, 0.0, False),
    (torch.float16, 1001, 0.7, 0.05, True),
    (torch.bfloat16, 383, 1.0, 0.999, False),  # min_p near 1 (1 itself is refused): the argmax and near-ties alone
]


def _inputs(dtype, vocab, temperature, min_p, n=41, hdim=24, seed=0):
    return exact_hidden_inputs(n, hdim, vocab, dtype, temperature=temperature, min_p=min_p, seed=seed + vocab)


@interpreted
@pytest.mark.parametrize("dtype,vocab,temperature,min_p,entropy", _CASES)
def test_interpreted_folds_match_the_reference_and_the_torch_folds(dtype, vocab, temperature, min_p, entropy,
                                                                   monkeypatch):
    # several ragged backward tiles (rows and columns) and forward chunks
    monkeypatch.setattr(sv, "_FUSED_GRAD_ROWS", 16)
    monkeypatch.setattr(sv, "_GRAD_VOCAB_TILE", 1500)
    hidden, weight, tokens, gen = _inputs(dtype, vocab, temperature, min_p)
    g = torch.randn(len(tokens), generator=gen, dtype=torch.float64)
    ge = torch.randn(len(tokens), generator=gen, dtype=torch.float64) if entropy else None
    kw = dict(min_p=min_p, temperature=temperature, compute_entropy=entropy, chunk_size=10)
    fused = run_hidden("triton", hidden, weight, tokens, g, ge, **kw)
    plain = run_hidden("torch", hidden, weight, tokens, g, ge, **kw)
    ref_in = assert_folds_match(fused, plain, hidden, weight, tokens, g, ge, min_p=min_p, temperature=temperature,
                                entropy_atol=1e-5)
    assert 0 < int(ref_in.sum()) < len(tokens) or min_p == 0.0  # tokens on both sides of the boundary


@interpreted
@pytest.mark.parametrize("dtype,vocab,temperature,min_p,entropy", _CASES[:4])
def test_interpreted_logits_folds_match_the_reference_and_the_torch_folds(dtype, vocab, temperature, min_p, entropy):
    """The logits path (verl's): the folds read the logits in place, also a row-strided view of wider logits."""
    logits, gen = make_logits(23, vocab + 5, seed=vocab, dtype=dtype)
    logits = logits[:, :vocab]  # rows of unit stride, row stride vocab + 5
    keep0 = naive_keep(logits.double() / temperature, min_p, 0, 1.0)
    tokens = sample_tokens(logits, keep0, temperature, gen)
    g = torch.randn(23, generator=gen, dtype=torch.float64)
    ge = torch.randn(23, generator=gen, dtype=torch.float64) if entropy else None
    results = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_() if backend == "torch" else logits.detach().requires_grad_()
        out = safe_logprobs_from_logits(x, tokens, min_p=min_p, temperature=temperature, compute_entropy=entropy,
                                        backend=backend)
        loss = (out.logprobs.masked_fill(~out.in_safe, 0) * g.float()).sum()
        if entropy:
            loss = loss + (out.entropy * ge.float()).sum()
        loss.backward()
        results[backend] = (out, x.grad)
    (out, grad), (plain, plain_grad) = results["triton"], results["torch"]
    ref_lp, ref_in, keep, ref_ent, ref_pruned = naive_safe(logits, tokens, min_p=min_p, temperature=temperature)
    ref_grad = naive_grad(logits, tokens, g, ge if entropy else torch.zeros_like(g), min_p=min_p,
                          temperature=temperature)
    assert torch.equal(out.in_safe, ref_in) and torch.equal(out.size, keep.sum(-1))
    assert torch.equal(out.in_safe, plain.in_safe) and torch.equal(out.size, plain.size)
    torch.testing.assert_close(out.logprobs.double()[ref_in], ref_lp[ref_in], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logprobs, plain.logprobs, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(out.pruned_mass.double(), ref_pruned, atol=1e-6, rtol=0)
    if entropy:
        torch.testing.assert_close(out.entropy.double(), ref_ent, atol=1e-5, rtol=0)
    assert grad.dtype == dtype and grad.shape == logits.shape
    g_tol = TOL[dtype][1] * ref_grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref_grad, atol=g_tol, rtol=0)
    torch.testing.assert_close(grad.double(), plain_grad.double(), atol=g_tol, rtol=0)


@interpreted
def test_interpreted_folds_entropy_gradient_alone_empty_input_and_no_grad():
    hidden, weight, tokens, gen = _inputs(torch.float32, 383, 1.0, 0.02, n=9)
    tokens = torch.stack([tokens, tokens.flip(0)], 1)[:, 0]  # a strided view, as a slice of [B, T] ids can be
    assert not tokens.is_contiguous()
    ge = torch.randn(9, generator=gen, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = safe_logprobs_from_hidden(h, w, tokens, min_p=0.02, compute_entropy=True, backend="triton")
    (out.entropy * ge.float()).sum().backward()  # no log-prob gradient: the kernel's entropy term alone
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_in, _, ref_ent, _ = naive_safe(h2 @ w2.t(), tokens, min_p=0.02)
    (ref_ent * ge).sum().backward()
    assert torch.equal(out.in_safe, ref_in)
    torch.testing.assert_close(out.logprobs.double()[ref_in], ref_lp.detach()[ref_in], atol=2e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), h2.grad.double(), atol=1e-4 * h2.grad.abs().max().item(), rtol=0)
    torch.testing.assert_close(w.grad.double(), w2.grad.double(), atol=1e-4 * w2.grad.abs().max().item(), rtol=0)

    empty = safe_logprobs_from_hidden(hidden[:0].clone().requires_grad_(), weight.clone().requires_grad_(),
                                      tokens[:0], min_p=0.02, compute_entropy=True, backend="triton")
    assert empty.logprobs.shape == empty.size.shape == empty.entropy.shape == (0,)
    with torch.no_grad():
        out = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="triton")
    assert out.logprobs.grad_fn is None


def test_folds_under_the_interpreter():
    run_interpreted(__file__, len(_CASES) + 4 + 1)


def test_backend_choice_and_its_errors():
    hidden, weight, tokens, _ = _inputs(torch.float32, 383, 1.0, 0.02, n=5)
    with pytest.raises(ValueError, match=r"backend='cuda'.*expected one of"):
        safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="cuda")
    with pytest.raises(ValueError, match=r"top_k=5, top_p=1.0.*min_p alone.*backend='auto' or 'torch'"):
        safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, top_k=5, backend="triton")
    assert not sv._fused_by_default(hidden)  # CPU tensors: the torch folds


def test_a_failing_fold_leaves_the_call_to_torch(monkeypatch):
    """Where the Triton folds cannot run (here: CPU tensors without the interpreter), "auto" counts the failure,
    warns and returns the torch folds' result for that call; the next call tries the folds again (a failure is
    counted per call, not a switch that turns them off for the rest of the process)."""
    if INTERPRETED:
        pytest.skip("the interpreter runs the folds on the CPU")
    monkeypatch.setattr(sv, "_fused_failures", 0)
    monkeypatch.setattr(sv, "_fused_by_default", lambda hidden: True)
    hidden, weight, tokens, _ = _inputs(torch.float32, 383, 1.0, 0.02, n=7)
    with pytest.warns(UserWarning, match="Triton safe-vocab folds failed.*this call uses the torch folds"):
        got = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02)
    assert sv.fused_failure_count() == 1
    want = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="torch")
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.in_safe, want.in_safe)
    with pytest.raises(Exception):  # forced: no fallback
        safe_logprobs_from_hidden(hidden, weight, tokens, min_p=0.02, backend="triton")
    assert sv.fused_failure_count() == 1  # "triton" raises, it does not fall back
    # the logits path shares the choice and the fallback; it tries the folds again (the count goes on)
    logits = hidden @ weight.t()
    with pytest.warns(UserWarning, match="Triton safe-vocab folds failed"):
        got = safe_logprobs_from_logits(logits, tokens, min_p=0.02)
    want = safe_logprobs_from_logits(logits, tokens, min_p=0.02, backend="torch")
    assert sv.fused_failure_count() == 2 and torch.equal(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match=r"backend='triton' with top_k=0, top_p=0.9"):
        safe_logprobs_from_logits(logits, tokens, min_p=0.02, top_p=0.9, backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("flags", [(1.0, DEFAULT_MIN_P, False), (0.7, 0.0, True)])
def test_folds_compile_for_hopper(dtype, flags):
    """Compile both kernels ahead of time for sm_90 with the arguments a launch passes (Triton's bundled ptxas;
    no GPU needed): catches what the interpreter does not check, such as a loop-carried value changing type."""
    if INTERPRETED:
        pytest.skip("the kernels are interpreter functions in this process")
    pytest.importorskip("triton.backends.compiler")
    from tim_plugins import _safe_vocab_kernel as K

    temperature, min_p, entropy = flags
    n, v = 8, 1000
    x, tok = torch.zeros(n, v, dtype=dtype), torch.zeros(n, dtype=torch.int64)
    stats, size, row = torch.zeros(len(K.STATS), n), torch.zeros(n, dtype=torch.int32), torch.zeros(n)
    _, args, consts = K.fold_launch(x, tok, stats, size, temperature, min_p, entropy)
    fold = compile_for_hopper(K._fold_kernel, args, consts, K.FOLD_WARPS)
    _, args, consts = K.grad_launch(x, 0, tok, row, row, row if entropy else None, row, row if entropy else None,
                                    temperature, min_p)
    grad = compile_for_hopper(K._grad_kernel, args, consts, 4)
    for compiled in (fold, grad):
        assert ".target sm_90" in compiled.asm["ptx"]
    if temperature != 1.0:  # the IEEE division the torch folds use, not Triton's approximate one
        assert "div.rn.f32" in fold.asm["ptx"] and "div.rn.f32" in grad.asm["ptx"]
