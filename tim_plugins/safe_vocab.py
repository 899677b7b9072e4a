"""Safe-vocabulary log-probs: the trainer-side half of consistent tail pruning.

Rule (the same as vLLM's and HF's ``min_p`` sampling):
    p_T = softmax(z / T),   S = {a : p_T(a) >= min_p · max_b p_T(b)}
    safe log p(a) = log p_T(a) − log Σ_{b∈S} p_T(b) = z_a/T − logsumexp_{b∈S}(z_b/T)
Top-k / top-p cut S further with the sampler's order (``tim_plugins.truncation``), so any engine truncation
can be matched. ``min_p = 0`` (and no top-k/top-p) gives exactly ``log_softmax(z / T)[a]``.

Why: if every logit moves by at most ε between two pipelines, |Δ log p_a| <= 2ε(1 − p_a) to first order: the tail disagrees
most, and a sampled tail token carries a large, biased ratio. Pruning the extreme tail on both sides trades that
for a small pruning bias, reported here as the pruned mass 1 − Σ_S p_T.

Both entry points run a custom autograd Function over row chunks: forward keeps only per-row statistics
(max, threshold tau, log Σ_S), backward recomputes each chunk's logits (``hidden @ weight.T`` for the hidden
path) and turns them into the gradient in place. On CUDA both paths fold with Triton kernels
(``_safe_vocab_kernel``: the hidden path around its cuBLAS tiles, the logits path over the logits where they lie)
when the truncation is min-p alone (the default); top-k / top-p, and devices without Triton, take the torch
folds. S is chosen under no_grad (not differentiated); the gradient is that of the renormalised masked
log-softmax: d safe_logp(a) / dz_j = (1[j = a] − q_j) / T, q = p_T restricted to S and renormalised (q_j = 0
off S). ``safe_linear_logprobs`` is the hidden-state path with a fused head's contract (verl's
``FusedLinearForPPO``: [..., H] hidden states, the whole [V, H] weight, a ``Truncation``). The torch folds take S
from a selector (``_Threshold``: the rule recomputed; ``tim_plugins.replay``: the engine's own kept set).

Tokens outside the trainer's S (the sampler kept them, the trainer's own probabilities do not: "boundary
disagreements") get ``in_safe = False`` and the finite value z_a/T − logsumexp_S so that a multiplied-in mask
never creates NaN; exclude them from the loss with ``safe_loss_mask`` (``tim_plugins.safe_vocab_stats``, with the
``tim/safe_vocab/*`` statistics; both re-exported here).

Bad logits are reported, never raised (the diagnostics' rule): a logit at -inf (a token masked by the model or a
logits processor) is never in S, whatever the truncation, so |S| counts only tokens that can be sampled. A row with a
NaN or +inf logit (after the division by T), or without any finite one, has no distribution and no S: its log-prob
and entropy are NaN (as ``log_softmax`` gives them: the loss is not made to look finite), its ``pruned_mass`` is NaN
(the per-row mark of such a row, for the statistics to count it apart), its ``size`` 0 and its ``in_safe`` True (it
is no boundary disagreement: the mismatch monitor counts its NaN log-prob under ``tim/invalid_tokens``). Every other
row's results are the same as without it: rows are folded independently.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from ._matmul import addmm_fp32
from ._optional import is_triton_available
from ._safe_vocab_fused import _LOWEST, SafeFromHiddenFused, SafeFromLogitsFused, _bad_rows, _void_rows
from .safe_vocab_stats import SafeVocabStats, safe_loss_mask, safe_vocab_metrics
from .truncation import DEFAULT_MIN_P, Truncation, truncation_threshold

__all__ = [
    "BACKENDS",
    "DEFAULT_MIN_P",
    "TILE_ELEMENTS",
    "SafeLogprobs",
    "SafeVocabStats",
    "Truncation",
    "default_chunk_rows",
    "full_weight",
    "fused_failure_count",
    "safe_logprobs_from_logits",
    "safe_logprobs_from_hidden",
    "safe_linear_logprobs",
    "safe_loss_mask",
    "safe_vocab_metrics",
]

# TRL 1.16's fused-head tile in elements (trl/kernels/chunked_logprob.py: TOKEN_CHUNK_SIZE 4096 rows × the
# 32768 vocabulary columns add_fused_lm_head asks for), held in the compute dtype. One chunk's buffers here take
# at most as many bytes, so the working set is no larger than TRL's.
TILE_ELEMENTS = 4096 * 32768


# Vocabulary tile of a half-precision head's logits and gradient GEMMs (a [rows, tile] buffer in its dtype).
_GRAD_VOCAB_TILE = 32768
# The Triton backward's tile: TRL's own (TOKEN_CHUNK_SIZE rows × add_fused_lm_head's 32768 columns).
_FUSED_GRAD_ROWS = 4096
# "auto": the Triton folds on CUDA for a min-p-only truncation, else torch; "triton" / "torch" force one.
BACKENDS = ("auto", "triton", "torch")


def default_chunk_rows(vocab: int, dtype: torch.dtype = torch.float32, *, fused: bool = False) -> int:
    """Rows per chunk whose buffers fit TRL's tile in bytes (``TILE_ELEMENTS`` elements of ``dtype``).

    torch folds, per row: the fp32 logits and the bool safe-set mask (5 bytes per vocabulary entry), plus for
    half precision the row's [32768] GEMM tile in ``dtype``; at V = 151,936: 706 rows in fp32, 325 in bf16 /
    fp16. Triton folds (``fused``): the row's logits in ``dtype`` alone, 883 rows in any dtype.
    """
    vocab = max(1, int(vocab))
    itemsize = torch.empty((), dtype=dtype).element_size()
    if fused:
        return max(1, TILE_ELEMENTS // vocab)
    per_row = 5 * vocab + (min(vocab, _GRAD_VOCAB_TILE) * itemsize if itemsize < 4 else 0)
    return max(1, TILE_ELEMENTS * itemsize // per_row)


@dataclass
class SafeLogprobs:
    """Per-token results, all of shape [N].

    Attributes:
        logprobs: fp32 safe log-prob of the given token (differentiable).
        in_safe: bool, token ∈ S under the trainer's own probabilities.
        pruned_mass: fp32, 1 − Σ_S p_T (no grad).
        size: int64, |S|.
        entropy: fp32 entropy of the renormalised safe distribution (differentiable), or None.

    A row whose logits hold a NaN or +inf (or no finite value) has NaN log-prob, entropy and pruned mass, size 0
    and ``in_safe`` True (module docstring): ``pruned_mass`` is finite exactly on the rows with a distribution.
    """

    logprobs: torch.Tensor
    in_safe: torch.Tensor
    pruned_mass: torch.Tensor
    size: torch.Tensor
    entropy: torch.Tensor | None = None


class _Threshold:
    """Chooses S per row chunk for the torch folds: the sampler's rule recomputed on the trainer's logits,
    S = {a : z_a >= tau} with one threshold tau per row (``truncation_threshold``).

    The folds ask a selector for S twice per chunk (``select`` in forward, ``reselect`` in backward, bit-exactly
    the same set from the same logits), so another source of S (``tim_plugins.replay``: the engine's own kept
    set) plugs into the same autograd Functions.
    """

    keeps_max = True  # S always holds the row's largest logit (the cut is relative to it)

    def __init__(self, trunc: Truncation) -> None:
        self.trunc = trunc
        self.temperature = trunc.temperature
        self.masks = trunc.active  # whether S can be smaller than V (the folds then keep a [rows, V] bool buffer)

    def select(self, z: torch.Tensor, start: int, m: torch.Tensor, buf):
        """(keep [n, V] bool in ``buf`` or None for S = V, tau [n] saved for ``reselect``) of rows start…"""
        tau = truncation_threshold(z, self.trunc, row_max=m).clamp_(min=_LOWEST)  # -inf logits never kept
        return self.reselect(z, start, tau, buf), tau

    def reselect(self, z: torch.Tensor, start: int, tau: torch.Tensor, buf):
        if not self.masks:
            return None
        return torch.ge(z, tau[:, None], out=buf[: z.shape[0]])

    @staticmethod
    def contains(keep, z_tok: torch.Tensor, tau: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return z_tok >= tau  # without a mask pass when nothing is cut (tau = _LOWEST)


# Rows per slice of the mask passes below: the CPU kernels of float × uint8 and of a bool sum to int32 cast their
# input to the output's dtype first, a temporary of the operand's size; slices bound it (32 × V × 4 bytes).
# On CUDA one launch per pass is cheaper than bounding that temporary.
_MASK_ROWS = 32


def _mask_rows(x: torch.Tensor) -> int:
    return _MASK_ROWS if x.device.type == "cpu" else max(1, x.shape[0])


def _apply_mask(e: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    # float × uint8 has a vectorised CPU kernel, float × bool does not (about 1.4× slower); same values
    if keep is None:
        return e
    k = keep.view(torch.uint8)
    rows = _mask_rows(e)
    for s in range(0, e.shape[0], rows):
        e[s : s + rows].mul_(k[s : s + rows])
    return e


def _count_kept(keep: torch.Tensor) -> torch.Tensor:
    """|S| per row of a bool [n, V] mask, int64."""
    # an int32 reduction of the bool mask is ~1.5× faster on CPU than the default int64 one; |S| <= V < 2^31
    out = torch.empty(keep.shape[0], dtype=torch.int32, device=keep.device)
    rows = _mask_rows(keep)
    for s in range(0, keep.shape[0], rows):
        torch.sum(keep[s : s + rows], dim=-1, dtype=torch.int32, out=out[s : s + rows])
    return out.long()


def _chunk_forward(z: torch.Tensor, tok: torch.Tensor, sel, start: int, want_entropy: bool, keep_buf):
    """Statistics of one chunk (rows start…). z: [n, V] fp32 logits / T, overwritten. Returns per-row tensors."""
    m = z.amax(dim=-1)
    z_tok = z.gather(-1, tok[:, None]).squeeze(-1)
    keep, tau = sel.select(z, start, m, keep_buf)  # reselected bit-exactly in backward from the same z and tau
    in_set = sel.contains(keep, z_tok, tau, tok)
    if keep is None:
        # nothing is cut, but |S| leaves out the -inf logits (tau = _LOWEST): one compare pass, in this case only
        size = _count_kept(torch.ge(z, tau[:, None], out=keep_buf[: z.shape[0]]))
    else:
        size = _count_kept(keep)
    empty = None
    if keep is not None and not sel.keeps_max:
        # a replayed S need not hold the row's max: shifted by it, every e^(z−m) of S can underflow (a kept set 104
        # nats under the trainer's top token at fp32) and log Σ_S be -inf. Shifted by S's own max instead, whose term
        # is 1; the full sum keeps the row max (a token above S's max would overflow); a row whose S holds no finite
        # logit has no distribution over S (log-prob -inf, out of S)
        m_all, m = m, _masked_max(z, keep)
        empty = m == -math.inf
        m = torch.where(empty, m_all, m)
        full = _shifted_sum(z, m_all)
        e = z.sub_(m[:, None]).clamp_(max=0.0).exp_()  # off S above its max: clamped, then masked out
    else:
        e = z.sub_(m[:, None]).exp_()  # in place: e = exp(z − m), 0 < e <= 1
        full = e.sum(dim=-1)
    kept = full if keep is None else _apply_mask(e, keep).sum(dim=-1)  # Σ_S e^(z−m)
    log_kept = kept.log()
    log_zs = m + log_kept  # log Σ_S e^z
    logp = (z_tok - m) - log_kept  # log_softmax's own order of operations: min_p = 0 reproduces it
    if empty is None:
        pruned = (1.0 - kept / full).clamp_(min=0.0)
    else:
        pruned = (1.0 - kept * torch.exp(m - m_all) / full).clamp_(min=0.0)
        logp = logp.masked_fill(empty, -math.inf)
        log_zs = log_zs.masked_fill(empty, math.inf)  # backward: q = e^(z − log_zs) = 0 on the row, no NaN
        m = m_all  # _bad_rows: whether the row has a distribution at all
    entropy = None
    if want_entropy:
        # H(q) = log Σ_S e^(z−m) − Σ_S e^(z−m)(z−m) / Σ_S e^(z−m); e log e = e (z − m), and 0 where e underflows.
        # e is not needed afterwards: xlogy overwrites it instead of allocating another [n, V] tensor
        entropy = log_kept - torch.special.xlogy(e, e, out=e).sum(dim=-1) / kept
    if empty is not None and entropy is not None:
        entropy = entropy.masked_fill(empty, 0.0)
    logp, in_set, pruned, size, entropy = _void_rows(_bad_rows(m, full), logp, in_set, pruned, size, entropy)
    return logp, in_set, pruned, size, tau, log_zs, entropy


def _masked_max(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """max over S per row (-inf for an empty S), a slice of rows at a time (a [rows, V] temporary)."""
    out = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    rows = _mask_rows(z)
    for s in range(0, z.shape[0], rows):
        out[s : s + rows] = z[s : s + rows].masked_fill(~keep[s : s + rows], -math.inf).amax(dim=-1)
    return out


def _shifted_sum(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Σ e^(z − m) per row, z left unmodified, a slice of rows at a time."""
    out = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    rows = _mask_rows(z)
    for s in range(0, z.shape[0], rows):
        out[s : s + rows] = (z[s : s + rows] - m[s : s + rows, None]).exp_().sum(dim=-1)
    return out


def _chunk_grad(z, tok, tau, log_zs, entropy, g_lp, g_ent, sel, start, keep_buf):
    """Gradient wrt the tempered-input logits of one chunk, factored as ``row_scale[:, None] * G``.

    Returns (G, row_scale): G [n, V] fp32 written into z's storage, row_scale [n] fp32. Without an entropy
    gradient, dL/dz_j = −g·(q_j − 1[j = a])/T: G = q − onehot(a) and the per-row factor −g/T is applied to the
    [n, H] GEMM operands or results by the caller instead of in another pass over [n, V].
    """
    inv_t = 1.0 / sel.temperature
    keep = sel.reselect(z, start, tau, keep_buf)
    if g_ent is not None:
        # dH/dz_j = −q_j (log q_j + H) on S; log q = z − log Σ_S, floored at _LOWEST so that a -inf logit (q = 0)
        # gets 0, not 0 · (−inf) = NaN
        logq = z.sub_(log_zs[:, None]).clamp_(min=_LOWEST, max=0.0)  # <= 0 on S; off S (a replayed S) masked
        q = _apply_mask(logq.exp(), keep)
        grad = logq.add_(entropy[:, None]).mul_(q).mul_(-g_ent[:, None])  # reuses z's storage
        if g_lp is not None:
            grad.sub_(q.mul_(g_lp[:, None]))
            # d logp(a)/dz_a gets +1 (also for a outside S: logp(a) = z_a − log Σ_S is still a function of z_a)
            grad.scatter_add_(-1, tok[:, None], g_lp[:, None])
        return grad, torch.full_like(log_zs, inv_t)
    g = _apply_mask(z.sub_(log_zs[:, None]).clamp_(max=0.0).exp_(), keep)  # q, zero off S (clamped first: no inf × 0)
    g.scatter_add_(-1, tok[:, None], torch.full_like(g_lp[:, None], -1.0))  # also for a outside S (see above)
    return g, g_lp.neg().mul_(inv_t)


def _temper(z: torch.Tensor, temperature: float) -> torch.Tensor:
    # vLLM and HF divide the logits by T (not multiply by 1/T): same rounding here
    return z.div_(temperature) if temperature != 1.0 else z


def _keep_buffer(rows: int, vocab: int, sel, device, forward: bool = False) -> torch.Tensor | None:
    # allocated once per call: a fresh [rows, V] bool tensor per chunk costs page faults on CPU. Forward needs it
    # also when nothing is cut, to count |S| without the -inf logits (``default_chunk_rows`` budgets it anyway)
    return torch.empty((rows, vocab), dtype=torch.bool, device=device) if sel.masks or forward else None


class _SafeFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, sel, chunk, want_entropy):
        ctx.set_materialize_grads(False)
        rows, vocab = min(chunk, logits.shape[0]), logits.shape[1]
        zf = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
        keep_buf = _keep_buffer(rows, vocab, sel, logits.device, forward=True)
        outs = [[] for _ in range(7)]
        for s in range(0, max(logits.shape[0], 1), chunk):  # once for N = 0: empty results
            src = logits[s : s + chunk]
            z = _temper(zf[: src.shape[0]].copy_(src), sel.temperature)
            for acc, val in zip(outs, _chunk_forward(z, tokens[s : s + chunk], sel, s, want_entropy, keep_buf)):
                acc.append(val)
        del zf, keep_buf
        logp, in_safe, pruned, size, tau, log_zs, ent = (torch.cat(o) if o[0] is not None else None for o in outs)
        ctx.save_for_backward(logits, tokens, tau, log_zs, ent if ent is not None else log_zs)
        ctx.sel, ctx.chunk = sel, chunk
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size, ent

    @staticmethod
    def backward(ctx, g_lp, _a, _b, _c, g_ent):
        logits, tokens, tau, log_zs, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        sel, chunk = ctx.sel, ctx.chunk
        rows, vocab = min(chunk, logits.shape[0]), logits.shape[1]
        zf = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
        keep_buf = _keep_buffer(rows, vocab, sel, logits.device)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            sl = slice(s, s + chunk)
            src = logits[sl]
            z = _temper(zf[: src.shape[0]].copy_(src), sel.temperature)
            gz, scale = _chunk_grad(z, tokens[sl], tau[sl], log_zs[sl], ent[sl],
                                    None if g_lp is None else g_lp[sl].float(),
                                    None if g_ent is None else g_ent[sl].float(), sel, s, keep_buf)
            torch.mul(gz, scale[:, None], out=grad[sl])
        return grad, None, None, None, None


def _buffers(rows: int, vocab: int, cdt: torch.dtype, device):
    """The fp32 [rows, V] chunk buffer, plus a [rows, tile] buffer in the compute dtype for half precision."""
    zf = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    tile = None if cdt == torch.float32 else torch.empty((rows, min(vocab, _GRAD_VOCAB_TILE)), dtype=cdt,
                                                         device=device)
    return zf, tile


def _logits_into(zf: torch.Tensor, tile: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 logits of one row chunk, [n, V] view of ``zf``; half precision is rounded to its dtype first, as the
    model's own lm_head produces it, in vocab tiles (a [n, 150k] half GEMM is slower on CPU than tiles, and the
    tile bounds the half-precision buffer)."""
    n = h.shape[0]
    z = zf[:n]
    if tile is None:
        return torch.mm(h, w.t(), out=z)
    step = tile.shape[1]
    for v0 in range(0, w.shape[0], step):
        v1 = min(v0 + step, w.shape[0])
        t = tile[:n, : v1 - v0]
        torch.mm(h, w[v0:v1].t(), out=t)
        z[:, v0:v1].copy_(t)
    return z


class _SafeFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, sel, chunk, want_entropy):
        ctx.set_materialize_grads(False)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        zf, tile = _buffers(min(chunk, n_rows), vocab, cdt, hidden.device)
        keep_buf = _keep_buffer(min(chunk, n_rows), vocab, sel, hidden.device, forward=True)
        outs = [[] for _ in range(7)]
        for s in range(0, max(n_rows, 1), chunk):  # once for N = 0: empty results
            h = hidden[s : s + chunk].to(cdt)
            z = _temper(_logits_into(zf, tile, h, w), sel.temperature)
            for acc, val in zip(outs, _chunk_forward(z, tokens[s : s + chunk], sel, s, want_entropy, keep_buf)):
                acc.append(val)
        del zf, tile, keep_buf
        logp, in_safe, pruned, size, tau, log_zs, ent = (torch.cat(o) if o[0] is not None else None for o in outs)
        ctx.save_for_backward(hidden, weight, tokens, tau, log_zs, ent if ent is not None else log_zs)
        ctx.sel, ctx.chunk = sel, chunk
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size, ent

    @staticmethod
    def backward(ctx, g_lp, _a, _b, _c, g_ent):
        hidden, weight, tokens, tau, log_zs, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        sel, chunk = ctx.sel, ctx.chunk
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        zf, tile = _buffers(min(chunk, n_rows), vocab, cdt, hidden.device)
        keep_buf = _keep_buffer(min(chunk, n_rows), vocab, sel, hidden.device)
        # grad_hidden rows are written once each (one GEMM per row chunk); grad_weight sums over all chunks: fp32
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n_rows, chunk):
            sl = slice(s, s + chunk)
            h = hidden[sl].to(cdt)
            n = h.shape[0]
            z = _temper(_logits_into(zf, tile, h, w), sel.temperature)
            # dL/dz = scale[:, None] * gz, gz fp32 [n, V] in zf
            gz, scale = _chunk_grad(z, tokens[sl], tau[sl], log_zs[sl], ent[sl],
                                    None if g_lp is None else g_lp[sl].float(),
                                    None if g_ent is None else g_ent[sl].float(), sel, s, keep_buf)
            if cdt == torch.float32:
                if need_w:  # dW += gz^T (scale · h)
                    grad_w.addmm_(gz.t(), h * scale[:, None])
                if need_h:
                    grad_h[sl] = torch.mm(gz, w).mul_(scale[:, None])
                continue
            # Half precision, as TRL's fused head: the logit gradient (scale · gz) is rounded to the head's dtype
            # one vocab tile at a time, and both GEMMs take half inputs with fp32 accumulation (addmm_fp32), so
            # the GEMMs run on tensor cores while no partial product is rounded to half precision.
            acc = torch.zeros((n, w.shape[1]), dtype=torch.float32, device=w.device) if need_h else None
            for v0 in range(0, vocab, tile.shape[1]):
                v1 = min(v0 + tile.shape[1], vocab)
                t = torch.mul(gz[:, v0:v1], scale[:, None], out=tile[:n, : v1 - v0])
                if need_w:
                    addmm_fp32(grad_w[v0:v1], t.t(), h)
                if need_h:
                    addmm_fp32(acc, t, w[v0:v1])
            if need_h:
                grad_h[sl] = acc
        del zf, tile, keep_buf  # before the cast of grad_w below, which is often the step's peak
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None)


# How many calls' Triton folds failed in this process (each such call fell back to the torch folds); read it with
# ``fused_failure_count()``. A count, not a switch: one failure (say, one launch that met a transient error)
# does not turn the folds off for every later call.
_fused_failures = 0


def fused_failure_count() -> int:
    """Calls in this process whose Triton folds failed and that ran the torch folds instead ("auto" backend)."""
    return _fused_failures


def _fused_by_default(x: torch.Tensor) -> bool:
    return x.is_cuda and is_triton_available()


def _fused_applies(trunc: Truncation) -> bool:
    """The Triton folds select S by min-p alone; top-k / top-p need a sort or selection per row (torch)."""
    return trunc.top_p >= 1.0 and trunc.k == 0


def _use_fused(x: torch.Tensor, trunc: Truncation, backend: str) -> bool:
    """Whether a call runs the Triton folds (``backend``; see ``safe_logprobs_from_hidden``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "triton" and not _fused_applies(trunc):
        raise ValueError(f"backend='triton' with top_k={trunc.top_k}, top_p={trunc.top_p}: the Triton folds select "
                         "the safe set by min_p alone; use backend='auto' or 'torch' for top-k / top-p")
    return backend == "triton" or (
        backend == "auto" and _fused_applies(trunc) and _fused_by_default(x))


def _run_fused(function, backend: str, *args):
    """``function.apply(*args)`` (a Triton-fold autograd Function), or None when its forward failed and
    ``backend`` is "auto": then the failure is counted (``fused_failure_count``), warned about (Python shows a
    repeated warning once) and this call runs the torch folds; the next call tries the Triton folds again (a
    compile or launch error comes before any result exists). "triton" re-raises; running out of memory is never a
    fold failure."""
    global _fused_failures
    try:
        return function.apply(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        if backend == "triton":
            raise
        _fused_failures += 1
        warnings.warn(f"tim_plugins: the Triton safe-vocab folds failed ({err!r}); this call uses the torch folds.",
                      stacklevel=3)
        return None


def _resolve(min_p, temperature, top_p, top_k, order) -> Truncation:
    return Truncation(min_p=float(min_p), top_p=float(top_p), top_k=int(top_k), temperature=float(temperature),
                      order=order)


def _check_rows(name: str, x: torch.Tensor, tokens: torch.Tensor, vocab: int, check_ids: bool = True) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: expected 2-D [N, ...]; flatten batch and time first")
    if tokens.shape != (x.shape[0],):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}: expected [N] = [{x.shape[0]}] to match {name}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens dtype {tokens.dtype}: expected an integer tensor of token ids")
    if check_ids and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}); got range [{int(tokens.min())}, {int(tokens.max())}]")


def _pack(res) -> SafeLogprobs:
    logp, in_safe, pruned, size, ent = res
    return SafeLogprobs(logprobs=logp, in_safe=in_safe, pruned_mass=pruned, size=size, entropy=ent)


def safe_logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, *, min_p: float, temperature: float = 1.0, top_p: float = 1.0,
    top_k: int = 0, order: str = "vllm", compute_entropy: bool = False, chunk_size: int | None = None,
    backend: str = "auto", check_ids: bool = True,
) -> SafeLogprobs:
    """Safe log-probs of ``tokens`` from full logits.

    Args:
        logits: [N, V] raw logits (any float dtype; computed in fp32), not yet divided by the temperature.
        tokens: [N] int token ids.
        min_p, temperature, top_p, top_k, order: the sampler's truncation (see ``Truncation``).
        compute_entropy: also return the entropy of the safe distribution.
        chunk_size: rows per chunk for the torch folds' fp32 temporaries (default: ``default_chunk_rows(V,
            logits.dtype)``); the Triton folds read the logits in place and need none.
        backend: "auto", "triton" or "torch", as for ``safe_logprobs_from_hidden``.
        check_ids: check that every token id lies in the vocabulary (two host reads: on an accelerator a wait for
            the device; a caller whose ids are the model's own inputs, in a per-micro-batch path, passes False).
    Returns:
        ``SafeLogprobs`` with [N] tensors.
    """
    _check_rows("logits", logits, tokens, logits.shape[-1] if logits.dim() else 0, check_ids)
    trunc = _resolve(min_p, temperature, top_p, top_k, order)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be >= 1 rows")
    tokens = tokens.long()
    if _use_fused(logits, trunc, backend):
        res = _run_fused(SafeFromLogitsFused, backend, logits, tokens.contiguous(), trunc, bool(compute_entropy))
        if res is not None:
            return _pack(res)
    return _fold_logits(logits, tokens, _Threshold(trunc), chunk_size, compute_entropy)


def _fold_logits(logits, tokens, sel, chunk_size, compute_entropy) -> SafeLogprobs:
    """The torch folds over ``logits`` with the kept sets of ``sel`` (inputs already checked)."""
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(logits.shape[1], logits.dtype)
    return _pack(_SafeFromLogits.apply(logits, tokens, sel, chunk, bool(compute_entropy)))


def _fold_hidden(hidden, weight, tokens, sel, chunk_size, compute_entropy) -> SafeLogprobs:
    """The torch folds over ``hidden @ weight.T`` with the kept sets of ``sel`` (inputs already checked)."""
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    chunk = int(chunk_size) if chunk_size else default_chunk_rows(weight.shape[0], cdt)
    return _pack(_SafeFromHidden.apply(hidden, weight, tokens, sel, chunk, bool(compute_entropy)))


def safe_logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, min_p: float, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, order: str = "vllm", compute_entropy: bool = False,
    chunk_size: int | None = None, backend: str = "auto", check_ids: bool = True,
) -> SafeLogprobs:
    """Safe log-probs of ``tokens`` from final hidden states and the lm_head weight, never holding [N, V].

    Args:
        hidden: [N, H] final hidden states (after the last norm).
        weight: [V, H] lm_head weight (no bias: Qwen/Llama heads have none).
        tokens: [N] int token ids.
        min_p, temperature, top_p, top_k, order: the sampler's truncation (see ``Truncation``).
        compute_entropy: also return the entropy of the safe distribution.
        chunk_size: rows per chunk; one [chunk, V] tile is live at a time, in forward and in backward
            (default ``default_chunk_rows(V, dtype, fused=...)``: no more bytes than TRL's fused-head tile).
        backend: "auto" (Triton folds for CUDA tensors when the truncation is min-p alone, else torch),
            "triton" or "torch". If the Triton folds fail (e.g. no compiler for this GPU), "auto" counts it
            (``fused_failure_count``), warns, and runs this call on the torch folds.
        check_ids: as for ``safe_logprobs_from_logits``.
    Returns:
        ``SafeLogprobs`` with [N] tensors; gradients flow to ``hidden`` and ``weight``.
    """
    trunc = _resolve(min_p, temperature, top_p, top_k, order)
    return _from_hidden(hidden, weight, tokens, trunc, chunk_size, compute_entropy, backend, check_ids)


def _check_hidden(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, chunk_size,
                  check_ids: bool = True) -> None:
    for name, x in (("hidden", hidden), ("weight", weight)):
        if _is_dtensor(x):
            raise ValueError(
                f"{name} is a DTensor (placements {x.placements}): the safe-vocab folds need every row of the "
                "lm_head weight on this rank. Pass the gathered tensor: `tim_plugins.safe_vocab.full_weight(weight)` "
                "under FSDP2 (differentiable, its gradient averaged over the ranks as FSDP2 averages the others'; "
                "a bare `weight.full_tensor()` leaves each rank's shard its own rank's gradient), the parameter "
                "inside `FSDP.summon_full_params(...)` under FSDP1, and `hidden.to_local()` for the hidden states")
    _check_rows("hidden", hidden, tokens, weight.shape[0], check_ids)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: expected [V, H] with H = {hidden.shape[1]}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be >= 1 rows")


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """The whole lm_head weight from an FSDP2 shard (a DTensor), differentiably; a plain tensor as it is.

    The gradient of the gathered weight is each rank's own (its own tokens); it goes back to the shards averaged
    over every dimension of the weight's mesh, as FSDP2 reduces the gradients of the parameters it gathers itself
    (its default: the mean over the data-parallel ranks). ``weight.full_tensor()`` alone declares that gradient
    replicated, the same on every rank, and hands each shard its own rank's rows unreduced: the lm_head would train
    on one rank's tokens per shard. Where ranks hold the same tokens (a tensor-parallel dimension) the mean is their
    common gradient."""
    if not _is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Partial

    return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)


def _is_dtensor(x: torch.Tensor) -> bool:
    # by name: torch.distributed.tensor is absent from some builds, and importing it costs time
    return any(c.__name__ == "DTensor" for c in type(x).__mro__)


def _from_hidden(hidden, weight, tokens, trunc: Truncation, chunk_size, compute_entropy, backend,
                 check_ids: bool = True) -> SafeLogprobs:
    _check_hidden(hidden, weight, tokens, chunk_size, check_ids)
    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    tokens = tokens.long()
    if _use_fused(hidden, trunc, backend):
        chunk = int(chunk_size) if chunk_size else default_chunk_rows(weight.shape[0], cdt, fused=True)
        res = _run_fused(SafeFromHiddenFused, backend, hidden, weight, tokens.contiguous(), trunc, chunk,
                         (_FUSED_GRAD_ROWS, _GRAD_VOCAB_TILE), bool(compute_entropy))
        if res is not None:
            return _pack(res)
    return _fold_hidden(hidden, weight, tokens, _Threshold(trunc), chunk_size, compute_entropy)


def safe_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, truncation: Truncation, *,
    temperature: float | None = None, compute_entropy: bool = True, chunk_size: int | None = None,
    backend: str = "auto", check_ids: bool = True,
) -> SafeLogprobs:
    """The safe-vocab counterpart of a fused "linear + log-prob + entropy" head (verl's ``FusedLinearForPPO``:
    hidden states [..., H], lm_head weight [V, H], labels [...]), never holding the [N, V] logits.

    Per row chunk the logits ``hidden @ weight.T`` are computed, folded into per-token statistics and dropped;
    backward recomputes them chunk by chunk (``safe_logprobs_from_hidden``), so the gradients w.r.t. ``hidden``
    and ``weight`` are exact.

    Args:
        hidden: [..., H] final hidden states (after the last norm), plain tensors (``.to_local()`` a DTensor).
        weight: [V, H] lm_head weight, all of it: an FSDP2 shard is refused with the fix (``full_weight(weight)``).
        labels: [...] token ids, ``hidden``'s leading shape.
        truncation: the sampler's rule (``Truncation``).
        temperature: overrides ``truncation.temperature`` (a fused head is given the temperature per call).
        compute_entropy, chunk_size, backend, check_ids: as for ``safe_logprobs_from_hidden``.
    Returns:
        ``SafeLogprobs`` whose tensors have ``labels``' shape (log-probs and entropy fp32, differentiable).
    """
    if not isinstance(truncation, Truncation):
        raise ValueError(f"truncation={truncation!r}: expected a tim_plugins.truncation.Truncation")
    if temperature is not None and float(temperature) != truncation.temperature:
        truncation = dataclasses.replace(truncation, temperature=float(temperature))
    if hidden.dim() < 1 or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels has shape {tuple(labels.shape)}: expected hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})")
    shape = labels.shape
    res = _from_hidden(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), truncation, chunk_size,
                       compute_entropy, backend, check_ids)
    return SafeLogprobs(logprobs=res.logprobs.view(shape), in_safe=res.in_safe.view(shape),
                        pruned_mass=res.pruned_mass.view(shape), size=res.size.view(shape),
                        entropy=None if res.entropy is None else res.entropy.view(shape))
