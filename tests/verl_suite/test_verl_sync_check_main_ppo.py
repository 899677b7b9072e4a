"""The weight-sync check through verl's own ``python -m verl.trainer.main_ppo`` (``tim_sync``, GRPO, FSDP2 actor, the
vLLM CPU-build rollout server, the toy model, fp32 on both sides) with the rollout's weight update skipping one layer
at every sync (``cpu_site/skip_sync.py``: verl's vLLM worker extension drops ``model.layers.1.*`` from each bucket it
loads). verl starts the rollout on dummy weights (``load_format=dummy``), so that layer never holds the actor's.

What crosses processes is the real thing: the actor worker samples what its engine streams, the vLLM server's
``tim_read_weights`` asks vLLM's worker (``TIMWorkerExtension``, in the worker process) for the engine's values, and
the answers come back through vLLM's ``collective_rpc`` and Ray. Checked: the first sync (``on_init_end``, before
any step) names the layer with its tensors in the console line; step 1's metrics, logged by verl's tracker, carry
``tim/cause/*``; the probe (``+tim.probe.enable=true +tim.probe.action=stop``, its limits out of reach) stops the run
after step 1 of 4 with exit code 0. References: the test's own fault (the prefix it dropped) and the model's tensors
(transformers' state dict of the checkpoint: what verl's FSDP engine streams). The fault-free side (no cause named,
every tensor checked at every sync) is asserted on ``test_verl_main_ppo.py``'s runs.

The same run is made twice: full fine-tuning, and a LoRA actor (rank 8 on every linear layer) whose adapters verl
merges into the weights it syncs (``actor_rollout_ref.model.lora.merge=true``: verl's merged-LoRA export, the base
names with merged values). There every tensor is compared as well, and only the skipped layer's are named. verl's
other LoRA mode, the adapter sync (``lora.merge=false``: vLLM loads the adapter apart from the weights with
``add_lora``), runs with a fault of its own: the old adapter is never removed, so vLLM keeps it, and the sync after
step 1 is named a no-op with the adapter's matrices. verl 0.9.1's adapter loader calls
``WeightsMapper.get_unstacked_mapper``, which vLLM 0.31 no longer has: the CPU shims give it back (shim 8).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402

pytestmark = pytest.mark.slow

SKIPPED = "model.layers.1."
STEPS = 4
RUN_TIMEOUT_S = 900


def _model_tensors(path) -> list[str]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(str(path)).state_dict())


# verl's LoRA settings (actor_rollout_ref.model.lora_rank / lora_alpha / target_modules; lora.merge picks the sync)
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear"]
LORA_MERGED = LORA + ["actor_rollout_ref.model.lora.merge=true"]
LORA_ADAPTER = LORA + ["actor_rollout_ref.model.lora.merge=false"]


def _overrides(files, wd, extra: list[str]) -> list[str]:
    """A GRPO run of STEPS steps with the monitor, the sync check and a probe that stops on a named cause."""
    return M.base_overrides(files, wd, steps=STEPS) + M.CPU_OVERRIDES + [
        "trainer.v1.trainer_mode=tim_sync",
        "+tim.monitor.enable=true",
        "+tim.probe.enable=true", "+tim.probe.action=stop",
        "+tim.probe.kl_k3=1e9", "+tim.probe.abs_diff_max=1e9",  # out of reach: only a named cause trips it
    ] + extra


@pytest.fixture(scope="module", params=["full", "lora_merged"])
def run(request, tmp_path_factory, toy_model_path):
    wd = tmp_path_factory.mktemp(f"sync_check_{request.param}")
    files = M.prepare(wd, toy_model_path)
    overrides = _overrides(files, wd, LORA_MERGED if request.param == "lora_merged" else [])
    run = M.run_main_ppo(overrides, cwd=wd, timeout=RUN_TIMEOUT_S, extra_env={"TIM_TEST_SYNC_SKIP": SKIPPED},
                         log_path=wd / "sync_skip.log")
    print(f"[sync_skip {request.param}] exit {run.returncode} after {run.seconds:.0f} s; per-step seconds "
          f"{ {s: round(t, 2) for s, t in run.step_times.items()} }; log {wd / 'sync_skip.log'}")
    return run, files


def test_the_skipped_layer_is_named_at_the_first_sync_with_its_tensors(run):
    run, files = run
    assert run.returncode == 0, run.output[-3000:]
    names = _model_tensors(files["model"])
    skipped = [n for n in names if n.startswith(SKIPPED)]
    assert len(skipped) >= 9
    # the first sync is verl's on_init_end one (global step 0), before any generation
    line = next((x for x in run.output.splitlines() if "tim-plugins cause [" in x), None)
    assert line is not None, run.output[-3000:]
    assert "tim-plugins cause [sync-tensors-differ] at step 0: at the weight sync after optimizer step 0, " \
           f"{len(skipped)} tensors hold values that are not the trainer's nor a rounding of them, and there is no " \
           "previous check of them to compare with (the first check, or the first after a resume): a tensor this " \
           f"sync left out looks the same: {SKIPPED}* ({len(skipped)} tensors)." in line
    assert "Fix (verl): verl's weight sync (ActorRolloutRefWorker.update_weights" in line
    # the sync at the end of step 1: the layer still holds what it held
    assert re.search(rf"tim-plugins cause \[sync-tensors-stale\] at step 1: .*{re.escape(SKIPPED)}\* "
                     rf"\({len(skipped)} tensors\)", run.output)
    assert "tim-plugins cause [sync-tensors-missing]" not in run.output
    assert "tim-plugins cause [sync-precision]" not in run.output


def test_step_metrics_carry_the_cause_and_the_probe_stops_the_run(run):
    run, files = run
    assert sorted(run.steps) == [1], run.output[-3000:]  # planned STEPS, stopped after the first
    m = run.steps[1]
    names = _model_tensors(files["model"])
    assert m["tim/cause/sync_checked_tensors"] == len(names)  # every tensor verl's engine streamed
    assert m["tim/cause/sync_bad_tensors"] == len([n for n in names if n.startswith(SKIPPED)])
    assert m["tim/cause/named"] >= 1.0  # the sync's; the broken engine's samples may add engine-stale
    assert m["tim/probe/tripped"] == 1.0 and "tim/diag/sync_check_unavailable" not in m
    assert re.search(r"tim parity probe tripped at step 1: .*tim/cause/named=\d", run.output)
    assert "parity probe asked to stop at step 1" in run.output


def _adapter_names(path) -> list[str]:
    """The adapter matrices verl streams at an adapter sync: PEFT's own adapter state dict of the model with the
    run's LoRA settings (verl's FSDP engine streams get_peft_model_state_dict)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return list(get_peft_model_state_dict(model))


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, toy_model_path):
    """A LoRA adapter sync whose old adapter is never removed (``cpu_site/skip_sync.py``, ``TIM_TEST_LORA_KEEP``):
    vLLM's ``add_lora`` under verl's one adapter id keeps the adapter it holds, the first one."""
    pytest.importorskip("peft")
    wd = tmp_path_factory.mktemp("sync_check_lora_adapter")
    files = M.prepare(wd, toy_model_path)
    run = M.run_main_ppo(_overrides(files, wd, LORA_ADAPTER), cwd=wd, timeout=RUN_TIMEOUT_S, extra_env={"TIM_TEST_LORA_KEEP": "1"},
                         log_path=wd / "lora_keep.log")
    print(f"[lora_keep] exit {run.returncode} after {run.seconds:.0f} s; log {wd / 'lora_keep.log'}")
    return run, files


def test_an_adapter_sync_that_keeps_the_old_adapter_is_named(adapter_run):
    """The first sync (onto dummy weights: the base weights, then the first adapter) holds everything it was sent;
    the sync after step 1 leaves the first adapter in vLLM: named a no-op sync, with the adapter's matrices, and
    the probe stops the run at the step that reads it."""
    run, files = adapter_run
    assert run.returncode == 0, run.output[-3000:]
    base, adapter = _model_tensors(files["model"]), _adapter_names(files["model"])
    assert len(adapter) >= 8 and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapter)
    first = run.steps[1]
    assert first["tim/cause/sync_checked_tensors"] == len(base) + len(adapter)
    assert first["tim/cause/sync_bad_tensors"] == 0 and first["tim/cause/named"] == 0.0
    assert "tim-plugins cause [sync-noop] at step 0" not in run.output
    line = next((x for x in run.output.splitlines() if "tim-plugins cause [" in x), None)
    assert line is not None, run.output[-3000:]
    assert "tim-plugins cause [sync-noop] at step 1: at the weight sync after optimizer step 1, none of the " in line
    assert sorted(run.steps) == [1, 2], run.output[-3000:]
    second = run.steps[2]
    assert second["tim/cause/sync_checked_tensors"] == len(adapter)  # an adapter sync streams the adapter only
    lora_b = [n for n in adapter if n.endswith(".lora_B.weight")]  # B starts at zero: every one moved at step 1
    assert len(lora_b) <= second["tim/cause/sync_bad_tensors"] <= len(adapter)
    assert second["tim/probe/tripped"] == 1.0 and "tim/diag/sync_check_unavailable" not in second
    assert "parity probe asked to stop at step 2" in run.output
