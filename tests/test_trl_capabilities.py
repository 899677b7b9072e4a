"""Capability checks instead of version refusals, on a real TRL GRPOTrainer (CPU, the toy model).

- an untested version is one warning, never an exception;
- a moved hook (simulated on the safe-vocabulary route the installed TRL uses: the fused head's kernel with TRL
  1.14's signature, or ``selective_log_softmax`` with renamed parameters) switches off only the feature that needs it, with one warning naming the feature, the symbol and the version, and ``tim/diag/feature_off/<name>``;
  the run is then bitwise the run without the callback (the reference: TRL alone);
- the monitor refuses to attach, in one line with the fix, only when its measurement point is gone;
- every patch is undone when ``train()`` raises: a later trainer in the same process trains as TRL alone does.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("trl")

import trl.trainer.utils as trl_utils  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

import tim_plugins._optional as opt  # noqa: E402
from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402
from test_trl_callback import make_trainer  # noqa: E402

pytestmark = pytest.mark.trl

WRAPPED = ("_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies",
           "_generate_single_turn", "train")


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _warnings(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


def test_untested_version_warns_once_and_attaches(toy_model_path, tmp_path, monkeypatch, caplog):
    real = opt.package_version
    low, high = opt.SUPPORTED_RANGES["trl"]
    untested = f"{high}.0"  # the first release past the tested range (tim_plugins/_tested.py)
    monkeypatch.setattr(opt, "package_version", lambda dist: untested if dist == "trl" else real(dist))
    monkeypatch.setattr(opt, "_NOTED", set())
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):  # other tests leave it at ERROR (the study)
        first = TIMCallback(trainer, TIMConfig())
        TIMCallback(make_trainer(toy_model_path, tmp_path / "b", max_steps=1), TIMConfig())
    assert first.trl_version == untested
    assert len(_warnings(caplog, f"trl {untested} is outside the tested range (>={low},<{high})")) == 1
    trainer.add_callback(first)
    trainer.train()
    assert any(k.startswith("tim/token/") for row in trainer.state.log_history for k in row)


class _KernelWithTRL114Signature:
    """TRL's own kernel behind the signature TRL 1.14 had (no ``outputs``): what the capability check reads."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                logit_scale=1.0):
        raise AssertionError("never called: apply is TRL's own")


def _move_safe_vocab_route(monkeypatch) -> tuple[str, str]:
    """Move the hook of the safe-vocabulary route the installed TRL uses, keeping TRL's computation as it is;
    returns (the symbol, what the check says of it)."""
    route, _ = features.safe_vocab_route()
    assert route is not None
    if route is features.SAFE_VOCAB_FUSED_HEAD:
        monkeypatch.setattr(_KernelWithTRL114Signature, "apply", trl_utils._ChunkedLogProbFunction.apply,
                            raising=False)
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", _KernelWithTRL114Signature)
        return "_ChunkedLogProbFunction.forward", "takes no outputs"
    import trl.trainer.grpo_trainer as grpo

    # a release that renamed its parameters: TRL's own result, by position (the original held in a default, where
    # the check cannot follow it: a closure or a global would lead it to TRL's own function)
    def selective_log_softmax(x, ids, _original=grpo.selective_log_softmax):
        return _original(x, ids)

    monkeypatch.setattr(grpo, "selective_log_softmax", selective_log_softmax)
    return "grpo_trainer:selective_log_softmax", "takes no logits, index"


def test_moved_hook_switches_off_only_its_feature(toy_model_path, tmp_path, monkeypatch, caplog):
    reference = make_trainer(toy_model_path, tmp_path / "ref", min_p=1e-3)
    reference.train()

    symbol, problem = _move_safe_vocab_route(monkeypatch)
    trainer = make_trainer(toy_model_path, tmp_path / "tim", min_p=1e-3)
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):  # other tests leave it at ERROR (the study)
        cb = TIMCallback(trainer, TIMConfig(safe_vocab=True))
    warned = _warnings(caplog, "safe vocabulary")
    assert len(warned) == 1, warned
    assert symbol in warned[0] and problem in warned[0]
    assert f"trl {opt.package_version('trl')}" in warned[0] and "Fix:" in warned[0]
    assert cb.truncation is None and [s.name for s in cb.features_off] == ["safe_vocab"]
    trainer.add_callback(cb)
    trainer.train()
    logged = {k: v for row in trainer.state.log_history for k, v in row.items()}
    assert logged["tim/diag/feature_off/safe_vocab"] == 1.0
    assert torch.isfinite(torch.tensor(logged["tim/token/kl_k3"])) and not any(k.startswith("tim/safe_vocab/") for k in logged)
    # the monitor alone leaves training untouched: the same losses as TRL alone
    assert _losses(trainer) == _losses(reference)


def test_doctor_statuses_name_the_moved_symbol(monkeypatch):
    from test_trl_hook_guards import expected

    statuses = features.trl_features()
    assert {s.name for s in statuses} == {f.name for f in features.FEATURES if f not in features.SAFE_VOCAB_ROUTES} \
        | {"safe_vocab"}
    # every feature the installed TRL must support (test_trl_hook_guards.FEATURE_RELEASES) is on
    assert [s.warning() for s in statuses if expected(s.name) and not s.available] == []
    used, _ = features.safe_vocab_route()
    symbol, problem = _move_safe_vocab_route(monkeypatch)
    route, statuses = features.safe_vocab_route()
    assert route is None
    moved = next(s for s in statuses if s.name == used.name)
    assert not moved.available and symbol in moved.reason and problem in moved.reason
    safe = next(s for s in features.trl_features() if s.name == "safe_vocab")
    assert not safe.available and problem in safe.reason


def test_monitor_refuses_in_one_line_when_its_hook_is_gone(toy_model_path, tmp_path, monkeypatch):
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    monkeypatch.delattr(GRPOTrainer, "_compute_loss")
    with pytest.raises(RuntimeError) as err:
        TIMCallback(trainer, TIMConfig())
    message = str(err.value)
    assert "\n" not in message and "GRPOTrainer._compute_loss is missing" in message and "Fix: " in message
    # disabled: nothing is checked, nothing attaches
    TIMCallback(trainer, TIMConfig(enabled=False))


def _failing_reward(calls: list):
    def reward(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("the user stops the run")  # not an Exception: nothing may swallow it
        return [float(len(c)) / 10.0 for c in completions]

    return reward


def test_patches_undone_when_train_raises(toy_model_path, tmp_path):
    before = make_trainer(toy_model_path, tmp_path / "before", min_p=1e-3)
    before.train()
    import trl.trainer.grpo_trainer as grpo

    # the module globals the two safe-vocabulary routes replace during a log-prob call (hooks.TRL_SOURCES)
    kernel, logsoftmax = trl_utils._ChunkedLogProbFunction, getattr(grpo, "selective_log_softmax", None)

    failing = make_trainer(toy_model_path, tmp_path / "failing", reward=_failing_reward([]), min_p=1e-3)
    cb = TIMCallback(failing, TIMConfig(safe_vocab=True, is_correction="token_tis"))
    failing.add_callback(cb)
    with pytest.raises(KeyboardInterrupt):
        failing.train()
    assert cb.installed == []
    assert not (set(WRAPPED) - {"train"}) & set(vars(failing))  # train: the callback's own, until detach()
    assert trl_utils._ChunkedLogProbFunction is kernel and getattr(grpo, "selective_log_softmax", None) is logsoftmax

    after = make_trainer(toy_model_path, tmp_path / "after", min_p=1e-3)
    after.train()
    assert _losses(after) == _losses(before) and len(_losses(after)) == 2
    for a, b in zip(after.model.parameters(), before.model.parameters()):
        assert torch.equal(a, b)


def test_a_moved_engine_hook_switches_off_only_the_audit_s_engine_read(toy_model_path, tmp_path, monkeypatch, caplog):
    """features.ENGINE_AUDIT gates the audit's read of TRL's live vLLM engine: with VLLMGeneration._init_vllm moved,
    a colocate trainer's audit does not read ``trainer.vllm_generation`` (the engine's settings are unknown), one
    warning names the feature, ``tim/diag/feature_off/parity_audit_engine`` is 1, and the rest runs."""
    from trl.generation.vllm_generation import VLLMGeneration

    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    cb = TIMCallback(trainer, TIMConfig())
    assert cb._live_audit_reads() == {"engine": False, "server": False}  # no vLLM: nothing live to read
    monkeypatch.delattr(VLLMGeneration, "_init_vllm")
    monkeypatch.setattr(trainer.args, "use_vllm", True)
    monkeypatch.setattr(trainer.args, "vllm_mode", "colocate")

    class Engine:  # the audit would read this live engine if it were allowed to
        @property
        def llm(self):
            raise AssertionError("the audit read the live engine although its hook moved")

    trainer.vllm_generation = Engine()
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        reads = cb._live_audit_reads()
    assert reads == {"engine": False, "server": False}
    assert [s.name for s in cb.features_off] == ["parity_audit_engine"]
    assert len(_warnings(caplog, "_init_vllm")) == 1
    assert cb.pipeline.diag == {"feature_off/parity_audit_engine": 1.0}
    from tim_plugins.integrations.trl._parity import collect_specs

    rollout, _ = collect_specs(trainer, "vllm", **reads)  # Engine.llm would raise if it were read
    assert rollout.source == "trl GRPOConfig → LLM(...) colocate kwargs (vllm_generation.py)"

