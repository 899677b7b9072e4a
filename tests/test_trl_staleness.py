"""Mismatch or staleness through TRL's own GRPOTrainer (CPU, the toy model, an injected mismatch).

With ``num_iterations=2`` each generation batch trains two optimizer steps: the first pass runs at the rollout's
weights (no staleness: π_θ is π_old), the second after one update. The logged ``tim/split/*`` and
``tim/staleness/*`` values are checked against references computed here, per logging step, from the tensors TRL
itself used (``sampling_per_token_logps``, ``old_per_token_logps``, the loss pass's own per-token log-probs),
with the split written out in float64; the parts add up to TRL's own log-ratio per token. With
``num_iterations=1`` the staleness part is exactly zero at every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from test_trl_callback import Capture, _loss_mask, _logged, make_trainer  # noqa: E402

pytestmark = pytest.mark.trl

INJECT = {"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}


def _run(model_path, tmp_path, iterations: int, **overrides):
    trainer = make_trainer(model_path, tmp_path, num_iterations=iterations, max_steps=4, **overrides)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, rollout="inject", inject_options=INJECT)))
    trainer.train()
    return trainer, cap


def _reference(passes) -> dict[str, float]:
    """The split of the loss passes' tokens, written out: s = current − old, m = old − rollout (float64)."""
    s = np.concatenate([(c.double() - o.double())[k].numpy() for r, o, c, k in passes])
    m = np.concatenate([(o.double() - r.double())[k].numpy() for r, o, c, k in passes])
    d = s + m
    var_d = np.var(d)
    return {"tim/split/tokens": float(len(d)), "tim/split/staleness_mean": s.mean(),
            "tim/split/mismatch_mean": m.mean(), "tim/split/total_var": var_d,
            "tim/split/staleness_var_share": np.var(s) / var_d, "tim/split/mismatch_var_share": np.var(m) / var_d,
            "tim/split/cov_share": 2 * np.mean((s - s.mean()) * (m - m.mean())) / var_d,
            "tim/staleness/token/kl_k3": float(np.mean(np.expm1(s) - s)),
            "tim/staleness/token/abs_diff_max": float(np.abs(s).max())}


def _reused_reference(passes) -> dict[str, float]:
    """tim/split/reused_*: the split of the reused passes' tokens (trained one update after their rollout) alone."""
    s = np.concatenate([(c.double() - o.double())[k].numpy() for r, o, c, k in passes])
    d = np.concatenate([(c.double() - r.double())[k].numpy() for r, o, c, k in passes])
    return {"tim/split/reused_tokens": float(len(d)), "tim/split/reused_staleness_var_share": np.var(s) / np.var(d),
            "tim/split/reused_staleness_kl_k3": float(np.mean(np.expm1(s) - s))}


def _by_lag_reference(passes_with_lag) -> dict[str, float]:
    """tim/by_lag/<lag>/*: the whole log-ratio current − rollout of each lag's tokens, written out."""
    out = {}
    for lag in sorted({lag for *_, lag in passes_with_lag}):
        d = np.concatenate([(c.double() - r.double())[k].numpy() for r, o, c, k, g in passes_with_lag if g == lag])
        p = f"tim/by_lag/{lag}"
        out.update({f"{p}/count": float(len(d)), f"{p}/abs_diff_mean": np.abs(d).mean(), f"{p}/mean": d.mean(),
                    f"{p}/kl_k3": np.mean(np.expm1(d) - d), f"{p}/abs_diff_max": np.abs(d).max()})
    return out


def _passes_by_step(cap):
    """step -> [(rollout, π_old, π_θ, mask)] of its loss passes; π_old is π_θ at a step that generated its batch
    (no update since), else TRL's own old_per_token_logps."""
    generated = {s for s, _ in cap.generations}
    out: dict[int, list] = {}
    for step, inputs, current in cap.losses:
        old = inputs.get("old_per_token_logps")
        if step in generated or old is None:
            old = current
        rollout = inputs["sampling_per_token_logps"]
        # the parts add up to TRL's own log-ratio (current − rollout) per token
        s, m = current.double() - old.double(), old.double() - rollout.double()
        torch.testing.assert_close(s + m, current.double() - rollout.double(), rtol=0, atol=1e-12)
        out.setdefault(step, []).append((rollout, old, current, _loss_mask(inputs)))
    return out, generated


def test_two_iterations_split_matches_trls_tensors(toy_model_path, tmp_path):
    trainer, cap = _run(toy_model_path, tmp_path, iterations=2)
    passes, generated = _passes_by_step(cap)
    assert sorted(passes) == [1, 2, 3, 4] and generated == {1, 3}
    for step, step_passes in passes.items():
        logged, want = _logged(trainer, step), _reference(step_passes)
        # by policy lag: 0 at a step that generated its batch, 1 one update later (num_iterations=2)
        lag = 0 if step in generated else 1
        want.update(_by_lag_reference([(*p, lag) for p in step_passes]))
        assert {k for k in logged if k.startswith("tim/by_lag/")} == {k for k in want if k.startswith("tim/by_lag/")}
        for key, value in want.items():
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, key)
        if step in generated:  # the first pass over a batch: no update since it was sampled
            assert logged["tim/split/staleness_mean"] == 0.0 and logged["tim/staleness/token/abs_diff_max"] == 0.0
            assert logged["tim/split/mismatch_var_share"] == 1.0
            assert logged["tim/split/reused_tokens"] == 0.0
        else:  # one update later the policy moved: staleness is there, next to the injected mismatch
            assert logged["tim/staleness/token/abs_diff_max"] > 0 and logged["tim/split/staleness_var_share"] > 0
            assert 0 < logged["tim/split/mismatch_var_share"] < 1
            for key, value in _reused_reference(step_passes).items():
                assert logged[key] == pytest.approx(value, rel=1e-5), (step, key)


def test_one_iteration_has_exactly_zero_staleness(toy_model_path, tmp_path):
    trainer, _ = _run(toy_model_path, tmp_path, iterations=1)
    rows = [h for h in trainer.state.log_history if "tim/split/tokens" in h]
    assert len(rows) == 4
    for row in rows:
        assert row["tim/split/tokens"] > 0
        assert row["tim/split/staleness_mean"] == 0.0 and row["tim/split/staleness_var_share"] == 0.0
        assert row["tim/staleness/token/kl_k3"] == 0.0 and row["tim/staleness/token/abs_diff_max"] == 0.0
        assert row["tim/split/mismatch_var_share"] == 1.0


def test_a_window_over_a_batchs_two_passes_judges_the_reused_one(toy_model_path, tmp_path):
    """num_iterations=2 with logging_steps=2: each window holds a batch's first pass (lag 0) and its reused pass
    (lag 1). ``tim/split/reused_*`` are the reused pass's tokens alone (what the staleness rule reads), the pooled
    ``tim/staleness/*`` both passes' (diluted by the fresh tokens). Reference: TRL's own tensors."""
    trainer, cap = _run(toy_model_path, tmp_path, iterations=2, logging_steps=2)
    passes, generated = _passes_by_step(cap)
    assert generated == {1, 3}
    for window in (2, 4):
        logged = _logged(trainer, window)
        fresh, reused = passes[window - 1], passes[window]
        for key, value in _reused_reference(reused).items():
            assert logged[key] == pytest.approx(value, rel=1e-5), (window, key)
        pooled = _reference(fresh + reused)["tim/staleness/token/kl_k3"]
        assert logged["tim/staleness/token/kl_k3"] == pytest.approx(pooled, rel=1e-5)
        assert logged["tim/split/reused_staleness_kl_k3"] > 1.5 * pooled  # the fresh half of the window dilutes it
