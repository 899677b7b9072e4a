"""StepPipeline.measure on inputs an adapter should not hand it: each is counted under tim/diag/<name>, never raised
(strict mode raises), and what can still be measured is measured as without the bad part. References: the
monitor's own ``mismatch_metrics`` of the same batch, and the pipeline's result on the clean inputs."""

from __future__ import annotations

import math

import pytest
import torch

from tim_plugins.corrections import CorrectionConfig
from tim_plugins.metrics import mismatch_metrics
from tim_plugins.pipeline import PipelineConfig, StepPipeline


def _batch(b: int = 3, t: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3
    train = rollout + 0.3 * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    return rollout, train, mask


def _pipe(correction: bool, strict: bool = False) -> StepPipeline:
    return StepPipeline(PipelineConfig(compile=False, strict=strict,
                                       correction=CorrectionConfig(mode="token_tis") if correction else None))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_a_weight_per_sequence_is_counted_and_the_batch_measured_without_it():
    rollout, train, mask = _batch()
    pipe = _pipe(correction=False)
    assert pipe.measure(rollout, train, mask, is_weights=torch.ones(3)) is None
    assert pipe.diag == {"shape_mismatch": 1.0}
    assert _same(pipe.monitor.compute(sync=False), mismatch_metrics(rollout, train, mask, compile=False))
    # with the pipeline's own correction the framework's weights are not read: the correction's come back
    corrected, clean = _pipe(correction=True), _pipe(correction=True)
    weights = corrected.measure(rollout, train, mask, is_weights=torch.ones(3))
    assert torch.equal(weights, clean.measure(rollout, train, mask))


@pytest.mark.parametrize("correction", [False, True])
def test_one_dimensional_log_probs_are_counted_not_measured(correction):
    rollout, train, mask = _batch()
    pipe = _pipe(correction)
    assert pipe.measure(rollout[0], train[0], mask[0]) is None
    assert pipe.diag == {"shape_mismatch": 1.0}
    assert pipe.monitor.compute(sync=False)["tim/tokens"] == 0


def test_integer_log_probs_are_counted_not_measured():
    rollout, train, mask = _batch()
    pipe = _pipe(correction=True)
    assert pipe.measure(rollout.long(), train.long(), mask) is None
    assert pipe.diag == {"logprobs_not_float": 1.0}
    assert pipe.monitor.compute(sync=False)["tim/tokens"] == 0


@pytest.mark.parametrize("bad", ["weights", "1d", "int"])
def test_strict_mode_raises_with_the_problem_named(bad):
    rollout, train, mask = _batch()
    pipe = _pipe(correction=False, strict=True)
    args, kwargs = {"weights": ((rollout, train, mask), {"is_weights": torch.ones(3)}),
                    "1d": ((rollout[0], train[0], mask[0]), {}),
                    "int": ((rollout.long(), train.long(), mask), {})}[bad]
    with pytest.raises(RuntimeError, match="shape_mismatch" if bad != "int" else "logprobs_not_float"):
        pipe.measure(*args, **kwargs)


def test_tokens_of_unknown_lag_ride_in_a_checkpoint_cut_between_windows():
    """measure_lagged counts a token whose policy lag is unknown (-1) when the logging window closes: a state saved
    before that (TRL's save_steps off its logging_steps) carries the count as the window's keyed statistics ride,
    so the resumed window reports what the uninterrupted one reports (the reference)."""
    from tim_plugins.pipeline import pipeline_config

    rollout, train, _ = _batch(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    lag = torch.tensor([[-1] * 5, [0] * 5])
    pipe = StepPipeline(pipeline_config())
    pipe.measure_lagged(rollout, train, mask, lag)
    resumed = StepPipeline(pipeline_config())
    resumed.load_state_dict(pipe.state_dict())
    want, got = pipe.compute(1, sync=False)[0], resumed.compute(1, sync=False)[0]
    assert want["tim/diag/async_lag_unknown"] == got["tim/diag/async_lag_unknown"] == 5.0
    assert want["tim/tokens"] == got["tim/tokens"] == 5.0  # the lag-0 row, measured
