"""TIMCallback on a GRPOTrainer with ``GRPOConfig(use_liger_kernel=True)``, through TRL's own ``train()``.

TRL 1.9 - 1.13 then trains through Liger's fused GRPO loss (``GRPOTrainer.compute_liger_loss``): the loss forward
never reaches ``_compute_loss`` or ``_get_per_token_logps_and_entropies``, where the callback measures a batch TRL did
not score at generation and applies the loss-side mitigations. There (the oldest stack, TRL 1.9.0):

- what needs the loss forward is switched off at attach, one warning each with the fix, and counted
  (``tim/diag/feature_off/liger_*``), strict mode refuses; every generation batch left unmeasured is counted;
- the callback changes nothing in what TRL trains: every step's loss and grad norm equal a run without it;
- a batch TRL scores at generation (``old_per_token_logps``: num_iterations > 1) is measured, equal to the naive
  formulas on TRL's own tensors.

The reference for "the loss is Liger's" is TRL's own dispatch: a test-side wrapper on ``compute_liger_loss`` counts
its calls and one on ``_compute_loss`` sees none (a TRL whose dispatch moved fails here). On TRL >= 1.14 (the main
suite: 1.16) ``use_liger_kernel`` keeps TRL's loss path: the callback measures as without it, nothing switched off.

Liger's layer kernels are Triton kernels for a GPU: the runs here turn them off (``liger_kernel_config``), which
leaves the GRPO loss (TRL 1.9 - 1.13: ``liger_kernel.chunked_loss``, plain torch) as it is on a GPU.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl")
pytest.importorskip("liger_kernel")
torch = pytest.importorskip("torch")

from test_trl_callback import Capture, _check_against_reference, make_trainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402

pytestmark = pytest.mark.trl

# every layer kernel off (they need a GPU); TRL 1.9 - 1.13's GRPO loss is Liger's whatever these say
NO_LAYER_KERNELS = dict(rope=False, swiglu=False, rms_norm=False, cross_entropy=False, fused_linear_cross_entropy=False)
OFF = {"liger_safe_vocab", "liger_loss_factor", "liger_loss_pass"}


def liger_trainer(model_path, tmp_path, **overrides):
    return make_trainer(model_path, tmp_path, use_liger_kernel=True, liger_kernel_config=NO_LAYER_KERNELS,
                        **overrides)


def _liger_loss_calls(trainer) -> dict:
    """Count TRL's own loss paths as TRL dispatches to them (installed before the callback)."""
    calls = {"compute_liger_loss": 0, "_compute_loss": 0}
    for name in calls:
        original = getattr(trainer, name, None)
        if original is None:
            continue

        def wrapper(*a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(*a, **k)

        setattr(trainer, name, wrapper)
    return calls


def _has_liger_loss(model_path, tmp_path) -> bool:
    return features.liger_grpo_loss(liger_trainer(model_path, tmp_path))


@pytest.fixture(scope="module")
def liger_loss(toy_model_path, tmp_path_factory):
    """Whether the installed TRL trains ``use_liger_kernel`` through Liger's GRPO loss (TRL 1.9 - 1.13)."""
    return _has_liger_loss(toy_model_path, tmp_path_factory.mktemp("probe"))


def _rows(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "step" in h]


def test_liger_loss_switches_off_what_needs_the_loss_forward_and_trains_as_trl(toy_model_path, tmp_path, caplog,
                                                                               liger_loss):
    if not liger_loss:
        pytest.skip("this TRL trains use_liger_kernel through its own loss path (TRL >= 1.14)")
    plain = liger_trainer(toy_model_path, tmp_path / "plain", max_steps=3)
    plain.train()
    trainer = liger_trainer(toy_model_path, tmp_path / "tim", max_steps=3)
    calls = _liger_loss_calls(trainer)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        callback = TIMCallback(trainer, TIMConfig(safe_vocab=True, is_correction="token_tis"))
    trainer.add_callback(callback)
    warned = [r.getMessage() for r in caplog.records if "use_liger_kernel=True" in r.getMessage()]
    assert {s.name for s in callback.features_off} == OFF and len(warned) == 3
    assert all("Fix: GRPOConfig(use_liger_kernel=False), or pip install -U 'trl>=1.16'" in w for w in warned)
    trainer.train()
    # TRL's own dispatch: every loss forward was Liger's (so the callback's hooks had nothing to see)
    assert calls == {"compute_liger_loss": 3, "_compute_loss": 0}
    rows, reference = _rows(trainer), _rows(plain)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row, ref in zip(rows, reference):
        # nothing half-applied: the safe vocabulary and the IS weights are off, TRL trains what it trains alone
        assert row["loss"] == ref["loss"] and row["grad_norm"] == ref["grad_norm"], row["step"]
        assert all(row[f"tim/diag/feature_off/{name}"] == 1 for name in OFF)
        assert not any(k.startswith("tim/token/") for k in row)
    # each generation batch (one per step here) was counted unmeasured: the diagnostics add up over the run
    assert [r["tim/diag/liger_loss_unmeasured"] for r in rows] == [1, 2, 3]


def test_strict_mode_refuses_liger_loss_at_attach(toy_model_path, tmp_path, liger_loss):
    if not liger_loss:
        pytest.skip("this TRL trains use_liger_kernel through its own loss path (TRL >= 1.14)")
    trainer = liger_trainer(toy_model_path, tmp_path)
    with pytest.raises(RuntimeError, match=r"the loss forward's measurement .*Fix: GRPOConfig\(use_liger_kernel=False"):
        TIMCallback(trainer, TIMConfig(strict=True))
    assert not any(type(cb).__name__ == "TIMState" for cb in trainer.callback_handler.callbacks)


def test_batches_scored_at_generation_are_measured_under_liger_loss(toy_model_path, tmp_path, liger_loss):
    """num_iterations=2: TRL scores each generation batch at generation (old_per_token_logps), which the monitor
    measures whatever the loss is; the reference is the naive formulas on TRL's own tensors."""
    # a low rate: the second pass over each batch stays ordinary PPO reuse (no staleness named)
    trainer = liger_trainer(toy_model_path, tmp_path, num_iterations=2, max_steps=4, learning_rate=1e-5)
    cap = Capture(trainer)
    callback = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(callback)
    trainer.train()
    assert callback.liger_loss is liger_loss
    assert sum(out.get("old_per_token_logps") is not None for _, out in cap.generations) == 2
    assert _check_against_reference(trainer, cap) == 2
    if liger_loss:  # no batch went unmeasured
        assert all("tim/diag/liger_loss_unmeasured" not in r for r in _rows(trainer))


def test_newer_trl_measures_every_loss_forward_with_use_liger_kernel(toy_model_path, tmp_path, liger_loss):
    if liger_loss:
        pytest.skip("this TRL trains use_liger_kernel through Liger's GRPO loss (TRL 1.9 - 1.13)")
    trainer = liger_trainer(toy_model_path, tmp_path, max_steps=2)
    cap = Capture(trainer)
    callback = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(callback)
    trainer.train()
    assert not callback.features_off and not callback.liger_loss
    assert len(cap.losses) == 2 and _check_against_reference(trainer, cap) == 2
