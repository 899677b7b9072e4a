"""The weight-sync check through TRL's own ``GRPOTrainer.train()`` with vLLM colocate (the CPU build): TRL's own
``VLLMGeneration.sync_weights`` runs unmodified (test-side, vLLM keeps plain linear weights: tests/trl_cpu_vllm.py
``keep_plain_linear_weights``), broken three ways at chosen syncs, each named at that sync with the tensors' names:

- a no-op sync (``sync_weights`` returns without writing anything) -> ``sync-noop``;
- one layer skipped by the engine's loader (``load_weights`` drops ``model.layers.1.*``) -> ``sync-tensors-stale``
  with exactly that layer's tensors;
- one tensor written rounded through a coarser dtype (bf16 into an fp32 engine, fp8 into a bf16 one) ->
  ``sync-precision`` with that tensor.

The syncs between the faults are fault-free: no sync cause there. A second run stops on the first cause
(``parity_probe=True``, ``action="stop"``). One vLLM engine serves both runs (TRL builds an ``LLM`` per trainer; a
test-side stand-in hands back the module's one engine, which each run's first sync loads with its initial weights).
The reference for "which tensors" is the fault itself (the names the test dropped or rounded), and for "the values
the engine holds" the engine's own parameters read directly here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from test_trl_callback import STALE_LR, make_trainer  # noqa: E402
from trl_cpu_vllm import CauseLines, one_plain_engine  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

# global_step at the sync -> the fault of that sync (a sync at global_step g precedes step g + 1's generation)
FAULTS = {1: "noop", 3: "skip_layer", 5: "dtype"}
SKIPPED = "model.layers.1."
ROUNDED = "model.layers.0.mlp.down_proj.weight"
STEPS = 7


class Faults:
    """The faults, installed on the trainer's own ``vllm_generation.sync_weights`` and on the engine model's
    ``load_weights`` before the callback attaches: under the callback's wrappers, so the callback sees what TRL sent
    and the engine what the fault left. Also keeps the trainer's parameters at each sync (the reference of
    ``test_the_engine_really_holds_what_the_check_says``)."""

    def __init__(self):
        self.schedule, self.trainer, self.model = {}, None, None
        self.engine_dtype = None
        self.snapshot = {}

    def fault(self):
        return self.schedule.get(self.trainer.state.global_step)

    def attach(self, trainer) -> None:
        self.trainer = trainer
        gen = trainer.vllm_generation
        original = gen.sync_weights

        def sync_weights():
            self.snapshot = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            if self.fault() == "noop":
                return None
            return original()

        gen.sync_weights = sync_weights
        model = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model
        if self.model is model:
            return
        self.model, self.engine_dtype = model, gen.llm.llm_engine.model_config.dtype
        load = model.load_weights

        def load_weights(weights, *args, **kwargs):
            fault, kept = self.fault(), []
            for name, tensor in weights:
                if fault == "skip_layer" and name.startswith(SKIPPED):
                    continue
                if fault == "dtype" and name == ROUNDED:
                    tensor = tensor.to(self.coarse).to(tensor.dtype)
                kept.append((name, tensor))
            return load(kept, *args, **kwargs)

        model.load_weights = load_weights

    @property
    def coarse(self):
        """A dtype coarser than the engine's: what the faulty write rounds one tensor through."""
        return torch.bfloat16 if self.engine_dtype == torch.float32 else torch.float8_e4m3fn


@pytest.fixture(scope="module")
def engine(toy_model_path):
    mp = pytest.MonkeyPatch()
    one_plain_engine(mp, kv_cache_memory_bytes=64 * 2**20)
    yield Faults()
    mp.undo()


def _run(engine, model_path, tmp_path, schedule, steps, config, **overrides):
    engine.schedule = schedule
    trainer = make_trainer(model_path, tmp_path, use_vllm=True, vllm_mode="colocate",
                           vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128, max_steps=steps,
                           loss_type="grpo", **overrides)
    engine.attach(trainer)
    cb = TIMCallback(trainer, config)
    trainer.add_callback(cb)
    trainer.train()
    return trainer, cb


@pytest.fixture(scope="module")
def faulty_run(engine, toy_model_path, tmp_path_factory):
    with CauseLines() as lines:
        trainer, cb = _run(engine, toy_model_path, tmp_path_factory.mktemp("sync_faults"), FAULTS, STEPS,
                           TIMConfig(dump_dir=str(tmp_path_factory.mktemp("sync_dump")), log_detail=True))
    return trainer, cb, lines


def _parameter_names(trainer):
    return [name for name, _ in trainer.model.named_parameters()]


def test_every_sync_is_checked_and_each_fault_is_named_at_its_sync(faulty_run, engine):
    trainer, cb, _ = faulty_run
    reports = {r.step: r for r in cb.sync_watch.check.reports}
    assert sorted(reports) == list(range(STEPS))  # TRL syncs before each step's generation, from step 0 on
    names = _parameter_names(trainer)
    for step, report in reports.items():
        assert sorted(report.statuses) == sorted(names)  # every parameter compared (none unread)
        codes = [c.code for c in report.causes]
        fault = FAULTS.get(step)
        if fault is None:
            assert codes == [], (step, [c.message for c in report.causes])
            assert report.bad_tensors == 0
        elif fault == "noop":
            (cause,) = report.causes
            assert cause.code == "sync-noop"
            assert set(report.not_sent) == set(names)  # TRL sent nothing; compared from the trainer's own tensors
            # every tensor the optimizer moved in the engine's precision is named, nothing else is off
            assert set(cause.tensors) == set(report.names("stale")) and len(cause.tensors) >= len(names) - 2
        elif fault == "skip_layer":
            (cause,) = report.causes
            assert cause.code == "sync-tensors-stale"
            assert set(cause.tensors) == {n for n in names if n.startswith(SKIPPED)}
            assert report.not_sent == []  # TRL sent them: the engine's loader dropped them
        else:
            (cause,) = report.causes
            assert cause.code == "sync-precision" and cause.tensors == (ROUNDED,)
            assert f"rounded through {str(engine.coarse).replace('torch.', '')}" in cause.message


def test_the_engine_really_holds_what_the_check_says(faulty_run, engine):
    """Independent of the check's sampling and name mapping: after the last (fault-free) sync every engine parameter,
    read whole, equals the trainer's parameters at that sync cast to the engine's dtype, q/k/v and gate/up stacked
    as vLLM merges them (Qwen2's packed_modules_mapping)."""
    trainer, cb, _ = faulty_run
    assert cb.sync_watch.check.reports[-1].bad_tensors == 0
    model = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    held, sent, dtype = dict(model.named_parameters()), engine.snapshot, engine.engine_dtype
    merged = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    compared = set()
    for name, tensor in held.items():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        parts = [".".join(x for x in (parent, p, leaf) if x) for p in merged.get(last, (last,))]
        expected = torch.cat([sent[p] for p in parts]).to(dtype)
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":  # vLLM pads the vocabulary
            tensor = tensor[: expected.shape[0]]
        assert torch.equal(tensor, expected), name
        compared.update(parts)
    assert compared == set(sent)


def test_causes_are_logged_named_and_in_the_dump(faulty_run):
    trainer, cb, lines = faulty_run
    # the console line (doctor style), at the sync
    assert any(line.startswith("tim-plugins cause [sync-noop] at step 1:") and "Fix (TRL):" in line for line in lines)
    assert any(line.startswith("tim-plugins cause [sync-tensors-stale] at step 3:") and SKIPPED in line
               for line in lines)
    assert any(line.startswith("tim-plugins cause [sync-precision] at step 5:") and ROUNDED in line
               for line in lines)
    # tim/cause/* in TRL's own log: the window after each faulty sync names it
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/cause/named" in h}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert logged[1]["tim/cause/named"] == 0 and logged[1]["tim/cause/sync_bad_tensors"] == 0
    for step in (2, 4, 6):
        assert logged[step]["tim/cause/named"] >= 1
        report = next(r for r in cb.sync_watch.check.reports if r.step == step - 1)
        assert logged[step]["tim/cause/sync_bad_tensors"] == report.bad_tensors > 0
        assert logged[step]["tim/cause/sync_checked_tensors"] == len(_parameter_names(trainer))
    # beside the dump, for the report
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in (Path(cb.config.dump_dir) / "causes.jsonl").read_text().splitlines()]
    sync_rows = [(r["code"], r["step"]) for r in rows if r["code"].startswith("sync-")]
    assert sync_rows == [("sync-noop", 1), ("sync-tensors-stale", 3), ("sync-precision", 5)]


def test_no_cause_before_the_first_fault(faulty_run):
    trainer, cb, _ = faulty_run
    first = [c for c in cb.pipeline.causes.named if c.step <= 1 and not c.code.startswith("sync-")]
    assert first == []  # the stream rules name nothing on the fault-free first steps


@pytest.fixture(scope="module")
def stopped_run(engine, faulty_run, toy_model_path, tmp_path_factory):
    probe = {"action": "stop", "kl_k3_max": None, "seq_log_ratio_abs_max": 1e9}
    return _run(engine, toy_model_path, tmp_path_factory.mktemp("sync_stop"), {1: "noop"}, 5,
                TIMConfig(parity_probe=True, parity_probe_options=probe))


def test_a_named_cause_stops_the_run(stopped_run):
    trainer, cb = stopped_run
    # the no-op sync before step 2 is named there; the probe stops the run at that step's end
    assert trainer.state.global_step == 2
    trips = cb.pipeline.probe.trips
    assert [t.key for t in trips] == ["tim/cause/named"] and trips[0].step == 2



@pytest.fixture(scope="module")
def unchecked_stale_run(engine, stopped_run, toy_model_path, tmp_path_factory):
    """The check off and every sync after step 0 a no-op: the engine keeps the initial policy all run."""
    return _run(engine, toy_model_path, tmp_path_factory.mktemp("sync_off"), {s: "noop" for s in range(1, 9)}, 4,
                TIMConfig(sync_check=False), learning_rate=STALE_LR)


def test_without_the_check_the_lag0_rules_name_a_stale_engine(unchecked_stale_run):
    trainer, cb = unchecked_stale_run
    assert cb.sync_watch is None
    named = [(c.step, c.code) for c in cb.pipeline.causes.named]
    assert named and all(code in ("engine-stale", "floor-jump") for _, code in named)
    assert 2 <= min(step for step, _ in named) <= 4  # from the first step sampled by the stale engine (2)
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/cause/named" in h}
    assert logged[1]["tim/cause/named"] == 0 and max(logged[s]["tim/cause/named"] for s in (2, 3, 4)) >= 1


PEFT_FAULTS = {1: "noop", 3: "skip_layer"}


@pytest.fixture(scope="module")
def peft_run(engine, faulty_run, toy_model_path, tmp_path_factory):
    """A LoRA run (q_proj and v_proj adapters): TRL merges the adapters for each sync and sends the base model's
    parameters. The reference is PEFT's own merge (``merge_and_unload`` on a copy of the trainer's model), taken at
    every sync before TRL's: which tensors the sync should change, and their values."""
    import copy
    import functools

    from trl import GRPOTrainer

    LoraConfig = pytest.importorskip("peft").LoraConfig  # in main's environment (verl's); not in the TRL-only stacks

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    engine.schedule = PEFT_FAULTS
    trainer = make_trainer(toy_model_path, tmp_path_factory.mktemp("sync_peft"), use_vllm=True, vllm_mode="colocate",
                           vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128, max_steps=5,
                           loss_type="grpo", trainer_cls=functools.partial(GRPOTrainer, peft_config=lora))
    engine.attach(trainer)
    merged, sync = [], trainer.vllm_generation.sync_weights

    def merge_now():
        model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).merge_and_unload()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def sync_weights():
        merged.append(merge_now())
        return sync()

    trainer.vllm_generation.sync_weights = sync_weights
    cb = TIMCallback(trainer, TIMConfig())
    trainer.add_callback(cb)
    trainer.train()
    return trainer, cb, merged, merge_now


def test_a_lora_runs_syncs_are_checked_and_its_faults_named(peft_run):
    trainer, cb, merged, _ = peft_run
    reports = cb.sync_watch.check.reports
    assert [r.step for r in reports] == list(range(5)) == list(range(len(merged)))
    for k, report in enumerate(reports):
        assert sorted(report.statuses) == sorted(merged[k])  # every base parameter, under the base model's name
        changed = {n for n in merged[k] if k and not torch.equal(merged[k][n], merged[k - 1][n])}
        assert all(".q_proj." in n or ".v_proj." in n for n in changed)  # only the adapted layers move
        codes = [(c.code, set(c.tensors)) for c in report.causes]
        fault = PEFT_FAULTS.get(k)
        if fault is None:
            assert codes == [] and report.not_sent == [], (k, codes)
        elif fault == "noop":  # nothing sent: compared from the trainer's merged values
            assert set(report.not_sent) == set(merged[k]) and changed
            assert codes == [("sync-noop", changed)]
        else:
            assert report.not_sent == []
            assert codes == [("sync-tensors-stale", {n for n in changed if n.startswith(SKIPPED)})]
            assert codes[0][1]


def test_a_lora_models_unsent_tensors_are_its_merged_weights(peft_run):
    """What the check compares an unsent tensor with equals PEFT's own merge of the trainer's model now."""
    trainer, cb, _, merge_now = peft_run
    reference = merge_now()
    for name, value in reference.items():
        assert torch.equal(cb.sync_watch._local_tensor(name), value), name


BREAK = 4  # the mid-run break: every sync from global_step 4 on is a no-op, so step 5 is the first stale one


@pytest.fixture(scope="module")
def unchecked_break_run(engine, unchecked_stale_run, toy_model_path, tmp_path_factory):
    """The check off and syncs that stop applying mid-run (from the sync before step 5 on): four fault-free windows
    give the lag-0 floor its history first. At the stale runs' learning rate, so that one stale step moves the policy
    by more than a draw's spread of the floor."""
    return _run(engine, toy_model_path, tmp_path_factory.mktemp("sync_break"),
                {s: "noop" for s in range(BREAK, 20)}, 8, TIMConfig(sync_check=False), learning_rate=STALE_LR)


def test_a_sync_that_breaks_mid_run_is_named_by_the_floor_jump(unchecked_break_run):
    """The floor-jump rule on a real run, against the rule recomputed here from the floors TRL logged
    (``tim/token/abs_diff_mean``): nothing named on the fault-free steps, the jump named at the first stale step
    and at each one after it."""
    import statistics

    from tim_plugins.causes import CauseConfig

    trainer, cb = unchecked_break_run
    c = CauseConfig()
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/cause/named" in h}
    assert sorted(logged) == list(range(1, 9))
    kept, expected = [], []
    for step in sorted(logged):
        floor = logged[step]["tim/token/abs_diff_mean"]
        median = statistics.median(kept[-c.floor_window:]) if kept else None
        if median is not None and floor > c.floor_jump_factor * median and floor - median > c.floor_jump_min:
            expected.append(step)
        else:
            kept.append(floor)
    jumps = [x.step for x in cb.pipeline.causes.named if x.code == "floor-jump"]
    assert jumps == expected
    assert jumps == list(range(BREAK + 1, 9))  # nothing before the break; named at its first stale step and after
    assert all(logged[s]["tim/cause/named"] == 0 for s in range(1, BREAK + 1))
    assert all(logged[s]["tim/cause/named"] >= 1 for s in jumps)
    assert max(logged[s]["tim/token/abs_diff_mean"] for s in range(1, BREAK + 1)) < c.floor_jump_min


def test_the_report_leads_with_the_named_causes(faulty_run):
    """tim-plugins report on the run's dump: the verdict is ACT and names the broken sync first (not a dtype fix),
    and the causes section lists each with its tensors and TRL's fix."""
    from tim_plugins.report import build_report, read_summary, verdict_for

    trainer, cb, _ = faulty_run
    folder = cb.config.dump_dir
    v = verdict_for(read_summary(__import__("pathlib").Path(folder)), folder)
    assert v["status"] == "act"
    assert v["headline"].startswith("ACT: the engine sampled from other weights than the trainer scored: sync-noop "
                                    "(first at step 1)")
    assert v["causes"]["sync-tensors-stale"] == [3] and v["causes"]["sync-precision"] == [5]
    assert v["extra"][0].startswith("sync-noop at step 1: ") and "Fix (TRL): TRL's weight sync" in v["extra"][0]
    html = build_report(folder).read_text()
    assert "What is causing it" in html and ROUNDED in html
