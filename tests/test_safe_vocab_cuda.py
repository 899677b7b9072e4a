"""The safe-vocab head's Triton folds on a CUDA GPU, against the float64 reference and the torch folds.

Skipped without CUDA (CI has none); ``benchmarks/gpu_perf.sh`` runs this file first on a GPU machine. The same
comparisons run on the CPU under Triton's interpreter in ``tests/test_safe_vocab_triton.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_safe_vocab import HIDDEN_TOL, exact_hidden_inputs, naive_safe

from tim_plugins import safe_vocab as sv
from tim_plugins.safe_vocab import DEFAULT_MIN_P, safe_logprobs_from_hidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(dtype, vocab, temperature, min_p, n=300, hdim=64, seed=0):
    hidden, weight, tokens, gen = exact_hidden_inputs(n, hdim, vocab, dtype, temperature=temperature, min_p=min_p,
                                                      seed=seed)
    return hidden.cuda(), weight.cuda(), tokens.cuda(), gen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,temperature,min_p,entropy", [(50_001, 1.0, DEFAULT_MIN_P, False),
                                                            (32_771, 0.7, 0.02, True), (4_099, 1.3, 0.0, True)])
def test_cuda_folds_match_the_reference_and_the_torch_folds(dtype, vocab, temperature, min_p, entropy,
                                                            monkeypatch):
    monkeypatch.setattr(sv, "_FUSED_GRAD_ROWS", 128)  # several backward row tiles
    hidden, weight, tokens, gen = _inputs(dtype, vocab, temperature, min_p)
    g = torch.randn(len(tokens), generator=gen, dtype=torch.float64).cuda()
    ge = torch.randn(len(tokens), generator=gen, dtype=torch.float64).cuda() if entropy else None
    kw = dict(min_p=min_p, temperature=temperature, compute_entropy=entropy, chunk_size=100)
    results = {}
    for backend in ("auto", "torch"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = safe_logprobs_from_hidden(h, w, tokens, backend=backend, **kw)
        loss = (out.logprobs.masked_fill(~out.in_safe, 0) * g.float()).sum()
        if entropy:
            loss = loss + (out.entropy * ge.float()).sum()
        loss.backward()
        results[backend] = (out, h.grad, w.grad)
    assert not sv._fused_failed  # "auto" ran the Triton folds
    (fused, fh, fw), (plain, ph, pw) = results["auto"], results["torch"]

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_in, keep, ref_ent, ref_pruned = naive_safe(h2 @ w2.t(), tokens, min_p=min_p, temperature=temperature)
    ((ref_lp.masked_fill(~ref_in, 0) * g).sum() + ((ref_ent * ge).sum() if entropy else 0)).backward()

    assert torch.equal(fused.in_safe, ref_in) and torch.equal(fused.size, keep.sum(-1))
    torch.testing.assert_close(fused.logprobs.double()[ref_in], ref_lp.detach()[ref_in], atol=2e-5, rtol=0)
    torch.testing.assert_close(fused.pruned_mass.double(), ref_pruned.detach(), atol=1e-6, rtol=0)
    if entropy:
        torch.testing.assert_close(fused.entropy.double(), ref_ent.detach(), atol=2e-5, rtol=0)
    g_tol = HIDDEN_TOL[dtype][1]
    for mine, ref in ((fh, h2.grad), (fw, w2.grad)):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.double(), ref.double(), atol=g_tol * ref.abs().max().item(), rtol=0)
    assert torch.equal(fused.in_safe, plain.in_safe) and torch.equal(fused.size, plain.size)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=2e-6, rtol=1e-6)
    rel = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    for mine, other in ((fh, ph), (fw, pw)):
        torch.testing.assert_close(mine.double(), other.double(), atol=2 * rel * other.abs().max().item(), rtol=0)
