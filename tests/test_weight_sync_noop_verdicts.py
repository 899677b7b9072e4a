"""When a sync is named ``sync-noop`` (the engine changed nothing) and when it is not.

A no-op sync is named so also where some tensors' trainer values moved by less than the engine can hold: a finer
copy of the configured rounding (vLLM's CPU kernels keep some biases in fp32 after loading them in the engine's
bf16), a quantized layer (fp8: a move within the quantizer's grid leaves the same quantized values). The reference is
torch's own casts, computed here: which tensors the step moved as the engine holds them. And a sync whose stream the
check did not see is no no-op where the engine holds tensors the trainer moved: the engine did change."""

from __future__ import annotations

import torch

from tim_plugins.weight_sync import EngineRead, SyncCheck


class FinerCopyEngine:
    """Every tensor loaded in ``dtype``; those named ``*.bias`` then kept as fp32 copies of that rounding."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.held = dtype, {}

    def load(self, weights, skip=()):
        for name, t in weights:
            if name not in skip:
                t = t.to(self.dtype)
                self.held[name] = t.float() if name.endswith(".bias") else t

    def read(self, name, shape, index):
        t = self.held[name]
        return EngineRead(values=t[tuple(index.T)].double(), dtype=t.dtype)


def _sync(check, engine, weights, step, skip=()):
    record = check.begin(step)
    engine.load(record.observing(list(weights.items())), skip=skip)
    return check.finish(record, engine)


def test_a_noop_sync_is_named_noop_when_a_finer_copy_moved_only_below_the_configured_dtype():
    g = torch.Generator().manual_seed(0)
    before = {"layers.0.q.weight": torch.randn(32, 16, generator=g) * 0.05,
              "layers.0.q.bias": 0.5 + torch.arange(32) * 1e-3,
              "layers.1.q.weight": torch.randn(32, 16, generator=g) * 0.05}
    after = {n: t + 1e-2 * torch.randn(t.shape, generator=g) for n, t in before.items()}
    after["layers.0.q.bias"] = before["layers.0.q.bias"] + 1e-6  # a move the engine's bf16 cannot hold
    bf16 = torch.bfloat16
    # the reference: which tensors moved in the configured dtype (torch's cast), and that the bias moved in fp32
    moved = {n for n in before if not torch.equal(after[n].to(bf16), before[n].to(bf16))}
    assert moved == {"layers.0.q.weight", "layers.1.q.weight"}
    assert not torch.equal(after["layers.0.q.bias"].float(), before["layers.0.q.bias"].float())
    engine, check = FinerCopyEngine(bf16), SyncCheck()
    assert engine.dtype == bf16 and _sync(check, engine, before, 0).causes == []
    assert engine.held["layers.0.q.bias"].dtype == torch.float32
    report = _sync(check, engine, after, 1, skip=set(after))  # the sync writes nothing
    assert report.statuses == {"layers.0.q.weight": "stale", "layers.0.q.bias": "ok", "layers.1.q.weight": "stale"}
    assert [(c.code, set(c.tensors)) for c in report.causes] == [("sync-noop", moved)]


def test_a_finer_copy_that_moved_in_the_configured_dtype_still_keeps_a_partial_sync_stale():
    """The other side: where the finer copy was updated and its configured rounding moved, the sync was no no-op."""
    g = torch.Generator().manual_seed(1)
    before = {"layers.0.q.weight": torch.randn(32, 16, generator=g) * 0.05,
              "layers.0.q.bias": torch.randn(32, generator=g) * 0.05}
    after = {n: t + 1e-2 * torch.randn(t.shape, generator=g) for n, t in before.items()}
    engine, check = FinerCopyEngine(torch.bfloat16), SyncCheck()
    _sync(check, engine, before, 0)
    report = _sync(check, engine, after, 1, skip={"layers.0.q.weight"})
    assert report.statuses == {"layers.0.q.weight": "stale", "layers.0.q.bias": "ok"}
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", ("layers.0.q.weight",))]


FP8 = torch.float8_e4m3fn


class MixedFP8Engine:
    """bf16, with the ``*.proj.weight`` tensors held in fp8 with a static scale, read dequantized within the
    quantizer's half step (``EngineRead.quantized``)."""

    SCALE = 2.0 ** -10

    def __init__(self):
        self.dtype, self.held, self.scale = torch.bfloat16, {}, {}

    def load(self, weights, skip=()):
        for name, t in weights:
            if name in skip:
                continue
            if name.endswith(".proj.weight"):
                scale = self.scale[name] = self.SCALE
                self.held[name] = (t / scale).to(FP8)
            else:
                self.held[name] = t.to(self.dtype)

    def read(self, name, shape, index):
        t = self.held[name]
        if t.dtype != FP8:
            return EngineRead(values=t[tuple(index.T)].double(), dtype=t.dtype)
        scale = self.scale[name]
        v = t[tuple(index.T)].double() * scale
        tiny = torch.finfo(FP8).smallest_normal * 2.0 ** -3
        return EngineRead(values=v, dtype=FP8, quantized=True, atol=v.abs() * 2.0 ** -4 + scale * tiny / 2)


def test_a_noop_sync_is_named_noop_when_quantized_layers_moved_within_their_grid():
    g = torch.Generator().manual_seed(2)
    on_grid = lambda t: (t / MixedFP8Engine.SCALE).to(FP8).float() * MixedFP8Engine.SCALE  # noqa: E731
    before = {"layers.0.q.proj.weight": on_grid(torch.randn(32, 16, generator=g) * 0.05),
              "layers.0.o.proj.weight": on_grid(torch.randn(16, 32, generator=g) * 0.05),
              "layers.0.norm.weight": 1.0 + torch.randn(16, generator=g) * 0.05,
              "embed.weight": torch.randn(40, 16, generator=g) * 0.05}
    # the fp8 layers move by 0.1% of each value (a fraction of fp8's 1/16 relative half step), the others by 1e-2
    after = {n: t * 1.001 if ".proj." in n else t + 1e-2 * torch.randn(t.shape, generator=g)
             for n, t in before.items()}
    engine, check = MixedFP8Engine(), SyncCheck()
    assert _sync(check, engine, before, 0).causes == []
    # the reference (torch's casts): the fp8 layers' quantized values are the same before and after the step, the
    # bf16 tensors' values moved; and the step did move the fp8 layers' trainer values
    q = {n: (after[n] / engine.scale[n]).to(FP8) for n in engine.scale}
    assert all(torch.equal(q[n].float(), engine.held[n].float()) for n in q) and len(q) == 2
    assert all(not torch.equal(after[n], before[n]) for n in q)
    moved = {n for n in before if n not in q and not torch.equal(after[n].to(torch.bfloat16),
                                                                 before[n].to(torch.bfloat16))}
    assert moved == {"layers.0.norm.weight", "embed.weight"}
    report = _sync(check, engine, after, 1, skip=set(after))  # the sync writes nothing
    assert {n: s for n, s in report.statuses.items() if n in q} == {n: "ok" for n in q}
    assert [(c.code, set(c.tensors)) for c in report.causes] == [("sync-noop", moved)]


def test_a_quantized_layer_a_sync_updated_past_its_grid_keeps_a_partial_sync_stale():
    g = torch.Generator().manual_seed(3)
    before = {"layers.0.q.proj.weight": torch.randn(32, 16, generator=g) * 0.05,
              "embed.weight": torch.randn(40, 16, generator=g) * 0.05}
    after = {n: t + 1e-2 * torch.randn(t.shape, generator=g) for n, t in before.items()}
    engine, check = MixedFP8Engine(), SyncCheck()
    _sync(check, engine, before, 0)
    report = _sync(check, engine, after, 1, skip={"embed.weight"})
    assert report.statuses == {"layers.0.q.proj.weight": "ok", "embed.weight": "stale"}
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", ("embed.weight",))]


def test_a_sync_that_streams_nothing_but_updated_moved_tensors_is_no_noop():
    """Every name expected; nothing streamed through the check; the engine written all the same (out of the check's
    sight) for every tensor but one that has no trainer value to compare (a shard): the moved tensors it holds show
    the engine changed, so the one left out is stale, not the whole sync a no-op."""
    g = torch.Generator().manual_seed(4)
    before = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) * 0.05 for i in range(3)}
    after = {n: t + 1e-2 * torch.randn(t.shape, generator=g) for n, t in before.items()}
    shard = "layers.2.weight"
    engine, check = FinerCopyEngine(torch.bfloat16), SyncCheck()
    for step, weights in ((0, before), (1, after)):
        record = check.begin(step)
        record.expect(weights)
        engine.load([(n, t) for n, t in weights.items() if n != shard or step == 0])
        report = check.finish(record, engine, local=lambda n: None if n == shard else weights[n])
    # the reference: the engine holds the trainer's new values (torch's cast) for the two tensors that moved
    for n in ("layers.0.weight", "layers.1.weight"):
        assert torch.equal(engine.held[n], after[n].to(torch.bfloat16))
        assert not torch.equal(after[n].to(torch.bfloat16), before[n].to(torch.bfloat16))
    assert report.not_sent == list(after)
    assert report.statuses == {"layers.0.weight": "ok", "layers.1.weight": "ok", shard: "stale"}
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", (shard,))]
