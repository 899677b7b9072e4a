"""TIMCallback on GRPOTrainers that other libraries touched (issue 59), through a real ``GRPOTrainer.train()`` on the
toy model: ``__init__`` and the hooked methods wrapped with and without ``functools.wraps`` (and with the original
out of any check's reach), a user subclass with its own ``__init__`` or its own override of a hooked method (passing
TRL's arguments on as ``*args, **kwargs``), and the class rebuilt from TRL's own module
source with one unrelated line changed (compiled from a string, or loaded from a file), as patching libraries do.

Each attaches with every feature on and logs ``tim/`` at every step, and its run is the run of TRL's own class with
the same callback (the reference: same seeds, so the same losses and the same ``tim/`` values). A real move still
switches off only the feature that needs it, with a message naming what moved: a statement deleted from a copy of
TRL's source, an attribute removed from the live trainer; the monitor refuses only when its own setting is gone, and
never names an upgrade to the installed release as the fix.
"""

from __future__ import annotations

import logging

import pytest
from packaging.version import Version

pytest.importorskip("trl")
pytest.importorskip("datasets")

from touched import opaque, plain, rebuilt_grpo_module, replace_grpo_trainer, wraps  # noqa: E402
from test_trl_callback import make_trainer  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from tim_plugins._optional import package_version  # noqa: E402
from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = pytest.mark.trl

TRL = Version(package_version("trl"))
STEPS = 3
# every feature the toy trainer can run: the monitor, the safe vocabulary, the IS correction through TRL's loss
CONFIG = dict(safe_vocab=True, is_correction="token_tis")
HOOKED = ("__init__", "_compute_loss", "_get_per_token_logps_and_entropies", "log")
UPGRADE = "pip install -U 'trl>=1.16'"  # features._UPGRADE: a fix only where the installed TRL is older


class UserTrainer(GRPOTrainer):
    """A user's subclass with its own ``__init__``."""

    def __init__(self, *args, note: str = "mine", **kwargs):
        super().__init__(*args, **kwargs)
        self.note = note


class ForwardingTrainer(GRPOTrainer):
    """A user's subclass that overrides a hooked method the usual way: everything passed on to ``super()``."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class ModelFirstTrainer(GRPOTrainer):
    """The same with ``model`` named and the rest passed on."""

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


def _touched(kind: str, monkeypatch, tmp_path):
    """The trainer class as ``kind`` leaves it (installed where users import GRPOTrainer from)."""
    if kind == "subclass":
        return UserTrainer
    if kind == "override_varargs":
        return ForwardingTrainer
    if kind == "override_model_first":
        return ModelFirstTrainer
    if kind.startswith("rebuilt"):
        # one unrelated line of __init__ changed, as patchers edit it
        module = rebuilt_grpo_module(
            lambda text: text.replace("self.use_vllm = args.use_vllm",
                                      "self.use_vllm = args.use_vllm; self.rebuilt_by = 'a patching library'", 1),
            monkeypatch, tmp_path if kind == "rebuilt_file" else None)
        replace_grpo_trainer(module.GRPOTrainer, monkeypatch)
        return module.GRPOTrainer
    wrap = {"wraps": wraps, "plain": plain, "opaque_init": opaque}[kind]
    for name in HOOKED if kind != "opaque_init" else ("__init__",):
        monkeypatch.setattr(GRPOTrainer, name, wrap(getattr(GRPOTrainer, name)))
    return GRPOTrainer


def _run(toy_model_path, tmp_path, trainer_cls=None, **config):
    trainer = make_trainer(toy_model_path, tmp_path, trainer_cls=trainer_cls, min_p=1e-3, max_steps=STEPS)
    cb = TIMCallback(trainer, TIMConfig(**{**CONFIG, **config}))
    trainer.add_callback(cb)
    return trainer, cb


def _steps(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "loss" in row]


@pytest.fixture(scope="module")
def reference(toy_model_path, tmp_path_factory):
    """TRL's own GRPOTrainer with the callback: what every touched class must reproduce."""
    trainer, cb = _run(toy_model_path, tmp_path_factory.mktemp("reference"))
    assert cb.features_off == []
    trainer.train()
    return _steps(trainer)


@pytest.mark.parametrize("kind", ["wraps", "plain", "opaque_init", "subclass", "override_varargs",
                                  "override_model_first", "rebuilt_string", "rebuilt_file"])
def test_a_touched_trainer_attaches_and_logs_every_step(toy_model_path, tmp_path, monkeypatch, caplog, reference,
                                                        kind):
    cls = _touched(kind, monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        trainer, cb = _run(toy_model_path, tmp_path, trainer_cls=cls)
    assert type(trainer) is cls and cb.features_off == [], [s.warning() for s in cb.features_off]
    assert not [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert cb.truncation is not None and cb.pipeline.config.correction is not None
    trainer.train()
    steps = _steps(trainer)
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    for row in steps:  # every step: the monitor, the safe vocabulary, the correction
        assert {"tim/token/kl_k3", "tim/safe_vocab/boundary_frac", "tim/is/ess"} <= set(row), sorted(row)
    # the same run as TRL's own class: same losses, same tim/ values
    for row, ref in zip(steps, reference):
        assert row["loss"] == ref["loss"]
        assert {k: v for k, v in row.items() if k.startswith("tim/")} == \
            {k: v for k, v in ref.items() if k.startswith("tim/")}
    if kind.startswith("rebuilt"):
        assert trainer.rebuilt_by == "a patching library"


@pytest.mark.parametrize("where", ["file", "string"])
def test_a_statement_deleted_from_a_copy_switches_off_only_its_feature(toy_model_path, tmp_path, monkeypatch, caplog,
                                                                       where):
    """TRL's class rebuilt with the loss's read of ``inputs["advantages"]`` rewritten (the loss factor's hook):
    the loss factor is off, naming the statement and the class, the rest runs; read from a file the check sees the
    statement missing, compiled from a string it sees code it cannot read that differs from TRL's."""
    module = rebuilt_grpo_module(
        lambda text: text.replace('advantages = inputs["advantages"]', 'advantages = inputs.get("advantages")'),
        monkeypatch, tmp_path if where == "file" else None, name="moved_grpo_trainer")
    replace_grpo_trainer(module.GRPOTrainer, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        # a trainer-side safe set narrower than the sampler's, so the boundary mask would act (the loss factor)
        trainer, cb = _run(toy_model_path, tmp_path, trainer_cls=module.GRPOTrainer, is_correction=None,
                           safe_vocab_min_p=0.3)
    assert [s.name for s in cb.features_off] == ["loss_factor"]
    warned = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert len(warned) == 1 and "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss" in warned[0]
    if where == "file":
        assert "no longer contains 'inputs[\"advantages\"]'" in warned[0]
        copy = tmp_path / "moved_grpo_trainer.py"
        assert f"it is trl.trainer.moved_grpo_trainer.GRPOTrainer._compute_loss ({copy}:" in warned[0]
        assert "Fix: keep the statement 'inputs[\"advantages\"]' where trl.trainer.moved_grpo_trainer.GRPOTrainer." \
               "_compute_loss replaces trl's GRPOTrainer._compute_loss" in warned[0]
    else:
        assert "moved_grpo_trainer.GRPOTrainer._compute_loss (<moved_grpo_trainer>:" in warned[0]
        assert "its source is unreadable" in warned[0] and "not trl's own" in warned[0]
    assert "pip install" not in warned[0]
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == STEPS and all("tim/safe_vocab/boundary_frac" in row and "tim/token/kl_k3" in row
                                       for row in steps)
    assert steps[0]["tim/diag/feature_off/loss_factor"] == 1.0


def test_an_attribute_removed_from_the_live_trainer_switches_off_only_its_feature(toy_model_path, tmp_path, caplog):
    trainer = make_trainer(toy_model_path, tmp_path, min_p=1e-3, max_steps=STEPS)
    del trainer.top_p  # what the safe vocabulary reads of the sampler (the rest of TRL's run does not)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        cb = TIMCallback(trainer, TIMConfig(safe_vocab=True))
    assert [s.name for s in cb.features_off] == ["safe_vocab"] and cb.truncation is None
    warned = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert len(warned) == 1
    assert "trainer.top_p is missing on the live GRPOTrainer (trl.trainer.grpo_trainer:GRPOTrainer.__init__ sets it)" \
        in warned[0]
    assert (UPGRADE in warned[0]) == (TRL < Version("1.16"))  # an upgrade only where it changes something
    trainer.add_callback(cb)
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == STEPS and all("tim/token/kl_k3" in row for row in steps)
    assert steps[0]["tim/diag/feature_off/safe_vocab"] == 1.0
    assert not any(k.startswith("tim/safe_vocab/") for row in steps for k in row)


def test_the_monitor_refuses_only_without_its_setting_and_names_a_fix_that_changes_something(toy_model_path,
                                                                                            tmp_path, monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "__init__", opaque(GRPOTrainer.__init__))
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    TIMCallback(trainer, TIMConfig()).detach()  # the opaque wrapper alone: attaches
    del trainer.use_vllm
    with pytest.raises(RuntimeError) as err:
        TIMCallback(trainer, TIMConfig())
    message = str(err.value)
    assert "\n" not in message and "cannot attach to this TRL: trainer.use_vllm is missing on the live GRPOTrainer" \
        in message
    assert (UPGRADE in message) == (TRL < Version("1.16"))
    if TRL >= Version("1.16"):
        assert "Fix: keep trainer.use_vllm as trl.trainer.grpo_trainer:GRPOTrainer.__init__ sets it" in message


class TwiceScoringTrainer(GRPOTrainer):
    """A user's subclass whose loss runs TRL's twice over the same inputs (here averaged: TRL's own loss again)."""

    def _compute_loss(self, model, inputs):
        return (super()._compute_loss(model, inputs) + super()._compute_loss(model, inputs)) / 2


def test_a_loss_that_scores_twice_reads_the_correction_once_and_gets_trls_inputs_back(toy_model_path, tmp_path):
    """Each policy forward inside one loss call scales TRL's own advantages (never the ones an earlier forward of the
    same call scaled), and the inputs hold TRL's values again after the call. The reference: the token TIS weights
    min(exp(train - rollout), 2) computed here from TRL's tensors, on TRL's own advantages."""
    import torch
    from test_trl_callback import Capture, token_tis_reference

    trainer = make_trainer(toy_model_path, tmp_path, trainer_cls=TwiceScoringTrainer, max_steps=1)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(rollout="inject", inject_options={"scale": 1.0},
                                                        is_correction="token_tis",
                                                        is_correction_options={"token_clip": 2.0})))
    trainer.train()
    adv, w = token_tis_reference(cap)
    assert adv.dim() == 1  # TRL's own (B,) advantages, back after the loss call
    assert sorted(adv.tolist()) == pytest.approx(sorted(cap.trl_built[0]["advantages"].double().tolist()))
    read = cap.read_in_loss[0]["advantages"].double()  # what the second of TRL's loss calls read
    assert torch.allclose(read, adv[:, None] * w, rtol=1e-5, atol=1e-6)
