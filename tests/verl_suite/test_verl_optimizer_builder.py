"""verl's own optimizer builder resolves tim_plugins' scaled optimizer by module + class name."""

from __future__ import annotations

import torch
from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

from tim_plugins.lr_scaling import ScaledAdamW


def test_verl_build_optimizer_path():
    model = torch.nn.Linear(3, 2)
    cfg = FSDPOptimizerConfig(lr=1e-3, optimizer_impl="tim_plugins.lr_scaling", optimizer="ScaledAdamW")
    opt = build_optimizer(model.parameters(), cfg)
    assert isinstance(opt, ScaledAdamW) and opt.lr_scale == 1.0
