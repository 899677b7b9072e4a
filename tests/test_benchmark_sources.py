"""Guards on the TRL internals only the benchmarks rely on (``benchmarks/sources.py`` ``BENCHMARK_SOURCES``), on the
installed TRL: each entry exists from its release on, and the profiling hook ``bench_trl_step`` records through
behaves as it assumes (one call per profiled block, with the block's name, the scoring block named as it reads it).
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

pytest.importorskip("trl")

from packaging.version import Version  # noqa: E402

from benchmarks.bench_trl_step import LOGPS_PHASE  # noqa: E402
from benchmarks.sources import BENCHMARK_SINCE, BENCHMARK_SOURCES  # noqa: E402
from tim_plugins._optional import package_version  # noqa: E402


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("key", sorted(BENCHMARK_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_entry_exists_from_its_release_on(key):
    since = BENCHMARK_SINCE.get(key)
    if since is not None and Version(package_version(since[0])) < Version(since[1]):
        pytest.skip(f"{key[0]}:{key[1]} exists from {since[0]} {since[1]} on (installed: {package_version(since[0])})")
    assert _resolve(*key) is not None, f"{key[0]}:{key[1]} is gone: revisit benchmarks/sources.py and its users"


def test_profiled_blocks_report_through_log_metrics(monkeypatch):
    """``ProfilingContext._log_metrics(self, duration)`` runs once per block, on the class attribute the benchmark
    replaces, with ``self.name`` = '<trainer class>.<block>'."""
    from trl.extras.profiling import ProfilingContext, profiling_context

    assert list(inspect.signature(ProfilingContext._log_metrics).parameters) == ["self", "duration"]
    seen = []
    monkeypatch.setattr(ProfilingContext, "_log_metrics", lambda ctx, duration: seen.append((ctx.name, duration)))

    class FakeTrainer:  # what profiling_context reads of a trainer
        state = types.SimpleNamespace(global_step=3)
        args = types.SimpleNamespace(report_to=[])
        accelerator = types.SimpleNamespace(is_main_process=True)

    with profiling_context(FakeTrainer(), LOGPS_PHASE.lstrip(".")):
        pass
    assert len(seen) == 1 and seen[0][0] == "FakeTrainer" + LOGPS_PHASE and seen[0][1] >= 0.0


def test_the_scoring_phase_is_a_profiled_block():
    """GRPOTrainer profiles its scoring method under its own name: the phase ``bench_trl_step`` sums."""
    from trl import GRPOTrainer

    method = GRPOTrainer.__dict__[LOGPS_PHASE.lstrip(".")]
    assert hasattr(method, "__wrapped__") and "@profiling_decorator" in inspect.getsource(method)
