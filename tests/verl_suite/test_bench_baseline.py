"""The benchmark baseline loaded from verl's source files (for machines without verl) is verl itself."""

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


def test_missing_definition_is_reported(tmp_path):
    (tmp_path / "utils" / "debug").mkdir(parents=True)
    (tmp_path / "utils" / "torch_functional.py").write_text("def masked_sum():\n    pass\n")
    with pytest.raises(RuntimeError, match="masked_mean"):
        load_verl_baseline(tmp_path)
