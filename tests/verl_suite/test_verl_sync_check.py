"""The weight-sync check on verl's FSDP actor engine (``integrations/verl/sync_check.py``), at engine level: the
engine's own ``get_per_tensor_param`` (what verl's ``update_weights`` streams to the rollout) goes through the tim
engine's tee into a transformers copy of the model standing for the rollout engine, started on random weights as
verl's vLLM rollout starts (``load_format=dummy``); the copy is read with the vLLM reader and the cross-process
protocol (``integrations/vllm/worker_reads.py``: plain requests and answers, as the vLLM worker extension answers),
through the same ``SyncWatch.around`` the worker runs. A layer the "rollout" skips is named at the first sync
(``sync-tensors-differ``: dummy values, neither the actor's nor any earlier ones) and at a later one
(``sync-tensors-stale``), with exactly that layer's tensors; the engine's next measurement window logs
``tim/cause/*`` and the probe's decision is ``stop``; a fault-free sync names nothing. References: the names the
test skipped, and the copy's tensors compared whole with the actor's (not the check's sample). The path through
verl's ``main_ppo`` with the real vLLM server: ``test_verl_main_ppo.py`` / ``test_verl_sync_check_main_ppo.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import TIMVerlConfig  # noqa: E402

VOCAB = 383
SKIPPED = "model.layers.1."


def _actor_tensors(engine) -> dict:
    return {n: t.detach().clone() for n, t in engine.get_per_tensor_param()[0]}


def _window(engine, step: int):
    """A measurement pass at verl's global ``step`` (a window): its metrics and the probe's decision. The batch's
    rollout log-probs sit below log 0.5 (``rollout_noise``), so the stream rules (confident tokens) stay silent and
    the window's causes are the syncs'."""
    engine.tim_begin_step(step)
    td, _ = H.make_batch(VOCAB, response=6, seed=3, rollout_noise=5.0)
    H.infer(engine, td)
    return engine.tim_pop_metrics(), engine.tim_pop_decision()


def _train(engine, seed: int):
    td, _ = H.make_batch(VOCAB, response=6, seed=seed, rollout_noise=5.0)
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    H.train_step(engine, td, old)


@pytest.fixture(scope="module")
def engine(toy_model_path):
    H.init_dist(port=29631)
    engine = H.build_engine(toy_model_path, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True},
                                                  "probe": {"enable": True, "kl_k3": 1e9, "action": "stop"}}))
    return engine


def test_a_skipped_layer_is_named_at_the_first_sync_and_the_probe_stops(engine, toy_model_path):
    rollout = H.Rollout(toy_model_path)
    dummy = {n: p.detach().clone() for n, p in rollout.params.items()}
    report = H.checked_sync(engine, rollout, 0, skip=SKIPPED)
    skipped = [n for n in rollout.streamed if n.startswith(SKIPPED)]
    assert len(skipped) >= 9 and set(report.statuses) == set(rollout.streamed)  # every streamed tensor compared
    # the reference: the copy's layer 1 is still its dummy init, every other tensor the actor's
    actor = _actor_tensors(engine)
    for name in rollout.streamed:
        held = rollout.params[name].detach()
        assert torch.equal(held, dummy[name] if name in skipped else actor[name]), name
    assert {n for n, s in report.statuses.items() if s != "ok"} == set(skipped)
    assert [c.code for c in report.causes] == ["sync-tensors-differ"]
    cause = report.causes[0]
    assert set(cause.tensors) == set(skipped) and cause.step == 0
    assert f"{SKIPPED}* ({len(skipped)} tensors)" in cause.message

    # the next measurement window: tim/cause/* and the probe's decision (a named cause trips it at any limit)
    metrics, decision = _window(engine, 1)
    assert metrics["tim/cause/named"] == 1.0
    assert metrics["tim/cause/sync_bad_tensors"] == len(skipped)
    assert metrics["tim/cause/sync_checked_tensors"] == len(rollout.streamed)
    assert decision.tripped and decision.stop and [t.key for t in decision.trips] == ["tim/cause/named"]

    # a later sync after an optimizer step, the same layer skipped: it still holds what it held (stale)
    _train(engine, seed=4)
    report = H.checked_sync(engine, rollout, 1, skip=SKIPPED)
    assert [c.code for c in report.causes] == ["sync-tensors-stale"]
    assert set(report.causes[0].tensors) == set(skipped) and report.names("stale") == skipped
    moved = _actor_tensors(engine)
    assert all(torch.equal(rollout.params[n].detach(), dummy[n]) and not torch.equal(dummy[n], moved[n])
               for n in skipped)
    metrics, decision = _window(engine, 2)
    assert metrics["tim/cause/named"] == 1.0 and metrics["tim/cause/sync_bad_tensors"] == len(skipped)
    assert decision.stop

    # a fault-free sync after another step: nothing named, every tensor compared
    _train(engine, seed=5)
    report = H.checked_sync(engine, rollout, 3)
    assert report.causes == [] and set(report.statuses.values()) == {"ok"}
    metrics, decision = _window(engine, 4)
    assert metrics["tim/cause/named"] == 0.0 and not decision.tripped
    assert metrics["tim/cause/sync_bad_tensors"] == 0.0
    assert metrics["tim/cause/sync_checked_tensors"] == len(rollout.streamed)
    metrics, _ = _window(engine, 5)
    assert math.isnan(metrics["tim/cause/sync_checked_tensors"])  # no sync in this window


def test_every_n_syncs_and_the_switches(engine, toy_model_path):
    rollout = H.Rollout(toy_model_path, seed=1)
    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "sync_check": {"every_n_syncs": 2}})
    engine.tim_deconfigure()
    engine.tim_configure(tim)
    try:
        checked = [H.checked_sync(engine, rollout, s, skip=SKIPPED) is not None for s in range(4)]
        assert checked == [True, False, True, False]
        # the stream of an unchecked sync is verl's own generator, untouched
        assert rollout.streamed and engine.tim_sync_watch.record is None
        for node in ({"monitor": {"enable": True}, "sync_check": {"enable": False}},
                     {"monitor": {"enable": True}, "causes": {"enable": False}},
                     {"safe_vocab": {"min_p": 1e-4}}):  # the monitor off: no causes, so no check
            engine.tim_deconfigure()
            engine.tim_configure(TIMVerlConfig.from_node(node))
            assert engine.tim_sync_watch is None, node
    finally:
        engine.tim_deconfigure()


def test_a_sync_no_rank_can_read_is_counted_not_raised(engine, toy_model_path):
    """The disaggregated checkpoint-engine sync, or verl's own server without the reads: the worker passes no
    reader; the sync runs, nothing is named, the window counts it."""
    rollout = H.Rollout(toy_model_path, seed=2)
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        watch = engine.tim_sync_watch

        async def gather(reports):
            return reports, True

        asyncio.run(watch.around(0, lambda: rollout.load(engine, SKIPPED), None, gather))
        assert watch.check.reports == [] and rollout.streamed

        async def failing(requests):
            raise ConnectionError("the server went away")

        asyncio.run(watch.around(1, lambda: rollout.load(engine, SKIPPED), failing, gather))
        assert watch.check.reports == []
        metrics, _ = _window(engine, 2)
        assert metrics["tim/diag/sync_check_unavailable"] == 2.0 and metrics["tim/cause/named"] == 0.0
    finally:
        engine.tim_deconfigure()


def _disaggregated_sync(engine, replicas: list, step: int, skips: list, reads: list | None = None):
    """One disaggregated sync, as verl's checkpoint-engine mode runs it: the actor's ``update_weights`` sends the
    engine's stream (``SyncWatch.sent``; the "checkpoint engine" here keeps the tensors it is sent), then every replica
    loads what was sent (each dropping its ``skips[j]`` prefix), then the driver has the actor read the replicas
    (``SyncWatch.read_replicas``, each through ``harness.worker_read``). Returns the reports the sync added to the
    pipeline's window."""
    watch = engine.tim_sync_watch
    sent: dict = {}

    async def send():
        weights, _ = engine.get_per_tensor_param()
        for name, tensor in weights:
            sent[name] = tensor.detach().clone()

    asyncio.run(watch.sent(step, send, reads_here=True))
    for rollout, skip in zip(replicas, skips):  # the rollout workers load after the actor has sent
        rollout.streamed = list(sent)
        with torch.no_grad():
            for name, tensor in sent.items():
                if skip is None or not name.startswith(skip):
                    rollout.params[name].copy_(tensor)

    delivered: list = []

    async def gather(reports):
        delivered.extend(reports)
        return reports, True

    asyncio.run(watch.read_replicas([H.worker_read(r) for r in replicas] if reads is None else reads, gather))
    return delivered


def test_a_disaggregated_sync_reads_every_replica_after_they_loaded(engine, toy_model_path):
    """verl's checkpoint-engine sync (separate_async's standalone replicas): the record is kept from the actor's send
    to the reads the driver asks for once every replica has loaded; each replica is compared with it, against its
    own previous reads. Two replicas, the second skipping a layer: only its report names it, with that layer's
    tensors; after an optimizer step the second replica's layer is stale and the first is fine."""
    healthy, broken = H.Rollout(toy_model_path, seed=5), H.Rollout(toy_model_path, seed=6)
    dummy = {n: p.detach().clone() for n, p in broken.params.items()}
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        first = _disaggregated_sync(engine, [healthy, broken], 0, [None, SKIPPED])
        skipped = [n for n in broken.streamed if n.startswith(SKIPPED)]
        assert len(first) == 2 and len(skipped) >= 9
        assert first[0].causes == [] and set(first[0].statuses.values()) == {"ok"}
        assert set(first[0].statuses) == set(healthy.streamed)
        assert [c.code for c in first[1].causes] == ["sync-tensors-differ"]
        assert set(first[1].causes[0].tensors) == set(skipped)
        assert all(torch.equal(broken.params[n].detach(), dummy[n]) for n in skipped)  # the reference: never loaded
        metrics, _ = _window(engine, 1)
        assert metrics["tim/cause/named"] == 1.0 and metrics["tim/cause/sync_bad_tensors"] == len(skipped)
        assert metrics["tim/cause/sync_checked_tensors"] == len(healthy.streamed)  # the most of any replica

        _train(engine, seed=7)
        second = _disaggregated_sync(engine, [healthy, broken], 1, [None, SKIPPED])
        assert second[0].causes == [] and [c.code for c in second[1].causes] == ["sync-tensors-stale"]
        assert second[1].names("stale") == skipped
        # the colocated check's own state is apart: its next sync compares against its own earlier reads
        assert engine.tim_sync_watch.check.reports == []
    finally:
        engine.tim_deconfigure()


def test_a_disaggregated_sync_that_cannot_be_read_is_counted_and_a_skipped_one_reads_nothing(engine, toy_model_path):
    rollout = H.Rollout(toy_model_path, seed=8)
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "sync_check": {"every_n_syncs": 2}}))
    try:
        async def failing(requests):
            raise ConnectionError("the replica went away")

        # checked, but no replica answers (verl's own server; a failed read): counted, nothing named, no raise
        assert _disaggregated_sync(engine, [rollout, rollout], 0, [None, None], reads=[None, failing]) == []
        # not checked (every_n_syncs=2): the stream passes unsampled and the reads do nothing, on every rank
        calls = []

        async def counting(requests):
            calls.append(requests)
            return []

        assert _disaggregated_sync(engine, [rollout], 1, [None], reads=[counting]) == [] and calls == []
        assert engine.tim_sync_watch.sent_record is None
        metrics, _ = _window(engine, 2)
        assert metrics["tim/diag/sync_check_unavailable"] == 1.0 and metrics["tim/cause/named"] == 0.0
        # checked again at the third sync, and read
        reports = _disaggregated_sync(engine, [rollout], 2, [None])
        assert len(reports) == 1 and reports[0].causes == [] and set(reports[0].statuses.values()) == {"ok"}
    finally:
        engine.tim_deconfigure()


def test_the_sync_settings_are_the_core_configs():
    from tim_plugins.causes import CauseConfig
    from tim_plugins.weight_sync import SyncCheckConfig

    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "causes": {"confident_gap": 3.0},
                                   "sync_check": {"elements_per_tensor": 8}})
    assert tim.causes.config() == CauseConfig(confident_gap=3.0)
    assert tim.sync_check.config() == SyncCheckConfig(elements_per_tensor=8)
    assert tim.pipeline_config().causes == CauseConfig(confident_gap=3.0)
    assert TIMVerlConfig.from_node({"monitor": {"enable": True}, "causes": {"enable": False}}).pipeline_config() \
        .causes is None
    assert TIMVerlConfig.from_node(tim.to_dict()) == tim  # what the driver hands the workers reads back the same
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(type(tim.sync_check))}
    assert helps["every_n_syncs"] == SyncCheckConfig.__dataclass_fields__["every_n_syncs"].metadata["help"]
    with pytest.raises(ValueError, match=r"tim.sync_check: SyncCheckConfig.every_n_syncs=0 is invalid: must be an "
                                         r"integer >= 1\. Fix: \+\+tim.sync_check.<option>=<value>"):
        TIMVerlConfig.from_node({"sync_check": {"every_n_syncs": 0}})
    with pytest.raises(ValueError, match=r"tim.causes.confident_p='high' is invalid: must be a number"):
        TIMVerlConfig.from_node({"causes": {"confident_p": "high"}})


def test_a_tensor_parallel_rollouts_sync_check_samples_every_shard(engine, toy_model_path):
    """The actor's sync check is sized to the rollout's ``tensor_model_parallel_size`` (the driver's
    ``ActorContext.rollout_tp``): at 8 ranks a matrix's 4 default columns would leave half of each row-parallel
    weight's shards (o_proj, down_proj: split by columns) without a sampled element, so a fault in those shards could
    not be seen. Reference: each sampled column's shard, from the column index and an equal split of the width."""
    from tim_plugins.integrations.verl.config import ActorContext
    from tim_plugins.weight_sync import SyncCheckConfig, sample_index

    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}})
    other = H.build_engine(toy_model_path)  # its own: the module's engine holds what the tests above configured
    other.tim_configure(tim, context=ActorContext())
    assert other._tim_sync.check.config == SyncCheckConfig()  # a rollout of one rank: the defaults
    for tp, columns in ((2, 4), (4, 4), (8, 8), (16, 16)):
        other.tim_configure(tim, context=ActorContext(rollout_tp=tp))
        config = other._tim_sync.check.config
        assert config.columns_per_tensor == columns
        assert config.elements_per_tensor >= SyncCheckConfig().elements_per_tensor
        width = 4864  # a 0.5B model's down_proj (hidden x intermediate): row-parallel, split by columns
        index = sample_index("model.layers.0.mlp.down_proj.weight", (896, width), config.elements_per_tensor,
                             config.columns_per_tensor, config.seed)
        shards = {int(c) * tp // width for c in index[:, 1]}
        assert shards == set(range(tp)), (tp, sorted(shards))


def test_the_features_hold_and_a_moved_hook_switches_off_the_check_alone(engine, monkeypatch):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.capabilities import check
    from tim_plugins.integrations.verl import features
    from tim_plugins.integrations.verl.sources import VERL_SOURCES

    for feature in (features.SYNC_CHECK, features.SYNC_CHECK_DISAGGREGATED, features.ROLLOUT_SYNC_READS):
        assert check(feature).available, check(feature).warning()
        assert all((h.module, h.qualname) in VERL_SOURCES for h in feature.hooks)
    # the actor side is checked in the workers with the others; the server side where the rollout is built
    assert features.SYNC_CHECK in features.FEATURES and features.ROLLOUT_SYNC_READS not in features.FEATURES

    async def update_weights(self, global_steps=None):  # the mode argument gone
        raise AssertionError("never called")

    monkeypatch.setattr(ActorRolloutRefWorker, "update_weights", update_weights)
    status = check(features.SYNC_CHECK)
    assert not status.available and "takes no mode" in status.reason
    # the disaggregated half reads the same method: off with it
    assert [s.feature.name for s in features.verl_features() if not s.available] == [
        "verl_sync_check", "verl_sync_check_disaggregated"]
    # what the worker then hands the engine: the check off, the monitor and the causes of the stream on
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}), features_off=("verl_sync_check",))
    try:
        assert engine.tim_sync_watch is None and engine._tim_pipeline.causes is not None
        metrics, _ = _window(engine, 1)
        assert metrics["tim/diag/feature_off/verl_sync_check"] == 1.0 and metrics["tim/cause/named"] == 0.0
    finally:
        engine.tim_deconfigure()


def test_a_moved_checkpoint_manager_switches_off_the_disaggregated_half_alone(monkeypatch):
    """The driver's half reads the manager's update_weights as verl 0.9.1 wrote it; a manager that no longer waits
    for its replicas there switches off only that half (the colocated check's hooks still hold)."""
    from verl.checkpoint_engine import CheckpointEngineManager

    from tim_plugins.capabilities import check
    from tim_plugins.integrations.verl import features

    async def update_weights(self, global_steps: int = None):  # sends, and leaves the replicas to load later
        ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend))  # noqa: F821

    monkeypatch.setattr(CheckpointEngineManager, "update_weights", update_weights)
    status = check(features.SYNC_CHECK_DISAGGREGATED)
    assert not status.available and "CheckpointEngineManager.update_weights" in status.reason, status.reason
    assert check(features.SYNC_CHECK).available
    assert [s.feature.name for s in features.verl_features() if not s.available] == ["verl_sync_check_disaggregated"]


def test_every_cause_has_its_fix_in_verls_words():
    from tim_plugins.causes import CAUSES, cause_fix
    from tim_plugins.integrations.verl.fixes import CAUSE_FIXES

    assert set(CAUSE_FIXES) == set(CAUSES)
    for code in CAUSES:
        assert cause_fix(code, "verl") == CAUSE_FIXES[code]


def test_a_tensor_the_actors_export_leaves_out_is_named_stale(engine, toy_model_path, monkeypatch):
    """verl's FSDP export (``get_per_tensor_param``) stops streaming one layer after the first sync: the check never
    samples it, but the earlier checked sync streamed it, so the later sync expects it, and after an optimizer step
    the engine's copy (the first sync's values; the actor's moved) is named stale, with exactly that layer's tensors,
    each marked never sent. The reference: the names the test's export dropped, and the copy's tensors compared whole
    with the actor's."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    rollout = H.Rollout(toy_model_path, seed=3)
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        report = H.checked_sync(engine, rollout, 0)
        assert report.causes == [] and set(report.statuses.values()) == {"ok"}
        first = list(rollout.streamed)
        layer = [n for n in first if n.startswith(SKIPPED)]
        synced = {n: rollout.params[n].detach().clone() for n in layer}
        export = FSDPEngine.get_per_tensor_param

        def leaving_out(self, *args, **kwargs):
            weights, peft = export(self, *args, **kwargs)
            return ((n, t) for n, t in weights if not n.startswith(SKIPPED)), peft

        monkeypatch.setattr(FSDPEngine, "get_per_tensor_param", leaving_out)
        _train(engine, seed=6)
        report = H.checked_sync(engine, rollout, 1)
        actor = {n: t for n, t in export(engine)[0] if n.startswith(SKIPPED)}
        H.assert_left_out_layer_named_stale(report, rollout, first, layer, synced, actor)
    finally:
        engine.tim_deconfigure()
