"""The benchmark baseline (``benchmarks/_verl_baseline.py``): loaded from verl's source files (for machines
without verl) it is verl itself, and either way ``run`` feeds verl the rollout and trainer log-probs in their
roles, so the benchmark times verl computing the mismatch of the same tensors our monitor gets (checked against
formulas written here in float64: a swapped or mis-masked argument changes them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")

from benchmarks._verl_baseline import load_verl_baseline  # noqa: E402


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(5, 37, generator=g) * 6.0
    train = rollout + 0.1 * torch.randn(5, 37, generator=g)
    mask = (torch.rand(5, 37, generator=g) < 0.8).long()
    mask[2] = 0  # a fully masked row
    return rollout, train, mask


@pytest.mark.parametrize("seed", [0, 1])
def test_source_loaded_functions_equal_installed_verl(seed):
    installed = load_verl_baseline()
    from_source = load_verl_baseline(Path(verl.__file__).parent)
    assert from_source.origin.startswith("verl source files")
    rollout, train, mask = _batch(seed)
    a = installed.run(rollout, train, mask)
    b = from_source.run(rollout, train, mask)
    assert a.keys() == b.keys()
    assert len(a) >= 15  # both verl functions contributed
    for key in a:
        assert a[key] == b[key], key  # same code, same ops: bitwise equal


@pytest.mark.parametrize("origin", ["installed", "source"])
def test_run_computes_the_mismatch_of_its_arguments(origin):
    baseline = load_verl_baseline() if origin == "installed" else load_verl_baseline(Path(verl.__file__).parent)
    rollout, train, mask = _batch(0)
    out = baseline.run(rollout, train, mask)
    keep = mask.bool()
    r, t = rollout[keep].double(), train[keep].double()
    log_ratio = t - r  # log(π_train / π_rollout) per response token
    # verl's inputs are float32: its token means carry ~1e-7 relative rounding, k3 (e^x − 1 − x) ~1e-5.
    assert out["rollout_corr/kl"] == pytest.approx(float((r - t).mean()), rel=1e-5)
    assert out["rollout_corr/k3_kl"] == pytest.approx(float((log_ratio.exp() - log_ratio - 1).mean()), rel=1e-4)
    assert out["training/rollout_probs_diff_mean"] == pytest.approx(float((t.exp() - r.exp()).abs().mean()),
                                                                    rel=1e-5)
    assert out["training/rollout_probs_diff_max"] == pytest.approx(float((t.exp() - r.exp()).abs().max()),
                                                                   rel=1e-6)


def test_missing_definition_is_reported(tmp_path):
    (tmp_path / "utils" / "debug").mkdir(parents=True)
    (tmp_path / "utils" / "torch_functional.py").write_text("def masked_sum():\n    pass\n")
    with pytest.raises(RuntimeError, match="masked_mean"):
        load_verl_baseline(tmp_path)
