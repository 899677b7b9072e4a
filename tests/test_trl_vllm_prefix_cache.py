"""``sync-prefix-cache`` through TRL's own ``GRPOTrainer.train()`` with vLLM colocate (the CPU build, blocks of 32
tokens): TRL's ``VLLMGeneration.sync_weights`` writes every weight and then resets the engine's prefix cache. Every
prompt starts with the same instruction (two blocks and more), as a system prompt does.

- fault-free: at every sync the cache is empty after TRL's reset; nothing is named;
- the reset dropped (a wrapper of the engine that does not pass ``reset_prefix_cache`` on): every weight is still
  written, so the weight comparison passes, but from the first sync after a generation the cache holds the prompts'
  blocks: named at that sync, with at least the shared instruction's blocks; the probe stops the run on it. At a
  learning rate of 1e-4 the stream rules see nothing of it; the read still names it at every sync.

The reference for "what the cache holds" is vLLM's own account (``test_vllm_prefix_cache.py``); here it is the fault
(whether the reset ran) and the prompts' shared prefix, counted in blocks with the trainer's tokenizer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
datasets = pytest.importorskip("datasets")

from test_trl_callback import STALE_LR, make_trainer  # noqa: E402
from trl_cpu_vllm import CauseLines, one_plain_engine  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.toy_model import synthetic_prompts  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
INSTRUCTION = ("You are a careful assistant. Answer with the next letters of the chain, one letter at a time, and "
               "stop at the end. ")
PROMPTS = [INSTRUCTION + p for p in synthetic_prompts(64)]
STEPS = 4


@pytest.fixture(scope="module")
def engine(toy_model_path):
    """One engine for the module's runs, with blocks of ``BLOCK`` tokens."""
    mp = pytest.MonkeyPatch()
    yield one_plain_engine(mp, kv_cache_memory_bytes=64 * 2**20, block_size=BLOCK)
    mp.undo()


def _run(model_path, tmp_path, *, drop_reset: bool, steps: int, config: TIMConfig, learning_rate: float = STALE_LR):
    trainer = make_trainer(model_path, tmp_path, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                           vllm_max_model_length=256, max_steps=steps, loss_type="grpo", learning_rate=learning_rate,
                           prompts=PROMPTS)
    llm = trainer.vllm_generation.llm
    assert llm.reset_prefix_cache() is True  # a clean cache whatever the module's earlier runs left
    mp = pytest.MonkeyPatch()
    if drop_reset:  # installed before the callback attaches, as another library's wrapper of the engine would be
        mp.setattr(llm, "reset_prefix_cache", lambda *args, **kwargs: True, raising=False)
    try:
        with CauseLines() as lines:
            cb = TIMCallback(trainer, config)
            trainer.add_callback(cb)
            trainer.train()
    finally:
        mp.undo()
    return trainer, cb, lines


@pytest.fixture(scope="module")
def fault_free_run(engine, toy_model_path, tmp_path_factory):
    return _run(toy_model_path, tmp_path_factory.mktemp("prefix_ok"), drop_reset=False, steps=STEPS,
                config=TIMConfig())


@pytest.fixture(scope="module")
def dropped_reset_run(engine, fault_free_run, toy_model_path, tmp_path_factory):
    return _run(toy_model_path, tmp_path_factory.mktemp("prefix_kept"), drop_reset=True, steps=STEPS,
                config=TIMConfig())


def _shared_blocks(trainer) -> int:
    return len(trainer.processing_class(INSTRUCTION).input_ids) // BLOCK


def test_fault_free_syncs_leave_an_empty_cache_and_name_nothing(fault_free_run):
    trainer, cb, lines = fault_free_run
    reports = cb.sync_watch.check.reports
    assert [r.step for r in reports] == list(range(STEPS))
    assert [r.prefix_blocks for r in reports] == [0] * STEPS
    assert all(r.causes == [] and r.bad_tensors == 0 for r in reports)
    assert cb.pipeline.causes.named == [] and not any("tim-plugins cause" in line for line in lines)
    assert "prefix_cache_unread" not in cb.pipeline.diag


def test_a_dropped_reset_is_named_at_the_first_sync_after_a_generation(dropped_reset_run):
    trainer, cb, lines = dropped_reset_run
    assert _shared_blocks(trainer) >= 2
    reports = {r.step: r for r in cb.sync_watch.check.reports}
    assert sorted(reports) == list(range(STEPS))
    assert reports[0].prefix_blocks == 0 and reports[0].causes == []  # nothing generated before the first sync
    for step in range(1, STEPS):
        report = reports[step]
        assert report.bad_tensors == 0 and report.checked_tensors > 0  # the weights themselves were all written
        (cause,) = report.causes
        assert cause.code == "sync-prefix-cache" and cause.tensors == ()
        assert report.prefix_blocks >= _shared_blocks(trainer) and cause.evidence["blocks"] == report.prefix_blocks
        assert report.prefix_blocks >= reports[step - 1].prefix_blocks  # nothing drops them: the cache only grows
    line = next(x for x in lines if x.startswith("tim-plugins cause [sync-prefix-cache] at step 1:"))
    assert "Fix (TRL): TRL's VLLMGeneration.sync_weights ends with the engine's reset_prefix_cache" in line
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/cause/named" in h}
    assert logged[1]["tim/cause/named"] == 0 and all(logged[s]["tim/cause/named"] >= 1 for s in range(2, STEPS + 1))
    assert {c.step for c in cb.pipeline.causes.named if c.code == "sync-prefix-cache"} == set(range(1, STEPS))


def test_the_kept_cache_is_a_real_mismatch(fault_free_run, dropped_reset_run):
    """What the named cause costs: the first step sampled through the kept cache has a lag-0 floor far above the
    same step of the fault-free run (same seed and data; they differ from that step's generation on)."""
    floors = [{h["step"]: h["tim/token/abs_diff_mean"] for h in run[0].state.log_history if "tim/cause/named" in h}
              for run in (fault_free_run, dropped_reset_run)]
    assert floors[1][1] == pytest.approx(floors[0][1], rel=1e-6)  # step 1: the same run so far
    assert floors[1][2] > 10 * floors[0][2]


def test_the_probe_stops_the_run_on_it(engine, dropped_reset_run, toy_model_path, tmp_path_factory):
    probe = {"action": "stop", "kl_k3_max": None, "seq_log_ratio_abs_max": 1e9}
    trainer, cb, _ = _run(toy_model_path, tmp_path_factory.mktemp("prefix_stop"), drop_reset=True, steps=4,
                          config=TIMConfig(parity_probe=True, parity_probe_options=probe))
    # named at the sync after step 1, in the window of step 2; the probe stops the run at that step's end
    assert trainer.state.global_step == 2
    assert [t.key for t in cb.pipeline.probe.trips] == ["tim/cause/named"] and cb.pipeline.probe.trips[0].step == 2


def test_at_a_small_learning_rate_only_the_read_names_it(engine, dropped_reset_run, toy_model_path, tmp_path_factory):
    """At 1e-4 a step moves the policy too little for the stream: the kept cache leaves the lag-0 floor within its
    rules' margins (no engine-stale, no floor jump), while the cache's age, and with it the mismatch, grows; the read
    at the sync names it at every sync from the first after a generation."""
    trainer, cb, _ = _run(toy_model_path, tmp_path_factory.mktemp("prefix_small_lr"), drop_reset=True, steps=STEPS,
                          config=TIMConfig(), learning_rate=1e-4)
    named = sorted((c.step, c.code) for c in cb.pipeline.causes.named)
    assert named == [(step, "sync-prefix-cache") for step in range(1, STEPS)]
