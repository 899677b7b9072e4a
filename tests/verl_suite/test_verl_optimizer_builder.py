"""verl's own optimizer builder, pointed at our classes the way users configure it
(``optim.optimizer_impl=tim_plugins.integrations.verl.optim optim.optimizer=AdamW``), gives an optimizer whose steps
are torch's at ``scale × lr``: compared numerically with the plain torch class at the scaled LR."""

from __future__ import annotations

import pytest
import torch
from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

IMPL = "tim_plugins.integrations.verl.optim"
LR = 1e-3
STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _run(opt: torch.optim.Optimizer, model: torch.nn.Module, before_step=None) -> None:
    gen = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        x = torch.randn(8, 5, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if before_step is not None:
            before_step(t)
        opt.step()


def _torch_reference(name: str, cfg: FSDPOptimizerConfig, params, lr: float) -> torch.optim.Optimizer:
    # The arguments verl's build_optimizer passes (betas for the Adam family only), at the LR wanted.
    kwargs = {"lr": lr, "weight_decay": cfg.weight_decay}
    if "adam" in name.lower():
        kwargs["betas"] = cfg.betas
    return getattr(torch.optim, name)(params, **kwargs)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_built_optimizer_steps_as_torch_at_the_scaled_lr(name, scale):
    cfg = FSDPOptimizerConfig(lr=LR, optimizer_impl=IMPL, optimizer=name)
    model, ref_model = _model(), _model()
    opt = build_optimizer(model.parameters(), cfg)
    ref = _torch_reference(name, cfg, ref_model.parameters(), LR * scale)

    # The engine hands the pipeline's scale to the optimizer before every step (StepPipeline.end_step).
    _run(opt, model, before_step=lambda t: opt.tim_apply_scale(scale))
    _run(ref, ref_model)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{name} at scale {scale} differs from torch.optim.{name}(lr={LR * scale})"
    # verl's LambdaLR rewrites the group LR every step from its own value: the scale must not leak into it.
    assert [g["lr"] for g in opt.param_groups] == [LR]


def test_half_scale_is_not_the_full_lr():
    """The comparison above can tell the two LRs apart: at scale 0.5 the parameters leave torch's full-LR run."""
    cfg = FSDPOptimizerConfig(lr=LR, optimizer_impl=IMPL, optimizer="AdamW")
    model, full_model = _model(), _model()
    opt = build_optimizer(model.parameters(), cfg)
    _run(opt, model, before_step=lambda t: opt.tim_apply_scale(0.5))
    _run(_torch_reference("AdamW", cfg, full_model.parameters(), LR), full_model)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), full_model.parameters()))
