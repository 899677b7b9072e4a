"""The safe-vocab head's per-tile folds as Triton kernels, for CUDA (``safe_vocab`` runs the GEMMs in cuBLAS).

Forward (``fold_rows``): one program per row of a [rows, V] logits buffer in the compute dtype reads the row
twice, first for its max m, then for Σ e^(z−m) over the whole vocabulary and over S = {z >= tau}, |S|, and the
entropy's Σ_S e^(z−m)(z−m) (tau = m + log min_p: min-p needs the row's max before it can select, so one
online pass, as TRL's full-vocabulary fold does, cannot give S exactly). The row (≈300 KB at V 150k in bf16)
is still in L2 for the second read. Backward (``grad_tile``): one program per (row, block) of a vocabulary tile
overwrites the recomputed logits with the gradient wrt them, in the tile's dtype, as TRL's backward does.

Same formulas as the torch folds in ``safe_vocab`` (z = x / T rounded as torch divides; the tests compare both
with a float64 reference under ``TRITON_INTERPRET=1`` on the CPU). ``tl.exp`` is the fast exp: sums agree with
the torch path to float32 rounding, and S itself is exact (it depends on comparisons of z alone).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["FOLD_BLOCK", "GRAD_BLOCK", "STATS", "fold_rows", "grad_tile"]

# Vocabulary entries per loop step of the forward fold (8 warps: 16 per thread), and per program of the backward.
FOLD_BLOCK = 4096
FOLD_WARPS = 8
GRAD_BLOCK = 1024
# Rows of the forward's per-row statistics (``fold_rows`` writes them into a [len(STATS), N] fp32 tensor).
STATS = ("max", "tau", "kept", "full", "z_token", "kept_ez")


@triton.jit
def _temper(x, temperature, HAS_T: tl.constexpr):
    z = x.to(tl.float32)
    if HAS_T:
        z = tl.math.div_rn(z, temperature)  # torch divides with IEEE rounding; Triton's `/` is approximate
    return z


@triton.jit
def _fold_kernel(x_ptr, x_stride, tok_ptr, stats_ptr, stats_stride, size_ptr, n_cols, temperature, log_min_p,
                 HAS_T: tl.constexpr, HAS_MIN_P: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_stride
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), -float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        z = _temper(tl.load(base + cols, mask=cols < n_cols, other=-float("inf")), temperature, HAS_T)
        run_max = tl.maximum(run_max, z)
    m = tl.max(run_max, axis=0)
    if HAS_MIN_P:
        tau = m + log_min_p
    else:
        tau = -float("inf")
    full = tl.zeros((BLOCK,), tl.float32)
    kept = tl.zeros((BLOCK,), tl.float32)
    ez = tl.zeros((BLOCK,), tl.float32)
    size = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        valid = cols < n_cols
        z = _temper(tl.load(base + cols, mask=valid, other=-float("inf")), temperature, HAS_T)
        e = tl.exp(z - m)  # 0 on the padding lanes (z = -inf)
        full += e
        keep = valid & (z >= tau) & (z > -float("inf"))  # a -inf logit is never in S (tau is -inf without min-p)
        kept += tl.where(keep, e, 0.0)
        size += keep.to(tl.int32)
        if HAS_ENTROPY:  # (z − m on kept lanes only: the padding's −inf × 0 would be NaN before the select)
            ez += e * tl.where(keep, z - m, 0.0)
    z_tok = _temper(tl.load(base + tl.load(tok_ptr + row)), temperature, HAS_T)
    out = stats_ptr + row
    tl.store(out, m)
    tl.store(out + stats_stride, tau)
    tl.store(out + 2 * stats_stride, tl.sum(kept, axis=0))
    tl.store(out + 3 * stats_stride, tl.sum(full, axis=0))
    tl.store(out + 4 * stats_stride, z_tok)
    if HAS_ENTROPY:
        tl.store(out + 5 * stats_stride, tl.sum(ez, axis=0))
    tl.store(size_ptr + row, tl.sum(size, axis=0))


@triton.jit
def _grad_kernel(x_ptr, x_stride, tok_ptr, tau_ptr, log_zs_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, vocab_start, n_cols,
                 temperature, inv_t, HAS_T: tl.constexpr, HAS_MIN_P: tl.constexpr, HAS_LP_GRAD: tl.constexpr,
                 HAS_ENT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # dL/dz_j = [g_lp (1[j = a] − q_j) − g_ent q_j (log q_j + H)] / T, q = softmax over S (0 off S)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    ptrs = x_ptr + row * x_stride + cols
    z = _temper(tl.load(ptrs, mask=valid, other=0.0), temperature, HAS_T)
    log_q = z - tl.load(log_zs_ptr + row)
    q = tl.exp(log_q)
    if HAS_MIN_P:
        q = tl.where(z >= tl.load(tau_ptr + row), q, 0.0)
    grad = tl.zeros((BLOCK,), tl.float32)
    if HAS_LP_GRAD:
        is_token = (cols + vocab_start) == tl.load(tok_ptr + row)
        grad += tl.load(g_lp_ptr + row) * (is_token.to(tl.float32) - q)
    if HAS_ENT_GRAD:
        # 0 at a -inf logit (q = 0), not 0 · (−inf) = NaN
        grad -= tl.load(g_ent_ptr + row) * tl.where(z > -float("inf"), q * (log_q + tl.load(ent_ptr + row)), 0.0)
    tl.store(ptrs, (grad * inv_t).to(x_ptr.dtype.element_ty), mask=valid)


def fold_launch(x: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, size: torch.Tensor, temperature: float,
                min_p: float, entropy: bool):
    """(grid, args, constexprs) of one ``_fold_kernel`` launch (also what the ahead-of-time compile test uses)."""
    args = (x, x.stride(0), tokens, stats, stats.stride(0), size, x.shape[1], float(temperature),
            math.log(min_p) if min_p > 0.0 else 0.0)
    consts = dict(HAS_T=temperature != 1.0, HAS_MIN_P=min_p > 0.0, HAS_ENTROPY=bool(entropy), BLOCK=FOLD_BLOCK)
    return (x.shape[0],), args, consts


def fold_rows(x: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, size: torch.Tensor, *,
              temperature: float, min_p: float, entropy: bool) -> None:
    """Per-row statistics of logits ``x`` [n, V] (any float dtype, rows contiguous) into ``stats`` [6, n] fp32
    (``STATS`` order; ``kept_ez`` only with ``entropy``) and ``size`` [n] int32 (|S|); ``tokens`` [n] int64."""
    if x.shape[0] == 0:
        return
    grid, args, consts = fold_launch(x, tokens, stats, size, temperature, min_p, entropy)
    _fold_kernel[grid](*args, **consts, num_warps=FOLD_WARPS)


def grad_launch(tile: torch.Tensor, vocab_start: int, tokens, tau, log_zs, entropy, g_lp, g_ent, temperature: float,
                min_p: float):
    """(grid, args, constexprs) of one ``_grad_kernel`` launch; an absent ``g_lp`` / ``g_ent`` / ``entropy`` is
    replaced by ``log_zs`` (a valid pointer the kernel does not read)."""
    args = (tile, tile.stride(0), tokens, tau, log_zs, log_zs if entropy is None else entropy,
            log_zs if g_lp is None else g_lp, log_zs if g_ent is None else g_ent, vocab_start, tile.shape[1],
            float(temperature), 1.0 / temperature)
    consts = dict(HAS_T=temperature != 1.0, HAS_MIN_P=min_p > 0.0, HAS_LP_GRAD=g_lp is not None,
                  HAS_ENT_GRAD=g_ent is not None, BLOCK=GRAD_BLOCK)
    return (tile.shape[0], triton.cdiv(tile.shape[1], GRAD_BLOCK)), args, consts


def grad_tile(tile: torch.Tensor, vocab_start: int, tokens: torch.Tensor, tau: torch.Tensor, log_zs: torch.Tensor,
              entropy: torch.Tensor | None, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, *,
              temperature: float, min_p: float) -> None:
    """Overwrite the logits tile [n, cols] (vocabulary ids ``vocab_start`` + j) with dL/dlogits, in its dtype.

    ``tokens``, ``tau``, ``log_zs`` (log Σ_S e^z of z = x / T), ``entropy``, ``g_lp``, ``g_ent``: [n] per row,
    fp32 (tokens int64), from the forward and the incoming gradients (None: no such term).
    """
    if tile.shape[0] == 0 or tile.shape[1] == 0:
        return
    grid, args, consts = grad_launch(tile, vocab_start, tokens, tau, log_zs, entropy, g_lp, g_ent, temperature,
                                     min_p)
    _grad_kernel[grid](*args, **consts)
