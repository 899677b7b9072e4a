"""The tim engine inside verl 0.9.1's real FSDP2 engine on CPU (world size 1, gloo): safe-vocab log-probs and the
monitor against the core functions on the same tensors, and stock numerics when nothing is configured."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig  # noqa: E402
from tim_plugins.metrics import mismatch_metrics  # noqa: E402
from tim_plugins.safe_vocab import safe_logprobs_from_logits  # noqa: E402

VOCAB = 383
MIN_P = 0.05  # large on purpose: the toy model is near uniform on random tokens, so pruning must bite
FP32_TOL = 2e-5  # packed sdpa vs a per-sequence HF forward, fp32 (measured ~8e-6)


@pytest.fixture(scope="module")
def dist():
    H.init_dist(port=29571)
    yield


@pytest.fixture(scope="module")
def engines(dist, toy_model_path):
    return {rp: H.build_engine(toy_model_path, remove_padding=rp) for rp in (True, False)}


@pytest.fixture(scope="module")
def batch():
    return H.make_batch(VOCAB, batch=4, seed=1)


def reference(model_path, raw, *, min_p: float, temperature: float = 1.0):
    """Per-sequence HF forward (no padding) → response-token log-probs [B, R] from the core functions, their
    in_safe flags, pruned mass and safe-set size ([B, R] each; zeros past each response)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    attn, ids, resp_mask = raw["attention_mask"], raw["input_ids"], raw["response_mask"]
    prompt_len = raw["prompts"].shape[1]
    out = torch.zeros(resp_mask.shape, dtype=torch.float32)
    in_safe = torch.ones(resp_mask.shape, dtype=torch.bool)
    pruned = torch.zeros(resp_mask.shape, dtype=torch.float32)
    size = torch.zeros(resp_mask.shape, dtype=torch.float64)
    for i in range(ids.shape[0]):
        keep = attn[i].bool()
        seq = ids[i][keep]
        n_prompt = int(attn[i, :prompt_len].sum())
        n_resp = int(attn[i, prompt_len:].sum())
        with torch.no_grad():
            logits = model(seq.unsqueeze(0)).logits[0].float()
        rows = logits[n_prompt - 1 : n_prompt - 1 + n_resp]
        toks = seq[n_prompt : n_prompt + n_resp]
        res = safe_logprobs_from_logits(rows, toks, min_p=min_p, temperature=temperature)
        out[i, :n_resp] = res.logprobs
        in_safe[i, :n_resp] = res.in_safe
        pruned[i, :n_resp] = res.pruned_mass
        size[i, :n_resp] = res.size.double()
    return out, in_safe, pruned, size


@pytest.mark.parametrize("remove_padding", [True, False])
def test_unconfigured_engine_is_stock_verl(engines, batch, remove_padding):
    """Registered but not configured (and configured with pruning off, and deconfigured after pruning):
    log-probs equal verl's own engine class on the same weights, bit for bit."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    eng = engines[remove_padding]
    td, _ = batch
    ours = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    stock = FSDPEngineWithLMHead.prepare_model_outputs  # the parent's method, called on the same module
    eng_cls = type(eng)
    try:
        eng.__class__ = FSDPEngineWithLMHead
        plain = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    finally:
        eng.__class__ = eng_cls
    assert stock is not eng_cls.prepare_model_outputs
    assert torch.equal(ours, plain)
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))  # monitor on, pruning off
    try:
        monitored = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    finally:
        eng.tim_deconfigure()
    assert torch.equal(monitored, plain)
    # pruning on changes the log-probs; tim_deconfigure() gives stock verl's back, bit for bit
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}))
    try:
        pruned = H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td)
    finally:
        eng.tim_deconfigure()
    assert not torch.equal(pruned, plain)
    assert not eng.tim_active and eng.tim_pop_metrics() == {}
    assert torch.equal(H.old_log_probs_padded(H.infer(eng, td, use_remove_padding=remove_padding), td), plain)


@pytest.mark.parametrize("layout", ["dense", "v1"])
def test_registered_engine_trains_like_stock_verl(dist, toy_model_path, layout):
    """What a run with the plugin installed but no tim settings does to numerics: nothing. The registered engine
    (picked by verl's registry) and verl's own class, built alike from the same checkpoint, give bit-identical
    old log-probs, losses, gradient norms and updated parameters over two training steps. (Rollouts of verl's
    vLLM server are not reproducible run to run on this CPU, so whole main_ppo runs cannot be compared.)"""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is not FSDPEngineWithLMHead
    results = []
    for cls in (None, FSDPEngineWithLMHead):
        eng = H.build_engine(toy_model_path, engine_cls=cls)
        assert (type(eng) is FSDPEngineWithLMHead) == (cls is not None)
        steps = []
        for seed in (1, 2):
            td, raw = H.make_batch(VOCAB, batch=4, seed=seed)
            if layout == "v1":
                td = H.to_v1_layout(raw)
            old = H.old_log_probs_padded(H.infer(eng, td), td)
            out, lr = H.train_step(eng, td, old)
            steps.append((old, [float(v) for v in out["metrics"]["actor/pg_loss"].values],
                          out["metrics"]["grad_norm"], lr))
        params = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                  for k, v in eng.module.state_dict().items()}
        results.append((steps, params))
    (ours, ours_params), (stock, stock_params) = results
    for (o_old, o_loss, o_gn, o_lr), (s_old, s_loss, s_gn, s_lr) in zip(ours, stock):
        assert torch.equal(o_old, s_old) and o_loss == s_loss and o_gn == s_gn and o_lr == s_lr
    assert ours_params.keys() == stock_params.keys()
    assert all(torch.equal(ours_params[k], stock_params[k]) for k in ours_params)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_safe_vocab_logprobs_and_monitor_match_core(engines, batch, toy_model_path, remove_padding):
    eng = engines[remove_padding]
    td, raw = batch
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}))
    try:
        out = H.infer(eng, td, use_remove_padding=remove_padding)
        got = H.old_log_probs_padded(out, td)
        metrics = eng.tim_pop_metrics()
    finally:
        eng.tim_deconfigure()
    ref, ref_in_safe, ref_pruned, ref_size = reference(toy_model_path, raw, min_p=MIN_P)
    mask = raw["response_mask"].bool()
    assert (~ref_in_safe & mask).any(), "the test needs boundary tokens: raise MIN_P"
    assert (got - ref)[mask].abs().max().item() < FP32_TOL
    # the full-vocabulary log-prob differs by log Σ_S p on kept tokens: the pruning really happened
    keep = mask & ref_in_safe
    full = reference(toy_model_path, raw, min_p=0.0)[0]
    assert ((got - full)[keep] > 1e-4).all()

    # monitor: engine's DP-merged metrics vs the core function on the same tensors (boundary tokens excluded)
    want = mismatch_metrics(raw["rollout_log_probs"], ref, keep)
    for key in ("tim/tokens", "tim/token/abs_diff_max", "tim/token/kl_k3", "tim/token/ratio_min",
                "tim/seq/log_ratio_abs_max", "tim/by_prob/0-0.01/count"):
        assert metrics[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    n_valid = int(mask.sum())
    assert metrics["tim/safe_vocab/tokens"] == n_valid
    assert metrics["tim/safe_vocab/boundary_frac"] == pytest.approx(float((mask & ~ref_in_safe).sum()) / n_valid)
    # pruned mass and |S| over the response tokens, against the core function on the unpadded reference
    assert metrics["tim/safe_vocab/pruned_mass_mean"] == pytest.approx(float(ref_pruned[mask].double().mean()),
                                                                       rel=1e-4)
    assert metrics["tim/safe_vocab/pruned_mass_max"] == pytest.approx(float(ref_pruned[mask].max()), rel=1e-4)
    assert metrics["tim/safe_vocab/size_mean"] == pytest.approx(float(ref_size[mask].mean()), rel=1e-9)
    assert 0.0 < metrics["tim/safe_vocab/pruned_mass_mean"] < metrics["tim/safe_vocab/pruned_mass_max"] < 1.0


@pytest.mark.parametrize("layout", ["dense", "v1"])
@pytest.mark.parametrize("mask_boundary", [True, False])
def test_boundary_tokens_leave_the_loss(dist, toy_model_path, layout, mask_boundary):
    """Training pass with pruning, in both batch layouts the engine meets: dense responses (harness, verl's legacy
    trainer) and the ragged rows verl's V1 trainer hands it (TransferQueue). On the first, on-policy step every
    kept token's ratio is exactly 1, so each micro-batch's pg_loss is -Σ_kept A / N with N the mini-batch's
    response tokens: boundary tokens (outside the trainer's safe set) contribute nothing when masked. (The V1
    layout used to crash here: the rebuilt nested mask padded to the total token count.)"""
    td, raw = H.make_batch(VOCAB, batch=4, seed=1)
    if layout == "v1":
        td = H.to_v1_layout(raw)
    eng = H.build_engine(toy_model_path)  # a fresh one: the step changes its weights
    eng.tim_configure(TIMVerlConfig.from_node({"safe_vocab": {"min_p": MIN_P, "mask_boundary": mask_boundary}}))
    try:
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        out, _ = H.train_step(eng, td, old)
    finally:
        eng.tim_deconfigure()
    in_safe = reference(toy_model_path, raw, min_p=MIN_P)[1]
    mask = raw["response_mask"].bool()
    kept = mask & in_safe if mask_boundary else mask
    adv = raw["advantages"].double()
    n_tokens = float(mask.sum())
    micro = (slice(0, 2), slice(2, 4))  # micro_batch_size_per_gpu=2 in the harness
    assert any((mask & ~in_safe)[rows].any() for rows in micro), "the test needs boundary tokens: raise MIN_P"
    want = [float(-(adv[rows] * kept[rows]).sum() / n_tokens) for rows in micro]
    got = [float(v) for v in out["metrics"]["actor/pg_loss"].values]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert all(float(v) == 0.0 for v in out["metrics"]["actor/ppo_kl"].values)
    assert math.isfinite(out["metrics"]["grad_norm"])


def test_moved_safe_vocab_hook_switches_off_only_the_safe_vocabulary(engines, batch):
    """``features_off`` from the worker (features.SAFE_VOCAB's hooks moved in this verl): the configured safe
    vocabulary is off (log-probs are verl's own, full-vocabulary), the monitor still measures, and the run logs
    ``tim/diag/feature_off/verl_safe_vocab``."""
    eng = engines[True]
    td, raw = batch
    plain = H.old_log_probs_padded(H.infer(eng, td), td)
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}),
                      context=ActorContext(features_off=("verl_safe_vocab",),
                                           audit_errors=("sampler-truncation-unmatched",)))
    try:
        got = H.old_log_probs_padded(H.infer(eng, td), td)
        metrics = eng.tim_pop_metrics()
        # the driver's audit, handed over with the context, reaches the causes' rules
        assert eng._tim_pipeline.causes.audit_codes == {"sampler-truncation-unmatched"}
    finally:
        eng.tim_deconfigure()
    assert torch.equal(got, plain)
    assert metrics["tim/diag/feature_off/verl_safe_vocab"] == 1.0
    assert metrics["tim/tokens"] == float(raw["response_mask"].sum())
    assert not any(k.startswith("tim/safe_vocab/") for k in metrics)
    # switched on by tim.safe_vocab.enable instead of a min-p: off alike (no refusal for the sampler's missing cut)
    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, "safe_vocab": {"enable": True}}),
                      features_off=("verl_safe_vocab",))
    try:
        assert eng._tim_truncation is None
        assert torch.equal(H.old_log_probs_padded(H.infer(eng, td), td), plain)
    finally:
        eng.tim_deconfigure()


def test_a_micro_batch_the_monitor_cannot_read_is_counted_not_raised(engines, batch, monkeypatch):
    """A measurement that fails on a micro-batch (here: the layout read made to raise, standing in for a layout this
    code does not know) costs that micro-batch's statistics, not the step: the old-log-prob pass returns verl's own
    log-probs, each micro-batch is counted under ``tim/diag/measure_failed``, and the pass still merges (verl's actor
    builds no strict pipeline: diagnostics never stop its training)."""
    from tim_plugins.integrations.verl import engine_mixin

    eng = engines[True]
    td, raw = batch
    plain = H.old_log_probs_padded(H.infer(eng, td), td)

    def unreadable(self, x):
        raise RuntimeError("a layout this code does not know")

    eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
    try:
        with monkeypatch.context() as patch:
            patch.setattr(engine_mixin.ResponseLayout, "cells", unreadable)
            got = H.old_log_probs_padded(H.infer(eng, td), td)
        metrics = eng.tim_pop_metrics()
        # the next pass measures again
        H.infer(eng, td)
        again = eng.tim_pop_metrics()
    finally:
        eng.tim_deconfigure()
    assert torch.equal(got, plain)
    micro_batches = math.ceil(raw["response_mask"].shape[0] / 2)  # H.infer's micro_batch_size_per_gpu
    assert metrics["tim/diag/measure_failed"] == micro_batches
    assert metrics.get("tim/tokens", 0.0) == 0.0
    assert again["tim/tokens"] == float(raw["response_mask"].sum())


def test_a_training_micro_batch_the_split_cannot_read_is_counted_and_trains_alike(dist, toy_model_path, monkeypatch):
    """The training pass's split (staleness vs mismatch) failing on its micro-batches: the step's losses, grad norm
    and LR are those of the same engine whose split reads them, and the failures are counted."""
    from tim_plugins.integrations.verl import engine_mixin

    def unreadable(self, x):
        raise RuntimeError("a layout this code does not know")

    td, raw = H.make_batch(VOCAB, batch=4, seed=3)
    results = []
    for broken in (False, True):
        eng = H.build_engine(toy_model_path)
        eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}}))
        try:
            old = H.old_log_probs_padded(H.infer(eng, td), td)
            with monkeypatch.context() as patch:
                if broken:
                    patch.setattr(engine_mixin.ResponseLayout, "cells", unreadable)
                out, lr = H.train_step(eng, td, old)
            metrics = eng.tim_pop_metrics()
            H.infer(eng, td)  # the problem counts ride with the next window's metrics
            metrics["next"] = eng.tim_pop_metrics()
        finally:
            eng.tim_deconfigure()
        results.append(([float(v) for v in out["metrics"]["actor/pg_loss"].values], out["metrics"]["grad_norm"], lr,
                        metrics))
    (loss, grad_norm, lr, ok), (b_loss, b_grad_norm, b_lr, bad) = results
    assert (b_loss, b_grad_norm, b_lr) == (loss, grad_norm, lr)
    assert any(k.startswith("tim/staleness/") for k in ok) and not any(k.startswith("tim/staleness/") for k in bad)
    assert "tim/diag/measure_failed" not in ok["next"]
    assert bad["next"]["tim/diag/measure_failed"] == math.ceil(raw["response_mask"].shape[0] / 2)


def test_boundary_masked_loss_puts_the_micro_batch_mask_back(dist, toy_model_path):
    """verl's loss reads the boundary-masked ``response_mask``; after the call the micro-batch holds its own mask
    again (it was rewritten in place and left so)."""
    from tim_plugins.integrations.verl.micro_batch import padded_response

    td, raw = H.make_batch(VOCAB, batch=4, seed=1)
    eng = H.build_engine(toy_model_path)
    seen = []
    after = eng._tim_after_forward

    def record(micro_batch, model_output, forward_only):  # runs right after verl's loss call
        if not forward_only:
            seen.append(padded_response(micro_batch["response_mask"], raw["response_mask"].shape[1]).bool())
        return after(micro_batch, model_output, forward_only)

    eng._tim_after_forward = record
    eng.tim_configure(TIMVerlConfig.from_node({"safe_vocab": {"min_p": MIN_P}}))
    try:
        old = H.old_log_probs_padded(H.infer(eng, td), td)
        H.train_step(eng, td, old)
    finally:
        eng.tim_deconfigure()
    mask = raw["response_mask"].bool()
    in_safe = reference(toy_model_path, raw, min_p=MIN_P)[1]
    assert (mask & ~in_safe).any()  # the loss did mask tokens
    assert torch.equal(torch.cat(seen), mask)  # and each micro-batch has its own mask back


class _HostReads:
    """Counts the tensor-to-host conversions Python code makes (``.item()``, ``.tolist()``, ``int()``, ``float()``,
    ``bool()`` of a tensor): on an accelerator each one waits for the device."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.n += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_no_host_read_per_micro_batch(dist, toy_model_path, monkeypatch):
    """The tim hooks add a fixed number of host reads per step (the merge, the end of the update), not one per
    micro-batch: with 2 and with 4 micro-batches (micro_batch_size 2) the extra reads of a configured engine over
    verl's own are the same, in the measurement pass and in the training pass (monitor, safe vocabulary and its
    boundary mask, the split by lag)."""
    reads = _HostReads(monkeypatch)
    config = {"monitor": {"enable": True}, "safe_vocab": {"min_p": MIN_P}}
    extra = {}
    for rows in (4, 8):
        td, _ = H.make_batch(VOCAB, batch=rows, seed=3)
        counts = {}
        for configured in (False, True):
            eng = H.build_engine(toy_model_path)
            if configured:
                eng.tim_configure(TIMVerlConfig.from_node(config))
            reads.n = 0
            old = H.old_log_probs_padded(H.infer(eng, td), td)
            infer_reads = reads.n
            reads.n = 0
            H.train_step(eng, td, old, actor_overrides={"ppo_mini_batch_size": rows})
            counts[configured] = (infer_reads, reads.n)
        extra[rows] = tuple(t - s for t, s in zip(counts[True], counts[False]))
    assert extra[4] == extra[8], extra


@pytest.mark.parametrize("layout", ["dense", "v1"])
def test_response_layout_reads_what_verls_no_padding_2_padding_reads(layout):
    """``ResponseLayout`` (the engine's device-side response alignment) against verl's own host-side function on
    the same packed per-token values, in both batch layouts the engine meets."""
    from verl.workers.utils.padding import no_padding_2_padding

    from tim_plugins.integrations.verl.micro_batch import ResponseLayout, padded_response

    td, raw = H.make_batch(VOCAB, batch=5, seed=4)
    if layout == "v1":
        td = H.to_v1_layout(raw)
    ids = td["input_ids"]
    packed = torch.nested.nested_tensor_from_jagged(torch.randn(ids.values().shape[0]), ids.offsets())
    want = no_padding_2_padding(packed, td)
    lay = ResponseLayout(td)
    got = torch.zeros_like(want)
    got[lay.rows[lay.valid], lay.cols[lay.valid]] = lay.gather(packed)[lay.valid]
    assert torch.equal(got, want)
    mask = raw["response_mask"].bool()
    assert torch.equal(padded_response(td["response_mask"], want.shape[1]).bool(), mask[:, : want.shape[1]])
    # cells and like are inverse on a response field
    field = td["response_mask"]
    back = lay.like(field, lay.cells(field))
    assert torch.equal(padded_response(back, want.shape[1]), padded_response(field, want.shape[1]))


def test_a_sequence_parallel_rank_other_than_the_source_measures_and_writes_nothing(dist, toy_model_path, tmp_path):
    """With Ulysses SP every SP rank holds the gathered outputs and measures them; verl collects from SP rank 0
    (``is_mp_src_rank_with_outputs``), and so does the dump: another SP rank computes the same metrics and names the
    same causes, and writes no dump file and no cause line (two would append each cause twice). Reference: the same
    step on a source rank, which writes both."""
    from tim_plugins.dump import CAUSES_LOG

    def step(source: bool):
        out = tmp_path / ("source" if source else "other")
        eng = H.build_engine(toy_model_path)
        if not source:  # as on a Ulysses SP rank other than 0
            eng.is_mp_src_rank_with_outputs = lambda: False
        eng.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True},
                                                   "dump": {"dir": str(out), "sample_rate": 1.0}}))
        eng.tim_begin_step(1)
        td, _ = H.make_batch(VOCAB, batch=4, seed=1, rollout_noise=-12.0)  # confident disagreements: a cause
        H.infer(eng, td)
        return eng.tim_pop_metrics(), out

    (want, written), (got, other) = step(True), step(False)
    assert want["tim/cause/named"] >= 1.0 and got.keys() == want.keys()
    assert all(got[k] == v or (math.isnan(got[k]) and math.isnan(v)) for k, v in want.items())
    assert sorted(p.name for p in written.glob("*.parquet")) == ["step_00000001-rank_0000.parquet"]
    assert len((written / CAUSES_LOG).read_text().splitlines()) == want["tim/cause/named"]
    assert not other.exists() or not any(other.iterdir())
