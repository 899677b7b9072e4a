"""Full next-token distributions of rollout and trainer compared on the same prefixes (torch only).

Sampled-token estimators (k1, k3, |d|) look at one token per position; two pipelines can agree on the sampled
token's log-prob and still disagree elsewhere in the vocabulary. Here, per position, with p_r the rollout's
and p_t the trainer's distribution over the vocabulary V (given as log-probs, ``-inf`` for excluded tokens):

* ``KL(p_r ‖ p_t) = Σ_a p_r(a) (log p_r(a) − log p_t(a))`` (what k1/k3 estimate from rollout samples) and
  ``KL(p_t ‖ p_r)``, exact, in float64; ``+inf`` when one side gives mass to a token the other excludes
  (counted as a *support mismatch*);
* total variation ``TV = ½ Σ_a |p_r(a) − p_t(a)|``;
* top-k overlap ``|top_k(p_r) ∩ top_k(p_t)| / max(|top_k(p_r)|, |top_k(p_t)|)``, ``top_k`` a side's k most likely
  tokens among those it gives mass to (fewer than k where it truncates; the denominator is then below k, so two
  equal truncated distributions overlap fully), and whether the argmax agrees;
* the sampled token's rank in each (1 = most likely; ties do not push a token down).

Rows are renormalised in float64 first (an fp32 log-softmax row sums to 1 only to ~1e-7).

When the rollout engine returns only its top-K log-probs (vLLM's ``logprobs=K``), pass ``known`` (which
entries of the rollout row are known). The two distributions are then coarse-grained to the known tokens plus
one "rest" bucket (mass ``1 − Σ_known p``), and KL and TV are computed on that partition: by the data-processing
inequality these are *lower bounds* of the true values. Top-k overlap (k <= K) and the rank of a sampled token
inside the top-K stay exact (every token more likely than it is known).

The known log-probs are float roundings, so the rollout's rest mass is known only to within ``K · eps``
(``_rest_mass_tolerance``). A confident row shows why it matters: a float32 top-1 log-prob of p > 1 − 6e-8
rounds to 0.0, the known mass is then >= 1 and the rollout's rest 0, while the trainer's rest, from its full
row, is a few 1e-8: taken as given, that is KL(p_t ‖ p_r) = +inf and a support mismatch between identical
weights. So where both rest masses are within the tolerance, neither side resolves mass outside the known tokens
and the rest bucket holds the trainer's rest on both sides (it adds nothing to KL or TV and is no support
mismatch). Where the trainer's rest is beyond the tolerance, the rollout's rest stays as computed: 0 (a known
mass of 1, e.g. an engine that truncated its distribution to the known tokens) is a support mismatch, and a
positive rest gives the partition's finite KL, still a lower bound of the exact one.

`VocabProfile` accumulates ``|log p_t(a) − log p_r(a)|`` over *every* vocabulary entry of the compared
positions, binned by the rollout probability (by 1 − p and by p), so the (1 − p) picture is drawn from the whole
distributions, not only from the sampled tokens. Its state is additive (counts, sums, histogram bins) and maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "PositionComparison",
    "compare_distributions",
    "summarize_comparison",
    "VocabProfile",
    "DIST_KEYS",
]

# Elements of one float64 [rows, V] working tile (rows are processed in chunks of about this size).
_TILE_ELEMENTS = 1 << 22

# Keys of `summarize_comparison`, in its order.
DIST_KEYS = (
    "tim/dist/positions", "tim/dist/invalid_positions", "tim/dist/kl_rollout_train_mean",
    "tim/dist/kl_rollout_train_max", "tim/dist/kl_train_rollout_mean", "tim/dist/kl_train_rollout_max",
    "tim/dist/tv_mean", "tim/dist/tv_max", "tim/dist/topk_overlap_mean", "tim/dist/top1_agree_frac",
    "tim/dist/sampled_rank_rollout_mean", "tim/dist/sampled_rank_train_mean", "tim/dist/sampled_rank_changed_frac",
    "tim/dist/support_mismatch_frac",
)


@dataclass
class PositionComparison:
    """Per-position results ([N] each, one entry per compared position; invalid rows hold NaN / -1)."""

    kl_rollout_train: torch.Tensor
    kl_train_rollout: torch.Tensor
    tv: torch.Tensor
    topk_overlap: torch.Tensor
    top1_agree: torch.Tensor
    rank_rollout: torch.Tensor
    rank_train: torch.Tensor
    support_mismatch: torch.Tensor
    valid: torch.Tensor
    top_k: int
    exact: bool

    @staticmethod
    def cat(parts: list["PositionComparison"]) -> "PositionComparison":
        if not parts:
            raise ValueError("PositionComparison.cat needs at least one part")
        if len({(p.top_k, p.exact) for p in parts}) != 1:
            raise ValueError("PositionComparison.cat: parts differ in top_k or exactness")
        fields = ("kl_rollout_train", "kl_train_rollout", "tv", "topk_overlap", "top1_agree", "rank_rollout",
                  "rank_train", "support_mismatch", "valid")
        out = {f: torch.cat([getattr(p, f) for p in parts]) for f in fields}
        return PositionComparison(**out, top_k=parts[0].top_k, exact=parts[0].exact)


def _flat_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if mask is None:
        return rows
    return rows[mask.reshape(-1).to(rows.device).bool()]


def _rest_mass_tolerance(known_count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far from 0 a rollout's rest mass ``1 − Σ_known p`` is not resolved, per row of ``known_count`` known
    log-probs given in ``dtype``: K · eps. Each known p <= 1 comes from a log-prob off by up to about eps nats (its
    float rounding), so it is off by up to eps absolutely, and the K-term sum by up to K · eps. eps is at least
    float32's: engines compute log-probs in float32 or less (a float64 row is usually one converted)."""
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    return known_count.double() * eps


def _xlogy_ratio(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ p (log p − log q) per row with 0·(...) = 0 and p > 0, q = 0 → +inf. A KL of two normalised rows is
    >= 0; for nearly equal rows the float64 sum can round to -1e-16, so it is clamped at 0."""
    term = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return term.sum(dim=-1).clamp_min(0.0)


def compare_distributions(
    rollout_logprobs: torch.Tensor,
    train_logprobs: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    top_k: int = 10,
    known: torch.Tensor | None = None,
) -> PositionComparison:
    """Compare rollout and trainer next-token distributions position by position.

    Args:
        rollout_logprobs, train_logprobs: [..., V] log-probs (``-inf`` = excluded token, e.g. truncated).
        tokens: [...] the sampled token ids.
        mask: [...] positions to compare (None = all).
        top_k: k of the top-k overlap (clamped to V).
        known: optional [..., V] bool, which rollout entries are known (an engine's top-K); None = all.
    Returns:
        `PositionComparison` over the masked positions, in row-major order. A row is invalid (NaN, rank -1)
        when either side holds a NaN or excludes every token.
    """
    if rollout_logprobs.shape != train_logprobs.shape:
        raise ValueError(f"compare_distributions: rollout {tuple(rollout_logprobs.shape)} and train "
                         f"{tuple(train_logprobs.shape)} log-probs differ in shape")
    if tokens.shape != rollout_logprobs.shape[:-1]:
        raise ValueError(f"compare_distributions: tokens {tuple(tokens.shape)} must be the log-probs' shape "
                         f"without the vocabulary axis, {tuple(rollout_logprobs.shape[:-1])}")
    if known is not None and known.shape != rollout_logprobs.shape:
        raise ValueError(f"compare_distributions: known {tuple(known.shape)} must have the log-probs' shape")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"compare_distributions(top_k={top_k!r}): must be an int >= 1")
    V = rollout_logprobs.shape[-1]
    k = min(top_k, V)
    lr_all = _flat_rows(rollout_logprobs, mask)
    lt_all = _flat_rows(train_logprobs, mask)
    tok_all = tokens.reshape(-1)
    if mask is not None:
        tok_all = tok_all[mask.reshape(-1).to(tok_all.device).bool()]
    kn_all = None if known is None else _flat_rows(known, mask)
    exact = kn_all is None or bool(kn_all.all())
    n = lr_all.shape[0]
    step = max(1, _TILE_ELEMENTS // max(1, V))
    parts = []
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        parts.append(_compare_chunk(lr_all[sl], lt_all[sl], tok_all[sl], None if exact else kn_all[sl], k,
                                    rollout_logprobs.dtype))
    if not parts:
        empty_f = torch.zeros(0, dtype=torch.float64)
        empty_b = torch.zeros(0, dtype=torch.bool)
        empty_l = torch.zeros(0, dtype=torch.long)
        return PositionComparison(empty_f, empty_f, empty_f, empty_f, empty_b, empty_l, empty_l, empty_b, empty_b,
                                  top_k=k, exact=exact)
    out = PositionComparison.cat([PositionComparison(*p, top_k=k, exact=exact) for p in parts])
    return out


@torch.no_grad()
def _compare_chunk(lr, lt, tok, known, k, rollout_dtype):
    lr = lr.detach().double().cpu()
    lt = lt.detach().double().cpu()
    tok = tok.detach().long().cpu()
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64)
    # Renormalise in float64 (fp32 log-softmax rows sum to 1 only to ~1e-7, which would floor the KL there);
    # a partial (top-K) rollout row is not a distribution and stays as given.
    lt = lt - torch.logsumexp(lt, dim=-1, keepdim=True)
    if known is not None:
        known = known.detach().bool().cpu()
        lr = torch.where(known, lr, neg_inf)
    else:
        lr = lr - torch.logsumexp(lr, dim=-1, keepdim=True)
    finite_r, finite_t = lr > -math.inf, lt > -math.inf
    valid = ~(torch.isnan(lr).any(-1) | torch.isnan(lt).any(-1)) & finite_r.any(-1) & finite_t.any(-1)
    pr, pt = lr.exp(), lt.exp()
    if known is None:
        support_mismatch = (finite_r != finite_t).any(-1)
        kl_rt = _xlogy_ratio(pr, lr, lt)
        kl_tr = _xlogy_ratio(pt, lt, lr)
        tv = 0.5 * (pr - pt).abs().sum(-1)
    else:
        # Coarse-grain both sides to {known tokens} ∪ {rest}: KL and TV of the partition (lower bounds).
        zero = torch.zeros_like(pt)
        pt_k = torch.where(known, pt, zero)
        lt_k = torch.where(known, lt, neg_inf)
        rest_r = (1.0 - pr.sum(-1)).clamp_min(0.0).unsqueeze(-1)
        rest_t = torch.where(known, zero, pt).sum(-1, keepdim=True)  # the unknown tokens' own sum: no cancellation
        # both rests within the known log-probs' rounding: resolved by neither side, the bucket holds the
        # trainer's rest on both (the module docstring)
        tol = _rest_mass_tolerance(known.sum(-1, keepdim=True), rollout_dtype)
        rest_r = torch.where((rest_r <= tol) & (rest_t <= tol), rest_t, rest_r)
        cr, ct = torch.cat([pr, rest_r], -1), torch.cat([pt_k, rest_t], -1)
        lcr = torch.cat([lr, rest_r.log()], -1)
        lct = torch.cat([lt_k, rest_t.log()], -1)
        support_mismatch = ((cr > 0) != (ct > 0)).any(-1)
        kl_rt = _xlogy_ratio(cr, lcr, lct)
        kl_tr = _xlogy_ratio(ct, lct, lcr)
        tv = 0.5 * (cr - ct).abs().sum(-1)
    top_r = lr.topk(k, dim=-1).indices
    top_t = lt.topk(k, dim=-1).indices
    # a truncated row has fewer than k tokens with mass: topk fills the rest with arbitrary excluded (-inf) ones,
    # which must neither match nor count
    kept_r = lr.gather(1, top_r) > -math.inf
    kept_t = lt.gather(1, top_t) > -math.inf
    in_r = torch.zeros_like(lr, dtype=torch.bool).scatter_(1, top_r, kept_r)
    size = torch.maximum(kept_r.sum(-1), kept_t.sum(-1)).clamp_min(1)
    overlap = (in_r.gather(1, top_t) & kept_t).sum(-1).double() / size
    top1 = top_r[:, 0] == top_t[:, 0]
    lr_tok = lr.gather(1, tok.unsqueeze(1))
    lt_tok = lt.gather(1, tok.unsqueeze(1))
    rank_r = 1 + (lr > lr_tok).sum(-1)
    rank_t = 1 + (lt > lt_tok).sum(-1)
    nan = torch.tensor(math.nan, dtype=torch.float64)
    bad = ~valid
    kl_rt, kl_tr, tv, overlap = (torch.where(bad, nan, x) for x in (kl_rt, kl_tr, tv, overlap))
    rank_r = torch.where(bad, -1, rank_r)
    rank_t = torch.where(bad, -1, rank_t)
    return (kl_rt, kl_tr, tv, overlap, top1 & valid, rank_r, rank_t, support_mismatch & valid, valid)


def summarize_comparison(comp: PositionComparison) -> dict[str, float]:
    """``tim/dist/*`` means and maxima over the valid positions.

    The KL means and maxima are taken over positions where the KL is finite; positions where one side gives
    mass to a token the other excludes (infinite KL) are reported as ``tim/dist/support_mismatch_frac``.
    Statistics of an empty set are NaN.
    """
    v = comp.valid
    n = int(v.sum())
    nan = math.nan

    def mean(x):
        x = x[v & torch.isfinite(x)] if x.is_floating_point() else x[v]
        return float(x.double().mean()) if x.numel() else nan

    def vmax(x):
        x = x[v & torch.isfinite(x)]
        return float(x.max()) if x.numel() else nan

    def frac(x):
        return float(x[v].double().mean()) if n else nan

    return {
        "tim/dist/positions": float(n),
        "tim/dist/invalid_positions": float((~v).sum()),
        "tim/dist/kl_rollout_train_mean": mean(comp.kl_rollout_train),
        "tim/dist/kl_rollout_train_max": vmax(comp.kl_rollout_train),
        "tim/dist/kl_train_rollout_mean": mean(comp.kl_train_rollout),
        "tim/dist/kl_train_rollout_max": vmax(comp.kl_train_rollout),
        "tim/dist/tv_mean": mean(comp.tv),
        "tim/dist/tv_max": vmax(comp.tv),
        "tim/dist/topk_overlap_mean": mean(comp.topk_overlap),
        "tim/dist/top1_agree_frac": frac(comp.top1_agree),
        "tim/dist/sampled_rank_rollout_mean": mean(comp.rank_rollout.double()),
        "tim/dist/sampled_rank_train_mean": mean(comp.rank_train.double()),
        "tim/dist/sampled_rank_changed_frac": frac(comp.rank_rollout != comp.rank_train),
        "tim/dist/support_mismatch_frac": frac(comp.support_mismatch),
    }


class VocabProfile:
    """|log p_t(a) − log p_r(a)| over every vocabulary entry, binned by the rollout probability p = p_r(a).

    Two binnings: by 1 − p (log-spaced, 1e-8 … 1: where the (1 − p) bound 2ε(1 − p) is tight, the head of the
    distribution) and by p (log-spaced, 1e-12 … 1: the tail). Per bin: count, mean, maximum, and a log-spaced
    histogram of |Δ| (8 bins per decade, 1e-9 … 1e2) from which `curves` reads quantiles as the upper edge of
    the bin holding them (at most a factor 10^(1/8) ≈ 1.33 above the exact value, capped at the bin maximum).
    Entries excluded on either side (``-inf``) or unknown are skipped and counted in ``skipped``.
    """

    ONE_MINUS_P_EDGES = torch.logspace(-8, 0, 33, dtype=torch.float64)
    P_EDGES = torch.logspace(-12, 0, 25, dtype=torch.float64)
    DIFF_EDGES = torch.logspace(-9, 2, 89, dtype=torch.float64)

    def __init__(self) -> None:
        nq, npb, nd = len(self.ONE_MINUS_P_EDGES) - 1, len(self.P_EDGES) - 1, len(self.DIFF_EDGES) + 1
        self._hist = {"one_minus_p": torch.zeros(nq * nd, dtype=torch.float64),
                      "p": torch.zeros(npb * nd, dtype=torch.float64)}
        self._sum = {"one_minus_p": torch.zeros(nq, dtype=torch.float64), "p": torch.zeros(npb, dtype=torch.float64)}
        self._max = {"one_minus_p": torch.zeros(nq, dtype=torch.float64), "p": torch.zeros(npb, dtype=torch.float64)}
        self.skipped = 0
        self.entries = 0

    @torch.no_grad()
    def update(self, rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor | None = None,
               known: torch.Tensor | None = None) -> None:
        """Add the entries of the masked positions ([..., V] log-probs, ``known`` as in `compare_distributions`)."""
        if rollout_logprobs.shape != train_logprobs.shape:
            raise ValueError("VocabProfile.update: rollout and train log-probs differ in shape")
        V = rollout_logprobs.shape[-1]
        lr_all, lt_all = _flat_rows(rollout_logprobs, mask), _flat_rows(train_logprobs, mask)
        kn_all = None if known is None else _flat_rows(known, mask)
        step = max(1, _TILE_ELEMENTS // max(1, V))
        for start in range(0, lr_all.shape[0], step):
            sl = slice(start, start + step)
            lr = lr_all[sl].detach().double().cpu().reshape(-1)
            lt = lt_all[sl].detach().double().cpu().reshape(-1)
            ok = (lr > -math.inf) & (lt > -math.inf) & ~torch.isnan(lr) & ~torch.isnan(lt)
            if kn_all is not None:
                ok &= kn_all[sl].detach().bool().cpu().reshape(-1)
            self.skipped += int((~ok).sum())
            lr, lt = lr[ok], lt[ok]
            self.entries += int(lr.numel())
            diff = (lt - lr).abs()
            dbin = torch.bucketize(diff, self.DIFF_EDGES, right=True)
            one_minus_p = -torch.expm1(lr)  # accurate near p = 1
            for name, x, edges in (("one_minus_p", one_minus_p, self.ONE_MINUS_P_EDGES), ("p", lr.exp(), self.P_EDGES)):
                nb = len(edges) - 1
                b = (torch.bucketize(x, edges, right=True) - 1).clamp_(0, nb - 1)
                nd = len(self.DIFF_EDGES) + 1
                self._hist[name] += torch.bincount(b * nd + dbin, minlength=nb * nd).double()
                self._sum[name] += torch.bincount(b, weights=diff, minlength=nb)
                self._max[name].scatter_reduce_(0, b, diff, reduce="amax")

    def curves(self, quantile: float = 0.99, min_count: int = 20) -> dict[str, dict[str, list[float]]]:
        """Per binning: bin centres (geometric), count, mean, the ``quantile`` and max of |Δ| for bins with at
        least ``min_count`` entries."""
        out = {}
        nd = len(self.DIFF_EDGES) + 1
        upper = torch.cat([self.DIFF_EDGES, torch.tensor([math.inf], dtype=torch.float64)])
        for name, edges in (("one_minus_p", self.ONE_MINUS_P_EDGES), ("p", self.P_EDGES)):
            hist = self._hist[name].reshape(-1, nd)
            count = hist.sum(-1)
            keep = count >= min_count
            centre = (edges[:-1] * edges[1:]).sqrt()
            cum = hist.cumsum(-1)
            qbin = (cum < quantile * count.unsqueeze(-1)).sum(-1).clamp_(max=nd - 1)
            q = torch.minimum(upper[qbin], self._max[name])
            out[name] = {
                "centre": centre[keep].tolist(), "count": count[keep].tolist(),
                "mean": (self._sum[name][keep] / count[keep]).tolist(), "quantile": q[keep].tolist(),
                "max": self._max[name][keep].tolist(),
            }
        return out
