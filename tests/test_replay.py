"""Replay of the engine's kept set: the trainer's log-probs renormalised over exactly the tokens the sampler kept,
against float64 references, and fed from vLLM's own output objects filled by vLLM's own sampler."""

from __future__ import annotations

import math
import types

import pytest
import torch

from tim_plugins.replay import KeptSets, replay_logprobs_from_hidden, replay_logprobs_from_logits
from tim_plugins.safe_vocab import safe_logprobs_from_logits
from tim_plugins.truncation import Truncation, truncation_threshold

from safe_vocab_reference import dense_kept as dense
from safe_vocab_reference import replay_reference as reference


def random_sets(n, vocab, gen, *, empty_rows=()):
    lists = []
    for i in range(n):
        if i in empty_rows:
            lists.append([])
            continue
        k = int(torch.randint(1, min(vocab, 40) + 1, (1,), generator=gen))
        lists.append(torch.randperm(vocab, generator=gen)[:k].tolist())
    return KeptSets.from_lists(lists)


@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 3), (1.3, 1)])
def test_replay_equals_a_float64_reference_values_and_gradients(temperature, chunk):
    gen = torch.Generator().manual_seed(1)
    n, vocab = 17, 1009
    logits = torch.randn(n, vocab, generator=gen) * 3
    kept = random_sets(n, vocab, gen, empty_rows=(4,))
    keep = dense(kept, vocab)
    # labels: mostly inside the engine's set (what it sampled), two outside (a label the set does not hold)
    tokens = torch.tensor([ids[0] if ids else 5 for ids in kept.to_lists()])
    outside = [i for i in (2, 9) if not keep[i, 0]]
    tokens[outside] = 0
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    x = logits.clone().requires_grad_()
    out = replay_logprobs_from_logits(x, tokens, kept, temperature=temperature, compute_entropy=True,
                                      chunk_size=chunk)
    ((out.logprobs * g).sum() + (out.entropy * ge).sum()).backward()
    xr = logits.double().requires_grad_()
    lp, ent, pruned, keep_full = reference(xr, tokens, keep, temperature)
    ((lp * g.double()).sum() + (ent * ge.double()).sum()).backward()

    assert torch.equal(out.in_safe, keep_full.gather(-1, tokens[:, None]).squeeze(-1))
    assert not out.in_safe[outside].any() and out.in_safe[[i for i in range(n) if i not in outside]].all()
    assert torch.equal(out.size, keep_full.sum(-1)) and int(out.size[4]) == vocab  # empty list: whole vocabulary
    # a label outside the set gets the finite z_a/T − logsumexp_S (masked out of a loss by in_safe)
    z = logits.double() / temperature
    finite = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z.masked_fill(~keep_full, -math.inf), -1)
    torch.testing.assert_close(out.logprobs.double(), finite, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logprobs.double()[out.in_safe], lp.detach()[out.in_safe], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.pruned_mass.double(), pruned, atol=1e-6, rtol=0)
    # gradient: the reference's own autograd for labels in S; for labels outside S the finite value's gradient
    xf = logits.double().requires_grad_()
    zf = xf / temperature
    lse = torch.logsumexp(zf.masked_fill(~keep_full, -math.inf), -1)
    val = zf.gather(-1, tokens[:, None]).squeeze(-1) - lse
    lp_all = torch.log_softmax(zf.masked_fill(~keep_full, -math.inf), -1)
    ent_f = -(lp_all.exp() * lp_all.masked_fill(~keep_full, 0)).sum(-1)
    ((val * g.double()).sum() + (ent_f * ge.double()).sum()).backward()
    torch.testing.assert_close(x.grad.double(), xf.grad, atol=1e-5, rtol=0)
    inside_rows = out.in_safe
    torch.testing.assert_close(x.grad.double()[inside_rows], xr.grad[inside_rows], atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_a_set_far_under_the_trainers_top_token_and_a_set_the_trainer_masks_whole(path):
    """The engine's S need not hold the trainer's top token (the disagreement replay exists for): 11 logits under it
    at T = 0.1, every e^(z − row max) of S underflows in fp32, yet the log-prob, entropy, pruned mass and gradients
    equal the float64 masked log-softmax. A row whose every kept id the trainer masks (-inf) has no distribution over
    S: log-prob -inf, out of S, entropy 0, and a loss that leaves it out by ``in_safe`` has finite gradients."""
    temperature, vocab = 0.1, 9
    logits = torch.zeros(3, vocab)
    logits[0, 0], logits[0, 3], logits[0, 4] = 12.0, 1.0, 0.5
    logits[1] = torch.linspace(-1.0, 1.0, vocab)
    logits[1, 8] = 11.0
    logits[2, 5:7] = -math.inf
    kept = KeptSets.from_lists([[3, 4], [2, 5, 6], [5, 6]])
    tokens = torch.tensor([3, 6, 5])
    g, ge = torch.tensor([1.0, -0.5, 0.0]), torch.tensor([0.3, 0.7, 0.0])
    if path == "logits":
        x = logits.clone().requires_grad_()
        out = replay_logprobs_from_logits(x, tokens, kept, temperature=temperature, compute_entropy=True)
        leaf = x
    else:  # logits = h @ W with h the identity: the same numbers, the gradient on W; a matmul gives no -inf logit,
        # so the masked row is the logits path's alone
        h = torch.eye(2, 4)
        w = torch.zeros(vocab, 4)
        w[:, :2] = logits[:2].T
        leaf = w.requires_grad_()
        out = replay_logprobs_from_hidden(h, leaf, tokens[:2], KeptSets.from_lists([[3, 4], [2, 5, 6]]),
                                          temperature=temperature, compute_entropy=True)
    rows = out.logprobs.shape[0]
    loss = torch.where(out.in_safe, out.logprobs * g[:rows] + out.entropy * ge[:rows], 0.0).sum()
    loss.backward()
    assert out.in_safe.tolist() == [True, True, False][:rows] and out.size.tolist() == [2, 3, 0][:rows]
    assert bool(torch.isfinite(leaf.grad).all())
    if path == "logits":
        assert out.logprobs[2] == -math.inf and out.entropy[2] == 0.0
    keep = dense(kept, vocab)
    xr = logits[:2].double().requires_grad_()
    lp, ent, pruned, _ = reference(xr, tokens[:2], keep[:2], temperature)
    ((lp * g[:2].double()).sum() + (ent * ge[:2].double()).sum()).backward()
    torch.testing.assert_close(out.logprobs[:2].double(), lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[:2].double(), ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.pruned_mass[:2].double(), pruned, atol=1e-6, rtol=0)
    grad = leaf.grad.double() if path == "logits" else leaf.grad.double()[:, :2].T
    torch.testing.assert_close(grad[:2], xr.grad, atol=1e-5, rtol=0)
    if path == "logits":
        assert not grad[2].any()


def test_hidden_path_equals_logits_path():
    """The chunked hidden-state variant (verl's fused-kernel mode) gives the logits path's values and gradients;
    inputs in eighths so both see bit-identical logits."""
    gen = torch.Generator().manual_seed(4)
    n, hdim, vocab = 23, 12, 777
    hidden = torch.randint(-2, 3, (n, hdim), generator=gen).float()
    weight = torch.randint(-6, 7, (vocab, hdim), generator=gen).float() / 8
    kept = random_sets(n, vocab, gen, empty_rows=(0, 22))
    tokens = torch.tensor([ids[-1] if ids else 1 for ids in kept.to_lists()])
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    a = replay_logprobs_from_hidden(h.view(1, n, hdim), w, tokens.view(1, n), kept, temperature=0.8,
                                    compute_entropy=True, chunk_size=5)
    assert a.logprobs.shape == (1, n)
    ((a.logprobs.view(-1) * g).sum() + (a.entropy.view(-1) * ge).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = replay_logprobs_from_logits(h2 @ w2.t(), tokens, kept, temperature=0.8, compute_entropy=True)
    ((b.logprobs * g).sum() + (b.entropy * ge).sum()).backward()
    assert torch.equal(a.in_safe.view(-1), b.in_safe) and torch.equal(a.size.view(-1), b.size)
    for x, y in ((a.logprobs.view(-1), b.logprobs), (a.entropy.view(-1), b.entropy), (h.grad, h2.grad),
                 (w.grad, w2.grad)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_packed_layout_is_all_that_is_kept_for_backward():
    """Memory bound: autograd saves the logits (the caller's own tensor) and per-row statistics; the kept sets stay
    packed, no [N, V] mask is saved."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 2001, generator=gen).requires_grad_()
    kept = random_sets(64, 2001, gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        replay_logprobs_from_logits(logits, torch.zeros(64, dtype=torch.long), kept, chunk_size=8)
    big = [t for t in saved if t.numel() >= 64 * 2001]
    assert len(big) == 1 and big[0] is logits and all(t.dtype != torch.bool for t in saved)


def test_kept_sets_layout_and_errors():
    lists = [[3, 1], [], [7], [0, 2, 4]]
    kept = KeptSets.from_lists(lists)
    assert kept.to_lists() == lists and len(kept) == 4 and kept.sizes.tolist() == [2, 0, 1, 3]
    assert kept.ids.dtype == torch.int32 and kept.offsets.tolist() == [0, 2, 2, 3, 6]
    both = KeptSets.concat([kept, KeptSets.from_lists([[5], [6, 8]])])
    assert both.to_lists() == lists + [[5], [6, 8]]
    placed = kept.placed(7, [1, 2, 4, 6])
    assert placed.to_lists() == [[], [3, 1], [], [], [7], [], [0, 2, 4]]
    with pytest.raises(ValueError, match="strictly increasing"):
        kept.placed(7, [1, 4, 2, 6])
    with pytest.raises(ValueError, match="3 rows given for 4 kept sets"):
        kept.placed(7, [1, 2, 4])
    import numpy as np

    assert KeptSets.from_csr(np.array([3, 1, 7]), np.array([0, 2, 2, 3])).to_lists() == [[3, 1], [], [7]]
    with pytest.raises(ValueError, match="offsets must rise from 0 to len"):
        KeptSets(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="decreasing"):
        KeptSets(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 2, 1, 2]))
    logits = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"kept ids must lie in \[0, 8\); got range \[0, 9\]"):
        replay_logprobs_from_logits(logits, torch.zeros(4, dtype=torch.long), KeptSets.from_lists([[9], [], [], [0]]))
    with pytest.raises(ValueError, match="kept has 4 rows, the tokens 3"):
        replay_logprobs_from_logits(logits[:3], torch.zeros(3, dtype=torch.long), kept)
    with pytest.raises(ValueError, match=r"temperature=0.0: must be a finite number > 0"):
        replay_logprobs_from_logits(logits, torch.zeros(4, dtype=torch.long), kept, temperature=0.0)
    with pytest.raises(ValueError, match="expected a tim_plugins.replay.KeptSets"):
        replay_logprobs_from_logits(logits, torch.zeros(4, dtype=torch.long), lists)


# ------------------------------------------------------------------------------------------------ with vLLM

def _vllm_sampler_kept_sets(logits, trunc, seed):
    """vLLM's own V1 sampler (``vllm.v1.sample.sampler.Sampler.sample``, processed log-probs) with vLLM's built-in
    min-p processor on ``logits``: (sampled tokens, kept sets = the finite processed log-probs, processed
    log-probs). The CPU build runs it as is."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    n, vocab = logits.shape
    procs = []
    if trunc.min_p > 0:
        cfg = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=n))
        min_p = MinPLogitsProcessor(cfg, torch.device("cpu"), False)
        params = SamplingParams(min_p=trunc.min_p, top_k=trunc.k, top_p=trunc.top_p, temperature=trunc.temperature)
        min_p.update_state(BatchUpdate(batch_size=n, added=[(i, params, [], []) for i in range(n)], removed=[],
                                       moved=[]))
        procs.append(min_p)
    meta = SamplingMetadata(
        temperature=torch.full((n,), trunc.temperature), all_greedy=False, all_random=True,
        top_p=torch.full((n,), trunc.top_p) if trunc.top_p < 1 else None,
        top_k=torch.full((n,), trunc.k, dtype=torch.int64) if trunc.k else None,
        generators={i: torch.Generator().manual_seed(seed + i) for i in range(n)}, max_num_logprobs=0,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(procs))
    sampled, processed = Sampler(logprobs_mode="processed_logprobs").sample(logits.clone(), meta)
    processed = processed.float()
    kept = [torch.isfinite(row).nonzero().squeeze(-1).tolist() for row in processed]
    return sampled.view(-1), kept, processed


VLLM_CASES = [Truncation(top_k=20, top_p=0.8), Truncation(min_p=0.02, top_k=20, top_p=0.9, temperature=0.7),
              Truncation(top_k=8, temperature=1.3)]


@pytest.mark.vllm
@pytest.mark.parametrize("trunc", VLLM_CASES, ids=lambda t: f"minp{t.min_p}-k{t.top_k}-p{t.top_p}-T{t.temperature}")
def test_vllm_mask_objects_replayed_equal_a_float64_reference(trunc):
    """Masks from vLLM's own sampler on known logits, carried in vLLM's own ``SamplingMask`` / ``CompletionOutput``
    / ``RequestOutput``, through the adapter's converter: the trainer's renormalised log-probs equal a float64
    reference over the same sets, and vLLM's own processed log-probs (fp32 logits on both sides)."""
    pytest.importorskip("vllm")
    from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask

    from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_outputs

    gen = torch.Generator().manual_seed(7)
    vocab, lengths = 1031, (6, 9, 4)  # three completions of two requests
    logits = torch.randn(sum(lengths), vocab, generator=gen) * 4
    sampled, kept_lists, processed = _vllm_sampler_kept_sets(logits, trunc, seed=3)
    assert all(0 < len(k) <= max(trunc.k, 1) for k in kept_lists)  # top_k bounds every set
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    comps = [CompletionOutput(index=i % 2, text="", token_ids=sampled[s : s + n].tolist(), cumulative_logprob=None,
                              logprobs=None, sampling_mask=SamplingMask(kept_lists[s : s + n]))
             for i, (s, n) in enumerate(zip(starts, lengths))]
    outputs = [RequestOutput("r0", None, [1, 2], None, comps[:2], True),
               RequestOutput("r1", None, [3], None, comps[2:], True)]

    kept = kept_sets_from_outputs(outputs)
    tokens = torch.tensor([t for c in comps for t in c.token_ids])
    out = replay_logprobs_from_logits(logits, tokens, kept, temperature=trunc.temperature, compute_entropy=True)
    keep = dense(kept, vocab)
    lp, ent, pruned, _ = reference(logits, tokens, keep, trunc.temperature)
    assert out.in_safe.all()  # every token vLLM sampled is in the set it sampled from: no boundary token
    torch.testing.assert_close(out.logprobs.double(), lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.pruned_mass.double(), pruned, atol=1e-6, rtol=0)
    engine_lp = processed.gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, engine_lp, atol=2e-5, rtol=0)


@pytest.mark.vllm
def test_a_token_outside_the_recomputed_set_but_inside_the_engines_is_kept():
    """The trainer's logits differ slightly from the engine's: recomputing top-k/top-p on them cuts tokens vLLM kept
    — boundary tokens, dropped from the loss. Replaying vLLM's set keeps them, with the float64 reference value of
    the renormalised log-prob over vLLM's set on the trainer's logits."""
    pytest.importorskip("vllm")
    from vllm.outputs import CompletionOutput, SamplingMask

    from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_completion

    trunc = Truncation(top_k=10, top_p=0.9)
    gen = torch.Generator().manual_seed(11)
    n, vocab = 64, 500
    engine_logits = torch.randn(n, vocab, generator=gen) * 3
    _, kept_lists, _ = _vllm_sampler_kept_sets(engine_logits, trunc, seed=5)
    # labels: each set's least likely member (vLLM could have sampled it: it is in the set), the token nearest the
    # cut; the trainer's logits carry a bf16-sized error
    sampled = torch.tensor([min(ids, key=lambda t: float(engine_logits[i, t])) for i, ids in enumerate(kept_lists)])
    trainer_logits = engine_logits + torch.randn(n, vocab, generator=gen) * 0.05
    comp = CompletionOutput(index=0, text="", token_ids=sampled.tolist(), cumulative_logprob=None, logprobs=None,
                            sampling_mask=SamplingMask(kept_lists))
    kept = kept_sets_from_completion(comp)

    recomputed = safe_logprobs_from_logits(trainer_logits, sampled, min_p=0.0, top_k=10, top_p=0.9)
    boundary = ~recomputed.in_safe
    assert boundary.sum() >= 3, "the perturbation should push some sampled tokens out of the recomputed set"
    tau = truncation_threshold(trainer_logits, trunc)
    assert (trainer_logits[boundary].gather(-1, sampled[boundary][:, None]).squeeze(-1) < tau[boundary]).all()

    out = replay_logprobs_from_logits(trainer_logits, sampled, kept)
    assert out.in_safe.all()  # kept: no boundary with the engine's own set
    lp, *_ = reference(trainer_logits, sampled, dense(kept, vocab), 1.0)
    torch.testing.assert_close(out.logprobs.double(), lp, atol=1e-5, rtol=0)
    assert (out.logprobs[boundary] > -math.inf).all()


@pytest.mark.vllm
def test_converter_errors_name_the_fix():
    pytest.importorskip("vllm")
    from vllm.outputs import CompletionOutput, SamplingMask

    from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_completion, kept_sets_from_mask

    bare = CompletionOutput(index=0, text="", token_ids=[1, 2], cumulative_logprob=None, logprobs=None)
    with pytest.raises(ValueError, match=r"no sampling_mask: start vLLM with return_sampling_mask=True"):
        kept_sets_from_completion(bare)
    short = CompletionOutput(index=1, text="", token_ids=[1, 2], cumulative_logprob=None, logprobs=None,
                             sampling_mask=SamplingMask([[1, 4]]))
    with pytest.raises(ValueError, match="completion 1: sampling_mask has 1 kept sets for 2 generated tokens"):
        kept_sets_from_completion(short)
    from vllm.v1.outputs import SamplingMaskLists
    import numpy as np

    csr = SamplingMaskLists(np.array([4, 1, 9], dtype=np.int32), np.array([0, 2, 3]))
    assert kept_sets_from_mask(csr).to_lists() == csr.to_nested_list() == [[4, 1], [9]]


def test_property_replay_against_float64():
    """Random shapes, sets (some empty, some with repeated ids) and chunkings against the float64 reference."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(n=st.integers(1, 9), v=st.integers(1, 50), seed=st.integers(0, 2**31 - 1), chunk=st.integers(1, 4),
           temperature=st.sampled_from([0.5, 1.0, 1.9]), scale=st.floats(0.1, 10.0))
    def check(n, v, seed, chunk, temperature, scale):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
        lists = [torch.randint(0, v, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(n)]
        kept = KeptSets.from_lists(lists)
        tokens = torch.randint(0, v, (n,), generator=gen)
        x = logits.float().requires_grad_()
        out = replay_logprobs_from_logits(x, tokens, kept, temperature=temperature, compute_entropy=True,
                                          chunk_size=chunk)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        xr = logits.float().double().requires_grad_()
        keep = dense(kept, v)
        lp, ent, pruned, keep_full = reference(xr, tokens, keep, temperature)
        z = xr / temperature
        val = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z.masked_fill(~keep_full, -math.inf), -1)
        (val.sum() + ent.sum()).backward()
        assert torch.equal(out.in_safe, keep_full.gather(-1, tokens[:, None]).squeeze(-1))
        assert torch.equal(out.size, keep_full.sum(-1))
        torch.testing.assert_close(out.logprobs.double(), val.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(out.pruned_mass.double(), pruned.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(x.grad.double(), xr.grad, atol=2e-5, rtol=0)

    check()
