"""TIMCallback on TRL's own AsyncGRPOTrainer (trl.experimental.async_grpo, CPU, the toy model): the mismatch by
policy lag.

What runs: ``AsyncGRPOTrainer.train()`` itself (its dataloader, rollout queue, packing planner and collator,
accelerate's dispatcher, its loss, weight syncs and logging), with the two seams TRL documents for tests: a
rollout worker (``RolloutWorkerProtocol``) and a weight transfer (``WeightTransferProtocol``). The stand-in engine
behind them is the toy model in bfloat16 (the injected mismatch) loaded with the weights each sync sends; it samples
with HF generate from a version 0, 1 or 2 syncs back in a fixed schedule (``async_standin.fetch_lag``) and scores
its samples in bfloat16, so a step trains samples of several policy versions.

Two test-only shims, both for what needs a GPU: TRL's tree attention calls the FlashAttention-3 kernel from the
Hub (``kernels``), replaced by a plain causal attention over the same tree layout; and the trainer's MFU set-up asks
``torch.cuda`` for the device name, answered with no peak FLOPs (MFU off, as TRL does for an unknown device).

What is not run: the vLLM server and TRL's own ``AsyncRolloutWorker`` (it needs the server). Two processes:
tests/test_trl_async_two_procs.py.

References, computed here independently of the callback: each sample's policy lag from the step the stand-in saw
each version synced at and the step that trained it (found by its log-probs), and the trainer's log-probs from a
plain forward of the weights the trainer held at that step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from packaging.version import Version

from tim_plugins._optional import package_version

pytest.importorskip("trl")
pytest.importorskip("datasets")
# The packed AsyncGRPOTrainer (trl.experimental.async_grpo.packing) exists from TRL 1.16 (1.15's async trainer has
# no packing): older releases skip by version; on 1.16 and later a module that moved fails the imports, not a skip.
if Version(package_version("trl")) < Version("1.16"):
    pytest.skip("the packed AsyncGRPOTrainer exists from TRL 1.16", allow_module_level=True)

from async_standin import GROUP, NEW_TOKENS, install_cpu_shims, make_trainer, reference_passes  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = pytest.mark.trl

STEPS = 8


def _train(toy_model_path, out, learning_rate: float = 3e-3):
    undo = install_cpu_shims()
    trainer, engine = make_trainer(toy_model_path, out, STEPS, learning_rate=learning_rate)
    # test side: the weights the trainer holds at each loss call (the reference's), and which samples it trains
    passes, original = [], trainer.compute_loss

    def compute_loss(model, inputs, *a, **k):
        sel = inputs["token_index"] >= 0
        passes.append((trainer.state.global_step, inputs["segment_id"][sel].clone(),
                       inputs["old_log_probs"][sel].clone(),
                       # unwrapped: after a test that left a process group up (vLLM's in-process engine),
                       # accelerate wraps the model in DDP and its names gain "module."
                       {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(model).named_parameters()}))
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, parity_audit=False, sync_check=False,
                                        dump_dir=str(out / "dump")))
    trainer.add_callback(cb)
    try:
        trainer.train()
    finally:
        undo()
    return trainer, cb, engine, passes, out / "dump"


@pytest.fixture(scope="module")
def async_run(toy_model_path, tmp_path_factory):
    return _train(toy_model_path, tmp_path_factory.mktemp("async"))


def _stats(d: np.ndarray) -> dict[str, float]:
    return {"count": float(len(d)), "abs_diff_mean": np.abs(d).mean(), "mean": d.mean(),
            "kl_k3": np.mean(np.expm1(d) - d), "abs_diff_max": np.abs(d).max()}


def test_by_lag_equals_the_reference_per_step(async_run, toy_model_path):
    trainer, cb, engine, passes, _ = async_run
    assert trainer.state.global_step == STEPS
    assert not cb.pipeline.diag, cb.pipeline.diag  # every token keyed, nothing unread
    ref = reference_passes(toy_model_path, engine, passes)
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == sorted(ref) == list(range(1, STEPS + 1))
    lags_seen, turns_seen = set(), set()
    for step, samples in ref.items():
        for lag in sorted({lag for lag, *_ in samples}):
            lags_seen.add(lag)
            want = _stats(np.concatenate([d for g, d, _ in samples if g == lag]))
            for stat, value in want.items():
                got = logged[step][f"tim/by_lag/{lag}/{stat}"]
                tol = 0 if stat == "count" else 2e-5 + 2e-3 * abs(value)
                assert abs(got - value) <= tol, (step, lag, stat, got, value)
        # no bucket the reference does not have
        buckets = {k.split("/")[2] for k in logged[step] if k.startswith("tim/by_lag/") and
                   logged[step][k] is not None}
        assert buckets == {str(lag) for lag, *_ in samples}, (step, buckets)
        # the monitor (tim/token/*) and the turns measure the lag-0 tokens only: the trainer at the rollout's weights
        zero = [(d, t) for g, d, t in samples if g == 0]
        if zero:
            d, turn = np.concatenate([d for d, _ in zero]), np.concatenate([t for _, t in zero])
            want = _stats(d)
            assert abs(logged[step]["tim/token/kl_k3"] - want["kl_k3"]) <= 2e-5 + 2e-3 * want["kl_k3"]
            for t in np.unique(turn):
                for stat, value in _stats(d[turn == t]).items():
                    got = logged[step][f"tim/by_turn/{t}/{stat}"]
                    assert abs(got - value) <= (0 if stat == "count" else 2e-5 + 2e-3 * abs(value)), (step, t, stat)
            turns_seen.update(np.unique(turn).tolist())
        else:
            assert logged[step].get("tim/token/kl_k3") is None
    assert lags_seen >= {0, 1, 2, 3}, lags_seen
    assert turns_seen == {0, 1}, turns_seen


def test_lag_zero_is_a_flat_floor_and_k3_grows_with_lag(async_run, toy_model_path):
    """The mismatch floor (lag 0: same weights, bf16 engine vs fp32 trainer) stays at its level at every step, while
    the log-ratio's k3 grows with the lag (the policy moved): read from the logged values alone."""
    trainer, *_ = async_run
    per_lag: dict[int, list[tuple[float, float]]] = {}
    for h in trainer.state.log_history:
        for key, value in h.items():
            if key.startswith("tim/by_lag/") and key.endswith("/kl_k3") and value is not None:
                lag = key.split("/")[2]
                per_lag.setdefault(int(lag.rstrip("+")), []).append((value, h[key.replace("kl_k3", "count")]))
    pooled = {lag: sum(v * n for v, n in vals) / sum(n for _, n in vals) for lag, vals in per_lag.items()}
    floor = [v for v, _ in per_lag[0]]
    assert len(floor) >= STEPS // 2
    # flat: the same stacks at the same weights. One step's lag-0 k3 rests on 16-48 tokens (measured per-step
    # values 7e-6 .. 1.5e-4 on one machine), so the level is compared pooled: the first half of the steps against
    # the second, and no single step reaches the first stale lag's pooled level
    half = len(per_lag[0]) // 2
    early, late = (sum(v * n for v, n in part) / sum(n for _, n in part)
                   for part in (per_lag[0][:half], per_lag[0][half:]))
    assert max(early, late) < 3 * min(early, late), per_lag[0]
    lags = sorted(pooled)
    older = [(v, n) for lag, vals in per_lag.items() if lag >= 2 for v, n in vals]
    older_k3 = sum(v * n for v, n in older) / sum(n for _, n in older)
    assert 10 * pooled[0] < pooled[1] < older_k3, pooled  # growth with lag, from a floor an order of magnitude down
    assert max(floor) < pooled[1], (floor, pooled)
    print("pooled k3 by lag:", {lag: f"{pooled[lag]:.3g}" for lag in lags}, "lag-0 k3 per step:",
          [f"{v:.3g}" for v in floor])


def _lag_rule_reference(toy_model_path, engine, passes) -> dict[int, tuple[float, float]]:
    """{step: (k3 of the tokens trained at lag >= 1, its part above the lag-0 floor)} by their definition over the
    reference's log-ratios of the step (at a step without lag-0 tokens, against the last step's floor that had
    them); steps with no stale token, or before any floor, are left out."""
    out, floor = {}, None
    for step, samples in sorted(reference_passes(toy_model_path, engine, passes).items()):
        zero = [d for lag, d, _ in samples if lag == 0]
        stale = [d for lag, d, _ in samples if lag >= 1]
        floor = _stats(np.concatenate(zero))["kl_k3"] if zero else floor
        if floor is not None and stale:
            k3 = _stats(np.concatenate(stale))["kl_k3"]
            out[step] = (k3, k3 - floor)
    return out


def test_staleness_by_lag_is_named_live_where_the_reference_says(async_run, toy_model_path):
    """AsyncGRPOTrainer computes no π_old at each sample's weights, so the staleness cause reads the statistics by
    lag: named at a step where the tokens trained at lag >= 1 have a k3 whose part above the lag-0 floor is at least
    half of it and above 0.015 (CauseConfig's staleness_share and staleness_k3), with TRL's fix in the closing line.
    Reference: those k3 by their definition (``_lag_rule_reference``)."""
    from tim_plugins.causes import cause_fix

    trainer, cb, engine, passes, _ = async_run
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    want = []
    for step, (k3, part) in _lag_rule_reference(toy_model_path, engine, passes).items():
        # the 1e-3-relative agreement of the logged k3 (test_by_lag_equals_the_reference_per_step) decides no step
        assert abs(part - 0.015) > 0.01 * part and abs(part - 0.5 * k3) > 0.01 * k3, (step, k3, part)
        if part > 0.015 and part >= 0.5 * k3:
            want.append(step)
    named = [step for step, h in sorted(logged.items()) if h["tim/cause/named"]]
    assert named == want and len(want) >= 2, (named, want)
    assert {c.code for c in cb.pipeline.causes.named} == {"staleness"}
    assert cb.pipeline.causes.summary_lines() == [
        f"tim-plugins: this run named [staleness] in {len(want)} windows, steps {want[0]} to {want[-1]} (first: "
        f"{cb.pipeline.causes.tally['staleness']['message']}). Fix (TRL): {cause_fix('staleness', 'trl')}"]
    assert "max_staleness" in cause_fix("staleness", "trl")


def test_a_learning_rate_whose_stale_samples_stay_near_the_floor_names_nothing(toy_model_path, tmp_path):
    """The same asynchronous run at a 100x smaller learning rate: the samples of older weights are still trained at
    lags 1 and 2, but the policy moves so little between syncs that their k3 above the floor stays far below 0.015
    at every step (the reference says so, by a factor of at least 4): no cause is named, and the closing lines are
    empty."""
    trainer, cb, engine, passes, _ = _train(toy_model_path, tmp_path, learning_rate=3e-5)
    ref = _lag_rule_reference(toy_model_path, engine, passes)
    assert len(ref) >= STEPS - 2, ref  # the rule judged (stale tokens and a floor) at nearly every step
    assert max(part for _, part in ref.values()) < 0.015 / 4, ref
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS and all(h["tim/cause/named"] == 0 for h in logged)
    assert cb.pipeline.causes.named == [] and cb.pipeline.causes.summary_lines() == []


def test_report_answers_mismatch_or_staleness_from_the_dump_folder(async_run, toy_model_path):
    """`tim-plugins report DUMP_DIR` of the async run: the section's lag table holds the reference's token counts
    and pooled k3, the verdict names staleness (with TRL's fix); the dump holds the lag-0 tokens (the measurement
    point) of the sampled sequences."""
    import re

    from tim_plugins.dump import read_dump
    from tim_plugins.report import build_report

    trainer, cb, engine, passes, dump = async_run
    ref = reference_passes(toy_model_path, engine, passes)
    html = build_report(dump).read_text()
    verdict = html[:html.index("Mismatch or staleness?</h2>")]
    assert "Mismatch or staleness: Staleness dominates" in verdict  # in the verdict block at the top too
    section = html[html.index("Mismatch or staleness?</h2>"):]
    assert "statistical: by policy lag" in section and "Staleness dominates" in section
    assert "max_staleness" in section  # TRL's fix for the dominant part
    pooled: dict[int, list] = {}
    for samples in ref.values():
        for lag, d, _ in samples:
            pooled.setdefault(lag, []).append(d)
    for lag, ds in pooled.items():
        d = np.concatenate(ds)
        k3 = np.mean(np.expm1(d) - d)
        row = re.search(rf"<tr><td>{lag}</td><td class='num'>(\d+)</td><td>([^<]+)</td></tr>", section)
        assert row is not None, lag
        assert int(row.group(1)) == len(d)
        assert abs(float(row.group(2)) - k3) <= 0.005 * k3 + 1e-6, (lag, row.group(2), k3)
    table = read_dump(dump)
    zero = sum(len(d) for samples in ref.values() for lag, d, _ in samples if lag == 0)
    assert 0 < len(table) <= zero


def test_packed_rows_lays_out_trls_own_packed_row():
    """translate.packed_rows on a row packed by TRL's own TreeRow and padded by its collator (two ranks' rows):
    samples sharing a prompt prefix, one with a tool segment; each sample's row holds its trained tokens' ids and
    rollout log-probs in order, the tool tokens as holes; a fake per-position log-prob (its position id) is read
    where TRL's loss reads it. Reference: the samples themselves."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    from tim_plugins.integrations.trl.translate import packed_rows

    prompt = [5, 6, 7]
    specs = [([8, 9, 10, 11], [1, 1, 1, 1]), ([8, 9, 12, 13, 14], [1, 1, 0, 0, 1]), ([15, 16], [1, 1])]
    rows = [TreeRow(), TreeRow()]
    samples = []
    for i, (completion, trained) in enumerate(specs):
        ids = torch.tensor(prompt + completion)
        mask = torch.tensor([0] * len(prompt) + trained)
        sample = {"input_ids": ids, "completion_mask": mask, "old_log_probs": -0.1 * torch.arange(len(ids)) - i,
                  "advantage": 1.0, "group_id": 0, "metrics": {}}
        samples.append(sample)
        rows[0].add(sample)
    rows[1].add(samples[2])
    batch = DataCollatorForRollout(pad_token_id=0, num_processes=2)([rows])
    row0 = {k: v[:1] for k, v in batch.items()}  # what the dispatcher hands rank 0
    unpadded = row0["attention_mask"].bool()
    fake = row0["position_ids"][unpadded].float().unsqueeze(0)  # "log-prob" of each position: its position id
    out = packed_rows(row0, fake)
    assert out["mask"].shape[0] == 3
    for i, sample in enumerate(samples):
        trained = sample["completion_mask"].bool()
        first = int(trained.nonzero()[0, 0])
        cols = (trained.nonzero()[:, 0] - first).tolist()
        assert out["mask"][i].nonzero()[:, 0].tolist() == cols
        assert out["token_ids"][i, cols].tolist() == sample["input_ids"][trained].tolist()
        assert torch.equal(out["rollout"][i, cols], sample["old_log_probs"][trained].float())
        # the trained token at position p is scored off position p - 1 (TRL's shift)
        assert out["current"][i, cols].tolist() == (trained.nonzero()[:, 0] - 1).float().tolist()
        assert (out["weights_step"][i, cols] == -1).all()  # no version recorded: unknown


def test_a_sample_without_a_version_is_passed_through_unrecorded():
    """The queue recorder never breaks TRL's drain: a sample without a readable model_version is returned as it is
    (its tokens then count under tim/diag/async_lag_unknown), one with a version is recorded under its log-probs."""
    import queue
    from collections import OrderedDict
    from types import SimpleNamespace

    from tim_plugins.integrations.trl.async_grpo import _RecordingQueue

    inner, versions = queue.Queue(), OrderedDict()
    bad, good = SimpleNamespace(old_log_probs=torch.zeros(3)), SimpleNamespace(old_log_probs=torch.ones(3),
                                                                               model_version=np.int64(4))
    inner.put(bad)
    inner.put(good)
    rec = _RecordingQueue(inner, versions)
    assert rec.get() is bad and rec.get() is good and rec.qsize() == 0
    assert list(versions.values()) == [(good.old_log_probs, 4)]


def test_lr_decay_fires_on_the_trained_length_surge(toy_model_path, tmp_path):
    """lr_decay=True on AsyncGRPOTrainer: the length signal is the mean trained tokens per sample of each step. The
    stand-in's groups 0-3 (steps 1-2) have 2 tokens, the later ones 6 (4 trained where a group has its tool
    segment): with a 2-step warm-up, window 1, margin 0.5 and patience 1 the rule fires at step 3 (mean 5 > 1.5 x
    2), and the constant schedule's learning rate halves from step 4 on (TRL's own logged value)."""
    from tim_plugins.lr_control import LRDecayConfig

    undo = install_cpu_shims()
    try:
        trainer, engine = make_trainer(toy_model_path, tmp_path, 5, lengths=lambda k: 2 if k < 4 else NEW_TOKENS)
        opts = LRDecayConfig(warmup_steps=2, window=1, patience=1, margin=0.5, cooldown=100, decay_factor=0.5)
        cb = TIMCallback(trainer, TIMConfig(log_detail=True, parity_audit=False, lr_decay=True, lr_decay_options=opts))
        trainer.add_callback(cb)
        trainer.train()
    finally:
        undo()
    assert cb.pipeline.lr_controller.trigger_steps == [3]
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for step in range(1, 6):
        assert logged[step]["learning_rate"] == pytest.approx(3e-3 * (0.5 if step > 3 else 1.0), rel=1e-12), step
    assert logged[3]["tim/lr/triggered"] == 1.0
    # the signal itself (window 1: the step's value): step s trains groups 2s-2 and 2s-1, in the order generated
    trained = [int(s["mask"].sum()) for s in engine.samples]
    for step in range(1, 6):
        want = np.mean(trained[(step - 1) * 2 * GROUP: step * 2 * GROUP])
        assert logged[step]["tim/lr/window_length"] == want, step
    assert [logged[s]["tim/lr/window_length"] for s in (1, 2, 3)] == [2.0, 2.0, 5.0]
    assert not any(s.name == "async_lr_decay" for s in cb.features_off)
    # on by default, and not run on AsyncGRPOTrainer: said once at attach, not left silent
    assert [s.name for s in cb.features_off] == ["async_sync_check"]


def test_tokens_of_an_unseen_version_are_counted_not_keyed(toy_model_path, tmp_path):
    """A sample whose policy version was never synced in this run (as after a resume) trains as usual; its tokens
    are counted under tim/diag/async_lag_unknown and left out of every bucket."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    undo = install_cpu_shims()
    try:
        trainer, engine = make_trainer(toy_model_path, tmp_path, 2)
        put = engine.rollout_buffer.put

        def put_unseen(sample: RolloutSample, *a, **k):  # group 1 claims a version this run never synced
            if sample.group_id == 1:
                sample.model_version = 99
            return put(sample, *a, **k)

        engine.rollout_buffer.put = put_unseen
        cb = TIMCallback(trainer, TIMConfig(log_detail=True, parity_audit=False, sync_check=False))
        trainer.add_callback(cb)
        trainer.train()
    finally:
        undo()
    unseen = sum(int(s["mask"].sum()) for s in engine.samples[GROUP:2 * GROUP])
    assert cb.pipeline.diag == {"async_lag_unknown": float(unseen)}
    step1 = next(h for h in trainer.state.log_history if h.get("step") == 1 and "loss" in h)
    keyed = sum(v for k, v in step1.items() if k.startswith("tim/by_lag/") and k.endswith("/count") and v)
    assert keyed == sum(int(s["mask"].sum()) for s in engine.samples[:2 * GROUP]) - unseen
    assert step1["tim/diag/async_lag_unknown"] == unseen


def test_every_patch_is_undone_when_train_raises_and_a_second_trainer_is_untouched(toy_model_path, tmp_path):
    """Nothing is patched before ``train()``; when it raises, the rollout queue, TreeRow.pack and the loss are
    TRL's own again without ``detach()``; a second AsyncGRPOTrainer in the same process then packs and trains
    without any of our columns."""
    from trl.experimental.async_grpo.packing import TreeRow

    pack = TreeRow.__dict__["pack"]
    undo = install_cpu_shims()
    try:
        failing, _ = make_trainer(toy_model_path, tmp_path / "failing", 3)
        queue, calls, loss = failing.rollout_queue, [], failing.compute_loss

        def compute_loss(model, inputs, *a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt("the user stops the run")  # not an Exception: nothing may swallow it
            return loss(model, inputs, *a, **k)

        failing.compute_loss = compute_loss
        cb = TIMCallback(failing, TIMConfig(log_detail=True, parity_audit=False, sync_check=False))
        failing.add_callback(cb)
        assert failing.rollout_queue is queue and TreeRow.__dict__["pack"] is pack  # nothing before train()
        with pytest.raises(KeyboardInterrupt):
            failing.train()
        assert len(calls) == 2 and cb.generation_count == 0
        assert cb.installed == [] and failing.rollout_queue is queue and TreeRow.__dict__["pack"] is pack
        assert vars(failing)["compute_loss"] is compute_loss

        second, _ = make_trainer(toy_model_path, tmp_path / "second", 1)
        seen, second_loss = [], second.compute_loss

        def record(model, inputs, *a, **k):
            seen.append(set(inputs))
            return second_loss(model, inputs, *a, **k)

        second.compute_loss = record
        second.train()
    finally:
        undo()
    assert seen and not any(key.startswith("tim_") for keys in seen for key in keys), seen


def _lag_reference(engine, passes, synced: dict[int, int]) -> tuple[dict, float]:
    """({step: {lag: tokens}}, tokens of unknown lag) of ``passes`` ((global_step, segment_id, old_log_probs) of each
    loss call), from the samples themselves: a sample's lag is the step that trained it minus the step its version
    was synced at in ``synced`` (the run's own syncs), unknown for a version not in it."""
    from async_standin import _key

    by_key = {}
    for s in engine.samples:
        by_key.setdefault(_key(s["engine"][s["mask"]]), s)
    counts: dict[int, dict[int, float]] = {}
    unknown = 0.0
    for step, segment, old in passes:
        for seg in segment.unique().tolist():
            sample = by_key[_key(old[segment == seg].numpy())]
            n = float(sample["mask"].sum())
            if sample["version"] in synced:
                lag = step - synced[sample["version"]]
                counts.setdefault(step + 1, {}).setdefault(lag, 0.0)
                counts[step + 1][lag] += n
            else:
                unknown += n
    return counts, unknown


@pytest.mark.parametrize("failure", ["exception", "probe_raise"])
def test_a_run_that_raised_leaves_nothing_for_the_next_train(toy_model_path, tmp_path, monkeypatch, failure):
    """``train()`` ends by an exception in the middle of a step (after one of its two loss calls) or by the probe's
    ``ParityError`` (action="raise"); ``train()`` again on the same trainer starts a new run (step 0). Its logged
    lags are the reference's over its own loss calls and its own syncs only: no loss call of the failed step is laid
    out in its first step, and a version synced before it is of unknown lag (counted, docs/trl.md), not keyed by the
    failed run's step numbers. The version live as it starts holds the trainer's weights: lag 0 from step 0."""
    import async_standin

    from tim_plugins.parity.findings import ParityError

    undo = install_cpu_shims()
    try:
        trainer, engine = make_trainer(toy_model_path, tmp_path, 3)
        passes, calls, loss = [], [], trainer.compute_loss

        def compute_loss(model, inputs, *a, **k):
            calls.append(trainer.state.global_step)
            if failure == "exception" and calls == [0, 0, 1, 1]:  # the second loss call of step 2
                raise RuntimeError("a failure in the middle of a step")
            sel = inputs["token_index"] >= 0
            passes.append((trainer.state.global_step, inputs["segment_id"][sel].clone(),
                           inputs["old_log_probs"][sel].clone()))
            return loss(model, inputs, *a, **k)

        trainer.compute_loss = compute_loss
        probe = {"parity_probe": True, "parity_probe_options": {"kl_k3_max": None, "abs_diff_max": 1e-12,
                                                                "every_n_steps": 2, "action": "raise"}}
        cb = TIMCallback(trainer, TIMConfig(log_detail=True, parity_audit=False, sync_check=False,
                                            **(probe if failure == "probe_raise" else {})))
        trainer.add_callback(cb)
        with pytest.raises(ParityError if failure == "probe_raise" else RuntimeError):
            trainer.train()
        assert trainer.state.global_step == (2 if failure == "probe_raise" else 1)
        live, before = trainer.model_version, dict(engine.synced_at)
        passes.clear()
        trainer.args.max_steps = 1 if failure == "probe_raise" else 2  # the probe checks at even steps only
        # every other group of the new run sampled one version back: at its start a version synced before it
        monkeypatch.setattr(async_standin, "fetch_lag", lambda k: k % 2)
        trainer.train()
    finally:
        undo()
    assert trainer.state.global_step == trainer.args.max_steps
    synced = {v: s for v, s in engine.synced_at.items() if v not in before} | {live: 0}
    counts, unknown = _lag_reference(engine, passes, synced)
    assert unknown > 0 and sorted(counts) == list(range(1, trainer.args.max_steps + 1))
    rows = {h["step"]: h for h in trainer.state.log_history if "loss" in h}  # the new run's state
    for step, by_lag in counts.items():
        logged = {int(k.split("/")[2]): v for k, v in rows[step].items()
                  if k.startswith("tim/by_lag/") and k.endswith("/count") and v}
        assert logged == by_lag, (step, logged, by_lag)
    assert rows[max(rows)]["tim/diag/async_lag_unknown"] == unknown


def test_one_micro_batch_per_step_is_said_at_attach_time(toy_model_path, tmp_path, caplog):
    """gradient_accumulation_steps=1: every batch trains one sync after its weights (accelerate fetches one ahead),
    so after the first step no token is at lag 0: said once when the callback attaches, with the fix; the run with
    two micro-batches says nothing of it. Reference: the lags the run logs (tim/by_lag/*)."""
    from tim_plugins.integrations.trl.async_grpo import ONE_MICRO_BATCH

    undo = install_cpu_shims()
    try:
        for ga in (1, 2):
            caplog.clear()
            trainer, _ = make_trainer(toy_model_path, tmp_path / f"ga{ga}", steps=3, gradient_accumulation_steps=ga)
            with caplog.at_level("WARNING"):
                trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
                trainer.train()
            said = [r for r in caplog.records if r.getMessage() == ONE_MICRO_BATCH]
            assert len(said) == (1 if ga == 1 else 0)
            later = [h for h in trainer.state.log_history if h.get("step", 0) >= 2 and "tim/tokens" in h]
            lag0 = [h.get("tim/by_lag/0/count", 0.0) for h in later]
            assert (all(n == 0 for n in lag0) if ga == 1 else any(n > 0 for n in lag0)), (ga, later)
    finally:
        undo()
