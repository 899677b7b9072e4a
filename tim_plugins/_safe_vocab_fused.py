"""The safe-vocab autograd Functions that run the Triton folds (``_safe_vocab_kernel``), for a min-p-only
truncation on CUDA: the logits path and the hidden-state path. ``safe_vocab`` chooses between them and its torch
folds; the kernels (and Triton) are imported only when a Function runs. Also the rules every fold (torch, Triton,
vocab-parallel) applies to bad logits (``_LOWEST``, ``_bad_rows``, ``_void_rows``): here, since ``safe_vocab``
imports this module and not the reverse.
"""

from __future__ import annotations

import torch

from ._matmul import addmm_fp32

__all__ = ["SafeFromHiddenFused", "SafeFromLogitsFused"]

# fp32's lowest finite value: the floor of every threshold tau, so that S = {z >= tau} never holds a -inf logit (a
# masked token), also where nothing is cut (tau = -inf) or top-k reaches past the row's finite logits.
_LOWEST = torch.finfo(torch.float32).min


def _bad_rows(m: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Rows without a distribution, from their max m and Σ e^(z−m): m is NaN / +inf with a NaN / +inf logit and -inf
    without a finite one; the sum is NaN with a NaN logit also where a max skipped it (Triton's may)."""
    return ~(torch.isfinite(m) & torch.isfinite(full))


def _void_rows(bad: torch.Tensor, logp, in_safe, pruned, size, entropy):
    """(logp, in_safe, pruned, size, entropy) with the rows ``bad`` (no distribution, no S) set as ``safe_vocab``'s
    docstring says: NaN log-prob, pruned mass and entropy, size 0, in_safe True; the other rows untouched. [n]
    operations only, no host read."""
    nan = float("nan")
    return (logp.masked_fill(bad, nan), in_safe | bad, pruned.masked_fill(bad, nan), size.masked_fill(bad, 0),
            None if entropy is None else entropy.masked_fill(bad, nan))


def _from_fold_stats(stats: torch.Tensor, size: torch.Tensor, want_entropy: bool):
    """(logp, in_safe, pruned, size, tau, log_zs, entropy) from the Triton fold's per-row statistics (``STATS``
    order) and |S| (int32), in the torch fold's order of operations; rows without a distribution (a NaN / +inf logit,
    none finite) as the torch folds leave them (``_void_rows``)."""
    m, tau, kept, full, z_tok, kept_ez = stats
    tau = tau.clamp(min=_LOWEST)  # the kernel's tau is -inf when nothing is cut; the grad kernel reads it too
    log_kept = kept.log()
    logp = (z_tok - m) - log_kept
    pruned = (1.0 - kept / full).clamp_(min=0.0)
    ent = log_kept - kept_ez / kept if want_entropy else None
    logp, in_safe, pruned, size, ent = _void_rows(_bad_rows(m, full), logp, z_tok >= tau, pruned, size.long(), ent)
    return logp, in_safe, pruned, size, tau, m + log_kept, ent


class SafeFromLogitsFused(torch.autograd.Function):
    """The logits path with the Triton folds (min-p-only truncation): forward, one fold program per row reads
    the logits where they lie (no fp32 copy); backward, one pass writes the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, tokens, trunc, want_entropy):
        from . import _safe_vocab_kernel as K

        ctx.set_materialize_grads(False)
        x = logits if logits.stride(-1) == 1 else logits.contiguous()  # rows of unit stride
        stats = torch.zeros((len(K.STATS), x.shape[0]), dtype=torch.float32, device=x.device)
        size = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
        K.fold_rows(x, tokens, stats, size, temperature=trunc.temperature, min_p=trunc.min_p, entropy=want_entropy)
        logp, in_safe, pruned, size, tau, log_zs, ent = _from_fold_stats(stats, size, want_entropy)
        ctx.save_for_backward(x, tokens, tau, log_zs, ent if ent is not None else log_zs)
        ctx.trunc, ctx.want_entropy = trunc, want_entropy
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size, ent

    @staticmethod
    def backward(ctx, g_lp, _a, _b, _c, g_ent):
        from . import _safe_vocab_kernel as K

        x, tokens, tau, log_zs, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None
        grad = x.clone(memory_format=torch.contiguous_format)  # overwritten with dL/dlogits by the kernel
        K.grad_tile(grad, 0, tokens, tau, log_zs, ent if ctx.want_entropy else None,
                    None if g_lp is None else g_lp.float().contiguous(),
                    None if g_ent is None else g_ent.float().contiguous(),
                    temperature=ctx.trunc.temperature, min_p=ctx.trunc.min_p)
        return grad, None, None, None


class SafeFromHiddenFused(torch.autograd.Function):
    """The hidden path with Triton folds (``_safe_vocab_kernel``), for a min-p-only truncation.

    Forward: per chunk of rows, one cuBLAS GEMM into a [rows, V] buffer in the compute dtype, then one fold
    program per row (max, then the sums over V and S). Backward: ``grad_tile`` = (rows, columns), TRL's tiling:
    each recomputed tile is overwritten with the logit gradient in its dtype, and both gradient GEMMs accumulate
    in fp32 (``addmm_fp32``).
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, trunc, chunk, grad_tile, want_entropy):
        from . import _safe_vocab_kernel as K

        ctx.set_materialize_grads(False)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        buf = torch.empty((min(chunk, n_rows), vocab), dtype=cdt, device=hidden.device)
        stats = torch.zeros((len(K.STATS), n_rows), dtype=torch.float32, device=hidden.device)
        size = torch.empty(n_rows, dtype=torch.int32, device=hidden.device)
        for s in range(0, n_rows, chunk):
            h = hidden[s : s + chunk].to(cdt)
            x = torch.mm(h, w.t(), out=buf[: h.shape[0]])
            K.fold_rows(x, tokens[s : s + chunk], stats[:, s : s + chunk], size[s : s + chunk],
                        temperature=trunc.temperature, min_p=trunc.min_p, entropy=want_entropy)
        del buf
        logp, in_safe, pruned, size, tau, log_zs, ent = _from_fold_stats(stats, size, want_entropy)
        ctx.save_for_backward(hidden, weight, tokens, tau, log_zs, ent if ent is not None else log_zs)
        ctx.trunc, ctx.grad_tile, ctx.want_entropy = trunc, grad_tile, want_entropy
        ctx.mark_non_differentiable(in_safe, pruned, size)
        return logp, in_safe, pruned, size, ent

    @staticmethod
    def backward(ctx, g_lp, _a, _b, _c, g_ent):
        from . import _safe_vocab_kernel as K

        hidden, weight, tokens, tau, log_zs, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        trunc, (tile_rows, tile_cols) = ctx.trunc, ctx.grad_tile
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        cdt = torch.promote_types(hidden.dtype, weight.dtype)
        w = weight.to(cdt)
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        rows = max(1, min(tile_rows, n_rows))
        buf = torch.empty((rows, min(vocab, tile_cols)), dtype=cdt, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        acc = torch.empty((rows, w.shape[1]), dtype=torch.float32, device=w.device) if need_h else None
        for s in range(0, n_rows, rows):
            sl = slice(s, s + rows)
            h = hidden[sl].to(cdt)
            n = h.shape[0]
            if need_h:
                acc[:n].zero_()
            for v0 in range(0, vocab, buf.shape[1]):
                v1 = min(v0 + buf.shape[1], vocab)
                tile = torch.mm(h, w[v0:v1].t(), out=buf[:n, : v1 - v0])
                K.grad_tile(tile, v0, tokens[sl], tau[sl], log_zs[sl], ent[sl] if ctx.want_entropy else None,
                            None if g_lp is None else g_lp[sl], None if g_ent is None else g_ent[sl],
                            temperature=trunc.temperature, min_p=trunc.min_p)
                if need_w:
                    addmm_fp32(grad_w[v0:v1], tile.t(), h)
                if need_h:
                    addmm_fp32(acc[:n], tile, w[v0:v1])
            if need_h:
                grad_h[sl] = acc[:n]
        del buf, acc  # before the cast of grad_w below, which is often the step's peak
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None)
