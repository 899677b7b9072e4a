"""Batch-invariance check: known-value wrapper model, the toy model per dtype, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from tim_plugins.parity import check_batch_invariance

transformers = pytest.importorskip("transformers")

# Per-dtype ceilings for the toy model (hidden 64): what a sane CPU forward stays under. Measured on the dev
# machines: fp32 <= 3e-6, bf16 <= 5e-2 (KV cache vs full recompute is the worst case in bf16).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


@pytest.fixture(scope="module")
def toy(toy_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 383, (2, 24), generator=torch.Generator().manual_seed(0))


class BatchScaled(torch.nn.Module):
    """Wraps a model and multiplies its logits by (1 + 0.01 (B − 1)): a deliberately batch-dependent kernel."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, **kwargs):
        out = self.inner(input_ids=input_ids, **kwargs)
        out.logits = out.logits * (1 + 0.01 * (input_ids.shape[0] - 1))
        return out


def _naive_logp(logits, ids):
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_detects_a_batch_dependent_model_by_the_known_amount(toy, ids):
    report = check_batch_invariance(BatchScaled(toy), ids, batch_sizes=(4,), paddings=(), dtypes=("float32",),
                                    kv_cache=False)
    (case,) = report.cases
    # independent reference: each row's logits alone (B = 1, factor 1) vs scaled by 1.03 (B = 4)
    with torch.no_grad():
        alone = torch.cat([toy(input_ids=ids[i:i + 1]).logits for i in range(ids.shape[0])])
    expected = (_naive_logp(alone * 1.03, ids) - _naive_logp(alone, ids)).abs().max().item()
    assert case.kind == "batch" and case.param == 4 and not case.bitwise
    assert case.max_abs_diff == pytest.approx(expected, rel=1e-3)
    assert expected > 1e-3  # the wrapper really is batch dependent


def test_toy_model_per_dtype(toy, ids):
    report = check_batch_invariance(toy, ids, batch_sizes=(2, 8), paddings=(3,), dtypes=("float32", "bfloat16"))
    summary = report.summary()
    assert set(summary) == {"float32", "bfloat16"}
    kinds = {(c.dtype, c.kind, c.param) for c in report.cases}
    for dtype in ("float32", "bfloat16"):
        assert {(dtype, "batch", 2), (dtype, "batch", 8), (dtype, "pad_right", 3), (dtype, "pad_left", 3),
                (dtype, "kv_cache", 12)} <= kinds
        assert summary[dtype]["max"] <= TOLERANCE[dtype], (dtype, summary[dtype])
    # the report is the measurement: bitwise flags agree with the numbers
    for c in report.cases:
        assert c.bitwise == (c.max_abs_diff == 0.0)
        assert c.tokens > 0
    print(json.dumps(summary, indent=1))  # the measured per-dtype figures (shown with -s)


def test_kv_cache_case_matches_a_manual_incremental_decode(toy, ids):
    report = check_batch_invariance(toy, ids[:1], batch_sizes=(), paddings=(), dtypes=("float32",))
    (case,) = report.cases
    k = ids.shape[1] // 2
    # Log-probs in fp32 as the report computes them: the KV-cache difference is ~2e-6, below what a float64
    # reference of the same fp32 logits would resolve.
    with torch.no_grad():
        full = torch.log_softmax(toy(input_ids=ids[:1]).logits[:, :-1].float(), -1)
        full = full.gather(-1, ids[:1, 1:].unsqueeze(-1)).squeeze(-1)[:, k - 1:]
        out = toy(input_ids=ids[:1, :k], use_cache=True)
        logits, past = [out.logits[:, -1:]], out.past_key_values
        for t in range(k, ids.shape[1] - 1):
            out = toy(input_ids=ids[:1, t:t + 1], past_key_values=past, use_cache=True)
            logits.append(out.logits)
            past = out.past_key_values
    inc = torch.log_softmax(torch.cat(logits, 1).float(), -1).gather(-1, ids[:1, k:].unsqueeze(-1)).squeeze(-1)
    want = (inc - full).abs().max().item()
    assert case.max_abs_diff == pytest.approx(want, rel=1e-6)  # measured here: ~2e-6


def test_the_kv_cache_case_uses_the_installed_transformers_cache_name(toy, ids):
    """transformers 5.25 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns "deprecated and
    will be removed in version 5.40.0" on every decode step of ``tim-plugins check-batch-invariance``, and is then
    to be swallowed by ``**kwargs``: every step would decode without its cache). The case passes the name the model's
    forward takes and reads the cache where its output keeps it: no deprecation warning, the incremental decode
    still within fp32 rounding of the full forward."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_batch_invariance(toy, ids[:1], batch_sizes=(), paddings=(), dtypes=("float32",))
    stale = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not stale, stale
    (case,) = report.cases
    assert case.max_abs_diff < 1e-4, case.max_abs_diff  # a decode without its cache is off by whole nats


def test_input_validation(toy):
    with pytest.raises(ValueError, match="L >= 3"):
        check_batch_invariance(toy, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="'float8'"):
        check_batch_invariance(toy, torch.tensor([1, 2, 3, 4]), dtypes=("float8",))


def test_cli_prints_a_per_dtype_table(toy_model_path, capsys):
    from tim_plugins.apps.cli import main

    rc = main(["check-batch-invariance", "--model", str(toy_model_path), "--dtypes", "float32,bfloat16",
               "--batch-sizes", "2", "--paddings", "2", "--seq-len", "12", "--num-sequences", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert any(line.startswith("float32 ") for line in lines) and any(line.startswith("bfloat16 ") for line in lines)
    assert "kv_cache max|Δlogp|" in out
