"""The tim engine inside verl 0.9.1's real Megatron LM-head engine on CPU (gloo): TP1 in this process, TP2, DP2, PP2
and PP2 with two virtual stages per rank in two processes (``ranks.py``). verl's own dataclasses, batches
(``left_right_2_no_padding``), ``ppo_loss`` and rollout-correction k3 helper; the tiny Qwen2 of
``cpu_site/tiny_qwen2.py``.

* Unconfigured, the engine verl's registry picks (ours) is bit-identical to verl's ``MegatronEngineWithLMHead`` built
  alike: old log-probs, per-micro-batch losses, grad norms, LRs and every parameter shard after two PPO steps.
* With the monitor on, the old log-probs stay verl's bit for bit, and ``tim/*`` comes from the rank that holds
  Megatron's outputs (TP rank 0 of the last pipeline stage; ``{}`` on the others), merged exactly over the data-parallel
  group: equal to a float64 reference computed here from the log-probs verl returned and the batch's rollout
  log-probs, and to verl's own ``rollout_corr/k3_kl`` on the same tensors.
* With the safe vocabulary (min-p; min-p + the rollout's top-k and top-p), at TP1, TP2 and PP2: the old log-probs, the
  entropy and the training pass's log-probs equal a float64 reference computed here (``safe_vocab_reference``) from
  the logits the processor saw (all shards gathered), the mask verl's loss aggregates over is the response mask
  without the tokens outside the reference's safe set, and ``tim/safe_vocab/*`` equal their reference.
* With the safe vocabulary and verl's fused kernels (``use_fused_kernels``, packed thd batches), at TP1, TP2 and
  PP2: our head takes Megatron's output processor for every micro-batch, and the old log-probs, the entropy, the
  metrics, what verl's loss sees, its grad norm and every parameter after the step equal those of the same engine
  without fused kernels (whose log-probs go through the logits processor, tested against the float64 reference above).
* Where the batch carries the rollout engine's kept sets (``extra_fields``, as verl's V1 trainer hands them over),
  at TP1, TP2 and PP2: the old log-probs and the entropy are the float64 log-softmax over exactly those sets on the
  logits the processor saw (bshd), no token is a boundary token (the recomputed rule would cut most of them), verl's
  loss keeps every response token, and the packed thd layout with and without fused kernels gives the same.
* With virtual pipeline stages (PP2 x 2 chunks, the 4-layer model): unconfigured bit-identity, the monitor, the dump,
  the safe vocabulary and fused kernels, as at PP2.
"""

from __future__ import annotations

import math
import types

import pytest

import harness as H
import scenarios
import torch
from safe_vocab_reference import replay_reference, safe_vocab_reference

from tim_plugins.truncation import Truncation


@pytest.fixture(scope="module")
def tp1(one_rank, tiny_qwen2, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("dump_tp1")
    return {**scenarios.stock_vs_tim(tiny_qwen2, tp=1, dump_dir=str(dump_dir)), "dump_dir": dump_dir}


def _assert_stock(result):
    ours, stock = result["ours"], result["stock"]
    assert ours["class"] == "TIMMegatronEngineWithLMHead" and stock["class"] == "MegatronEngineWithLMHead"
    for o, s in zip(ours["steps"], stock["steps"], strict=True):
        assert torch.equal(o["old"], s["old"])
        assert o["pg_loss"] == s["pg_loss"] and o["grad_norm"] == s["grad_norm"] and o["lr"] == s["lr"]
    assert ours["params"].keys() == stock["params"].keys()
    assert all(torch.equal(ours["params"][k], stock["params"][k]) for k in ours["params"])


def test_registry_picks_the_tim_engine_for_megatron(one_rank):
    import tim_plugins.integrations.verl.plugin as plugin
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from tim_plugins.integrations.verl.megatron_engine import TIMMegatronEngineWithLMHead

    assert plugin.REGISTERED["megatron_engine"] is TIMMegatronEngineWithLMHead
    assert "verl_megatron_engine" not in plugin.REGISTERED["features_off"]
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is TIMMegatronEngineWithLMHead
    # verl's own device-only entry is untouched (other vendors keep verl's engine)
    assert EngineRegistry._engines["language_model"]["megatron"]["cuda"] is MegatronEngineWithLMHead


def test_unconfigured_engine_is_stock_verl_tp1(tp1):
    _assert_stock(tp1)
    steps = tp1["ours"]["steps"]
    assert all(s["grad_norm"] is not None and s["grad_norm"] > 0 for s in steps)


def test_unconfigured_engine_is_stock_verl_tp2(two_ranks):
    for rank in (0, 1):
        _assert_stock(two_ranks[rank]["tp2"])
    # verl reports the grad norm on the output-holding rank only
    assert [s["grad_norm"] is None for s in two_ranks[1]["tp2"]["ours"]["steps"]] == [True, True]
    # both TP ranks computed the same log-probs (vocab-parallel, reduced over TP)
    assert torch.equal(two_ranks[0]["tp2"]["ours"]["steps"][0]["old"], two_ranks[1]["tp2"]["ours"]["steps"][0]["old"])


def test_unconfigured_engine_is_stock_verl_pp2(two_ranks):
    for rank in (0, 1):
        _assert_stock(two_ranks[rank]["pp2"])
    first, last = (two_ranks[r]["pp2"]["ours"] for r in (0, 1))
    # each stage holds its own layers (the final norm on the last), and verl's loss and grad norm are the last's
    assert [any("final_layernorm" in k for k in s["params"]) for s in (first, last)] == [False, True]
    assert all(s["pg_loss"] is None and s["grad_norm"] is None for s in first["steps"])
    assert all(s["pg_loss"] is not None and s["grad_norm"] > 0 for s in last["steps"])


def _assert_params_close(a: dict, b: dict) -> None:
    """Every bf16 parameter shard of one engine after the step against another's (one rounding step apart at most)."""
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=2**-7, atol=1e-6)


def _reference(old, rollout, mask) -> dict[str, float]:
    """tim/* of the monitor's token keys, in float64 from the tensors verl returned, and verl's own k3 helper."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

    valid = mask.bool()
    d = (old.double() - rollout.double())[valid]
    d32 = (old.float() - rollout.float())[valid]
    verl = compute_rollout_corr_metrics_from_logprobs(old.float(), rollout.float(), mask)
    return {"tim/tokens": float(valid.sum()), "tim/token/kl_k3": float((d.exp() - 1 - d).mean()),
            "tim/token/abs_diff_mean": float(d.abs().mean()), "tim/token/abs_diff_max": float(d32.abs().max()),
            "verl_k3": verl["rollout_corr/k3_kl"]}


def _assert_monitor(metrics, ref):
    assert metrics["tim/tokens"] == ref["tim/tokens"]
    assert metrics["tim/token/abs_diff_max"] == ref["tim/token/abs_diff_max"]  # a max merges bit-exactly
    for key in ("tim/token/kl_k3", "tim/token/abs_diff_mean"):
        assert metrics[key] == pytest.approx(ref[key], rel=1e-6), key
    assert metrics["tim/token/kl_k3"] == pytest.approx(ref["verl_k3"], rel=1e-6)  # verl's rollout_corr/k3_kl


def _assert_split(mon):
    """The training pass right after the old-log-prob pass (no update since the rollout): pi_old is pi_theta, so the
    staleness part is exactly 0 and every trained token is at lag 0, where the log-ratio is the mismatch the monitor
    measured on the same tokens."""
    split, ref = mon["split"], _reference(mon["old"], mon["rollout"], mon["mask"])
    assert split["tim/by_lag/0/count"] == ref["tim/tokens"] == split["tim/staleness/tokens"]
    assert split["tim/staleness/token/abs_diff_max"] == 0.0
    assert split["tim/by_lag/0/kl_k3"] == pytest.approx(ref["tim/token/kl_k3"], rel=1e-6)
    d = (mon["old"].double() - mon["rollout"].double())[mon["mask"].bool()]
    assert split["tim/split/staleness_mean"] == 0.0
    assert split["tim/split/mismatch_mean"] == pytest.approx(float(d.mean()), rel=1e-6)


def test_monitor_keeps_verl_numerics_and_equals_references_tp1(tp1):
    mon = tp1["monitor"]
    assert mon["holds"] and torch.equal(mon["old"], mon["plain"])
    _assert_monitor(mon["metrics"], _reference(mon["old"], mon["rollout"], mon["mask"]))
    _assert_split(mon)


def test_monitor_from_the_output_rank_tp2(two_ranks):
    src, other = two_ranks[0]["tp2"]["monitor"], two_ranks[1]["tp2"]["monitor"]
    assert src["holds"] and not other["holds"]
    assert other["metrics"] == {}  # TP rank 1 measures nothing and reports nothing
    assert torch.equal(src["old"], src["plain"])
    _assert_monitor(src["metrics"], _reference(src["old"], src["rollout"], src["mask"]))
    _assert_split(src)
    assert other["split"] == {} and other["pg_loss"] == src["pg_loss"]


def test_monitor_from_the_last_pipeline_stage_pp2(two_ranks):
    _assert_last_stage_monitor(two_ranks[0]["pp2"]["monitor"], two_ranks[1]["pp2"]["monitor"])


def _assert_last_stage_monitor(first, last):
    assert last["holds"] and not first["holds"]
    assert first["metrics"] == {} and first["split"] == {}  # the first stage has no log-probs: nothing measured
    assert torch.equal(last["old"], last["plain"])
    _assert_monitor(last["metrics"], _reference(last["old"], last["rollout"], last["mask"]))
    _assert_split(last)


def test_verls_driver_logs_the_output_ranks_metrics_tp2_pp2_and_virtual_pp(two_ranks):
    """verl's driver gets one answer per actor rank (``Dispatch.ONE_TO_ALL``, in rank order) and logs a holding
    rank's: at TP2 rank 0's, at PP2 (and with virtual stages) rank 1's, since rank 0 is the first stage, which has no
    outputs (its answer carries {})."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1 import get_trainer_cls

    from tim_plugins.integrations.verl.config import TIMVerlConfig

    for layout, holder in (("tp2", 0), ("pp2", 1), ("vpp", 1)):
        reports = [two_ranks[r][layout]["monitor"]["report"] for r in (0, 1)]
        assert [r["holds"] for r in reports] == [r == holder for r in (0, 1)], layout
        assert reports[1 - holder]["metrics"] == {} and reports[holder]["metrics"]["tim/tokens"] > 0, layout
        trainer = object.__new__(get_trainer_cls("tim_sync"))
        trainer.tim = TIMVerlConfig.from_node(scenarios.MONITOR)
        trainer.actor_rollout_wg = SimpleNamespace(tim_pop_metrics=lambda reports=reports: reports)
        logged = {}
        trainer._tim_collect(logged)
        assert logged == two_ranks[holder][layout]["monitor"]["metrics"], layout


def _assert_dump(dump_dir, mon):
    """One dump file for the step, from the output-holding rank (data-parallel rank 0): every measured token, with
    the log-probs verl returned and the batch's rollout log-probs."""
    import pyarrow.parquet as pq

    # (beside it causes.jsonl: the synthetic batch's rollout log-probs are confident tokens the model scores far lower,
    # which the stream rule names engine-stale)
    assert sorted(p.name for p in dump_dir.glob("*.parquet")) == ["step_00000000-rank_0000.parquet"]
    table = pq.read_table(dump_dir / "step_00000000-rank_0000.parquet").to_pydict()
    mask = mon["mask"].bool()
    assert len(table["position"]) == int(mask.sum())
    rows, cols = torch.tensor(table["sequence"]), torch.tensor(table["position"])
    assert torch.equal(torch.tensor(table["train_logprob"]), mon["old"].float()[rows, cols])
    assert torch.equal(torch.tensor(table["rollout_logprob"]), mon["rollout"].float()[rows, cols])
    assert bool(mask[rows, cols].all())


def test_dump_holds_the_measured_tokens_once_tp1_tp2_and_pp2(tp1, two_ranks):
    _assert_dump(tp1["dump_dir"], tp1["monitor"])
    _assert_dump(two_ranks["dump_dir"], two_ranks[0]["tp2"]["monitor"])  # TP rank 1 wrote nothing
    _assert_dump(two_ranks["dump_dir_pp2"], two_ranks[1]["pp2"]["monitor"])  # the first stage wrote nothing


def test_monitor_merges_exactly_over_data_parallel_ranks(two_ranks):
    ranks = [two_ranks[r]["dp2"] for r in (0, 1)]
    assert all(r["dp_size"] == 2 and r["holds"] for r in ranks)
    a, b = ranks[0]["metrics"], ranks[1]["metrics"]  # every DP rank holds the merged values
    assert a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)
    width = max(r["old"].shape[1] for r in ranks)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    old, rollout, mask = (torch.cat([pad(r[k]) for r in ranks]) for k in ("old", "rollout", "mask"))
    ref = _reference(old, rollout, mask)
    assert all(r["mask"].sum() > 0 for r in ranks) and ref["tim/tokens"] > float(ranks[0]["mask"].sum())
    _assert_monitor(ranks[0]["metrics"], ref)


def _safe_grids(case: str, records: list, width: int) -> dict:
    """The reference of each response cell of a pass ([B, width], the micro-batches' rows in order) from the
    processor's recorded calls: log-prob, entropy, in S, pruned mass, |S|, and the response mask."""
    safe, sampler = scenarios.SAFE_CASES[case]
    trunc = Truncation(min_p=safe["min_p"], top_k=sampler.get("top_k", 0), top_p=sampler.get("top_p", 1.0))
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    grids = {k: [] for k in ("logp", "entropy", "in_s", "pruned", "size", "mask")}
    for rec in records:
        logp, ent, in_s, pruned, size, _ = safe_vocab_reference(rec["logits"], rec["label"], trunc)
        for key, value in zip(grids, (logp.detach(), ent.detach(), in_s, pruned, size)):
            grids[key].append(pad(value[rec["cells"]]))
        grids["mask"].append(pad(rec["mask"]))
    return {k: torch.cat(v) for k, v in grids.items()}


def _assert_safe_vocab(result, *, holds: bool):
    for case, r in result.items():
        mask = r["mask"].bool()
        ref = _safe_grids(case, r["infer"], mask.shape[1])
        assert torch.equal(ref["mask"], mask), case
        assert r["keys"] == ["entropy", "log_probs"], case  # the safe set's fields never reach verl's outputs
        torch.testing.assert_close(r["old"][mask], ref["logp"][mask].float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(r["entropy"][mask], ref["entropy"][mask].float(), rtol=0, atol=1e-5)
        boundary = mask & ~ref["in_s"]
        assert 0 < int(boundary.sum()) < int(mask.sum()), case  # the case cuts some sampled tokens, not all
        if holds:
            m, n = r["metrics"], int(mask.sum())
            assert m["tim/safe_vocab/tokens"] == n
            assert m["tim/safe_vocab/boundary_frac"] == pytest.approx(int(boundary.sum()) / n, rel=1e-12)
            assert m["tim/safe_vocab/size_mean"] == pytest.approx(float(ref["size"][mask].double().mean()), rel=1e-12)
            assert m["tim/safe_vocab/pruned_mass_mean"] == pytest.approx(float(ref["pruned"][mask].mean()), abs=1e-6)
            assert m["tim/safe_vocab/pruned_mass_max"] == pytest.approx(float(ref["pruned"][mask].max()), abs=1e-6)
        else:
            assert r["metrics"] == {}
        # the training pass: its own logits through the safe vocabulary, and verl's loss aggregates over the
        # response tokens inside S only (a boundary token contributes nothing to ppo_loss)
        train = _safe_grids(case, r["train"], mask.shape[1])
        seen_mask = torch.cat([s["mask"] for s in r["loss"]])
        seen_lp = torch.cat([s["log_probs"] for s in r["loss"]])
        assert torch.equal(seen_mask, mask & train["in_s"]), case
        assert int((mask & ~train["in_s"]).sum()) > 0
        torch.testing.assert_close(seen_lp[mask], train["logp"][mask].float(), rtol=0, atol=1e-5)


def test_safe_vocabulary_equals_the_float64_reference_tp1(tp1):
    _assert_safe_vocab(tp1["safe_vocab"], holds=True)


def test_safe_vocabulary_equals_the_float64_reference_tp2(two_ranks):
    _assert_safe_vocab(two_ranks[0]["tp2"]["safe_vocab"], holds=True)
    _assert_safe_vocab(two_ranks[1]["tp2"]["safe_vocab"], holds=False)  # TP rank 1: the same numbers, no metrics
    for case in scenarios.SAFE_CASES:
        a, b = (two_ranks[r]["tp2"]["safe_vocab"][case] for r in (0, 1))
        assert torch.equal(a["old"], b["old"]) and torch.equal(a["entropy"], b["entropy"])


def test_safe_vocabulary_equals_the_float64_reference_pp2(two_ranks):
    _assert_safe_vocab(two_ranks[1]["pp2"]["safe_vocab"], holds=True)  # the last stage: logits, loss, metrics
    for case, first in two_ranks[0]["pp2"]["safe_vocab"].items():  # the first stage: no logits, nothing measured
        assert (first["infer"], first["train"], first["loss"], first["metrics"], first["keys"]) == ([], [], [], {}, [])
        assert torch.equal(first["old"], two_ranks[1]["pp2"]["safe_vocab"][case]["old"])  # as verl hands them over


@pytest.fixture(scope="module")
def fused_tp1(one_rank, tiny_qwen2):
    return scenarios.fused_safe_vocab(tiny_qwen2, tp=1)


def _assert_fused_equals_unfused(result, *, holds: bool, tp: int = 1, sequence_parallel: bool = False):
    assert result["use_fused_kernels"] == {"fused": True, "unfused": False}
    assert result["sequence_parallel"] == {"fused": sequence_parallel, "unfused": sequence_parallel}
    for case in scenarios.SAFE_CASES:
        fused, unfused = result[(case, "fused")], result[(case, "unfused")]
        mask = fused["mask"].bool()
        # our head computed every micro-batch of both passes (2 old-log-prob, 2 training; thd: [1, tokens]); the
        # unfused engine's log-probs came through the logits processor
        assert len(fused["head_calls"]) == 4 and all(labels[0] == 1 for labels, _ in fused["head_calls"]), case
        # the hidden states it was handed: the whole packed row, or with sequence parallelism this rank's 1/tp of it
        # (the head gathers the rest)
        shard = tp if sequence_parallel else 1
        assert all(rows * shard == labels[1] for labels, rows in fused["head_calls"]), (case, fused["head_calls"])
        assert unfused["head_calls"] == [], case
        assert fused["keys"] == unfused["keys"] == ["entropy", "log_probs"], case
        for key in ("old", "entropy"):
            torch.testing.assert_close(fused[key][mask], unfused[key][mask], rtol=0, atol=1e-5)
        # verl's loss aggregates over the same tokens (the boundary tokens dropped), with the same log-probs
        assert torch.equal(fused["loss_mask"], unfused["loss_mask"]), case
        assert 0 < int(fused["loss_mask"].sum()) < int(mask.sum()), case
        torch.testing.assert_close(fused["loss_log_probs"][mask], unfused["loss_log_probs"][mask], rtol=0, atol=1e-5)
        assert fused["pg_loss"] == pytest.approx(unfused["pg_loss"], rel=1e-5, abs=1e-7), case
        # the gradients: verl's grad norm (every parameter's, the decoder's through the hidden states included),
        # and every bf16 parameter shard after the optimizer step
        if holds:
            assert fused["grad_norm"] == pytest.approx(unfused["grad_norm"], rel=1e-5), case
            for key in ("tim/safe_vocab/boundary_frac", "tim/safe_vocab/size_mean", "tim/safe_vocab/pruned_mass_mean"):
                assert fused["metrics"][key] == pytest.approx(unfused["metrics"][key], rel=1e-6), (case, key)
            assert fused["metrics"]["tim/safe_vocab/tokens"] == unfused["metrics"]["tim/safe_vocab/tokens"] == int(
                mask.sum())
        else:
            assert fused["metrics"] == unfused["metrics"] == {}
        assert fused["params"].keys() == unfused["params"].keys()
        _assert_params_close(fused["params"], unfused["params"])


def test_fused_kernels_safe_vocabulary_equals_the_unfused_path_tp1(fused_tp1):
    _assert_fused_equals_unfused(fused_tp1, holds=True)


def test_fused_kernels_safe_vocabulary_equals_the_unfused_path_tp2(two_ranks):
    _assert_fused_equals_unfused(two_ranks[0]["tp2_fused"], holds=True, tp=2)
    _assert_fused_equals_unfused(two_ranks[1]["tp2_fused"], holds=False, tp=2)
    for case in scenarios.SAFE_CASES:  # both TP ranks computed the same log-probs
        assert torch.equal(two_ranks[0]["tp2_fused"][(case, "fused")]["old"],
                           two_ranks[1]["tp2_fused"][(case, "fused")]["old"])


def test_fused_kernels_safe_vocabulary_equals_the_unfused_path_tp2_sequence_parallel(two_ranks):
    """Megatron's sequence parallelism (mbridge's default at TP > 1): each TP rank holds 1/tp of the packed row's
    hidden states; the fused head gathers them as Megatron's own output layer does (and sums their gradients' parts
    back), so the fused engine again equals the unfused one, which goes through Megatron's output layer."""
    for rank in (0, 1):
        _assert_fused_equals_unfused(two_ranks[rank]["tp2_fused_sp"], holds=rank == 0, tp=2, sequence_parallel=True)
    for case in scenarios.SAFE_CASES:
        assert torch.equal(two_ranks[0]["tp2_fused_sp"][(case, "fused")]["old"],
                           two_ranks[1]["tp2_fused_sp"][(case, "fused")]["old"])
        # and the sequence-parallel engine computes what the one without it does (the same sums, split otherwise):
        # log-probs, entropy, verl's grad norm (the layer norms' gradients summed over the TP group included) and
        # the parameters after the step
        sp, plain = two_ranks[0]["tp2_fused_sp"][(case, "fused")], two_ranks[0]["tp2_fused"][(case, "fused")]
        mask = plain["mask"].bool()
        for key in ("old", "entropy"):
            torch.testing.assert_close(sp[key][mask], plain[key][mask], rtol=0, atol=1e-5)
        assert sp["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), case
        _assert_params_close(sp["params"], plain["params"])


def test_fused_kernels_safe_vocabulary_equals_the_unfused_path_pp2(two_ranks, fused_tp1):
    """Pipeline parallelism: our head computes the last stage's log-probs, and its hidden gradient crosses the stage
    boundary. verl's grad norm (the last stage's report of every stage's gradients) equals the unfused engine's and
    the single-stage engine's on the same checkpoint and batch (which holds every layer), and each stage's every
    parameter after the step equals the unfused engine's."""
    last, first = two_ranks[1]["pp2_fused"], two_ranks[0]["pp2_fused"]
    _assert_fused_equals_unfused(last, holds=True)
    for case in scenarios.SAFE_CASES:
        pp2, tp1 = last[(case, "fused")], fused_tp1[(case, "fused")]
        mask = pp2["mask"].bool()
        torch.testing.assert_close(pp2["old"][mask], tp1["old"][mask], rtol=0, atol=1e-5)
        assert pp2["grad_norm"] == pytest.approx(tp1["grad_norm"], rel=1e-5), case
    assert first["use_fused_kernels"] == {"fused": True, "unfused": False}
    _assert_first_stage_fused(first)
    for case in scenarios.SAFE_CASES:
        fused, unfused = first[(case, "fused")], first[(case, "unfused")]
        # the first stage has no outputs or loss; verl hands it the last stage's log-probs
        assert unfused["head_calls"] == [] and unfused["metrics"] == {} and fused["loss_mask"] is None, case
        assert fused["grad_norm"] is None and fused["keys"] == [], case
        assert torch.equal(fused["old"], last[(case, "fused")]["old"]), case
        assert fused["params"].keys() == unfused["params"].keys(), case


def _assert_first_stage_fused(first):
    """A pipeline stage before the last, fused kernels against none: no head call and no metrics, and its layers,
    trained from the gradient our head sent back through the pipeline, equal the unfused engine's after the step."""
    for case in scenarios.SAFE_CASES:
        fused, unfused = first[(case, "fused")], first[(case, "unfused")]
        assert fused["head_calls"] == [] and fused["metrics"] == {}, case
        _assert_params_close(fused["params"], unfused["params"])


def test_virtual_pipeline_stages(two_ranks):
    """Two pipeline stages of two virtual stages each (the 4-layer model: rank 0 holds layers 0 and 2, rank 1 layers
    1 and 3 and the head; Megatron's interleaved schedule calls each rank's forward step once per chunk and
    micro-batch). Unconfigured, ours is verl's engine bit for bit; with the monitor, tim/* comes from the last
    stage and equals the references; the safe vocabulary equals the float64 reference; with fused kernels, our head
    computes every micro-batch of the last virtual stage, and the step equals the unfused engine's."""
    first, last = (two_ranks[r]["vpp"] for r in (0, 1))
    for rank in (0, 1):
        _assert_stock(two_ranks[rank]["vpp"])
    # each rank holds two model chunks; only the last rank's last chunk has the final norm
    for result, norms in ((first, [False, False]), (last, [False, True])):
        chunks = sorted({k.split(".", 1)[0] for k in result["ours"]["params"]})
        assert chunks == ["0", "1"]
        assert [any(k.startswith(f"{c}.") and "final_layernorm" in k for k in result["ours"]["params"])
                for c in chunks] == norms
    _assert_last_stage_monitor(first["monitor"], last["monitor"])
    _assert_dump(two_ranks["dump_dir_vpp"], last["monitor"])
    _assert_safe_vocab(last["safe_vocab"], holds=True)
    for case, early in first["safe_vocab"].items():
        assert (early["infer"], early["train"], early["loss"], early["metrics"]) == ([], [], [], {}), case
    _assert_fused_equals_unfused(two_ranks[1]["vpp_fused"], holds=True)
    _assert_first_stage_fused(two_ranks[0]["vpp_fused"])


def test_the_engines_kept_sets_are_replayed_pp2(two_ranks):
    last, first = two_ranks[1]["pp2_replay"], two_ranks[0]["pp2_replay"]
    _assert_replay(last, holds=True)
    for name in ("bshd", "thd", "fused"):
        r = first[name]
        assert r["metrics"] == {} and r["loss_mask"] is None and r["entropy"] is None, name
        assert torch.equal(r["old"], last[name]["old"]), name  # as verl hands them over
    assert first["bshd"]["infer"] == []  # no logits on the first stage
    _assert_params_close(first["fused"]["params"], first["thd"]["params"])


@pytest.fixture(scope="module")
def replay_tp1(one_rank, tiny_qwen2):
    return scenarios.replay(tiny_qwen2, tp=1)


def _replay_grids(result) -> dict:
    """The float64 replay of each response cell ([B, R]) from the bshd engine's recorded processor calls: the
    masked log-softmax over the cell's kept set on the logits the processor saw (already divided by T)."""
    sets, width = result["sets"], result["mask"].shape[1]
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    grids = {"logp": [], "entropy": [], "label": []}
    sample = 0
    for rec in result["bshd"]["infer"]:
        logits, cells, mask = rec["logits"], rec["cells"], rec["mask"]
        keep = torch.zeros(logits.shape, dtype=torch.bool)
        for i in range(cells.shape[0]):
            for j, ids in enumerate(sets[sample + i]):
                keep[int(cells[i, j]), ids] = True
        sample += cells.shape[0]
        lp, ent, _, _ = replay_reference(logits, rec["label"], keep, 1.0)
        grids["logp"].append(pad(lp[cells] * mask))
        grids["entropy"].append(pad(ent[cells] * mask))
        grids["label"].append(pad(rec["label"][cells] * mask))
    return {k: torch.cat(v) for k, v in grids.items()}


def _assert_replay(result, *, holds: bool):
    mask = result["mask"].bool()
    ref = _replay_grids(result)
    assert torch.equal(ref["label"][mask], result["responses"][mask])  # the recorded rows predict the responses
    for name in ("bshd", "thd", "fused"):
        r = result[name]
        torch.testing.assert_close(r["old"][mask], ref["logp"][mask].float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(r["entropy"][mask], ref["entropy"][mask].float(), rtol=0, atol=1e-5)
        assert torch.equal(r["loss_mask"], mask), name  # no boundary token: verl's loss keeps every token
        if holds:
            assert r["metrics"]["tim/safe_vocab/boundary_frac"] == 0.0, name
            assert r["metrics"]["tim/safe_vocab/size_mean"] == pytest.approx(
                sum(len(x) for s in result["sets"] for x in s) / int(mask.sum()), rel=1e-12), name
            assert not any(k.startswith("tim/diag/") for k in r["metrics"]), name  # replayed, no fallback
        else:
            assert r["metrics"] == {}
    # the packed layout with and without fused kernels: the same numbers and the same optimizer step
    thd, fused = result["thd"], result["fused"]
    torch.testing.assert_close(fused["old"][mask], thd["old"][mask], rtol=0, atol=1e-5)
    if holds:
        assert fused["grad_norm"] == pytest.approx(thd["grad_norm"], rel=1e-5)
    _assert_params_close(fused["params"], thd["params"])


def test_a_replay_fallback_counts_once_per_micro_batch_under_virtual_stages(two_ranks):
    """PP2 with two virtual stages per rank: the last rank's forward_step runs once per model chunk for each
    micro-batch, and only the chunk that computes the log-probs reads the kept sets, so the fallback is counted
    once per micro-batch (the reference: the pass's rows over verl's micro-batch size), on the holding rank only."""
    last, first = two_ranks[1]["vpp_replay_fallback"], two_ranks[0]["vpp_replay_fallback"]
    assert last["holds"] and not first["holds"] and last["chunks"] == first["chunks"] == 2
    assert last["metrics"]["tim/diag/kept_sets_fallback"] == last["rows"] / H.MICRO == 2
    assert "tim/diag/kept_sets_fallback" not in first["metrics"]


def test_the_engines_kept_sets_are_replayed_tp1(replay_tp1):
    _assert_replay(replay_tp1, holds=True)


def test_the_engines_kept_sets_are_replayed_tp2(two_ranks):
    _assert_replay(two_ranks[0]["tp2_replay"], holds=True)
    _assert_replay(two_ranks[1]["tp2_replay"], holds=False)


def test_settings_the_megatron_engine_cannot_honour_fail_early(tp1, tiny_qwen2, monkeypatch):
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    engine = H.build_engine(tiny_qwen2)
    with monkeypatch.context() as patch:  # verl's engine config is frozen: the check reads this field only
        patch.setattr(engine, "engine_config", types.SimpleNamespace(dynamic_context_parallel=True))
        with pytest.raises(ValueError, match=r"dynamic_context_parallel=True with a tim trainer mode.*Fix: "):
            engine.tim_configure(TIMVerlConfig.from_node(scenarios.MONITOR))
    assert not engine.tim_active


def test_a_moved_fused_hook_switches_off_the_safe_vocabulary_only(tp1, tiny_qwen2, monkeypatch, capsys):
    import dataclasses

    from tim_plugins.capabilities import Hook
    from tim_plugins.integrations.verl import megatron_engine
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    engine = H.build_engine(tiny_qwen2)
    safe = TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"min_p": 0.05}})
    feature = megatron_engine.MEGATRON_FUSED_SAFE_VOCAB
    moved = dataclasses.replace(feature, hooks=(Hook("megatron.core.models.gpt.gpt_model", "GPTModel.forward",
                                                     params=("an_output_hook_megatron_renamed",)),))
    monkeypatch.setattr(megatron_engine, "MEGATRON_FUSED_SAFE_VOCAB", moved)
    engine.tim_configure(safe)  # without fused kernels the fused feature is not consulted
    assert engine._tim_truncation.min_p == 0.05
    engine.tim_deconfigure()
    with monkeypatch.context() as patch:
        patch.setattr(engine, "engine_config",
                      types.SimpleNamespace(dynamic_context_parallel=False, use_fused_kernels=True))
        engine.tim_configure(safe)
        assert engine.tim_active and engine._tim_truncation is None  # the monitor runs, the safe vocabulary is off
        assert engine._tim_pipeline.diag == {"feature_off/verl_megatron_fused_safe_vocab": 1.0}
        engine.tim_deconfigure()
    err = capsys.readouterr().err
    assert "verl_megatron_fused_safe_vocab" in err and "an_output_hook_megatron_renamed" in err


def test_a_script_that_imports_the_megatron_engine_module_before_verl_still_registers_it():
    """A script that imports ``megatron_engine`` before verl (to subclass the engine, say): that import's own verl
    imports load verl's plugins, this one, while the module is half-imported; the plugin waits for the import to end
    (``plugin.register_deferred``) and registers the Megatron engine then. A fresh process, verl's entry-point
    loading, this suite's CPU shims installed first as in every process of the suite."""
    import os
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{here!r}, {os.path.join(here, "cpu_site")!r}]
        import megatron_shims
        megatron_shims.install()
        import tim_plugins.integrations.verl.megatron_engine
        from verl.workers.engine import EngineRegistry
        from tim_plugins.integrations.verl import plugin
        from tim_plugins.integrations.verl.megatron_engine import TIMMegatronEngineWithLMHead
        picked = EngineRegistry.get_engine_cls("language_model", "megatron")
        print("RESULT", picked is TIMMegatronEngineWithLMHead, plugin.REGISTERED["megatron_engine"] is picked,
              "verl_megatron_engine" in plugin.REGISTERED["features_off"])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}  # verl's entry-point loading, as users
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert result == "RESULT True True False", result
    assert "loading the verl plugin" not in proc.stderr and "circular import" not in proc.stderr
