"""Structured outputs through TRL's own ``GRPOTrainer.train()`` with vLLM colocate (the vLLM CPU build, the toy
model): ``vllm_structured_outputs_regex`` makes TRL pass vLLM a ``StructuredOutputsParams`` per request, so the
engine samples from a grammar-masked distribution (p = 1 where the grammar leaves one token, close to it where it
leaves a few) and the trainer scores the unconstrained model.

Checked, each against TRL's own tensors and metrics:
- the start-up audit lists the constraint (``sampler-penalties-unmatched``, ``custom_logits_processors``);
- the cause named is ``sampler-constrained``, never ``engine-stale``: the engine holds the trainer's weights (the
  sync check compares all 27 tensors at every sync and finds none bad), and the same engine without the regex names
  nothing. Before this rule the constrained run named ``engine-stale``;
- the forced tokens it counts are TRL's: lag-0 tokens of the loss mask whose ``sampling_per_token_logps`` is 0
  exactly and whose ``old_per_token_logps`` is more than 2 nats lower, counted in a plain loop;
- what the TRL fix says: TRL's default sequence-level correction (``vllm_importance_sampling_mode="sequence_mask"``)
  multiplies each sequence by the trainer's p of what the grammar forced (TRL's own
  ``sampling/importance_sampling_ratio/max`` below 1e-6, its ``grad_norm`` below 1e-6: nothing learns), and with
  ``vllm_importance_sampling_correction=False`` TRL's gradient is back (the constraint, and its cause, stay).

Cost: one vLLM CPU engine for the module (~15 s), then ~10 s per run.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

from test_trl_callback import Capture, make_trainer  # noqa: E402
from trl_cpu_vllm import CauseLines, one_plain_engine  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

REGEX = r"the [a-z]+ (is|was) [a-z ]{1,12}"
STEPS, GAP = 3, 2.0  # GAP: CauseConfig().confident_gap


@pytest.fixture(scope="module")
def engine(toy_model_path):
    mp = pytest.MonkeyPatch()
    one_plain_engine(mp, kv_cache_memory_bytes=64 * 2**20)
    yield
    mp.undo()


def _run(model_path, tmp_path, **overrides):
    trainer = make_trainer(model_path, tmp_path, use_vllm=True, vllm_mode="colocate",
                           vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128, max_steps=STEPS,
                           max_completion_length=16, loss_type="grpo", **overrides)
    cap = Capture(trainer)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(cb)
    with CauseLines() as lines:
        trainer.train()
    windows = [h for h in trainer.state.log_history if "tim/tokens" in h]
    assert len(windows) == STEPS
    return trainer, cb, cap, lines, windows


def _every_sync_clean(cb, windows) -> None:
    for w in windows:
        assert w["tim/cause/sync_checked_tensors"] == 27 and w["tim/cause/sync_bad_tensors"] == 0


@pytest.fixture(scope="module")
def plain(engine, toy_model_path, tmp_path_factory):
    return _run(toy_model_path, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def constrained(engine, toy_model_path, tmp_path_factory):
    return _run(toy_model_path, tmp_path_factory.mktemp("regex"), vllm_structured_outputs_regex=REGEX)


def test_the_same_engine_without_the_grammar_names_nothing(plain):
    _, cb, _, lines, windows = plain
    _every_sync_clean(cb, windows)
    assert lines == [] and all(w["tim/cause/named"] == 0 for w in windows)
    assert "sampler-penalties-unmatched" not in {f.code for f in cb.findings}


def test_the_audit_lists_the_grammar(constrained):
    _, cb, _, _, _ = constrained
    (finding,) = [f for f in cb.findings if f.code == "sampler-penalties-unmatched"]
    assert finding.rollout_value == {"custom_logits_processors": ("structured_outputs",)}


def test_the_grammar_is_named_not_a_stale_engine(constrained):
    trainer, cb, cap, lines, windows = constrained
    _every_sync_clean(cb, windows)
    named = [c for c in cb.pipeline.causes.named]
    assert {c.code for c in named} == {"sampler-constrained"}, [c.message for c in named]
    assert all(w["tim/cause/named"] == 1 for w in windows)
    assert lines and all(x.startswith("tim-plugins cause [sampler-constrained] at step ") for x in lines)
    assert "vllm_importance_sampling_correction=False" in lines[0]
    # the forced tokens of each step, counted in TRL's own tensors (one generation batch per step here)
    assert len(cap.trl_built) == STEPS
    for cause, built in zip(named, cap.trl_built):
        mask = built["completion_mask"].bool().flatten().tolist()
        sampled = built["sampling_per_token_logps"].flatten().tolist()
        trained = built["old_per_token_logps"].flatten().tolist()
        forced = sum(1 for m, r, t in zip(mask, sampled, trained) if m and r == 0.0 and t < -GAP)
        assert forced >= 2 and cause.evidence["forced_disagreements"] == forced, (cause.step, forced)
        print(f"step {cause.step}: {cause.message}")


def test_trls_default_correction_erases_the_constrained_loss_and_the_printed_fix_restores_it(
        constrained, engine, toy_model_path, tmp_path):
    trainer, _, _, _, _ = constrained
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert all(h["sampling/importance_sampling_ratio/max"] < 1e-6 and h["grad_norm"] < 1e-6 for h in logs), logs
    fixed, cb, _, lines, windows = _run(toy_model_path, tmp_path, vllm_structured_outputs_regex=REGEX,
                                        vllm_importance_sampling_correction=False)
    fixed_logs = [h for h in fixed.state.log_history if "grad_norm" in h]
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 1e-2 for h in fixed_logs), fixed_logs
    assert {c.code for c in cb.pipeline.causes.named} == {"sampler-constrained"}  # the grammar is still there
