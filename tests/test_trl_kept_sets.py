"""TRL (vLLM colocate): the engine's own kept sets replayed by the trainer (``integrations/trl/kept_sets.py``).

vLLM's CPU build refuses ``return_sampling_mask`` (Model Runner V2 needs Triton), so no engine here hands out real
sets. What runs here:

- ``engine_kept_sets()`` around a real ``GRPOTrainer(...)``: the setting reaches vLLM's own engine configuration,
  which refuses it on this build with its own message, and TRL's module global is put back afterwards;
- a real ``GRPOTrainer.train()`` with the vLLM CPU engine (colocate), the callback's safe vocabulary and a user's
  ``top_k=20`` / ``top_p=0.8``. Test-side, the live engine is marked as started with ``return_sampling_mask`` (what
  a GPU build started inside ``engine_kept_sets()`` reports; vLLM's request validation then applies its per-request
  rules too) and each ``RequestOutput`` gets the ``SamplingMask`` an engine would return: vLLM's own top-k/top-p op
  on the policy's logits at generation, plus the most likely token just outside that cut, as an engine whose
  logits differ a little would keep it. The trainer's log-probs then equal a float64 reference renormalised over
  exactly those sets, which recomputing the cut would not give; no sampled token is a boundary token.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")
datasets = pytest.importorskip("datasets")

from test_trl_callback import _logged, make_trainer  # noqa: E402
from trl_cpu_vllm import cpu_sync_weights, llm_with  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig, engine_kept_sets  # noqa: E402
from tim_plugins.integrations.trl.kept_sets import ENGINE_KWARG, engine_returns_kept_sets  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

TOP_K, TOP_P = 20, 0.8  # the user's sampling as set: no min-p
# fp32 trainer against a float64 reference over sets of <= TOP_K + 1 tokens: the fused head's chunked fp32 sums
FP32_ABS = 2e-5
# what the extra token changes: log(1 + p_extra / kept mass) on every position where it carries mass
REPLAY_VISIBLE = 1e-3


@pytest.fixture(scope="module")
def cpu_engine():
    """TRL's colocate engine on the vLLM CPU build, as tests/test_trl_vllm.py builds it (test-side weight sync and
    a fixed KV cache)."""
    from trl.generation import vllm_generation

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_generation.VLLMGeneration, "sync_weights", cpu_sync_weights)
    mp.setattr(vllm_generation, "LLM", llm_with(vllm_generation.LLM, kv_cache_memory_bytes=64 * 2**20))
    mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    yield vllm_generation
    mp.undo()


def test_engine_kept_sets_reaches_vllms_own_config_and_is_undone(cpu_engine, toy_model_path, tmp_path):
    """Inside the block TRL's colocate engine is built with return_sampling_mask=True: vLLM's own configuration
    check refuses it on the CPU build (no Model Runner V2), with vLLM's message; TRL's global is back afterwards."""
    before = cpu_engine.LLM
    with pytest.raises(Exception, match="sampling distribution replay requires Model Runner V2"):
        with engine_kept_sets():
            assert cpu_engine.LLM is not before
            make_trainer(toy_model_path, tmp_path, use_vllm=True, vllm_mode="colocate",
                         vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128, top_k=TOP_K, top_p=TOP_P)
    assert cpu_engine.LLM is before


def test_vllm_still_reads_the_setting_where_the_callback_looks():
    """VLLM_SOURCES vllm.config:ModelConfig.return_sampling_mask (vLLM >= 0.31), the live engine's model config
    the callback reads (LLM.__init__ llm_engine, LLMEngine.__init__ vllm_config)."""
    import dataclasses

    from vllm.config import ModelConfig

    assert ENGINE_KWARG in {f.name for f in dataclasses.fields(ModelConfig)}
    assert ModelConfig.__dataclass_fields__[ENGINE_KWARG].default is False


class EngineSets:
    """Test-side: attaches to each completion of the live engine's ``generate`` the ``SamplingMask`` an engine with
    slightly different logits would return (vLLM's top-k/top-p cut on the policy's logits, plus the most likely
    token outside it), and records the sets by (prompt, completion)."""

    def __init__(self, trainer):
        self.trainer, self.sets, self.extras = trainer, {}, {}
        llm = trainer.vllm_generation.llm
        generate = llm.generate

        def wrapped(*args, **kwargs):
            outputs = generate(*args, **kwargs)
            for request in outputs:
                for completion in request.outputs:
                    self._attach(list(request.prompt_token_ids), completion)
            return outputs

        llm.generate = wrapped

    @torch.no_grad()
    def _attach(self, prompt, completion):
        from vllm.outputs import SamplingMask
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

        ids = torch.tensor([prompt + list(completion.token_ids)])
        logits = self.trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logits = logits / self.trainer.temperature
        n = logits.shape[0]
        cut = apply_top_k_top_p_pytorch(logits.clone(), torch.full((n,), TOP_K), torch.full((n,), TOP_P))
        lists, extras = [], []
        for row, full, token in zip(cut, logits, completion.token_ids):
            kept = torch.isfinite(row)
            extras.append(int(full.masked_fill(kept, -math.inf).argmax()))  # the most likely token the cut left out
            # the engine's set always holds what it sampled (its own logits put it inside its cut)
            lists.append(sorted(set(kept.nonzero().squeeze(-1).tolist()) | {extras[-1], int(token)}))
        completion.sampling_mask = SamplingMask(lists)
        key = (tuple(prompt), tuple(completion.token_ids))
        self.sets[key], self.extras[key] = lists, extras


class PolicyCalls:
    """Test-side, inside the callback's wrapper: each policy log-prob call's result against a float64 reference
    computed at call time (the same weights) over the recorded engine sets, and over the recomputed cut."""

    def __init__(self, trainer, engine: EngineSets):
        self.trainer, self.engine, self.compared, self.max_err, self.replay_gaps = trainer, engine, 0, 0.0, []
        original = trainer._get_per_token_logps_and_entropies
        sig = inspect.signature(type(trainer)._get_per_token_logps_and_entropies)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            a = sig.bind(trainer, *args, **kwargs).arguments
            if a["model"] is trainer.model:
                self._check(a["input_ids"], a["attention_mask"], a["logits_to_keep"], result[0].detach())
            return result

        trainer._get_per_token_logps_and_entropies = wrapped

    @torch.no_grad()
    def _check(self, input_ids, attention_mask, keep, logps):
        prompt_len = input_ids.shape[1] - keep
        z = self.trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits.double()
        z = z[:, prompt_len - 1 : -1] / self.trainer.temperature
        for r in range(input_ids.shape[0]):
            prompt = tuple(input_ids[r, :prompt_len][attention_mask[r, :prompt_len] == 1].tolist())
            completion = tuple(input_ids[r, prompt_len:][attention_mask[r, prompt_len:] == 1].tolist())
            key = (prompt, completion)  # every trained row was generated by the engine
            for i, (token, kept, extra) in enumerate(zip(completion, self.engine.sets[key], self.engine.extras[key])):
                zi = z[r, i]
                ref = zi[token] - torch.logsumexp(zi[kept], 0)
                self.max_err = max(self.max_err, abs(float(logps[r, i]) - float(ref)))
                # over the set without the added token: what recomputing the cut gives (up to fp32 ties)
                without = [t for t in kept if t != extra]
                if token in without:
                    self.replay_gaps.append(float(ref - (zi[token] - torch.logsumexp(zi[without], 0))))
                self.compared += 1


@pytest.fixture(scope="module")
def replay_run(cpu_engine, toy_model_path, tmp_path_factory, caplog_module):
    tmp = tmp_path_factory.mktemp("trl_kept_sets")
    trainer = make_trainer(toy_model_path, tmp, use_vllm=True,
                           vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128,
                           max_steps=2, loss_type="grpo", top_k=TOP_K, top_p=TOP_P)
    llm = trainer.vllm_generation.llm
    assert not engine_returns_kept_sets(llm)  # built outside engine_kept_sets(): the cut would be recomputed
    # what a GPU engine built inside engine_kept_sets() reports; vLLM's own request checks then apply as well
    llm.llm_engine.vllm_config.model_config.return_sampling_mask = True
    assert engine_returns_kept_sets(llm)
    engine = EngineSets(trainer)
    calls = PolicyCalls(trainer, engine)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True, dump_dir=str(tmp / "tim_dump")))
    trainer.add_callback(cb)
    trainer.train()
    return trainer, cb, engine, calls


@pytest.fixture(scope="module")
def caplog_module():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    log = logging.getLogger("tim_plugins.trl")
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)
    log.setLevel(old)


def test_the_callback_replays_what_the_engine_hands_out(replay_run, caplog_module):
    trainer, cb, engine, _ = replay_run
    assert cb.kept_sets is not None and engine.sets
    assert cb.installed == []  # every patch undone after train(), the engine's generate wrapper too
    assert trainer.vllm_generation.llm.generate.__qualname__.startswith("EngineSets")
    assert sum("kept set by replay (TRL's colocate vLLM engine" in m for m in caplog_module) == 1


def test_the_trainer_renormalises_over_exactly_the_engines_sets(replay_run):
    """Every policy log-prob call (old log-probs and each loss pass) equals the float64 reference over the engine's
    own set, and differs from the one over the recomputed cut (the added token's mass) by far more than that."""
    _, _, _, calls = replay_run
    gaps = sorted(abs(g) for g in calls.replay_gaps)
    print(f"[trl replay] {calls.compared} token log-probs compared, max |ours - float64 over the engine's sets| "
          f"{calls.max_err:.2e}; over the set without the added token they differ by median "
          f"{gaps[len(gaps) // 2]:.3g}, max {gaps[-1]:.3g}")
    assert calls.compared > 0
    assert calls.max_err < FP32_ABS, calls.max_err
    visible = [g for g in calls.replay_gaps if abs(g) > REPLAY_VISIBLE]
    assert len(visible) >= len(calls.replay_gaps) // 4, (len(visible), len(calls.replay_gaps))


def test_no_sampled_token_is_a_boundary_token_and_nothing_fell_back(replay_run):
    trainer, cb, _, _ = replay_run
    for step in (1, 2):
        m = _logged(trainer, step)
        assert m["tim/safe_vocab/tokens"] > 0
        assert m["tim/safe_vocab/boundary_frac"] == 0.0
        # the engine's sets hold at most top_k tokens plus the one added
        assert 1.0 <= m["tim/safe_vocab/size_mean"] <= TOP_K + 1
        assert not any(k.startswith("tim/diag/kept_sets") for k in m), {k for k in m if "diag" in k}


def test_evaluation_batches_recompute_without_counting_a_fallback(cpu_engine, toy_model_path, tmp_path):
    """With an evaluation (eval_strategy="steps"), TRL's evaluation batches are generated and scored by the same
    engine and trainer, but their sets are never kept (only a training generation batch's are): their policy
    forwards recompute the cut, which is no fallback from replay. Training rows replay as without evaluation
    (boundary_frac 0) and no tim/diag/kept_sets_* is counted; each training policy forward runs the replaying head,
    each evaluation one the recomputing head. Before, every evaluation forward counted tim/diag/kept_sets_fallback."""
    from tim_plugins.integrations.trl import hooks

    trainer = make_trainer(toy_model_path, tmp_path, use_vllm=True, vllm_mode="colocate",
                           vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128, max_steps=2, loss_type="grpo",
                           top_k=TOP_K, top_p=TOP_P, eval_prompts=["1 2 3", "4 5 6"], eval_strategy="steps",
                           eval_steps=1, per_device_eval_batch_size=4, num_generations_eval=2)
    llm = trainer.vllm_generation.llm
    llm.llm_engine.vllm_config.model_config.return_sampling_mask = True  # as in replay_run
    EngineSets(trainer)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True))
    trainer.add_callback(cb)
    heads = []  # (model in training mode, the head class of each policy log-prob call's fused head)
    real_safe_patch = cb._safe_patch

    def safe_patch(arguments):
        patch = real_safe_patch(arguments)
        import trl.trainer.utils as trl_utils

        heads.append((trainer.model.training, type(trl_utils._ChunkedLogProbFunction)))
        return patch

    cb._safe_patch = safe_patch
    trainer.train()
    history = trainer.state.log_history
    assert [h["step"] for h in history if "eval_loss" in h] == [1, 2]
    assert all(math.isfinite(h["eval_loss"]) for h in history if "eval_loss" in h)
    rows = [h for h in history if "tim/safe_vocab/tokens" in h]
    assert [h["step"] for h in rows] == [1, 2] and all(h["tim/safe_vocab/boundary_frac"] == 0.0 for h in rows)
    assert not any(k.startswith("tim/diag/kept_sets") for h in history for k in h), \
        {k: h[k] for h in history for k in h if k.startswith("tim/diag/")}
    assert {t for training, t in heads if training} == {hooks.ReplayHead}
    assert {t for training, t in heads if not training} == {hooks.SafeVocabHead}


def _outputs(prompts, completions, sets):
    """vLLM's own output objects, one request per prompt, one completion each, carrying ``sets``."""
    from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask

    return [RequestOutput(f"r{i}", None, list(p), None,
                          [CompletionOutput(index=0, text="", token_ids=list(c), cumulative_logprob=None,
                                            logprobs=None, sampling_mask=None if s is None else SamplingMask(s))],
                          True)
            for i, (p, c, s) in enumerate(zip(prompts, completions, sets))]


def test_the_store_hands_each_head_call_its_rows_sets_in_either_layout():
    """TRL's batch layout (left-padded prompts, right-padded completions, attention 0 on padding and after EOS):
    the sets come back per fused-head call (``batch_size`` rows), in the labelled-positions order (Triton devices)
    and placed in the every-position grid (elsewhere, unlabelled positions empty); a completion the mask cuts short
    takes its captured sets' prefix; a row nobody captured makes its own fused-head call fall back (None), the
    other calls of the log-prob call keep their sets."""
    from tim_plugins.integrations.trl.kept_sets import KeptSetStore
    from tim_plugins.integrations.trl.translate import _label_mask

    pad = 0
    prompts = [(5, 6, 7), (8, 9), (10,)]
    completions = [(11, 12, 13), (14, 15), (16, 17, 18)]
    sets = [[[11, 1], [12, 2], [13, 3]], [[14], [15, 4]], [[16, 5], [17], [18, 6, 7]]]
    store = KeptSetStore()
    # one completion without a mask, one whose mask has a set too few: left out, the second with the reason
    problems = store.record(_outputs(prompts, completions, sets) + _outputs([(1,), (2,)], [(2,), (3, 4)],
                                                                           [None, [[3]]]))
    assert len(store) == 3 and store.without_mask == 1
    assert len(problems) == 1 and "1 kept sets for 2 generated tokens" in problems[0]
    # row 2's completion masked after its second token (as TRL's completion mask after an EOS would)
    input_ids = torch.tensor([[5, 6, 7, 11, 12, 13], [pad, 8, 9, 14, 15, pad], [pad, pad, 10, 16, 17, 18]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    chunks = store.for_call(input_ids, attention, 3, batch_size=2)
    assert len(chunks) == 2
    want_rows = [sets[0] + sets[1], sets[2][:2]]  # labelled positions, row-major; row 2 cut to 2 tokens
    for chunk, want, rows in zip(chunks, want_rows, (slice(0, 2), slice(2, 3))):
        lm = _label_mask(input_ids[rows], attention[rows], 3)
        assert chunk.for_rows(int(lm.sum())).to_lists() == want
        grid = chunk.for_rows(lm.numel()).to_lists()
        flat = lm.reshape(-1).tolist()
        assert [g for g, m in zip(grid, flat) if m] == want and not any(g for g, m in zip(grid, flat) if not m)
        assert chunk.for_rows(lm.numel() + 1) is None
    stranger = input_ids.clone()
    stranger[1, 3] = 99  # a completion the engine never produced (a tool-using completion's rows look so too)
    first, second = store.for_call(stranger, attention, 3, batch_size=2)
    assert first is None and second.for_rows(int(_label_mask(input_ids[2:], attention[2:], 3).sum())).to_lists() \
        == want_rows[1]
    store.clear()
    assert len(store) == 0 and store.for_call(input_ids, attention, 3, None) == [None]


def test_only_a_training_generation_batch_records_the_engines_sets():
    """The colocated engine also generates for evaluation, whose completions are never scored with replay: their
    sets are not kept (an evaluation set's sets would sit in host memory until the next training batch). The
    callback's engine wrapper over vLLM's own output objects, outside and inside a training generation batch."""
    from types import SimpleNamespace

    from tim_plugins.integrations.trl.callback import TIMCallback, _CallRecord
    from tim_plugins.integrations.trl.kept_sets import KeptSetStore

    outputs = _outputs([(5, 6)], [(11, 12)], [[[11, 1], [12]]])
    counted = []
    cb = SimpleNamespace(kept_sets=KeptSetStore(), _call=_CallRecord(),
                         pipeline=SimpleNamespace(count=lambda *a, **k: counted.append(a)))
    generate = TIMCallback._wrap_engine_generate(cb, lambda *a, **k: outputs)
    assert generate() is outputs and len(cb.kept_sets) == 0  # evaluation: no generation batch in progress
    cb._call.gen_safe = []  # what _generate_and_score_completions sets for a training batch
    assert generate() is outputs and len(cb.kept_sets) == 1 and not counted


def test_the_replay_head_recomputes_and_counts_where_it_has_no_sets():
    """Without sets for a call the head gives exactly the recomputing head's values and reports the fallback; with
    sets, the float64 reference over them."""
    from tim_plugins.integrations.trl.hooks import ReplayHead, SafeVocabHead
    from tim_plugins.replay import KeptSets
    from tim_plugins.truncation import Truncation

    gen = torch.Generator().manual_seed(3)
    n, hdim, vocab = 7, 16, 101  # odd vocabulary
    hidden, weight = torch.randn(n, hdim, generator=gen), torch.randn(vocab, hdim, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    trunc, sink, fell = Truncation(top_k=5, top_p=0.9), [], []
    args = (hidden, weight, None, targets, 0.8, 4, None, 1.0, ("log_probs", "entropy"))
    recompute = SafeVocabHead(None, trunc, sink.append, lambda: None).apply(*args)
    none = ReplayHead(None, trunc, sink.append, lambda: None, lambda rows: None, lambda: fell.append(1)).apply(*args)
    assert fell == [1] and torch.equal(none[0], recompute[0]) and torch.equal(none[1], recompute[1])
    lists = [sorted({int(t), (int(t) + 1) % vocab, 7}) for t in targets]
    lists[2] = []  # no recorded set: the whole vocabulary
    kept = KeptSets.from_lists(lists)
    got = ReplayHead(None, trunc, sink.append, lambda: None, lambda rows: kept, fell.append).apply(*args)
    z = (hidden.double() @ weight.double().T) / 0.8
    for i, ids in enumerate(lists):
        ids = ids or list(range(vocab))
        ref = z[i, targets[i]] - torch.logsumexp(z[i, ids], 0)
        assert abs(float(got[0][i]) - float(ref)) < 1e-5, i
    assert fell == [1] and bool(sink[-1].in_safe.all())
    # sets naming ids past the head's vocabulary (an engine with a larger vocabulary): recomputed and counted
    wide = KeptSets.from_lists([[int(t), vocab + 3] for t in targets])
    again = ReplayHead(None, trunc, sink.append, lambda: None, lambda rows: wide, lambda: fell.append(2)).apply(*args)
    assert fell == [1, 2] and torch.equal(again[0], recompute[0]) and torch.equal(again[1], recompute[1])


def test_the_report_says_the_run_replayed(replay_run):
    """The run's summary records the replay; the report's truncation section reads it from there."""
    from tim_plugins.report import read_summary
    from tim_plugins.report.truncation import _kept_set

    trainer, cb, _, _ = replay_run
    summary = read_summary(Path(cb.config.dump_dir))
    assert summary["settings"]["sampling mask"] == "true"
    assert _kept_set(summary).mode == "replay"
