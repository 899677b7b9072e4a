"""TIMCallback with TRL's vLLM colocate rollouts on the vLLM CPU build (one engine start for the module).

TRL 1.16's weight sync fails on the CPU build: test-side only, ``VLLMGeneration.sync_weights`` is replaced by
vLLM's own ``reload_weights`` path (tests/trl_cpu_vllm.py).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
datasets = pytest.importorskip("datasets")

from test_trl_callback import Capture, _logged, check_vllm_step, make_trainer  # noqa: E402
from trl_cpu_vllm import cpu_sync_weights, llm_with  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_run(toy_model_path, tmp_path_factory):
    from trl.generation import vllm_generation

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_generation.VLLMGeneration, "sync_weights", cpu_sync_weights)
    # TRL passes only gpu_memory_utilization, which vLLM's CPU backend reads as a share of RAM that also has to
    # hold everything else this pytest process loaded: the KV cache gets a fixed size instead, allocated whole at
    # start-up (64 MiB holds 2**17 tokens of the toy model; VLLM_CPU_KVCACHE_SPACE, whole GiB, would replace it).
    mp.setattr(vllm_generation, "LLM", llm_with(vllm_generation.LLM, kv_cache_memory_bytes=64 * 2**20))
    mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    tmp = tmp_path_factory.mktemp("trl_vllm")
    trainer = make_trainer(
        toy_model_path, tmp, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=128, max_steps=2, loss_type="grpo",
    )
    cap = Capture(trainer)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(cb)
    trainer.train()
    yield trainer, cap, cb
    mp.undo()


def test_vllm_metrics_equal_reference_on_trl_tensors(vllm_run):
    trainer, cap, cb = vllm_run
    assert cb.rollout_source == "vllm"
    for step in (1, 2):
        check_vllm_step(trainer, cap, step)


def test_parity_audit_reads_live_engine(vllm_run):
    trainer, _, cb = vllm_run
    rollout_spec, trainer_spec = cb.parity_specs
    llm = trainer.vllm_generation.llm
    live_dtype = str(llm.llm_engine.vllm_config.model_config.dtype).replace("torch.", "")
    assert rollout_spec.dtype == live_dtype
    assert rollout_spec.logprobs_mode == "processed_logprobs"
    assert "live vLLM engine" in rollout_spec.source
    assert trainer_spec.dtype == "float32"
    codes = {f.code for f in cb.findings}
    if live_dtype != "float32":
        assert "dtype-mismatch" in codes
    assert _logged(trainer, 1)["tim/parity/errors"] == float(sum(f.severity == "error" for f in cb.findings))


def test_every_sync_is_checked_and_clean(vllm_run):
    """The weight-sync check on TRL's syncs through vLLM's reload_weights (this module's CPU sync), the engine's
    prepacked linear weights read through their forward: every parameter compared at every sync, none named."""
    trainer, _, cb = vllm_run
    reports = cb.sync_watch.check.reports
    assert [r.step for r in reports] == [0, 1]  # TRL syncs before each step's generation
    names = sorted(n for n, _ in trainer.model.named_parameters())
    for report in reports:
        assert sorted(report.statuses) == names and report.bad_tensors == 0 and report.causes == []
    assert cb.pipeline.causes.named == []
    assert _logged(trainer, 2)["tim/cause/sync_checked_tensors"] == len(names)
