"""Safe-vocabulary log-probs when the vocabulary is split over tensor-parallel ranks (a vocab-parallel lm_head, as
Megatron's: each rank holds the logits of one contiguous slice of the vocabulary, slices of any widths).

The kept set S of a row is the single-rank one (``tim_plugins.truncation``: vLLM order min-p → top-k → top-p, HF
order top-k → top-p → min-p; S = {a : z_a >= tau}), and the log-probs, ``in_safe``, pruned mass, |S| and entropy are
``tim_plugins.safe_vocab``'s; only the row statistics are reduced over the group:

* row max: each shard's max, ``all_reduce(MAX)``; the min-p threshold is m + log(min_p);
* top-k: each shard's k largest logits, ``all_gather``; the union holds the row's k largest exactly, so its k-th is
  the global k-th. Top-p after top-k is the nucleus among those k values and the copies of the k-th beyond them
  (``truncation._top_p_threshold_in_top_k`` with the whole row's count of the k-th value: each shard's count,
  ``all_reduce(SUM)``);
* top-p without top-k: candidates. Each shard's c largest logits of the set kept so far, ``all_gather``; their union's
  c largest are the row's c largest exactly. Their masses use the global normaliser over the kept set (one
  ``all_reduce(SUM)``); a sorted value is kept iff the mass strictly above it is < top_p (the descending form of
  vLLM's ascending cumulative rule, which keeps position j iff 1 − mass above j > 1 − top_p). A row whose kept prefix
  fills all c candidates may have its cut below them: those rows (the same on every rank, since the gathered values
  are) retry with c × 8, until c covers the widest shard;
* then one pass per chunk for Σ_S e^(z−m), Σ e^(z−m), |S|, Σ_S e^(z−m)(z−m) and the token's logit (from the rank
  that owns it, 0 elsewhere), stacked into one [k, N] ``all_reduce(SUM)``.

The fused head (``safe_linear_logprobs_vocab_parallel``) computes the shard's logits from the hidden states and this
rank's rows of the lm_head weight one row chunk at a time (the row statistics reduced per chunk), never [N, V].
The replay of a rollout engine's kept sets (``replay_logprobs_vocab_parallel`` and its hidden-state form) takes S
from the sets (global ids, every rank holds all of them; each shard expands its own columns per chunk): only the row
maximum and the stacked sums cross the shards.

Backward needs no communication (as Megatron's ``vocab_parallel_cross_entropy``): the gradient of a shard's logits
depends on its own values and the saved global row statistics, g·(onehot(a) − q) for the log-prob (no one-hot where
another rank owns the token) and −g_ent·q(log q + H) on S for the entropy, q the renormalised distribution on S.

Collectives per call: one ``all_reduce(MAX)`` and one ``all_reduce(SUM)``; with top-k one ``all_gather`` of [N, k]
(and with top-p one ``all_reduce(SUM)`` of the [N] tie counts, after one more pass over the shard); with top-p
without top-k one ``all_reduce(SUM)`` of [N] and one ``all_gather`` of [rows, c] per candidate round. Host reads:
none for min-p, top-k and top-k + top-p; top-p without top-k: one per candidate round (one round when every row's
nucleus lies within its 256 largest logits), plus one ``all_reduce`` of the shard widths at the first retry. Every
rank of the group must call with the same rows (the same N and tokens), as a TP group's ranks do.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._matmul import addmm_fp32
from ._safe_vocab_fused import _LOWEST, _bad_rows, _void_rows
from .replay import KeptSets, _check_kept, replay_logprobs_from_hidden, replay_logprobs_from_logits
from .safe_vocab import (SafeLogprobs, _buffers, _check_hidden, _check_rows, _logits_into, _temper, default_chunk_rows,
                         safe_logprobs_from_hidden, safe_logprobs_from_logits)
from .truncation import STEP_ORDER, Truncation, _top_p_threshold_in_top_k

__all__ = ["replay_linear_logprobs_vocab_parallel", "replay_logprobs_vocab_parallel",
           "safe_linear_logprobs_vocab_parallel", "safe_logprobs_vocab_parallel"]

# Candidates per row of the first top-p round (then × _CANDIDATE_GROWTH per retry): nuclei of sampled LLM rows at
# top_p 0.9-0.95 are mostly a few to a few hundred tokens; a [N, 256] fp32 gather per rank is small beside the logits.
_TOP_P_CANDIDATES = 256
_CANDIDATE_GROWTH = 8


def safe_logprobs_vocab_parallel(
    logits: torch.Tensor, tokens: torch.Tensor, trunc: Truncation, *, group=None, vocab_start: int = 0,
    compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """Safe log-probs of ``tokens`` from this rank's vocabulary shard of the logits.

    Args:
        logits: [N, V_local] this rank's shard: the columns vocab_start … vocab_start + V_local − 1 of the full
            vocabulary (shards may differ in width); any float dtype, computed in fp32 chunks; divided by
            ``trunc.temperature`` (pass temperature 1 for logits already scaled).
        tokens: [N] global token ids (not range-checked: no host read).
        trunc: the sampler's truncation (``Truncation``).
        group: the tensor-parallel process group; None, or a group of one rank, is the single-rank case:
            ``safe_logprobs_from_logits`` on the whole vocabulary (``vocab_start`` must then be 0).
        vocab_start: this shard's first vocabulary id.
        compute_entropy: also return the entropy of the safe distribution.
        chunk_size: rows per chunk for the fp32 temporaries (default ``default_chunk_rows(V_local, dtype)``).
    Returns:
        ``SafeLogprobs`` with [N] tensors, equal on every rank of the group; the log-probs and the entropy are
        differentiable w.r.t. this shard (no communication in backward).
    """
    if not isinstance(trunc, Truncation):
        raise ValueError(f"trunc={trunc!r}: expected a tim_plugins.truncation.Truncation")
    _check_rows("logits", logits, tokens, logits.shape[-1] if logits.dim() else 0, check_ids=False)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be >= 1 rows")
    if _single_rank(vocab_start, group):
        return safe_logprobs_from_logits(
            logits, tokens, min_p=trunc.min_p, temperature=trunc.temperature, top_p=trunc.top_p, top_k=trunc.top_k,
            order=trunc.order, compute_entropy=compute_entropy, chunk_size=chunk_size, check_ids=False)
    if logits.shape[1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: every shard needs at least one vocabulary column")
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(logits.shape[1], logits.dtype)
    logp, in_safe, pruned, size, ent = _VocabParallelSafe.apply(
        logits, tokens.long(), _Cut(trunc), group, int(vocab_start), chunk, bool(compute_entropy))
    return SafeLogprobs(logprobs=logp, in_safe=in_safe, pruned_mass=pruned, size=size, entropy=ent)


def safe_linear_logprobs_vocab_parallel(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, trunc: Truncation, *, group=None,
    vocab_start: int = 0, compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """Safe log-probs of ``tokens`` from final hidden states and this rank's rows of a vocab-parallel lm_head (a fused
    head: per row chunk the shard's logits ``hidden @ weight.T`` are computed, folded and dropped, never [N, V]).

    The same results as ``safe_logprobs_vocab_parallel`` on the logits the head would produce (a half-precision
    head's logits are rounded to its dtype first, as the model's own output layer rounds them); the row statistics
    are reduced over the group per chunk, so every rank of the group must call with the same rows and chunk size.

    Args:
        hidden: [N, H] final hidden states, the same on every rank of the group.
        weight: [V_local, H] this rank's rows of the lm_head weight: vocabulary ids vocab_start … vocab_start +
            V_local − 1 (no bias).
        tokens, trunc, group, vocab_start, compute_entropy: as for ``safe_logprobs_vocab_parallel``.
        chunk_size: rows per chunk (default ``default_chunk_rows(V_local, dtype)``).
    Returns:
        ``SafeLogprobs`` with [N] tensors, equal on every rank. Gradients: ``weight`` gets its rows' exact gradient;
        ``hidden`` gets this shard's part of its gradient, and the parts sum over the group to the whole one, as for
        Megatron's column-parallel output layer: the caller's mapping does that sum in its backward
        (``copy_to_tensor_model_parallel_region``, or the sequence-parallel gather). Backward communicates nothing.
    """
    if not isinstance(trunc, Truncation):
        raise ValueError(f"trunc={trunc!r}: expected a tim_plugins.truncation.Truncation")
    _check_hidden(hidden, weight, tokens, chunk_size, check_ids=False)
    if _single_rank(vocab_start, group):
        return safe_logprobs_from_hidden(
            hidden, weight, tokens, min_p=trunc.min_p, temperature=trunc.temperature, top_p=trunc.top_p,
            top_k=trunc.top_k, order=trunc.order, compute_entropy=compute_entropy, chunk_size=chunk_size,
            check_ids=False)
    if weight.shape[0] < 1:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: every shard needs at least one vocabulary row")
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(weight.shape[0], cdt)
    logp, in_safe, pruned, size, ent = _VocabParallelSafeHidden.apply(
        hidden, weight, tokens.long(), _Cut(trunc), group, int(vocab_start), chunk, bool(compute_entropy))
    return SafeLogprobs(logprobs=logp, in_safe=in_safe, pruned_mass=pruned, size=size, entropy=ent)


def _single_rank(vocab_start, group) -> bool:
    """Whether the call is the single-rank case (no group, or a group of one); checks ``vocab_start`` for it."""
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start={vocab_start!r}: must be an int >= 0 (this shard's first vocabulary id)")
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start != 0:
            raise ValueError(f"vocab_start={vocab_start} without a tensor-parallel group: a single rank holds the "
                             "whole vocabulary (vocab_start=0); pass the TP group for a shard")
        return True
    return False


def replay_logprobs_vocab_parallel(
    logits: torch.Tensor, tokens: torch.Tensor, kept: KeptSets, *, group=None, vocab_start: int = 0,
    temperature: float = 1.0, compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """``tim_plugins.replay.replay_logprobs_from_logits`` on this rank's vocabulary shard: the log-probs of
    ``tokens`` renormalised over the rollout engine's own kept set of each row, the vocabulary split over the group.

    Args:
        logits: [N, V_local] this rank's shard (columns vocab_start …), not yet divided by the temperature.
        tokens: [N] global token ids.
        kept: the engine's kept set of each row (``KeptSets``, N rows of global ids, the same on every rank; an empty
            row keeps the whole vocabulary). Ids are not range-checked against the other shards' widths.
        group, vocab_start, compute_entropy, chunk_size: as for ``safe_logprobs_vocab_parallel``.
        temperature: the engine's sampling temperature.
    Returns:
        ``SafeLogprobs`` with [N] tensors, equal on every rank (``in_safe``: the token is in the engine's set);
        differentiable w.r.t. this shard, no communication in backward. Collectives per call: the row maximum
        (``all_reduce(MAX)``) and one stacked ``all_reduce(SUM)``.
    """
    _check_rows("logits", logits, tokens, logits.shape[-1] if logits.dim() else 0, check_ids=False)
    _check_kept(kept, logits.shape[0], None, temperature)  # a shard does not know the whole vocabulary's size
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be >= 1 rows")
    if _single_rank(vocab_start, group):
        return replay_logprobs_from_logits(logits, tokens, kept, temperature=temperature,
                                           compute_entropy=compute_entropy, chunk_size=chunk_size)
    width = logits.shape[1]
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(width, logits.dtype)
    sel = _Kept.of(kept, temperature, int(vocab_start), width, logits.device)
    logp, in_safe, pruned, size, ent = _VocabParallelSafe.apply(
        logits, tokens.long(), sel, group, int(vocab_start), chunk, bool(compute_entropy))
    return SafeLogprobs(logprobs=logp, in_safe=in_safe, pruned_mass=pruned, size=size, entropy=ent)


def replay_linear_logprobs_vocab_parallel(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, kept: KeptSets, *, group=None,
    vocab_start: int = 0, temperature: float = 1.0, compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """``replay_logprobs_vocab_parallel`` from hidden states and this rank's rows of the lm_head weight, in row
    chunks (the contract and the gradients of ``safe_linear_logprobs_vocab_parallel``: ``hidden`` gets this shard's
    part of its gradient)."""
    _check_hidden(hidden, weight, tokens, chunk_size, check_ids=False)
    _check_kept(kept, hidden.shape[0], None, temperature)
    if _single_rank(vocab_start, group):
        return replay_logprobs_from_hidden(hidden, weight, tokens, kept, temperature=temperature,
                                           compute_entropy=compute_entropy, chunk_size=chunk_size)
    width = weight.shape[0]
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(width, cdt)
    sel = _Kept.of(kept, temperature, int(vocab_start), width, hidden.device)
    logp, in_safe, pruned, size, ent = _VocabParallelSafeHidden.apply(
        hidden, weight, tokens.long(), sel, group, int(vocab_start), chunk, bool(compute_entropy))
    return SafeLogprobs(logprobs=logp, in_safe=in_safe, pruned_mass=pruned, size=size, entropy=ent)


# ----------------------------------------------------------------------------------------------- row statistics


def _chunks(n: int, chunk: int):
    return ((s, min(s + chunk, n)) for s in range(0, n, chunk))


def _z(logits: torch.Tensor, rows, temperature: float) -> torch.Tensor:
    """fp32 logits / T of ``rows`` (a slice or an index tensor), a fresh tensor."""
    return _temper(logits[rows].to(torch.float32, copy=True), temperature)


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[n, c] from every rank, concatenated along the columns: [n, world · c]."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _local_top(z: torch.Tensor, c: int) -> torch.Tensor:
    """The c largest of each row of z, descending, -inf-padded where the shard is narrower than c."""
    top = z.topk(min(c, z.shape[1]), dim=-1, sorted=True).values
    if top.shape[1] < c:
        top = torch.nn.functional.pad(top, (0, c - top.shape[1]), value=-math.inf)
    return top


def _top_p_cut(logits, rows: torch.Tensor, m: torch.Tensor, tau: torch.Tensor, trunc: Truncation, group,
               chunk: int) -> torch.Tensor:
    """Smallest logit of the nucleus of the rows ``rows`` restricted to {z >= tau} ([r] each), across the shards."""
    temperature, top_p = trunc.temperature, trunc.top_p
    mass = torch.empty(rows.shape[0], dtype=torch.float32, device=m.device)
    c = _TOP_P_CANDIDATES
    tops = []
    for s, e in _chunks(rows.shape[0], chunk):
        z = _z(logits, rows[s:e], temperature)
        z.masked_fill_(z < tau[s:e, None], -math.inf)
        tops.append(_local_top(z, c))
        mass[s:e] = z.sub_(m[s:e, None]).exp_().sum(dim=-1)  # Σ_{kept} e^(z−m); e^(−inf) = 0 off the kept set
    dist.all_reduce(mass, op=dist.ReduceOp.SUM, group=group)
    cand = torch.cat(tops)
    cut = torch.empty_like(m)
    pending = torch.arange(rows.shape[0], device=m.device)
    widest = None
    while True:
        union = _gather_rows(cand, group)
        # every shard gave all its kept values: the union is the whole kept row, sorted whole (its c largest alone
        # would cut a nucleus wider than the widest shard at c values)
        whole = widest is not None and c >= widest
        vals = union.topk(union.shape[1] if whole else min(c, union.shape[1]), dim=-1, sorted=True).values
        p = (vals - m[pending, None]).exp_().div_(mass[pending, None])  # without whole: the rows' c largest, exactly
        above = p.cumsum(dim=-1).sub_(p)  # mass strictly above each sorted value
        count = ((above < top_p) & (vals > -math.inf)).sum(dim=-1)  # the kept prefix (>= 1: the row max)
        cut[pending] = vals.gather(-1, (count - 1).clamp(min=0)[:, None]).squeeze(-1)
        if whole:  # the cuts are exact
            return cut
        short = count >= vals.shape[1]  # the whole candidate prefix is kept: the cut may lie below it
        if not bool(short.any()):
            return cut
        if widest is None:  # the widest shard bounds the rounds (every rank needs the same answer)
            width = torch.tensor([float(logits.shape[1])], device=m.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            widest = int(width.item())
        pending = pending[short]
        c = min(c * _CANDIDATE_GROWTH, widest)
        tops = []
        for s, e in _chunks(pending.shape[0], chunk):
            idx = pending[s:e]
            z = _z(logits, rows[idx], temperature)
            tops.append(_local_top(z.masked_fill_(z < tau[idx, None], -math.inf), c))
        cand = torch.cat(tops)


@torch.no_grad()
def _row_stats(logits: torch.Tensor, trunc: Truncation, group, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global row max m, threshold tau of S) per row, [N] fp32 each, identical on every rank."""
    n, device = logits.shape[0], logits.device
    k = trunc.k
    m = torch.empty(n, dtype=torch.float32, device=device)
    tops = []
    for s, e in _chunks(n, chunk):
        z = _z(logits, slice(s, e), trunc.temperature)
        m[s:e] = z.amax(dim=-1)
        if k:
            tops.append(_local_top(z, k))
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    # floored at fp32's lowest finite value, as in safe_vocab: a -inf logit (a masked token) is never in S
    tau = torch.full((n,), _LOWEST, dtype=torch.float32, device=device)
    if not trunc.active:
        return m, tau
    # the k largest of each row (descending), -inf where the vocabulary has fewer
    desc = _gather_rows(torch.cat(tops), group).topk(k, dim=-1, sorted=True).values if k else None

    def min_p_cut() -> None:
        if trunc.min_p > 0.0:
            torch.maximum(tau, m + math.log(trunc.min_p), out=tau)

    def top_k_cut() -> None:
        if desc is not None:
            torch.maximum(tau, desc[:, k - 1], out=tau)  # unchanged when the row has < k finite logits: all kept

    def top_p_cut() -> None:
        if trunc.top_p >= 1.0:
            return
        if desc is None:
            cut = _top_p_cut(logits, torch.arange(n, device=device), m, tau, trunc, group, chunk)
        else:  # the kept set lies among the k largest and the copies of the k-th beyond them: count those
            kth = desc[:, k - 1 : k]
            ties = torch.empty(n, dtype=torch.float32, device=device)
            for s, e in _chunks(n, chunk):
                ties[s:e] = (_z(logits, slice(s, e), trunc.temperature) == kth[s:e]).sum(dim=-1)
            dist.all_reduce(ties, op=dist.ReduceOp.SUM, group=group)  # counts <= V < 2^24: exact in fp32
            cut = _top_p_threshold_in_top_k(None, tau, desc, k, trunc.top_p, ties=ties)
        torch.maximum(tau, cut, out=tau)

    cuts = {"min_p": min_p_cut, "top_k": top_k_cut, "top_p": top_p_cut}
    for step in STEP_ORDER[trunc.order]:
        cuts[step]()
    return m, tau


# ------------------------------------------------------------------------------------------------- autograd


def _owned(tokens: torch.Tensor, vocab_start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's column in this shard, 0 where another rank owns it; whether this shard owns it)."""
    local = tokens - vocab_start
    owned = (local >= 0) & (local < width)
    return torch.where(owned, local, torch.zeros_like(local)), owned


class _Cut:
    """S of each row: the sampler's rule recomputed on the trainer's logits (S = {a : z_a >= tau}, tau from
    ``_row_stats``)."""

    keeps_max = True  # S always holds the row max (the cut is relative to it): safe_vocab._Threshold's

    def __init__(self, trunc: Truncation) -> None:
        self.trunc, self.temperature = trunc, trunc.temperature

    def rows(self, s: int, e: int) -> "_Cut":
        return self

    def stats(self, logits, group, chunk: int):
        """(row max m, threshold tau, S's max: m, which S always holds)."""
        m, tau = _row_stats(logits, self.trunc, group, chunk)
        return m, tau, m

    @staticmethod
    def keep(z: torch.Tensor, s: int, e: int, tau: torch.Tensor) -> torch.Tensor:
        return z >= tau[s:e, None]

    @staticmethod
    def contains(z_tok: torch.Tensor, tau: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return z_tok >= tau


class _Kept:
    """S of each row: the engine's kept set (``tim_plugins.replay.KeptSets``: global ids, every rank holds all of
    them), this shard's columns of it expanded per chunk; a row without a recorded set keeps the whole vocabulary.
    The row maximum is the only row statistic reduced over the group."""

    keeps_max = False  # the engine's S need not hold the trainer's largest logit: replay._Replay's

    def __init__(self, ids: torch.Tensor, sizes: torch.Tensor, bounds: list, temperature: float, vocab_start: int,
                 width: int) -> None:
        self.ids, self.sizes, self.bounds = ids, sizes, bounds
        self.temperature, self.vocab_start, self.width = float(temperature), vocab_start, width

    @classmethod
    def of(cls, kept, temperature: float, vocab_start: int, width: int, device) -> "_Kept":
        return cls(kept.ids.to(device=device, dtype=torch.int64), kept.sizes.to(device), kept.offsets.tolist(),
                   temperature, vocab_start, width)

    def rows(self, s: int, e: int) -> "_Kept":
        a, b = self.bounds[s], self.bounds[e]
        return _Kept(self.ids[a:b], self.sizes[s:e], [x - a for x in self.bounds[s : e + 1]], self.temperature,
                     self.vocab_start, self.width)

    def stats(self, logits, group, chunk: int):
        """(row max m, a placeholder threshold the backward passes back, S's max: the engine's S need not hold the
        trainer's largest logit, and the sum over S is shifted by its own max, -inf for an S without a finite
        logit), both maxima in one ``all_reduce(MAX)``."""
        n = logits.shape[0]
        maxima = torch.empty((2, n), dtype=torch.float32, device=logits.device)
        for s, e in _chunks(n, chunk):
            z = _z(logits, slice(s, e), self.temperature)
            maxima[0, s:e] = z.amax(dim=-1)
            maxima[1, s:e] = z.masked_fill(~self.keep(z, s, e, None), -math.inf).amax(dim=-1)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        return maxima[0], torch.full_like(maxima[0], -math.inf), maxima[1]

    def keep(self, z: torch.Tensor, s: int, e: int, tau: torch.Tensor) -> torch.Tensor:
        n = e - s
        keep = torch.zeros((n, self.width), dtype=torch.bool, device=z.device)
        a, b = self.bounds[s], self.bounds[e]
        rows = torch.repeat_interleave(torch.arange(n, device=z.device), self.sizes[s:e], output_size=b - a)
        cols = self.ids[a:b] - self.vocab_start
        mine = (cols >= 0) & (cols < self.width)
        rows, cols = rows[mine], cols[mine]
        keep[rows, cols] = z[rows, cols] > -math.inf  # a -inf logit is never in S (replay._Replay)
        empty = [i - s for i in range(s, e) if self.bounds[i + 1] == self.bounds[i]]
        if empty:  # no recorded set: the whole vocabulary (found on the host: no pass over the chunk)
            keep[empty] = z[empty] > -math.inf
        return keep

    def contains(self, z_tok: torch.Tensor, tau: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        rows = torch.repeat_interleave(torch.arange(n, device=tokens.device), self.sizes,
                                       output_size=self.ids.shape[0])
        hits = torch.zeros(n, dtype=torch.int64, device=tokens.device)
        hits.index_add_(0, rows, (self.ids == tokens[rows]).long())
        return ((hits > 0) | (self.sizes == 0)) & (z_tok > -math.inf)


def _shard_forward(logits, tokens, local, owned, sel, group, chunk: int, want_entropy: bool):
    """The per-row results of rows of this shard's logits (any float dtype, not yet divided by T) over the sets
    ``sel`` gives (``_Cut`` or ``_Kept``, for these rows), its row statistics and one [k, n] ``all_reduce(SUM)``:
    (logp, in_safe, pruned, size as fp32, entropy or None, tau, log Σ_S e^z). Every rank of the group calls it with
    the same rows; n = 0 calls no collective."""
    n, device = logits.shape[0], logits.device
    empty = None
    if n == 0:  # every rank of the group has the same rows: none of them calls a collective
        m = tau = shift = torch.empty(0, dtype=torch.float32, device=device)
        sums = torch.zeros((5, 0), dtype=torch.float32, device=device)
    else:
        m, tau, shift = sel.stats(logits, group, chunk)
        # a replayed S (``_Kept``) need not hold the row max: the sum over S is shifted by S's own max
        # (safe_vocab._chunk_forward), the full sum by the row max; a row whose S holds no finite logit: log-prob
        # -inf, out of S
        apart = not sel.keeps_max
        if apart:
            empty = shift == -math.inf
            shift = torch.where(empty, m, shift)
        sums = torch.empty((5 if want_entropy else 4, n), dtype=torch.float32, device=device)
        with torch.no_grad():
            for s, e in _chunks(n, chunk):
                z = _z(logits, slice(s, e), sel.temperature)
                keep = sel.keep(z, s, e, tau)
                sums[3, s:e] = torch.where(owned[s:e], z.gather(-1, local[s:e, None]).squeeze(-1), 0.0)
                sums[2, s:e] = keep.sum(dim=-1, dtype=torch.int32).float()  # |S| <= V < 2^24: exact in fp32
                if apart:
                    sums[1, s:e] = (z - m[s:e, None]).exp_().sum(dim=-1)
                    ez = z.sub_(shift[s:e, None]).clamp_(max=0.0).exp_()  # off S above its max: masked out below
                else:
                    ez = z.sub_(m[s:e, None]).exp_()  # e^(z−m), in place
                    sums[1, s:e] = ez.sum(dim=-1)
                ez.mul_(keep)
                sums[0, s:e] = ez.sum(dim=-1)
                if want_entropy:  # e log e = e (z − m), 0 where e underflows (safe_vocab's form)
                    sums[4, s:e] = torch.special.xlogy(ez, ez, out=ez).sum(dim=-1)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    kept, full, size, z_tok = sums[0], sums[1], sums[2], sums[3]
    log_kept = kept.log()
    logp = (z_tok - shift) - log_kept  # safe_vocab._chunk_forward's order of operations
    in_safe = sel.contains(z_tok, tau, tokens)
    pruned = (1.0 - (kept if empty is None else kept * torch.exp(shift - m)) / full).clamp_(min=0.0)
    ent = log_kept - sums[4] / kept if want_entropy else None
    log_zs = shift + log_kept
    if empty is not None:
        logp = logp.masked_fill(empty, -math.inf)
        log_zs = log_zs.masked_fill(empty, math.inf)  # backward: q = e^(z − log_zs) = 0 on the row
        ent = None if ent is None else ent.masked_fill(empty, 0.0)
    # a row with a NaN / +inf logit on any shard (the reduced sum is NaN even where the MAX reduction dropped a NaN),
    # or none finite, as safe_vocab leaves it; the reduced values are the same on every rank, so is this
    logp, in_safe, pruned, size, ent = _void_rows(_bad_rows(m, full), logp, in_safe, pruned, size, ent)
    return logp, in_safe, pruned, size, ent, tau, log_zs


def _shard_grad(z: torch.Tensor, keep: torch.Tensor, local, owned, log_zs, ent, g_lp, g_ent,
                temperature: float) -> torch.Tensor:
    """dL/d(logits) of rows of this shard, fp32 [n, V_local], from ``z`` = those rows' fp32 logits / T (overwritten),
    their S on this shard (``keep``) and the saved row statistics: no communication."""
    logq = z.sub_(log_zs[:, None])
    q = torch.where(keep, logq.exp(), 0.0)
    g = torch.zeros_like(q)
    if g_ent is not None:  # dH/dz_j = −q_j (log q_j + H) on S; 0 at a -inf logit (q = 0), kept or not (_Kept)
        logq.clamp_(min=_LOWEST)
        g.sub_(torch.where(keep, logq.add_(ent[:, None]), 0.0).mul_(q).mul_(g_ent[:, None].float()))
    if g_lp is not None:  # d logp(a)/dz_j = 1[j = a] − q_j (the one-hot where this shard owns a)
        gl = g_lp.float()
        g.sub_(q.mul_(gl[:, None]))
        g.scatter_add_(-1, local[:, None], torch.where(owned, gl, 0.0)[:, None])
    return g.mul_(1.0 / temperature)


class _VocabParallelSafe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, sel, group, vocab_start, chunk, want_entropy):
        ctx.set_materialize_grads(False)
        local, owned = _owned(tokens, vocab_start, logits.shape[1])
        logp, in_safe, pruned, size, ent, tau, log_zs = _shard_forward(logits, tokens, local, owned, sel, group,
                                                                       chunk, want_entropy)
        ctx.save_for_backward(logits, local, owned, tau, log_zs, ent if ent is not None else log_zs)
        ctx.sel, ctx.chunk = sel, chunk
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size.long(), ent

    @staticmethod
    def backward(ctx, g_lp, _in_safe, _pruned, _size, g_ent):
        logits, local, owned, tau, log_zs, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return (None,) * 7
        grad = torch.empty_like(logits)
        sel = ctx.sel
        for s, e in _chunks(logits.shape[0], ctx.chunk):
            z = _z(logits, slice(s, e), sel.temperature)
            grad[s:e] = _shard_grad(z, sel.keep(z, s, e, tau), local[s:e], owned[s:e], log_zs[s:e], ent[s:e],
                                    None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e],
                                    sel.temperature)
        return grad, None, None, None, None, None, None


class _VocabParallelSafeHidden(torch.autograd.Function):
    """The hidden-state form of ``_VocabParallelSafe``: per row chunk the shard's logits (``safe_vocab._logits_into``:
    fp32, rounded to a half head's dtype first) go through ``_shard_forward``; backward recomputes them per chunk,
    ``_shard_grad`` gives dL/dlogits, and the two GEMMs accumulate in fp32 (a half head's logit gradient is rounded
    to its dtype per vocabulary tile first, as ``safe_vocab``'s hidden path does)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, sel, group, vocab_start, chunk, want_entropy):
        ctx.set_materialize_grads(False)
        n_rows, width = hidden.shape[0], weight.shape[0]
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        local, owned = _owned(tokens, vocab_start, width)
        zf, tile = _buffers(max(1, min(chunk, n_rows)), width, cdt, hidden.device)
        outs = []
        for s, e in _chunks(max(n_rows, 1), chunk):  # once for N = 0: empty results, no collective
            z = _logits_into(zf, tile, hidden[s:e].to(cdt), w)
            outs.append(_shard_forward(z, tokens[s:e], local[s:e], owned[s:e], sel.rows(s, e), group, e - s,
                                       want_entropy))
        del zf, tile
        logp, in_safe, pruned, size, ent, tau, log_zs = (
            torch.cat(o) if o[0] is not None else None for o in zip(*outs))
        ctx.save_for_backward(hidden, weight, local, owned, tau, log_zs, ent if ent is not None else log_zs)
        ctx.sel, ctx.chunk = sel, chunk
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size.long(), ent

    @staticmethod
    def backward(ctx, g_lp, _in_safe, _pruned, _size, g_ent):
        hidden, weight, local, owned, tau, log_zs, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w) or hidden.shape[0] == 0:
            grad_h = torch.zeros_like(hidden) if need_h else None
            grad_w = torch.zeros_like(weight) if need_w else None
            return grad_h, grad_w, None, None, None, None, None, None
        n_rows, width = hidden.shape[0], weight.shape[0]
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        zf, tile = _buffers(min(ctx.chunk, n_rows), width, cdt, hidden.device)
        sel = ctx.sel
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s, e in _chunks(n_rows, ctx.chunk):
            h = hidden[s:e].to(cdt)
            z = _temper(_logits_into(zf, tile, h, w), sel.temperature)
            g = _shard_grad(z, sel.keep(z, s, e, tau), local[s:e], owned[s:e], log_zs[s:e], ent[s:e],
                            None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e],
                            sel.temperature)
            if cdt == torch.float32:
                if need_w:
                    grad_w.addmm_(g.t(), h)
                if need_h:
                    grad_h[s:e] = torch.mm(g, w)
                continue
            acc = torch.zeros((e - s, w.shape[1]), dtype=torch.float32, device=w.device) if need_h else None
            for v0 in range(0, width, tile.shape[1]):
                v1 = min(v0 + tile.shape[1], width)
                t = tile[: e - s, : v1 - v0].copy_(g[:, v0:v1])
                if need_w:
                    addmm_fp32(grad_w[v0:v1], t.t(), h)
                if need_h:
                    addmm_fp32(acc, t, w[v0:v1])
            if need_h:
                grad_h[s:e] = acc
        del zf, tile
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None)
