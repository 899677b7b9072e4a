"""The safe-vocab head's Triton folds on a CUDA GPU, against the float64 reference and the torch folds.

Skipped without CUDA (CI has none); ``benchmarks/gpu_perf.sh`` runs this file first on a GPU machine. The same
comparisons run on the CPU under Triton's interpreter in ``tests/test_safe_vocab_triton.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_safe_vocab import assert_folds_match, exact_hidden_inputs, run_hidden

from tim_plugins import safe_vocab as sv
from tim_plugins.safe_vocab import DEFAULT_MIN_P

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
    failures = sv.fused_failure_count()
    fused = run_hidden("auto", hidden, weight, tokens, g, ge, **kw)
    assert sv.fused_failure_count() == failures  # "auto" ran the Triton folds
    plain = run_hidden("torch", hidden, weight, tokens, g, ge, **kw)
    assert_folds_match(fused, plain, hidden, weight, tokens, g, ge, min_p=min_p, temperature=temperature,
                       entropy_atol=2e-5)
