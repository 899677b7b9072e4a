"""The weight-sync check on verl's Megatron actor engine at TP1 (this process): the engine's own
``get_per_tensor_param`` (mbridge's HF export, what verl's ``update_weights`` streams to the rollout) goes through the
tim engine's tee into a transformers copy of the tiny Qwen2 in bf16 standing for the rollout engine (random weights,
as verl's vLLM rollout starts on ``load_format=dummy``), read with the vLLM reader and the cross-process protocol,
through the same ``SyncWatch.around`` verl's worker runs (``tests/verl_suite/harness.py`` ``Rollout`` /
``checked_sync``). A layer the "rollout" skips is named at the first sync with exactly that layer's tensors; a
fault-free sync after an optimizer step names nothing; a layer the export stops streaming after the first checked sync
is named stale. References: the names the test skipped, and the copy's
tensors compared whole with what the engine exported. verl's main_ppo with a PP2 Megatron actor and vLLM rollout
servers checks every sync of a fault-free run (``test_megatron_main_ppo.py``: every tensor compared, no cause);
a broken sync through main_ppo is run with the FSDP actor only (``tests/verl_suite/test_verl_sync_check_main_ppo.py``).
"""

from __future__ import annotations

import torch

import harness as H
from tim_plugins.integrations.verl.config import TIMVerlConfig

SKIPPED = "model.layers.1."


def _exported(engine) -> dict:
    return {n: t.detach().clone() for n, t in engine.get_per_tensor_param()[0]}


def test_a_skipped_layer_is_named_and_a_fault_free_sync_names_nothing(one_rank, tiny_qwen2):
    engine = H.build_engine(tiny_qwen2, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        rollout = H.Rollout(tiny_qwen2, dtype=torch.bfloat16)
        with torch.no_grad():  # as vLLM's dummy loader: every tensor random (from_config's norms are ones, biases 0)
            for param in rollout.params.values():
                param.uniform_(-1e-3, 1e-3)
        dummy = {n: p.detach().clone() for n, p in rollout.params.items()}
        report = H.checked_sync(engine, rollout, 0, skip=SKIPPED)
        skipped = [n for n in rollout.streamed if n.startswith(SKIPPED)]
        assert len(skipped) >= 9 and set(report.statuses) == set(rollout.streamed)
        exported = _exported(engine)
        assert set(exported) == set(rollout.streamed)
        for name in rollout.streamed:  # the reference: what the copy holds, whole
            want = dummy[name] if name in skipped else exported[name].to(torch.bfloat16)
            assert torch.equal(rollout.params[name].detach(), want), name
        assert {n for n, s in report.statuses.items() if s != "ok"} == set(skipped)
        assert [c.code for c in report.causes] == ["sync-tensors-differ"]
        assert set(report.causes[0].tensors) == set(skipped)

        td, _ = H.make_batch(H.VOCAB, response=6, seed=3, rollout_noise=5.0)
        H.train_step(engine, td, H.old_log_probs_padded(H.infer(engine, td), td))
        moved = _exported(engine)
        assert any(not torch.equal(moved[n], exported[n]) for n in moved)  # the optimizer stepped
        report = H.checked_sync(engine, rollout, 1)
        assert report.causes == [] and set(report.statuses.values()) == {"ok"}
        assert set(report.statuses) == set(moved)
    finally:
        engine.tim_deconfigure()


def test_a_moved_stream_switches_off_the_check_alone(one_rank, tiny_qwen2, monkeypatch, capsys):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    engine = H.build_engine(tiny_qwen2)
    original = MegatronEngine.get_per_tensor_param

    # base_sync_done gone (verl's function kept as a default, not a closure: a closure is a wrapper the capability
    # checks look through, and would read verl's own parameters)
    def get_per_tensor_param(self, layered_summon=False, _verl=original):
        return _verl(self, layered_summon=layered_summon)

    monkeypatch.setattr(MegatronEngine, "get_per_tensor_param", get_per_tensor_param)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        assert engine.tim_sync_watch is None and engine._tim_pipeline.causes is not None
        assert "verl_megatron_sync_check" in capsys.readouterr().err
        weights, peft = engine.get_per_tensor_param()  # verl's stream, untouched
        assert peft is None and len(dict(weights)) > 0
    finally:
        engine.tim_deconfigure()


def test_a_tensor_the_bridge_export_leaves_out_is_named_stale(one_rank, tiny_qwen2, monkeypatch):
    """The Megatron engine's export (mbridge's HF names through ``get_per_tensor_param``) stops streaming one layer
    after the first sync, as the FSDP test in ``tests/verl_suite/test_verl_sync_check.py`` does with verl's FSDP
    export: the earlier checked sync streamed the layer, so the later one expects it, and after an optimizer step the
    copy's tensors (the first sync's values; the engine's moved) are named stale, exactly that layer's, each marked
    never sent. The reference: the names the test's export dropped, and the copy's tensors compared whole with the
    engine's export."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    engine = H.build_engine(tiny_qwen2, lr=1e-2)
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        rollout = H.Rollout(tiny_qwen2, dtype=torch.bfloat16)
        report = H.checked_sync(engine, rollout, 0)
        assert report.causes == [] and set(report.statuses.values()) == {"ok"}
        first = list(rollout.streamed)
        layer = [n for n in first if n.startswith(SKIPPED)]
        synced = {n: rollout.params[n].detach().clone() for n in layer}
        export = MegatronEngine.get_per_tensor_param

        # the tim engine's tee calls the class's export through super() (the attach-time check read verl's own at
        # configure): verl's signature, leaving the layer out
        def get_per_tensor_param(self, base_sync_done=False, _verl=export, **kwargs):
            weights, peft = _verl(self, base_sync_done=base_sync_done, **kwargs)
            return ((n, t) for n, t in weights if not n.startswith(SKIPPED)), peft

        monkeypatch.setattr(MegatronEngine, "get_per_tensor_param", get_per_tensor_param)
        td, _ = H.make_batch(H.VOCAB, response=6, seed=3, rollout_noise=5.0)
        H.train_step(engine, td, H.old_log_probs_padded(H.infer(engine, td), td))
        report = H.checked_sync(engine, rollout, 1)
        actor = {n: t for n, t in export(engine)[0] if n.startswith(SKIPPED)}
        H.assert_left_out_layer_named_stale(report, rollout, first, layer, synced, actor)
    finally:
        engine.tim_deconfigure()
