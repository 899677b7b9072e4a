"""The mitigations' core math at its edges: each test pins a case, against an independent
reference (a naive formula of the documented rule)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import spawn_ranks

from tim_plugins.lr_control import LengthTriggeredLRDecay
from tim_plugins.truncation import Truncation


def _naive_top_p_logprobs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's / HF's top-p rule written out row by row in float64: sort ascending, drop the positions whose
    cumulative probability is <= 1 - top_p (never the largest), renormalise over the rest."""
    out = torch.full(logits.shape, -math.inf, dtype=torch.float64)
    for i, row in enumerate(logits.double()):
        vals, idx = row.sort()
        cum = vals.softmax(-1).cumsum(-1)
        keep = cum > 1.0 - top_p
        keep[-1] = True
        kept = idx[keep]
        out[i, kept] = row[kept] - row[kept].logsumexp(-1)
    return out


# ------------------------------------------------------------------- safe_vocab_tp: a nucleus wider than a shard

_TP_TRUNC = Truncation(top_p=0.99)
_TP_WIDTHS = (300, 301)


def _tp_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, sum(_TP_WIDTHS), generator=g) * 0.5  # flat rows: the nucleus holds ~580 of 601 tokens
    tokens = logits.argmax(-1)
    tokens[0] = logits[0].argmin()  # a pruned token: in_safe False, finite log-prob
    return logits, tokens


def _tp_worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.safe_vocab_tp import safe_logprobs_vocab_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits, tokens = _tp_inputs()
        start = sum(_TP_WIDTHS[:rank])
        res = safe_logprobs_vocab_parallel(logits[:, start : start + _TP_WIDTHS[rank]], tokens, _TP_TRUNC,
                                           group=dist.group.WORLD, vocab_start=start)
        queue.put((rank, res.logprobs.tolist(), res.size.tolist(), res.in_safe.tolist()))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_top_p_keeps_a_nucleus_wider_than_the_widest_shard():
    # The candidate rounds stopped at c = the widest shard's width and took the union's c largest only: a nucleus
    # of more tokens than one shard holds was cut at exactly that many (sizes 301 instead of ~580).
    logits, tokens = _tp_inputs()
    ref = _naive_top_p_logprobs(logits, _TP_TRUNC.top_p)
    ref_size = torch.isfinite(ref).sum(-1)
    assert bool((ref_size > max(_TP_WIDTHS)).all())  # the case: every row's nucleus is wider than a shard
    ref_lp = ref.gather(-1, tokens[:, None]).squeeze(-1)
    for _rank, lp, size, in_safe in spawn_ranks(_tp_worker, world=2):
        assert size == ref_size.tolist()
        assert in_safe == torch.isfinite(ref_lp).tolist()
        lp = torch.tensor(lp, dtype=torch.float64)
        ok = torch.isfinite(ref_lp)
        torch.testing.assert_close(lp[ok], ref_lp[ok], atol=1e-5, rtol=0)  # fp32 log-probs
        # the pruned token: its finite value z_a - logsumexp_S, over the reference's S
        row = logits[0].double()
        want = row[tokens[0]] - row[torch.isfinite(ref[0])].logsumexp(-1)
        torch.testing.assert_close(lp[0], want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------- lr_control: a stale call is ignored


def test_a_stale_call_keeps_the_trigger_it_follows():
    # An adapter may call observe once per micro-batch; the later calls of a step are "ignored". They cleared
    # tim/lr/triggered (and with it the fired baseline the step's metrics report), so a trigger never reached a log
    # written after the step's last micro-batch.
    ctrl = LengthTriggeredLRDecay(warmup_steps=3, window=1, patience=1, cooldown=2)
    for step in range(3):
        ctrl.observe(step, 100.0)
    assert ctrl.observe(3, 200.0) == 0.5  # 200 > 100 · 1.25: fires, the scale halves
    fired = ctrl.metrics()
    assert fired["tim/lr/triggered"] == 1.0 and fired["tim/lr/baseline_length"] == 100.0
    for _ in range(2):  # the step's other micro-batches
        assert ctrl.observe(3, 200.0) == 0.5
    after = ctrl.metrics()
    assert after["tim/lr/stale"] == 2.0
    assert {k: v for k, v in after.items() if k != "tim/lr/stale"} == {
        k: v for k, v in fired.items() if k != "tim/lr/stale"}


# ------------------------------------------------------------------- truncation: HF generate's other knobs off

_GENERATION_CONFIG_KNOBS = [{"typical_p": 0.5}, {"epsilon_cutoff": 3e-2}, {"top_h": 0.5}, {"repetition_penalty": 1.3},
                            {"no_repeat_ngram_size": 1}]


@pytest.mark.parametrize("knob", _GENERATION_CONFIG_KNOBS, ids=lambda k: next(iter(k)))
def test_hf_generate_kwargs_turn_off_the_models_other_sampling_knobs(knob):
    # A model's generation_config may carry sampling knobs of its own (Qwen2.5-Instruct: repetition_penalty 1.05);
    # hf_generate_kwargs set temperature / top-k / top-p / min-p only, so generate applied the others too and the
    # rollout's processed log-probs left the trainer's safe log-probs (max |diff| 0.17 - 2.5 nats here).
    transformers = pytest.importorskip("transformers")
    from tim_plugins.safe_vocab import safe_logprobs_from_logits
    from tim_plugins.truncation import hf_generate_kwargs

    torch.manual_seed(0)
    vocab = 300
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # rows of a few dozen plausible tokens: every knob cuts some
    model.generation_config = transformers.GenerationConfig(do_sample=True, **knob)
    trunc = Truncation(min_p=0.01, top_p=0.9, top_k=50, temperature=0.8, order="hf")
    ids = torch.randint(0, vocab, (2, 4))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, pad_token_id=0,
                         **hf_generate_kwargs(trunc))
    with torch.no_grad():
        logits = model(out.sequences).logits[:, 3:-1].reshape(-1, vocab)
    tokens = out.sequences[:, 4:].reshape(-1)
    processed = torch.stack(out.scores, 1).reshape(-1, vocab).log_softmax(-1)  # what HF sampled from
    processed = processed.gather(-1, tokens[:, None]).squeeze(-1)
    safe = safe_logprobs_from_logits(logits, tokens, min_p=trunc.min_p, temperature=trunc.temperature,
                                     top_p=trunc.top_p, top_k=trunc.top_k, order="hf")
    torch.testing.assert_close(safe.logprobs, processed, atol=1e-4, rtol=0)  # fp32 forward, as docs/safe-vocab.md
