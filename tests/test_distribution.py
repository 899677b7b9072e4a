"""Full-distribution comparison (tim_plugins.distribution) against a naive float64 reference written here:
python loops over the vocabulary, odd vocabularies, truncated (-inf) entries, fully masked rows, invalid rows,
top-K (coarse-grained) rows, and the (1 − p) profile over the whole vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tim_plugins.distribution import (
    DIST_KEYS,
    PositionComparison,
    VocabProfile,
    compare_distributions,
    summarize_comparison,
)


def _naive_position(lr: list[float], lt: list[float], tok: int, k: int, known: list[bool] | None = None):
    """One position, plain python floats (float64): KL both ways, TV, top-k overlap, top-1, ranks, support."""
    V = len(lr)
    lse_t = math.log(sum(math.exp(x) for x in lt if x > -math.inf))
    lt = [x - lse_t if x > -math.inf else -math.inf for x in lt]
    if known is None:
        lse_r = math.log(sum(math.exp(x) for x in lr if x > -math.inf))
        lr = [x - lse_r if x > -math.inf else -math.inf for x in lr]
        pr = [math.exp(x) if x > -math.inf else 0.0 for x in lr]
        pt = [math.exp(x) if x > -math.inf else 0.0 for x in lt]
    else:
        lr = [x if kn else -math.inf for x, kn in zip(lr, known)]
        pr_k = [math.exp(x) if x > -math.inf else 0.0 for x in lr]
        pt_k = [math.exp(x) if kn and x > -math.inf else 0.0 for x, kn in zip(lt, known)]
        rest_t = math.fsum(math.exp(x) for x, kn in zip(lt, known) if not kn and x > -math.inf)
        rest_r = max(0.0, 1.0 - sum(pr_k))
        tol = sum(known) * 2.0**-23  # float32 rows: K roundings of eps each
        if rest_r <= tol and rest_t <= tol:  # no side resolves mass outside the known tokens
            rest_r = rest_t
        pr = pr_k + [rest_r]
        pt = pt_k + [rest_t]

    def kl(p, q):
        total = 0.0
        for a, b in zip(p, q):
            if a > 0:
                total += math.inf if b == 0 else a * (math.log(a) - math.log(b))
        return max(total, 0.0)  # a KL is >= 0; a partial row's mass over 1 can put the sum below it

    # each side's k most likely tokens among those it gives mass to
    top_r = sorted((a for a in range(V) if lr[a] > -math.inf), key=lambda a: -lr[a])[:k]
    top_t = sorted((a for a in range(V) if lt[a] > -math.inf), key=lambda a: -lt[a])[:k]
    return {
        "kl_rt": kl(pr, pt), "kl_tr": kl(pt, pr), "tv": 0.5 * sum(abs(a - b) for a, b in zip(pr, pt)),
        "overlap": len(set(top_r) & set(top_t)) / max(len(top_r), len(top_t)), "top1": top_r[0] == top_t[0],
        "rank_r": 1 + sum(x > lr[tok] for x in lr), "rank_t": 1 + sum(x > lt[tok] for x in lt),
        "support": any((a > 0) != (b > 0) for a, b in zip(pr, pt)),
    }


def _rows(B=3, T=5, V=13, seed=0, noise=0.05, truncate=False):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    lt = torch.log_softmax(z, -1)
    lr = torch.log_softmax(z + noise * torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    if truncate:  # min-p style cut on each side separately: supports can differ at the boundary
        lr = torch.log_softmax(torch.where(lr >= lr.amax(-1, keepdim=True) - 2.5, lr, -math.inf), -1)
        lt = torch.log_softmax(torch.where(lt >= lt.amax(-1, keepdim=True) - 2.5, lt, -math.inf), -1)
    tokens = torch.distributions.Categorical(logits=lr).sample()
    return lr.float(), lt.float(), tokens


def _check(comp: PositionComparison, lr, lt, tokens, mask, k, known=None):
    rows = [(b, t) for b in range(lr.shape[0]) for t in range(lr.shape[1]) if mask is None or mask[b, t]]
    assert comp.valid.numel() == len(rows)
    for i, (b, t) in enumerate(rows):
        ref = _naive_position(lr[b, t].double().tolist(), lt[b, t].double().tolist(), int(tokens[b, t]), k,
                              None if known is None else known[b, t].tolist())
        for got, want in ((comp.kl_rollout_train[i], ref["kl_rt"]), (comp.kl_train_rollout[i], ref["kl_tr"]),
                          (comp.tv[i], ref["tv"])):
            if math.isinf(want):
                assert math.isinf(float(got))
            else:
                assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert float(comp.topk_overlap[i]) == ref["overlap"]
        assert bool(comp.top1_agree[i]) == ref["top1"]
        assert int(comp.rank_rollout[i]) == ref["rank_r"] and int(comp.rank_train[i]) == ref["rank_t"]
        assert bool(comp.support_mismatch[i]) == ref["support"]


@pytest.mark.parametrize("V", [7, 13, 383])
@pytest.mark.parametrize("truncate", [False, True])
def test_matches_naive_reference_odd_vocab(V, truncate):
    lr, lt, tokens = _rows(V=V, truncate=truncate, seed=V)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # a fully masked row contributes no position
    mask[2, 3:] = False
    comp = compare_distributions(lr, lt, tokens, mask, top_k=4)
    _check(comp, lr, lt, tokens, mask, 4)
    assert comp.exact and comp.top_k == 4


def test_top_k_overlap_of_rows_that_keep_fewer_than_k_tokens():
    """A truncated row (min-p / top-p) keeps fewer than k tokens: the overlap is over the kept ones only, so it
    does not depend on which token ids the excluded entries have (torch.topk fills a short row with arbitrary
    -inf ones), and two equal truncated rows overlap fully."""
    V, k = 97, 10
    vals = []
    for seed in range(6):
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:4]  # the same pair, relabelled
        lr = torch.full((1, V), -math.inf, dtype=torch.float64)
        lt = lr.clone()
        lr[0, ids[:3]] = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()
        lt[0, ids] = torch.tensor([0.5, 0.3, 0.19, 0.01], dtype=torch.float64).log()
        comp = compare_distributions(lr, lt, ids[:1], top_k=k)
        ref = _naive_position(lr[0].tolist(), lt[0].tolist(), int(ids[0]), k)
        vals.append(float(comp.topk_overlap[0]))
        assert vals[-1] == ref["overlap"] == 3 / 4
        assert float(compare_distributions(lr, lr.clone(), ids[:1], top_k=k).topk_overlap[0]) == 1.0
    # a steep cut on random rows: most keep fewer than k tokens
    lr, lt, _ = _rows(V=41, truncate=True, seed=3)
    cut = [torch.where(x >= x.amax(-1, keepdim=True) - 1.0, x, -math.inf) for x in (lr, lt)]
    top = cut[0].argmax(-1)
    assert (torch.isfinite(cut[0]).sum(-1) < k).float().mean() > 0.5
    _check(compare_distributions(*cut, top, top_k=k), *cut, top, None, k)


def test_identical_distributions_are_zero_and_top_k_is_clamped():
    lr, _, tokens = _rows(V=5)
    comp = compare_distributions(lr, lr.clone(), tokens, top_k=50)
    assert comp.top_k == 5
    assert torch.all(comp.kl_rollout_train == 0) and torch.all(comp.kl_train_rollout == 0)
    assert torch.all(comp.tv == 0) and torch.all(comp.topk_overlap == 1)
    assert torch.equal(comp.rank_rollout, comp.rank_train)


def test_invalid_rows_are_nan_and_excluded_from_the_summary():
    lr, lt, tokens = _rows(B=2, T=3, V=9)
    lr[0, 1] = float("nan")
    lt[1, 2] = -math.inf  # the trainer excludes every token here
    comp = compare_distributions(lr, lt, tokens)
    assert comp.valid.tolist() == [True, False, True, True, True, False]
    assert math.isnan(float(comp.tv[1])) and int(comp.rank_rollout[1]) == -1
    summary = summarize_comparison(comp)
    assert set(summary) == set(DIST_KEYS)
    assert summary["tim/dist/positions"] == 4 and summary["tim/dist/invalid_positions"] == 2
    keep = comp.valid
    assert summary["tim/dist/tv_mean"] == pytest.approx(float(comp.tv[keep].mean()), rel=1e-12)
    assert summary["tim/dist/sampled_rank_changed_frac"] == pytest.approx(
        float((comp.rank_rollout[keep] != comp.rank_train[keep]).double().mean()))


def test_fully_masked_input_gives_nan_statistics():
    lr, lt, tokens = _rows(B=2, T=2, V=5)
    comp = compare_distributions(lr, lt, tokens, torch.zeros(2, 2, dtype=torch.bool))
    summary = summarize_comparison(comp)
    assert summary["tim/dist/positions"] == 0
    assert all(math.isnan(summary[k]) for k in DIST_KEYS if k not in ("tim/dist/positions",
                                                                       "tim/dist/invalid_positions"))


def test_infinite_kl_is_counted_as_support_mismatch_not_averaged():
    lr, lt, tokens = _rows(B=1, T=4, V=11, truncate=True, seed=3)
    comp = compare_distributions(lr, lt, tokens)
    summary = summarize_comparison(comp)
    assert comp.support_mismatch.any(), "the fixture should truncate the two sides differently somewhere"
    for direction in ("kl_rollout_train", "kl_train_rollout"):
        kl = getattr(comp, direction)
        finite = torch.isfinite(kl)
        assert summary[f"tim/dist/{direction}_mean"] == pytest.approx(float(kl[finite].mean()))
        assert summary[f"tim/dist/{direction}_max"] == pytest.approx(float(kl[finite].max()))
    # The fixture's train side keeps a token the rollout truncated: KL(train‖rollout) is infinite there.
    assert not torch.isfinite(comp.kl_train_rollout).all()
    assert summary["tim/dist/support_mismatch_frac"] == pytest.approx(float(comp.support_mismatch.double().mean()))


def test_top_k_known_rows_match_the_naive_partition_and_bound_the_exact_values():
    lr, lt, tokens = _rows(B=2, T=4, V=17, noise=0.3, seed=5)
    K = 5
    known = torch.zeros_like(lr, dtype=torch.bool).scatter_(-1, lr.topk(K, -1).indices, True)
    known.scatter_(-1, tokens.unsqueeze(-1), True)  # an engine always returns the sampled token
    coarse = compare_distributions(lr, lt, tokens, known=known, top_k=3)
    exact = compare_distributions(lr, lt, tokens, top_k=3)
    assert not coarse.exact
    _check(coarse, lr, lt, tokens, None, 3, known=known)
    # Data-processing inequality: the coarse-grained divergences never exceed the exact ones (up to the fp32
    # normalisation of the rollout rows, ~1e-7, which a partial row keeps: it cannot be renormalised).
    assert torch.all(coarse.kl_rollout_train <= exact.kl_rollout_train + 1e-6)
    assert torch.all(coarse.kl_train_rollout <= exact.kl_train_rollout + 1e-6)
    assert torch.all(coarse.tv <= exact.tv + 1e-6)
    # Top-k overlap with k <= K, and ranks of tokens inside the top K, are exact.
    assert torch.equal(coarse.topk_overlap, exact.topk_overlap)
    inside = exact.rank_rollout <= K
    assert torch.equal(coarse.rank_rollout[inside], exact.rank_rollout[inside])


def test_a_rollout_rest_mass_within_rounding_is_no_support_mismatch_a_real_one_is():
    """Only the engine's top K = 5 known. Row 0: one token at p = 1 − 1.4e-8 on both sides (the same weights): its
    float32 log-prob rounds to 0.0, the known mass to >= 1; that is no support mismatch and KL, TV are ~1e-8, not
    inf. Row 1: the engine's known mass is 1 (its distribution truncated to its K tokens) and the trainer gives the
    other tokens 1e-3, far beyond K · eps: a support mismatch, KL(t ‖ r) = inf. Both against the naive partition."""
    V, K = 1000, 5
    logits = torch.zeros(2, V, dtype=torch.float64)
    logits[0, 0] = 25.0
    rollout = torch.log_softmax(logits.float(), -1)
    train = torch.log_softmax(logits, -1)
    assert rollout[0, 0] == 0.0  # the rounding this is about
    rollout[1] = -math.inf
    rollout[1, :K] = torch.tensor([0.0, -40.0, -40.0, -40.0, -40.0])
    train[1, :K] = rollout[1, :K].double() + math.log1p(-1e-3)
    train[1, K:] = math.log(1e-3 / (V - K))
    known = torch.zeros(2, V, dtype=torch.bool)
    known[:, :K] = True
    tokens = torch.tensor([0, 0])
    comp = compare_distributions(rollout, train.float(), tokens, known=known)
    assert comp.support_mismatch.tolist() == [False, True]
    assert 0 <= float(comp.kl_train_rollout[0]) < 1e-7 and 0 <= float(comp.kl_rollout_train[0]) < 1e-7
    assert 0 < float(comp.tv[0]) < 1e-7
    assert math.isinf(float(comp.kl_train_rollout[1])) and float(comp.tv[1]) == pytest.approx(1e-3, rel=1e-4)
    _check(comp, rollout.view(2, 1, V), train.float().view(2, 1, V), tokens.view(2, 1), None, 10,
           known=known.view(2, 1, V))
    assert summarize_comparison(comp)["tim/dist/support_mismatch_frac"] == 0.5


@settings(max_examples=40, deadline=None)
@given(V=st.integers(2, 40), K=st.integers(1, 40), seed=st.integers(0, 10_000), noise=st.floats(0.0, 2.0))
@example(V=2, K=1, seed=0, noise=1e-6)  # nearly equal rows: a float64 KL sum of -1.7e-16 before the clamp
def test_property_coarse_grained_values_are_lower_bounds(V, K, seed, noise):
    lr, lt, tokens = _rows(B=1, T=3, V=V, noise=noise, seed=seed)
    K = min(K, V)
    known = torch.zeros_like(lr, dtype=torch.bool).scatter_(-1, lr.topk(K, -1).indices, True)
    coarse = compare_distributions(lr, lt, tokens, known=known)
    exact = compare_distributions(lr, lt, tokens)
    for a, b in ((coarse.kl_rollout_train, exact.kl_rollout_train), (coarse.kl_train_rollout,
                                                                      exact.kl_train_rollout), (coarse.tv, exact.tv)):
        assert torch.all(a <= b + 1e-6)
    assert torch.all(exact.tv >= 0) and torch.all(exact.tv <= 1 + 1e-12)
    assert torch.all(exact.kl_rollout_train >= 0) and torch.all(exact.kl_train_rollout >= 0)


def test_vocab_profile_bins_every_entry():
    lr, lt, _ = _rows(B=4, T=6, V=31, seed=9, truncate=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0] = False
    prof = VocabProfile()
    prof.update(lr[:2], lt[:2], mask[:2])  # two updates merge like one
    prof.update(lr[2:], lt[2:], mask[2:])
    r, t = lr[mask].double(), lt[mask].double()
    ok = (r > -math.inf) & (t > -math.inf)
    diff = (t - r).abs()[ok]
    p = r.exp()[ok]
    assert prof.entries == int(ok.sum()) and prof.skipped == int((~ok).sum())
    curves = prof.curves(min_count=1)
    # Both binnings against the naive selection: bin i holds edges[i] <= x < edges[i + 1], the first bin also
    # everything below, the last everything above. 1 − p is computed as the naive 1 − e^r here.
    for name, x, edges in (("p", p, VocabProfile.P_EDGES), ("one_minus_p", 1.0 - p, VocabProfile.ONE_MINUS_P_EDGES)):
        c = curves[name]
        assert sum(c["count"]) == prof.entries
        for centre, count, mean, q, mx in zip(*(c[k] for k in ("centre", "count", "mean", "quantile", "max"))):
            i = int(torch.searchsorted(edges, torch.tensor(centre, dtype=torch.float64))) - 1
            lo = edges[i] if i > 0 else -math.inf
            sel = (x >= lo) & (x < edges[i + 1]) if i < len(edges) - 2 else x >= lo
            d = diff[sel]
            assert count == d.numel(), (name, i)
            assert mean == pytest.approx(float(d.mean()), rel=1e-9)
            assert mx == pytest.approx(float(d.max()), rel=1e-12)
            exact_q = float(torch.quantile(d, 0.99, interpolation="higher"))
            assert exact_q * (1 - 1e-12) <= q <= max(exact_q * 10 ** (1 / 8) * (1 + 1e-12), 1e-9)
