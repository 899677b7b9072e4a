"""When the loss factor's hook moved (``features.LOSS_FACTOR`` off), the callback leaves TRL's loss alone, also with
the safe vocabulary's boundary mask asked for: the pipeline's ``mask_boundary`` is off, and the advantages TRL's
loss reads are the ones TRL built (before the fix the callback read ``TIMConfig.mask_boundary_tokens`` instead of
the pipeline's setting and rewrote them anyway)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import Capture, make_trainer  # noqa: E402

from tim_plugins.capabilities import Feature, Hook  # noqa: E402
from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402

pytestmark = pytest.mark.trl

SAMPLER_MIN_P, TRAINER_MIN_P = 0.05, 0.3  # the trainer's safe set is narrower: sampled boundary tokens exist


def test_moved_loss_factor_hook_leaves_trl_advantages_untouched(toy_model_path, tmp_path, monkeypatch):
    moved = features.LOSS_FACTOR.hooks[0]
    monkeypatch.setattr(features, "LOSS_FACTOR", Feature(
        features.LOSS_FACTOR.name, features.LOSS_FACTOR.title, "trl", needs=("trl",), extra="trl", fix="upgrade",
        hooks=(Hook(moved.module, moved.qualname, fragments=("a statement TRL never wrote",)),)))
    trainer = make_trainer(toy_model_path, tmp_path, min_p=SAMPLER_MIN_P, max_steps=1)
    cap = Capture(trainer)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True, safe_vocab_min_p=TRAINER_MIN_P))
    assert [s.name for s in cb.features_off] == ["loss_factor"]
    assert cb.truncation is not None and not cb.pipeline.config.mask_boundary
    trainer.add_callback(cb)
    trainer.train()
    assert cap.losses and len(cap.read_in_loss) == len(cap.losses)
    for (_, inputs, _), read in zip(cap.losses, cap.read_in_loss):
        # TRL's loss read TRL's own [B] advantages: the loss factor would have made them [B, T] (boundary tokens 0)
        assert read["advantages"].dim() == 1 and torch.equal(read["advantages"], inputs["advantages"])
    logged = {k: v for row in trainer.state.log_history for k, v in row.items()}
    assert logged["tim/diag/feature_off/loss_factor"] == 1.0
    # the safe vocabulary still measures: boundary tokens exist (the mask would have acted on them)
    assert logged["tim/safe_vocab/boundary_frac"] > 0.0
