"""The weight-sync check's core (``tim_plugins.weight_sync``) against an engine held as plain tensors here: the
reference is the fault the test itself injects (which tensors it skipped, what it rounded them through) and the
engine's tensors read whole, never the check's own sample. The vLLM reader is tested on a live engine in
``test_vllm_weights.py``; the whole path through TRL in ``test_trl_vllm_sync_check.py``."""

from __future__ import annotations

import math

import pytest
import torch

from tim_plugins.weight_sync import (EngineRead, SyncCheck, SyncCheckConfig, coarser_dtypes, ravel,
                                     sample_index)

FP8 = torch.float8_e4m3fn


class DictEngine:
    """An engine that holds one tensor per sent name (in ``dtype`` unless stored otherwise) and reads it directly."""

    def __init__(self, dtype: torch.dtype, weights: dict):
        self.dtype = dtype
        self.held = {n: t.to(dtype) for n, t in weights.items()}
        self.unreadable: set[str] = set()

    def load(self, weights, *, skip=(), through: dict | None = None, store: dict | None = None):
        for name, t in weights:
            if name in skip:
                continue
            if through and name in through:
                t = t.to(through[name])
            self.held[name] = t.to((store or {}).get(name, self.dtype))

    def read(self, name, shape, index):
        if name in self.unreadable:
            return None
        if name not in self.held:
            return EngineRead(missing=True)
        t = self.held[name]
        return EngineRead(values=t[tuple(index.T)].double() if t.dim() else t.reshape(1).double(), dtype=t.dtype)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (97, 24), "model.layers.0.q.weight": (24, 24),
              "model.layers.0.q.bias": (24,), "model.layers.0.norm.weight": (24,),
              "model.layers.1.q.weight": (24, 24), "model.layers.1.mlp.weight": (48, 24), "model.scale": (),
              "model.conv.weight": (6, 4, 3)}
    return {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}


def _step(weights, size=1e-2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: t + size * torch.randn(t.shape, generator=g) for n, t in weights.items()}


def _sync(check, engine, weights, step, **fault):
    record = check.begin(step)
    engine.load(record.observing(list(weights.items())), **fault)
    return check.finish(record, engine)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (383, 64), (96,), (4864, 896)])
def test_every_tensor_parallel_shard_holds_sampled_elements(shape, tp):
    """A rank that checks only its own shard (TRL colocate, vllm_tensor_parallel_size > 1) has elements to compare
    in every tensor: up to 4 (columns_per_tensor) column shards of a row-parallel weight, 16 (64 elements / 4
    columns) row shards of a column-parallel one, and the vocabulary's row shards. Reference: the shards' bounds,
    equal splits of each dimension. Without the bands, 4 random columns of 128 all fall in one half for some
    names and seeds (model.layers.*.mlp.down_proj.weight of the toy model did: rank 0 of TP=2 read nothing)."""
    for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight", "w"):
        for seed in range(8):
            index = sample_index(name, shape, 64, 4, seed=seed)
            for d, size in enumerate(shape):
                for r in range(tp):
                    lo, hi = r * size // tp, (r + 1) * size // tp
                    assert bool(((index[:, d] >= lo) & (index[:, d] < hi)).any()), (name, seed, d, r)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
def test_a_config_for_tensor_parallel_samples_every_shard(tp):
    """``SyncCheckConfig.for_tensor_parallel(tp)``: every row shard and every column shard of TP ranks holds sampled
    elements (reference: the shards' bounds), the default unchanged up to 4 ranks (the packed reader pays per
    column), and the other settings kept."""
    base = SyncCheckConfig(every_n_syncs=3, seed=5)
    config = base.for_tensor_parallel(tp)
    # (columns, elements): 4 x 16 rows up to 4 ranks; 3 ranks: 6 x 12 rows; 8: 8 x 8; 16: 16 x 16
    expected = {1: (4, 64), 2: (4, 64), 3: (6, 72), 4: (4, 64), 8: (8, 64), 16: (16, 256)}[tp]
    assert (config.columns_per_tensor, config.elements_per_tensor) == expected
    assert (config is base) == (expected == (4, 64))
    assert (config.every_n_syncs, config.seed) == (3, 5)
    for shape in [(4864, 896), (896, 4864), (151936, 896), (896,)]:
        index = sample_index("model.layers.3.mlp.down_proj.weight", shape, config.elements_per_tensor,
                             config.columns_per_tensor, seed=config.seed)
        for d, size in enumerate(shape):
            for r in range(tp):
                lo, hi = r * size // tp, (r + 1) * size // tp
                assert bool(((index[:, d] >= lo) & (index[:, d] < hi)).any()), (shape, d, r)


@pytest.mark.parametrize("shape", [(7,), (5, 3), (1000, 7), (4, 5, 6), (3,), (), (0, 4), (2, 1)])
def test_sample_index_is_fixed_in_range_and_distinct(shape):
    a = sample_index("w", shape, 64, 4)
    assert torch.equal(a, sample_index("w", shape, 64, 4))
    assert a.shape[1] == len(shape) and a.dtype == torch.long
    if math.prod(shape) == 0:
        assert a.shape[0] == 0
        return
    for d, size in enumerate(shape):
        assert int(a[:, d].min()) >= 0 and int(a[:, d].max()) < size
    assert len({tuple(r) for r in a.tolist()}) == a.shape[0]  # no element twice
    if len(shape) >= 2:  # a grid of at most 4 columns (a higher tensor: columns of [shape[0], rest])
        flat_cols = {tuple(r[1:]) for r in a.tolist()}
        assert len(flat_cols) <= 4
    assert not torch.equal(sample_index("w", (1000, 7), 64, 4), sample_index("v", (1000, 7), 64, 4))


@pytest.mark.parametrize("shape", [(7,), (5, 3), (1000, 7), (4, 5, 6), (), (0, 4), (2, 1), (3, 1, 2, 5)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_the_flat_read_is_the_elements_at_the_index(shape, layout):
    # reference: the tensor indexed per dimension at the sampled [K, ndim] index (what the index means)
    g = torch.Generator().manual_seed(len(shape))
    if layout == "transposed" and len(shape) >= 2:  # a non-contiguous tensor of the same logical shape
        t = torch.randn(shape[::-1], generator=g).permute(*range(len(shape) - 1, -1, -1))
    elif layout == "sliced" and len(shape) >= 1:
        t = torch.randn((shape[0] * 2, *shape[1:]), generator=g)[::2]
    else:
        t = torch.randn(shape, generator=g)
    assert tuple(t.shape) == shape
    index = sample_index("w", shape, 64, 4)
    expected = t.reshape(1) if not shape else t[tuple(index.T)]
    assert torch.equal(torch.take(t, ravel(index, shape)), expected)


def test_coarser_dtypes():
    assert coarser_dtypes(torch.float32) == (torch.float16, torch.bfloat16, FP8, torch.float8_e5m2)
    assert coarser_dtypes(torch.bfloat16) == (FP8, torch.float8_e5m2)
    assert coarser_dtypes(torch.int8) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fault_free_syncs_name_nothing(dtype):
    weights = _model()
    engine, check = DictEngine(dtype, weights), SyncCheck()
    for step in range(4):
        report = _sync(check, engine, weights, step)
        assert report.causes == [] and report.bad_tensors == 0 and report.checked_tensors == len(weights)
        weights = _step(weights, seed=step + 1)


def _two_syncs(dtype=torch.bfloat16, size=1e-2, **fault):
    """A fault-free sync, an optimizer step, then a sync with ``fault``: the second report."""
    weights = _model()
    engine, check = DictEngine(dtype, weights), SyncCheck()
    _sync(check, engine, weights, 0)
    moved = _step(weights, size)
    return _sync(check, engine, moved, 1, **fault), engine, moved, weights


def test_noop_sync_names_every_moved_tensor_once():
    report, engine, moved, before = _two_syncs(skip=set(_model()))
    (cause,) = report.causes
    assert cause.code == "sync-noop" and cause.step == 1
    # reference: the tensors whose engine-dtype values the step changed (a scalar or a small norm may not move)
    really_moved = {n for n in moved if not torch.equal(moved[n].to(torch.bfloat16), before[n].to(torch.bfloat16))}
    assert set(cause.tensors) == really_moved and len(really_moved) >= len(moved) - 1


def test_a_skipped_layer_is_named_with_exactly_its_tensors():
    layer = {n for n in _model() if n.startswith("model.layers.1.")}
    report, *_ = _two_syncs(skip=layer)
    (cause,) = report.causes
    assert cause.code == "sync-tensors-stale" and set(cause.tensors) == layer
    assert "model.layers.1.* (2 tensors)" in cause.message


@pytest.mark.parametrize("engine_dtype,through", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.bfloat16, FP8), (torch.float16, torch.float8_e5m2)])
def test_a_tensor_written_through_a_coarser_dtype_is_named_with_that_dtype(engine_dtype, through):
    name = "model.layers.0.q.weight"
    report, *_ = _two_syncs(engine_dtype, through={name: through})
    (cause,) = report.causes
    assert cause.code == "sync-precision" and cause.tensors == (name,)
    assert f"rounded through {str(through).replace('torch.', '')}" in cause.message


def test_a_tensor_stored_coarser_than_configured_is_named_even_with_matching_values():
    name = "model.layers.1.mlp.weight"
    report, engine, *_ = _two_syncs(torch.float32, store={name: torch.bfloat16})
    assert engine.held[name].dtype == torch.bfloat16
    (cause,) = report.causes
    assert cause.code == "sync-precision" and cause.tensors == (name,) and "stored as bfloat16" in cause.message


def test_a_finer_copy_of_the_configured_rounding_is_no_fault():
    """vLLM's CPU kernels keep some biases in fp32 after loading them in the engine's bf16: as good as the cast."""
    name = "model.layers.0.q.bias"
    report, engine, *_ = _two_syncs(torch.bfloat16, through={name: torch.bfloat16}, store={name: torch.float32})
    assert engine.held[name].dtype == torch.float32
    assert report.causes == [] and report.statuses[name] == "ok"


def test_missing_unreadable_and_differing_tensors():
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    _sync(check, engine, weights, 0)
    del engine.held["model.layers.0.norm.weight"]
    engine.unreadable.add("model.conv.weight")
    moved = _step(weights)
    record = check.begin(1)
    engine.load(record.observing(list(moved.items())), skip={"model.layers.0.norm.weight"})
    engine.held["model.layers.1.q.weight"] = -engine.held["model.layers.1.q.weight"]  # neither new nor old
    report = check.finish(record, engine)
    assert {c.code: c.tensors for c in report.causes} == {
        "sync-tensors-missing": ("model.layers.0.norm.weight",),
        "sync-tensors-differ": ("model.layers.1.q.weight",)}
    assert report.statuses["model.conv.weight"] == "unread"  # counted apart, never named
    assert report.checked_tensors == len(weights) - 1 and report.bad_tensors == 2


def test_an_update_below_the_engine_precision_is_no_fault():
    """A stale engine is only visible once the trainer's update moves a sampled element in the engine's dtype."""
    report, *_ = _two_syncs(torch.bfloat16, size=1e-9, skip=set(_model()))
    assert report.causes == [] and report.bad_tensors == 0


def test_a_sync_that_streams_nothing_is_compared_from_the_trainers_tensors():
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    for step, sent in ((0, weights), (1, {})):
        record = check.begin(step)
        record.expect(weights)
        engine.load(record.observing(list(sent.items())))
        report = check.finish(record, engine, local=weights.get)
        weights = _step(weights, seed=step + 3) if step == 0 else weights
    assert report.not_sent == list(weights)
    assert [c.code for c in report.causes] == ["sync-noop"]
    assert "never sent" in report.causes[0].message


def test_expected_names_without_a_trainer_value_left_out_of_a_sync_are_stale_after_a_step():
    """Sharded parameters with their names expected (TRL under FSDP: no trainer value to compare, ``local`` gives
    None): a sync that streams all but three names them stale at every sync after an optimizer step, "never sent",
    with the engine's values the previous ones (reference: the names left out); at step 0 (the engine loaded the same
    initial weights) nothing is named; a sync that streams nothing names every expected tensor as a no-op."""
    weights = _model()
    left_out = sorted(weights)[:3]
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()

    def sync(step, sent):
        record = check.begin(step)
        record.expect(weights)
        engine.load(record.observing(list(sent.items())))
        return check.finish(record, engine, local=lambda name: None)

    for step in range(3):
        report = sync(step, {n: t for n, t in weights.items() if n not in left_out})
        assert sorted(report.not_sent) == left_out
        if step == 0:
            assert report.causes == [] and report.bad_tensors == 0
            continue
        (cause,) = report.causes
        assert (cause.code, cause.step, sorted(cause.tensors)) == ("sync-tensors-stale", step, left_out)
        assert "(3 of them never sent)" in cause.message and report.bad_tensors == 3
        assert {report.statuses[n] for n in left_out} == {"stale"}
        assert all(report.statuses[n] == "ok" for n in weights if n not in left_out)
        weights = _step(weights, seed=step)
    (cause,) = sync(3, {}).causes
    assert (cause.code, sorted(cause.tensors)) == ("sync-noop", sorted(weights))
    assert cause.evidence == {"sent": 0, "stale": len(weights)} and "nothing was sent" in cause.message


def test_without_an_expectation_a_sync_that_sends_nothing_after_a_step_is_a_noop():
    """Sharded parameters (no ``expect``): nothing to compare from, so nothing sent at all after an optimizer step,
    where the previous checked sync sent tensors, is the no-op; the same at the step already synced, or before any
    sync sent, is not."""
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()

    def sync(step, sent):
        record = check.begin(step)
        engine.load(record.observing(list(sent.items())))
        return check.finish(record, engine)

    assert sync(0, {}).causes == []  # nothing sent before: nothing to miss
    assert sync(0, weights).causes == []
    assert sync(0, {}).causes == []  # no optimizer step since
    (cause,) = sync(2, {}).causes
    assert cause.code == "sync-noop" and cause.step == 2 and set(cause.tensors) == set(weights)
    assert cause.evidence == {"sent": 0, "previously_sent": len(weights)}
    assert "nothing was sent; the checked sync after step 0 sent 8 tensors" in cause.message
    assert sync(3, _step(weights)).causes == []  # sends again: compared as usual


def test_a_lasting_fault_on_a_tensor_the_trainer_leaves_alone_keeps_its_name():
    """A tensor the trainer does not change (frozen, lr 0) that the engine holds written through bf16 is named
    ``sync-precision`` at every check, not ``stale`` from the second on: stale needs the trainer's values to have
    moved while the engine's did not. The trained tensors (moved, same fault) stay precision too; a really stale
    tensor (skipped) is stale."""
    weights = _model()
    frozen = "model.layers.0.norm.weight"
    engine, check = DictEngine(torch.float32, weights), SyncCheck()
    skipped = "model.layers.1.mlp.weight"
    for step in range(4):
        report = _sync(check, engine, weights, step, through={n: torch.bfloat16 for n in weights if n != "model.scale"},
                       skip={skipped} if step >= 2 else set())
        bf16_exact = {n for n, t in weights.items() if torch.equal(t.to(torch.bfloat16).float(), t)}
        want = {n: "precision" for n in weights if n not in bf16_exact and n != "model.scale"}
        if step >= 2:
            want[skipped] = "stale"
        assert {n: st for n, st in report.statuses.items() if st != "ok"} == want, step
        assert report.statuses[frozen] == "precision"
        weights = {n: (t if n == frozen else t + 1e-2) for n, t in weights.items()}


def test_a_tensor_the_sync_never_reaches_and_the_trainer_leaves_alone_is_differ_then_stale():
    """The engine starts on other values (verl's dummy weights) and the sync skips one tensor the trainer does not
    train (a norm under LoRA): at the first check it holds neither the trainer's values nor a rounding of them
    (differs); from the second on it still holds what it held (stale), as a trained tensor the sync skips is."""
    weights = _model()
    norm, trained = "model.layers.1.q.weight", "model.layers.1.mlp.weight"
    engine, check = DictEngine(torch.bfloat16, _model(seed=5)), SyncCheck()
    for step in range(3):
        report = _sync(check, engine, weights, step, skip={norm, trained})
        bad = {n: st for n, st in report.statuses.items() if st != "ok"}
        assert bad == ({norm: "differs", trained: "differs"} if step == 0 else {norm: "stale", trained: "stale"})
        weights = {n: (t if n == norm else t + 1e-2) for n, t in weights.items()}


def test_reports_are_bounded_and_the_noop_rule_still_finds_the_last_sync_that_sent(monkeypatch):
    import tim_plugins.weight_sync as ws

    monkeypatch.setattr(ws, "REPORTS_KEPT", 3)
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    assert _sync(check, engine, weights, 0).causes == []
    for step in range(1, 6):  # syncs that send nothing at the step already synced: no cause, reports pile up
        record = check.begin(0)
        assert check.finish(record, engine).causes == []
    assert len(check.reports) == 3 and all(not r.statuses for r in check.reports)
    record = check.begin(7)
    (cause,) = check.finish(record, engine).causes
    assert cause.code == "sync-noop" and set(cause.tensors) == set(weights)
    assert "the checked sync after step 0 sent 8 tensors" in cause.message


def test_a_tensor_without_elements_is_ok_not_unread():
    weights = {**_model(), "model.empty.bias": torch.zeros(0), "model.empty.weight": torch.zeros(0, 24)}
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    for step in range(2):
        report = _sync(check, engine, weights, step)
        assert report.causes == [] and report.names("unread") == []
        assert report.statuses["model.empty.bias"] == report.statuses["model.empty.weight"] == "ok"
        weights = _step(weights, seed=step + 1)


def test_a_tensor_the_stream_cannot_sample_costs_the_check_not_the_sync():
    """Sampling runs inside the framework's sync (the stream it loads from): a tensor it cannot sample (here a
    sparse one: no ``torch.take``) is passed on as it is, the rest of the stream too, and ``finish`` refuses the
    check with that tensor's name (the adapters count ``sync_check_failed``)."""
    weights = _model()
    check = SyncCheck()
    record = check.begin(0)
    stream = [(n, t.to_sparse() if n == "model.layers.0.q.weight" else t) for n, t in weights.items()]
    passed = list(record.observing(stream))
    assert [n for n, _ in passed] == list(weights) and all(a is b for (_, a), (_, b) in zip(passed, stream))
    assert record.failed.startswith("model.layers.0.q.weight: NotImplementedError")
    with pytest.raises(RuntimeError, match="could not sample a sent tensor: model.layers.0.q.weight"):
        check.finish(record, DictEngine(torch.bfloat16, weights))


def test_every_n_syncs():
    check = SyncCheck(SyncCheckConfig(every_n_syncs=3))
    assert [check.begin(s) is not None for s in range(7)] == [True, False, False, True, False, False, True]


def test_an_engine_that_stops_following_between_two_checks_is_differ_then_noop():
    """every_n_syncs=3 and an engine that stops applying the sync after an unchecked sync (4): at the next check (6) it
    holds neither the trainer's values nor those of the last check (3), and the message says that a sync in between
    may be the last one applied; at the check after (9) nothing moved: sync-noop."""
    weights = _model()
    check, engine = SyncCheck(SyncCheckConfig(every_n_syncs=3)), DictEngine(torch.bfloat16, weights)
    causes = {}
    for sync in range(10):
        weights = _step(weights, seed=sync + 1)
        record = check.begin(sync)
        items = list(weights.items()) if record is None else list(record.observing(list(weights.items())))
        if sync < 5:
            engine.load(items)
        if record is not None:
            causes[sync] = [c for c in check.finish(record, engine).causes]
    assert causes[0] == causes[3] == []
    # every tensor but the scalar, whose bf16 value the small steps after sync 3 did not move (it reads stale)
    differ = next(c for c in causes[6] if c.code == "sync-tensors-differ")
    assert set(differ.tensors) == set(weights) - {"model.scale"}
    assert "neither the trainer's nor those at the last check, 3 syncs ago (an engine that stopped following at a " \
           "sync in between holds neither)" in differ.message
    assert [c.code for c in causes[9]] == ["sync-noop"]


def test_a_tensor_one_check_does_not_stream_keeps_its_previous_values():
    """A partial stream (a rank that streams part of the model, no expectation): a tensor left out of one check
    keeps the values of the check before, also when other tensors of its dtype were read; when it is streamed again
    and its sync did not apply, it is stale (its previous values), not "neither"."""
    weights = _model()
    check, engine = SyncCheck(), DictEngine(torch.bfloat16, weights)
    _sync(check, engine, weights, 1)
    weights = _step(weights, seed=2)
    part = {n: t for n, t in weights.items() if n != "model.layers.1.q.weight"}
    assert _sync(check, engine, part, 2).causes == []
    weights = _step(weights, seed=3)
    report = _sync(check, engine, weights, 3, skip={"model.layers.1.q.weight"})
    assert report.statuses["model.layers.1.q.weight"] == "stale"
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", ("model.layers.1.q.weight",))]
    assert ", 1 tensor still holds its previous values: " in report.causes[0].message


def test_messages_agree_with_the_count():
    """One tensor: "1 tensor still holds its"; several: "2 tensors still hold their"."""
    weights = _model()
    names = sorted(weights)[:2]
    for skipped in (names[:1], names):
        check, engine = SyncCheck(), DictEngine(torch.bfloat16, weights)
        _sync(check, engine, weights, 1)
        moved = _step(weights, seed=2)
        report = _sync(check, engine, moved, 2, skip=set(skipped))
        one = len(skipped) == 1
        expected = "1 tensor still holds its" if one else f"{len(skipped)} tensors still hold their"
        assert [c.code for c in report.causes] == ["sync-tensors-stale"], report.causes
        assert f", {expected} previous values: " in report.causes[0].message


class ShardEngine(DictEngine):
    """This rank holds the first half of each matrix's rows (``held``); what it reads for the rest is whatever its
    buffer has there."""

    def read(self, name, shape, index):
        out = super().read(name, shape, index)
        if out is not None and not out.missing and len(shape) == 2:
            out.held = index[:, 0] < shape[0] // 2
        return out


def test_elements_another_rank_holds_are_left_out():
    weights = _model()
    engine, check = ShardEngine(torch.bfloat16, weights), SyncCheck()
    _sync(check, engine, weights, 0)
    moved = _step(weights)
    record = check.begin(1)
    engine.load(record.observing(list(moved.items())))
    name = "model.layers.1.mlp.weight"  # rows this rank does not hold are garbage: not its business
    engine.held[name][24:] = float("nan")
    engine.held["model.layers.0.q.weight"][12:] = 7.0
    report = check.finish(record, engine)
    assert report.causes == [] and set(report.statuses.values()) == {"ok"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_engine_holding_nan_or_inf_is_named_with_the_count(bad):
    """A corrupted load (a NaN scale, an overflowing cast) leaves non-finite weights in the engine: named
    ``differs`` with how many sampled values are not finite, on a tensor held whole and on this rank's shard alike;
    a NaN the trainer itself holds and sent is carried over, not a sync fault."""
    weights = _model()
    engine, check = ShardEngine(torch.bfloat16, weights), SyncCheck()
    _sync(check, engine, weights, 0)
    moved = _step(weights)
    moved["model.layers.0.q.bias"][3] = float("nan")  # the trainer's own NaN, sent as it is
    record = check.begin(1)
    engine.load(record.observing(list(moved.items())))
    engine.held["model.layers.0.norm.weight"][:] = bad  # held whole
    engine.held["model.layers.1.mlp.weight"][:20] = bad  # rows this rank holds (of its 24)
    report = check.finish(record, engine)
    named = ("model.layers.0.norm.weight", "model.layers.1.mlp.weight")
    assert {c.code: c.tensors for c in report.causes} == {"sync-tensors-differ": named}
    assert {n for n, st in report.statuses.items() if st != "ok"} == set(named)
    assert 3 in check.index("model.layers.0.q.bias", (24,))[:, 0].tolist()  # the trainer's NaN was compared
    norm, rows = len(check.index(named[0], (24,))), check.index(named[1], (48, 24))[:, 0]
    assert 0 < int((rows < 20).sum()) < int((rows < 24).sum()) < len(rows)  # corrupt, held and elsewhere sampled
    for name, n_bad, n_held in ((named[0], norm, norm), (named[1], int((rows < 20).sum()), int((rows < 24).sum()))):
        assert report.detail[name] == (f"{n_bad} of {n_held} sampled values NaN or infinite in the engine, finite "
                                       "in the trainer"), name


class FP8Engine(DictEngine):
    """A per-tensor-scaled fp8 engine read dequantized, with the quantizer's half step as the bound."""

    def __init__(self, weights):
        super().__init__(torch.float32, weights)
        self.q = {}
        self.load(list(weights.items()))

    def load(self, weights, *, skip=(), **_):
        for name, t in weights:
            if name in skip:
                continue
            scale = t.abs().max().clamp(min=1e-12) / 448.0
            self.q[name] = ((t / scale).to(FP8), scale)

    def read(self, name, shape, index):
        q, scale = self.q[name]
        v = (q.float() * scale).double()
        v = v[tuple(index.T)] if v.dim() else v.reshape(1)
        tiny = torch.finfo(FP8).smallest_normal * 2.0 ** -3
        return EngineRead(values=v, dtype=FP8, quantized=True, atol=v.abs() * 2.0 ** -4 + float(scale) * tiny / 2)


def test_a_quantized_engine_is_compared_within_its_quantizers_bound():
    weights = _model()
    engine, check = FP8Engine(weights), SyncCheck()
    report = _sync(check, engine, weights, 0)
    assert report.causes == [] and report.bad_tensors == 0
    moved = _step(weights, size=0.05)  # several quantization steps
    report = _sync(check, engine, moved, 1, skip={"model.layers.1.q.weight"})
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", ("model.layers.1.q.weight",))]


def test_config_rules():
    for bad in ({"every_n_syncs": 0}, {"elements_per_tensor": True}, {"columns_per_tensor": 1.5}, {"seed": "0"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SyncCheckConfig(**bad)


def test_merged_parts_share_their_columns():
    """q / k / v (or gate / up) of one width sample the same columns, so a reader that reads columns through the
    merged layer's forward pays once; rows still depend on the name."""
    q = sample_index("model.layers.0.self_attn.q_proj.weight", (64, 32), 64, 4)
    k = sample_index("model.layers.0.self_attn.k_proj.weight", (16, 32), 64, 4)
    q1 = sample_index("model.layers.1.self_attn.q_proj.weight", (64, 32), 64, 4)
    assert set(q[:, 1].tolist()) == set(k[:, 1].tolist()) == set(q1[:, 1].tolist())
    assert set(q[:, 0].tolist()) != set(q1[:, 0].tolist())  # the rows follow the name
    assert any(sample_index("a", (64, 32), 64, 4, seed=s)[:, 1].unique().tolist() != q[:, 1].unique().tolist()
               for s in range(1, 4))


def test_a_tensor_whose_stored_dtype_changes_keeps_its_history():
    """A tensor read in another dtype than at the previous check moves to another comparison group: its previous
    values still come from the older group, so a later stale sync is still named stale (reference: the injected
    skip)."""
    name = "model.layers.1.mlp.weight"
    check, weights = SyncCheck(), _model()
    engine = DictEngine(torch.float32, weights)
    assert _sync(check, engine, weights, 0, store={name: torch.bfloat16}).causes[0].code == "sync-precision"
    moved = _step(weights)
    report = _sync(check, engine, moved, 1)  # stored in fp32 again: fine
    assert report.causes == [] and report.statuses[name] == "ok"
    again = _step(moved, seed=2)
    report = _sync(check, engine, again, 2, skip={name})
    (cause,) = report.causes
    assert cause.code == "sync-tensors-stale" and cause.tensors == (name,)


@pytest.mark.parametrize("blocks", [0, 1, 7])
def test_a_prefix_cache_left_after_the_sync_is_named_beside_the_weights(blocks):
    """``CachedPrefix``: a prefix cache the sync left holding blocks is ``sync-prefix-cache`` (the tokens they hold
    stated), whatever the weights; an emptied one names nothing; an unread one (None) is recorded as unread."""
    from tim_plugins.weight_sync import CachedPrefix

    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    record = check.begin(3)
    engine.load(record.observing(list(weights.items())))
    report = check.finish(record, engine, prefix=CachedPrefix(blocks, 16))
    assert report.bad_tensors == 0 and report.prefix_blocks == blocks == report.to_dict()["prefix_blocks"]
    if blocks == 0:
        assert report.causes == []
    else:
        (cause,) = report.causes
        assert cause.code == "sync-prefix-cache" and cause.step == 3 and cause.tensors == ()
        assert f"still holds {blocks} block{'s' if blocks > 1 else ''} ({16 * blocks} tokens)" in cause.message
        assert cause.evidence == {"blocks": blocks, "block_size": 16}
    # with a weight fault too: both named, the weights' first
    record = check.begin(4)
    engine.load(record.observing(list(_step(weights).items())), skip={"model.scale"})
    report = check.finish(record, engine, prefix=CachedPrefix(blocks, 16))
    assert [c.code for c in report.causes] == ["sync-tensors-stale"] + ["sync-prefix-cache"] * (blocks > 0)
    assert _sync(check, engine, weights, 5).prefix_blocks is None


def test_a_tensor_whose_read_raises_is_unread_and_the_others_are_still_compared():
    """One layout the reader cannot handle costs that tensor's comparison, not the check: the tensor is unread
    (counted), and a fault elsewhere in the same sync is still named with exactly its tensors."""
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    _sync(check, engine, weights, 0)
    broken = "model.conv.weight"
    plain_read = engine.read

    def read(name, shape, index):
        if name == broken:
            raise IndexError("index 29 is out of bounds for dimension 1 with size 16")
        return plain_read(name, shape, index)

    engine.read = read
    moved = _step(weights)
    report = _sync(check, engine, moved, 1, skip={"model.layers.1.mlp.weight"})
    assert report.statuses[broken] == "unread" and "IndexError" in report.detail[broken]
    assert {c.code: c.tensors for c in report.causes} == {"sync-tensors-stale": ("model.layers.1.mlp.weight",)}
    assert report.checked_tensors == len(weights) - 1


@pytest.mark.parametrize("every", [1, 3])
def test_a_tensor_left_at_its_init_without_history_is_not_named_precision(every):
    """A resumed run's first check has no history, and its engine may hold the initial weights: a norm still at 1.0
    and a zero bias equal the trainer's values rounded through fp8 (its spacing at 1.0 is 0.125), which tells
    nothing. Named ``differs``, with a message that says there was no previous check, not that the values are not
    the previous ones. Reference: the tensors the test skipped."""
    g = torch.Generator().manual_seed(3)
    init = {"model.norm.weight": torch.ones(64), "model.mlp.bias": torch.zeros(64),
            "model.mlp.weight": torch.randn(64, 64, generator=g) * 0.02}
    trained = {"model.norm.weight": 1 + 4e-3 * torch.randn(64, generator=g),
               "model.mlp.bias": 3e-4 * torch.randn(64, generator=g),
               "model.mlp.weight": init["model.mlp.weight"] + 1e-3}
    skipped = ("model.norm.weight", "model.mlp.bias")
    for name in skipped:  # the premise: fp8 rounding reproduces the stale values exactly
        assert torch.equal(trained[name].to(FP8).to(torch.bfloat16), init[name].to(torch.bfloat16))
    engine, check = DictEngine(torch.bfloat16, init), SyncCheck(SyncCheckConfig(every_n_syncs=every))
    check.load_state_dict({"syncs": 6})  # resumed: syncs carried, no history
    report = _sync(check, engine, trained, 1000, skip=set(skipped))
    assert report.statuses == {"model.norm.weight": "differs", "model.mlp.bias": "differs", "model.mlp.weight": "ok"}
    (cause,) = report.causes
    assert cause.code == "sync-tensors-differ" and cause.tensors == skipped
    assert "no previous check of them to compare with" in cause.message
    assert "neither the trainer's nor" not in cause.message and "syncs ago" not in cause.message


def test_after_a_resume_a_noop_sync_says_there_is_no_previous_check():
    """The history is not carried over a resume: the first check after it cannot tell a no-op sync from a corrupted
    one, and says so; with history the same sync is ``sync-noop``."""
    w0 = _model()
    w1, w2 = _step(w0), _step(_step(w0), seed=2)
    check, engine = SyncCheck(), DictEngine(torch.bfloat16, w0)
    _sync(check, engine, w1, 1)
    assert [c.code for c in _sync(check, engine, w2, 2, skip=set(w2)).causes] == ["sync-noop"]
    check, engine = SyncCheck(), DictEngine(torch.bfloat16, w0)
    _sync(check, engine, w1, 1)
    resumed = SyncCheck()
    resumed.load_state_dict(check.state_dict())
    report = _sync(resumed, engine, w2, 2, skip=set(w2))
    (cause,) = report.causes
    differ = {n for n in w2 if not torch.equal(w2[n].to(torch.bfloat16), w1[n].to(torch.bfloat16))}
    assert cause.code == "sync-tensors-differ" and set(cause.tensors) == differ
    assert "no previous check of them to compare with" in cause.message
    assert "neither the trainer's nor" not in cause.message


def test_a_differ_message_separates_tensors_with_and_without_history():
    weights = _model()
    engine, check = DictEngine(torch.bfloat16, weights), SyncCheck()
    first = {n: t for n, t in weights.items() if n != "model.conv.weight"}
    _sync(check, engine, first, 0)
    record = check.begin(1)
    engine.load(record.observing(list(weights.items())))
    engine.held["model.conv.weight"] = -engine.held["model.conv.weight"]  # first seen now
    engine.held["model.layers.1.q.weight"] = -engine.held["model.layers.1.q.weight"]  # seen before
    report = check.finish(record, engine)
    (cause,) = report.causes
    assert set(cause.tensors) == {"model.conv.weight", "model.layers.1.q.weight"}
    assert "no previous check of 1 of them to compare with" in cause.message
    assert "the others' are not their previous ones either" in cause.message


def test_an_fp16_engine_holding_inf_for_a_finite_trainer_value_is_named():
    """A cast to fp16 overflows beyond 65504: the engine computes with inf where the trainer holds a finite weight.
    The cast of the trainer's value is inf too, so the comparison reads the trainer's unrounded value. Reference: the
    engine's tensor read whole at the sampled elements."""
    name = "model.layers.0.mlp.down_proj.weight"
    w = {name: torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.02}
    w[name][::4, ::4] = 7.0e4
    engine, check = DictEngine(torch.float16, w), SyncCheck()
    report = _sync(check, engine, w, 0)
    index = check.index(name, (32, 32))
    n_inf = int(torch.isinf(engine.held[name][tuple(index.T)]).sum())
    assert 0 < n_inf < len(index)
    assert report.statuses == {name: "differs"}
    assert report.detail[name] == (f"{n_inf} of {len(index)} sampled values NaN or infinite in the engine, finite in "
                                   "the trainer (beyond float16's range: the cast overflows)")
    assert [c.code for c in report.causes] == ["sync-tensors-differ"]
    # a trainer value that is itself inf, sent as inf, is carried over
    w[name][::4, ::4] = float("inf")
    engine, check = DictEngine(torch.float16, w), SyncCheck()
    report = _sync(check, engine, w, 0)
    assert report.statuses == {name: "ok"} and report.causes == []


class PlanningEngine(DictEngine):
    def __init__(self, dtype, weights):
        super().__init__(dtype, weights)
        self.planned: list = []
        self.reads_before_plan = 0

    def plan_reads(self, shapes):
        self.planned.append(dict(shapes))

    def read(self, name, shape, index):
        if not self.planned:
            self.reads_before_plan += 1
        return super().read(name, shape, index)


def test_a_reader_that_plans_is_given_every_shape_before_the_first_read():
    weights = _model()
    engine, check = PlanningEngine(torch.bfloat16, weights), SyncCheck()
    report = _sync(check, engine, weights, 0)
    assert engine.reads_before_plan == 0
    assert engine.planned == [{n: tuple(t.shape) for n, t in weights.items()}]
    assert report.causes == [] and report.checked_tensors == len(weights)
