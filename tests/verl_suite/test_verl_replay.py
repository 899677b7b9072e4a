"""Replay of the rollout engine's kept sets in verl 0.9.1's real FSDP2 engine on CPU (``engine.py``): where every
sample of a micro-batch carries its per-token kept sets (``extra_fields["tim_kept_sets"]``, as the rollout server
``rollout.TIMvLLMHttpServer`` writes them and verl's V1 trainer carries them), the safe vocabulary renormalises the
trainer's log-probs over exactly those sets, in the old-log-prob and training passes, unfused and fused.

The sets are built from the sampler's own rule (``tim_plugins.truncation``: min-p, top-k, top-p, vLLM's order) on a
float64 copy of the model's logits, with one sampled token deliberately added to its position's set though the rule
cuts it (what an engine whose logits differ at the cut keeps): replayed, it is kept (in the set, no boundary token) and
its log-prob is the float64 reference over exactly the given sets.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig  # noqa: E402

VOCAB = 383
FP32_TOL = 1e-5
MIN_P = 0.02
CONFIG = {"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}
SAMPLER = ActorContext(top_p=0.8, top_k=20)


@pytest.fixture(scope="module")
def dist():
    H.init_dist(port=29587)
    yield


@pytest.fixture(autouse=True)
def unpatched_model_class():
    """verl's fused kernels replace the model class's ``forward`` process-wide (see test_verl_fused_safe_vocab.py)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

    forward = Qwen2ForCausalLM.__dict__["forward"]
    yield
    Qwen2ForCausalLM.forward = forward


def _rows(raw):
    """Each sample's (prompt, response) token ids, as the V1 layout keeps them."""
    width = raw["prompts"].shape[1]
    out = []
    for i in range(raw["input_ids"].shape[0]):
        keep = raw["attention_mask"][i].bool()
        out.append((raw["prompts"][i][keep[:width]], raw["responses"][i][keep[width:]]))
    return out


@pytest.fixture(scope="module")
def case(toy_model_path):
    """(raw batch, per-sample kept-set lists, float64 logits rows predicting each response token). The responses are
    drawn token by token from the sampler's rule on the float64 model (each sampled token in its set, as an engine's
    is), except the last response token of sample 0: the most probable token the rule cuts, added to its set."""
    from transformers import AutoModelForCausalLM

    from tim_plugins.truncation import truncation_threshold

    _, raw = H.make_batch(VOCAB, batch=4, seed=5)
    model = AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float64,
                                                 attn_implementation="sdpa").eval()
    trunc = SAMPLER.truncation(MIN_P)
    g = torch.Generator().manual_seed(0)
    width = raw["prompts"].shape[1]
    sets, z_rows = [], []
    for i, (p, r) in enumerate(_rows(raw)):
        lists, zs = [], []
        for j in range(len(r)):
            with torch.no_grad():
                z = model(torch.cat([p, r[:j]])[None]).logits[0, -1]  # the row that predicts response token j
            keep = z >= truncation_threshold(z[None], trunc)[0]
            ids = torch.nonzero(keep).reshape(-1)
            if i == 0 and j == len(r) - 1:  # inside the engine's set, outside the rule's
                tok = int(torch.where(keep, -torch.inf, z).argmax())
                ids = torch.sort(torch.cat([ids, torch.tensor([tok])])).values
            else:
                tok = int(ids[torch.multinomial(torch.softmax(z[ids], 0), 1, generator=g)])
            r[j] = tok
            raw["responses"][i, j] = tok
            raw["input_ids"][i, width + j] = tok
            lists.append(ids.tolist())
            zs.append(z)
        sets.append(lists)
        z_rows.append(torch.stack(zs))
    return raw, sets, z_rows


def _extras(sets):
    out = []
    for lists in sets:
        sizes = np.array([len(x) for x in lists], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ids = np.array([t for x in lists for t in x], dtype=np.int32)
        out.append({"global_steps": 0, "tim_kept_sets": {"ids": ids, "offsets": offsets}})
    return out


def _reference(case):
    """float64 log-prob of each response token and entropy, renormalised over exactly the given sets: [B, R]."""
    raw, sets, z_rows = case
    b, width = raw["responses"].shape
    lp = torch.zeros(b, width, dtype=torch.float64)
    ent = torch.zeros(b, width, dtype=torch.float64)
    for i, ((_, r), lists, z) in enumerate(zip(_rows(raw), sets, z_rows)):
        for j, s in enumerate(lists):
            zs = z[j, s]
            lse = torch.logsumexp(zs, 0)
            lp[i, j] = z[j, int(r[j])] - lse
            q = torch.softmax(zs, 0)
            ent[i, j] = -(q * torch.log(q)).sum()
    return lp, ent


def _run(toy_model_path, td, fused: bool, remove_padding: bool = True):
    eng = H.build_engine(toy_model_path, fused=fused, optimizer="SGD", lr=0.1, remove_padding=remove_padding)
    before = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for k, p in eng.module.named_parameters()}
    eng.tim_configure(TIMVerlConfig.from_node(CONFIG), context=SAMPLER)
    out = H.infer(eng, td, fused=fused, use_remove_padding=remove_padding)
    metrics = eng.tim_pop_metrics()
    old = H.old_log_probs_padded(out, td)
    entropy = H.old_log_probs_padded({"model_output": {"log_probs": out["model_output"]["entropy"]}}, td)
    step, _ = H.train_step(eng, td, old, fused=fused, use_remove_padding=remove_padding)
    grads = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() - before[k]
             for k, p in eng.module.named_parameters()}
    eng.tim_deconfigure()
    return old, entropy, metrics, step, grads


def test_replayed_sets_give_the_float64_reference_fused_equal_to_unfused(dist, toy_model_path, case):
    raw, sets, _ = case
    td = H.to_v1_layout(raw, extra_fields=_extras(sets))
    ref_lp, ref_ent = _reference(case)
    mask = raw["response_mask"].bool()
    u_old, u_ent, u_m, u_step, u_grads = _run(toy_model_path, td, fused=False)  # unfused first (class patch)
    # the recomputed rule on the same batch: the edited token is a boundary token there
    plain = H.to_v1_layout(raw)
    r_old, _, r_m, _, _ = _run(toy_model_path, plain, fused=False)
    f_old, f_ent, f_m, f_step, f_grads = _run(toy_model_path, td, fused=True)

    j = len(sets[0]) - 1
    assert (u_old.double() - ref_lp)[mask].abs().max() <= FP32_TOL
    assert (u_ent.double() - ref_ent)[mask].abs().max() <= FP32_TOL
    assert torch.isfinite(u_old[0, j]) and u_old[0, j] > -1e3  # kept: a finite log-prob over the engine's set
    assert u_m["tim/safe_vocab/boundary_frac"] == 0.0
    assert r_m["tim/safe_vocab/boundary_frac"] > 0.0  # recomputing, the trainer cuts it
    assert "tim/diag/kept_sets_fallback" not in u_m
    # fused == unfused: log-probs, entropy, losses, the SGD step of every weight
    assert (f_old - u_old)[mask].abs().max() <= FP32_TOL
    assert (f_ent - u_ent)[mask].abs().max() <= FP32_TOL
    assert f_m["tim/safe_vocab/boundary_frac"] == 0.0
    _assert_same_training_step(f_step, u_step, f_grads, u_grads)


def test_a_micro_batch_whose_sets_do_not_line_up_recomputes_and_is_counted(dist, toy_model_path, case):
    raw, sets, _ = case
    bad = [list(x) for x in sets]
    bad[3] = bad[3] + [[1, 2]]  # one set more than the sample's response tokens (a multi-turn or padding sample)
    td = H.to_v1_layout(raw, extra_fields=_extras(bad))
    old, _, metrics, _, _ = _run(toy_model_path, td, fused=False)
    rec, _, rec_m, _, _ = _run(toy_model_path, H.to_v1_layout(raw), fused=False)
    ref_lp, _ = _reference(case)
    mask = raw["response_mask"].bool()
    # micro-batches of 2: samples 0-1 replay, samples 2-3 (the bad one's) recompute, like the plain batch
    assert metrics["tim/diag/kept_sets_fallback"] == 1.0
    assert (old.double() - ref_lp)[:2][mask[:2]].abs().max() <= FP32_TOL
    assert torch.equal(old[2:][mask[2:]], rec[2:][mask[2:]])


def test_replay_without_remove_padding(dist, toy_model_path, case):
    """verl's padded path ([B, L] logits, or hidden states, each sample's tokens at the start of its row)."""
    raw, sets, _ = case
    td = H.to_v1_layout(raw, extra_fields=_extras(sets))
    ref_lp, ref_ent = _reference(case)
    mask = raw["response_mask"].bool()
    u_old, u_ent, u_m, u_step, u_grads = _run(toy_model_path, td, fused=False, remove_padding=False)
    f_old, f_ent, f_m, f_step, f_grads = _run(toy_model_path, td, fused=True, remove_padding=False)
    for old, ent, m in ((u_old, u_ent, u_m), (f_old, f_ent, f_m)):
        assert (old.double() - ref_lp)[mask].abs().max() <= FP32_TOL
        assert (ent.double() - ref_ent)[mask].abs().max() <= FP32_TOL
        assert m["tim/safe_vocab/boundary_frac"] == 0.0
    _assert_same_training_step(f_step, u_step, f_grads, u_grads)


def test_sets_that_do_not_fit_the_heads_rows_recompute_and_are_counted():
    """A layout the engine did not expect (e.g. fewer rows than the sets' positions) falls back, never raises."""
    from tim_plugins.integrations.verl.micro_batch import MicroBatchKeptSets, place_kept
    from tim_plugins.pipeline import StepPipeline
    from tim_plugins.replay import KeptSets

    kept = MicroBatchKeptSets(KeptSets.from_lists([[1, 2], [3]]), packed=torch.tensor([4, 9]),
                              seq=torch.tensor([0, 0]), seq_offsets=torch.tensor([0, 11]))
    pipeline = StepPipeline(TIMVerlConfig.from_node(CONFIG).pipeline_config(SAMPLER))
    placed = place_kept(kept, pipeline, labels_shape=(1, 12), packed=True)
    assert placed.to_lists() == [[]] * 4 + [[1, 2]] + [[]] * 4 + [[3]] + [[]] * 2
    assert place_kept(kept, pipeline, labels_shape=(1, 8), packed=True) is None  # row 9 outside 8 rows
    assert pipeline.diag == {"kept_sets_fallback": 1.0}
    # padded [B, L]: the sample's tokens at the start of its row
    assert place_kept(kept, pipeline, labels_shape=(1, 11), packed=False).to_lists()[9] == [3]


def _assert_same_training_step(f_step, u_step, f_grads, u_grads) -> None:
    """The fused head's training step equals the unfused one's: verl's pg_loss per micro-batch, and the SGD step of
    every weight (fp32 summation order: 1e-4 of the largest)."""
    f_loss = [float(v) for v in f_step["metrics"]["actor/pg_loss"].values]
    u_loss = [float(v) for v in u_step["metrics"]["actor/pg_loss"].values]
    assert f_loss == pytest.approx(u_loss, rel=1e-5, abs=1e-7)
    for k in u_grads:
        scale = float(u_grads[k].abs().max())
        assert (f_grads[k] - u_grads[k]).abs().max() <= 1e-4 * scale + 1e-7, k
