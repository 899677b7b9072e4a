"""Importance-sampling corrections for rollouts whose log-probs differ from the trainer's (pure torch).

Per token, d_t = log π_train(y_t) − log π_rollout(y_t) and ρ_t = exp(d_t); per sequence, over its kept
tokens, S = Σ_t d_t, ρ_seq = exp(S) and the geometric mean g = exp(S / n). Every function takes
``(train_logprobs [B, T], rollout_logprobs [B, T], mask [B, T])`` and returns ``(weights [B, T],
new_mask [B, T] bool)``:

- weights are detached (computed under no_grad), float32 (float64 for float64 inputs), exactly 0 outside
  ``new_mask``; multiply the per-token policy-gradient loss by them.
- ``new_mask ⊆ mask``: a token leaves the mask when it is invalid (either log-prob NaN/±inf or
  <= ``INVALID_LOGPROB_THRESHOLD`` = -1e3, the placeholder convention of :mod:`tim_plugins.metrics`) or when
  the mode rejects it; sequence modes reject a whole row that contains an invalid token (its ρ_seq is
  unknown).

Modes (``CORRECTION_MODES``; join several with ``+``, e.g. ``"geo_rs+token_tis"``: masks intersect,
weights multiply):

====================  =========================================================  ====================
mode                  weight w_t / kept                                          option
====================  =========================================================  ====================
``none``              w = 1 on valid tokens                                       —
``token_tis``         w = min(ρ_t, C); all valid tokens kept                      C = ``token_clip``
``token_mis``         w = ρ_t · 1[ρ_t <= C]; tokens with ρ_t > C dropped          C = ``token_clip``
``icepop``            w = ρ_t · 1[lo <= ρ_t <= hi]; tokens outside dropped        ``icepop_band``
``seq_tis``           w = min(ρ_seq, C) on every token of the row                 C = ``seq_clip``
``seq_mis``           w = ρ_seq · 1[ρ_seq <= C]; rows with ρ_seq > C dropped      C = ``seq_clip``
``geo_rs``            w = 1; rows with g outside [lo, hi] dropped                 ``geo_band``
====================  =========================================================  ====================

Numerics: token modes use ρ_t = exp(min(d_t, L)) with L = ``log_ratio_clamp`` (20 as in verl; exp(20) ≈ 4.9e8
is finite in float32 and above any useful threshold, so decisions are unchanged); sequence modes stay in
log space — min(ρ_seq, C) = exp(min(S, log C)) and ρ_seq <= C ⇔ S <= log C — so a 10⁴-token sequence can
neither overflow nor produce inf · 0.

Empty kept set: when a mode removes every token (a fully masked batch, all rows rejected), the weights are
all 0 and ``new_mask`` is all False; nothing here divides. Aggregate the loss with :func:`masked_mean`,
which returns 0 (with zero gradient) instead of 0/0 = NaN, and read ``CorrectionResult.empty`` /
``tim/correction/kept_frac`` to see it happen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tim_plugins._mismatch_layout import valid_logprob_pair
from tim_plugins.accumulate import Accumulated, Accumulator

__all__ = [
    "CORRECTION_MODES",
    "CorrectionConfig",
    "CorrectionResult",
    "CorrectionStats",
    "apply_correction",
    "masked_mean",
    "token_tis",
    "token_mis",
    "icepop",
    "seq_tis",
    "seq_mis",
    "geo_rs",
    "no_correction",
]

CORRECTION_MODES = ("none", "token_tis", "token_mis", "icepop", "seq_tis", "seq_mis", "geo_rs")
_MAX_LOG_CLAMP = 80.0  # exp(80) ≈ 5.5e34 < float32 max 3.4e38


@dataclass
class CorrectionConfig:
    """Which correction to apply and its thresholds (one source of truth for the defaults)."""

    mode: str = field(default="token_tis", metadata={
        "help": f"One of {CORRECTION_MODES}, or several joined with '+' (e.g. 'geo_rs+token_tis')."})
    token_clip: float = field(default=2.0, metadata={
        "help": "C for token_tis / token_mis (verl's default 2; 1.5-5 are common)."})
    seq_clip: float = field(default=2.0, metadata={
        "help": "C for seq_tis / seq_mis on ρ_seq = Π ρ_t (Seq-MIS paper: 2; 2-10 are common)."})
    icepop_band: tuple = field(default=(0.5, 5.0), metadata={
        "help": "IcePop keeps tokens with lo <= ρ_t <= hi (Ling team: 0.5, 5)."})
    geo_band: tuple = field(default=(0.99, 1.01), metadata={
        "help": "geo_rs keeps rows whose geometric-mean ratio exp(mean_t d_t) is in [lo, hi]. 10x wider "
                "than verl's 0.999-1.001 preset, which can reject every row of a bf16 rollout."})
    log_ratio_clamp: float = field(default=20.0, metadata={
        "help": "Token modes compute ρ_t = exp(min(d_t, L)) (verl clamps at 20)."})

    def __post_init__(self) -> None:
        parts = _parse_mode(self.mode)
        self.icepop_band = tuple(float(v) for v in self.icepop_band)
        self.geo_band = tuple(float(v) for v in self.geo_band)
        lc = float(self.log_ratio_clamp)
        if not (math.isfinite(lc) and 0.0 < lc <= _MAX_LOG_CLAMP):
            raise ValueError(
                f"CorrectionConfig.log_ratio_clamp={self.log_ratio_clamp!r} must be in (0, {_MAX_LOG_CLAMP}] so "
                "exp() stays finite in float32; 20 is the usual value.")
        for name in ("token_clip", "seq_clip"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v > 0.0):
                raise ValueError(f"CorrectionConfig.{name}={getattr(self, name)!r} must be a finite number > 0.")
        if not float(self.token_clip) < math.exp(lc):
            raise ValueError(
                f"CorrectionConfig.token_clip={self.token_clip!r} must be below exp(log_ratio_clamp) = "
                f"{math.exp(lc):.3g}; raise log_ratio_clamp or lower the clip.")
        lo, hi = self._band("icepop_band")
        if not (0.0 <= lo < hi < math.exp(lc)):
            raise ValueError(
                f"CorrectionConfig.icepop_band={self.icepop_band!r} must satisfy 0 <= lo < hi < "
                f"exp(log_ratio_clamp); e.g. (0.5, 5.0).")
        lo, hi = self._band("geo_band")
        if not (0.0 < lo <= 1.0 <= hi and math.isfinite(hi)):
            raise ValueError(
                f"CorrectionConfig.geo_band={self.geo_band!r} must satisfy 0 < lo <= 1 <= hi (a band around "
                "ratio 1); e.g. (0.99, 1.01).")
        self.mode = "+".join(parts)

    def _band(self, name: str) -> tuple[float, float]:
        band = getattr(self, name)
        if len(band) != 2 or not all(math.isfinite(v) for v in band):
            raise ValueError(f"CorrectionConfig.{name}={band!r} must be two finite numbers (lo, hi).")
        return band[0], band[1]


def _parse_mode(mode: str) -> list[str]:
    if not isinstance(mode, str) or not mode.strip():
        raise ValueError(f"correction mode {mode!r} must be a non-empty string from {CORRECTION_MODES}.")
    parts = [p.strip() for p in mode.split("+")]
    bad = [p for p in parts if p not in CORRECTION_MODES]
    if bad:
        raise ValueError(
            f"correction mode {mode!r}: unknown part(s) {bad}; use one of {CORRECTION_MODES} or join several "
            "with '+' (e.g. 'geo_rs+token_tis').")
    if len(parts) > 1 and "none" in parts:
        raise ValueError(f"correction mode {mode!r}: 'none' cannot be combined with other modes.")
    if len(set(parts)) != len(parts):
        raise ValueError(f"correction mode {mode!r} lists a mode twice.")
    return parts


def _prepare(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor):
    """→ (d [B, T] with 0 on invalid/masked tokens, valid [B, T] bool, in_mask [B, T] bool)."""
    if train.dim() != 2 or train.shape != rollout.shape or train.shape != mask.shape:
        raise ValueError(
            "corrections expect train_logprobs, rollout_logprobs and mask of the same shape [B, T]; got "
            f"{tuple(train.shape)}, {tuple(rollout.shape)}, {tuple(mask.shape)}.")
    ct = torch.promote_types(torch.promote_types(train.dtype, rollout.dtype), torch.float32)
    t = train.detach().to(ct)
    r = rollout.detach().to(ct)
    in_mask = mask.detach() != 0
    d = t - r
    valid = in_mask & valid_logprob_pair(r, t, d)
    zero = torch.zeros((), dtype=ct, device=t.device)
    d = torch.where(valid, d, zero)  # d_t = log π_train − log π_rollout (0 where not valid)
    return d, valid, in_mask


def _token_ratio(d: torch.Tensor, log_ratio_clamp: float) -> torch.Tensor:
    return torch.exp(d.clamp(max=log_ratio_clamp))  # ρ_t = exp(min(d_t, L))


def _seq_parts(d: torch.Tensor, valid: torch.Tensor, in_mask: torch.Tensor):
    """→ (S [B] = Σ_t d_t over valid tokens, n [B] valid counts, row_ok [B] = no invalid token in the mask)."""
    s = d.sum(dim=-1)
    n = valid.sum(dim=-1)
    row_ok = ~(in_mask & ~valid).any(dim=-1)
    return s, n, row_ok


def _finish(w: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device)), keep


@torch.no_grad()
def no_correction(train_logprobs, rollout_logprobs, mask, **_: float):
    """w_t = 1 on valid tokens; invalid tokens leave the mask."""
    d, valid, _m = _prepare(train_logprobs, rollout_logprobs, mask)
    return _finish(torch.ones_like(d), valid)


@torch.no_grad()
def token_tis(train_logprobs, rollout_logprobs, mask, *, clip: float = 2.0, log_ratio_clamp: float = 20.0):
    """Truncated IS per token: w_t = min(ρ_t, C), ρ_t = exp(train − rollout). Keeps every valid token.

    Args:
        train_logprobs, rollout_logprobs: [B, T] log-probs of the sampled tokens.
        mask: [B, T] bool or 0/1 (response tokens).
    Returns:
        (weights [B, T], new_mask [B, T] bool).
    """
    d, valid, _m = _prepare(train_logprobs, rollout_logprobs, mask)
    return _finish(_token_ratio(d, log_ratio_clamp).clamp(max=clip), valid)  # min(ρ, C)


@torch.no_grad()
def token_mis(train_logprobs, rollout_logprobs, mask, *, clip: float = 2.0, log_ratio_clamp: float = 20.0):
    """Masked IS per token: w_t = ρ_t · 1[ρ_t <= C]; tokens with ρ_t > C leave the mask. Shapes as token_tis."""
    d, valid, _m = _prepare(train_logprobs, rollout_logprobs, mask)
    rho = _token_ratio(d, log_ratio_clamp)
    return _finish(rho, valid & (rho <= clip))  # ρ · 1[ρ <= C]


@torch.no_grad()
def icepop(train_logprobs, rollout_logprobs, mask, *, band: tuple[float, float] = (0.5, 5.0),
           log_ratio_clamp: float = 20.0):
    """IcePop: w_t = ρ_t · 1[lo <= ρ_t <= hi]; tokens outside the band leave the mask. Shapes as token_tis."""
    lo, hi = band
    d, valid, _m = _prepare(train_logprobs, rollout_logprobs, mask)
    rho = _token_ratio(d, log_ratio_clamp)
    return _finish(rho, valid & (rho >= lo) & (rho <= hi))  # ρ · 1[lo <= ρ <= hi]


@torch.no_grad()
def seq_tis(train_logprobs, rollout_logprobs, mask, *, clip: float = 2.0):
    """Truncated sequence IS: every kept token of row b gets w_b = min(ρ_seq, C) = exp(min(S_b, log C)),
    S_b = Σ_t d_bt over the row's valid tokens. Rows with an invalid token leave the mask. Shapes as token_tis."""
    d, valid, in_mask = _prepare(train_logprobs, rollout_logprobs, mask)
    s, _n, row_ok = _seq_parts(d, valid, in_mask)
    w_row = torch.exp(s.clamp(max=math.log(clip)))  # min(ρ_seq, C) in log space
    keep = valid & row_ok[:, None]
    return _finish(w_row[:, None].expand_as(d), keep)


@torch.no_grad()
def seq_mis(train_logprobs, rollout_logprobs, mask, *, clip: float = 2.0):
    """Masked sequence IS: w_b = ρ_seq · 1[ρ_seq <= C] (tested as S_b <= log C); rejected rows (and rows with
    an invalid token) leave the mask. Shapes as token_tis."""
    d, valid, in_mask = _prepare(train_logprobs, rollout_logprobs, mask)
    s, _n, row_ok = _seq_parts(d, valid, in_mask)
    log_c = math.log(clip)
    keep_row = row_ok & (s <= log_c)  # ρ_seq <= C ⇔ S <= log C
    w_row = torch.exp(s.clamp(max=log_c))  # exact ρ_seq on kept rows, never overflows on rejected ones
    return _finish(w_row[:, None].expand_as(d), valid & keep_row[:, None])


@torch.no_grad()
def geo_rs(train_logprobs, rollout_logprobs, mask, *, band: tuple[float, float] = (0.99, 1.01)):
    """Geometric-mean rejection: g_b = exp(S_b / n_b); rows with g_b outside [lo, hi] (or with an invalid
    token) leave the mask; w = 1 on kept tokens. Rows without tokens stay empty. Shapes as token_tis."""
    lo, hi = band
    d, valid, in_mask = _prepare(train_logprobs, rollout_logprobs, mask)
    s, n, row_ok = _seq_parts(d, valid, in_mask)
    g = torch.exp(s / n.clamp(min=1).to(s.dtype))  # g = exp(mean_t d_t); inf for huge means → rejected
    keep_row = row_ok & (g >= lo) & (g <= hi)
    return _finish(torch.ones_like(d), valid & keep_row[:, None])


@dataclass
class CorrectionResult:
    """Output of :func:`apply_correction`. Counts are 0-d tensors on the input's device (no host sync until
    :meth:`metrics`)."""

    weights: torch.Tensor  # [B, T], detached, 0 outside mask
    mask: torch.Tensor  # [B, T] bool, ⊆ input mask
    input_tokens: torch.Tensor  # tokens in the input mask
    kept_tokens: torch.Tensor  # tokens in the new mask
    invalid_tokens: torch.Tensor  # input-mask tokens with a NaN/inf/placeholder log-prob
    seqs: torch.Tensor  # rows with at least one input-mask token
    rejected_seqs: torch.Tensor  # of those, rows left with no kept token

    @property
    def empty(self) -> torch.Tensor:
        """0-d bool tensor: True when no token is kept (the loss must not be a plain mean: use masked_mean)."""
        return self.kept_tokens == 0

    def metrics(self, prefix: str = "tim/correction") -> dict[str, float]:
        """``CorrectionStats`` of this one result (see there); IS-weight statistics are MismatchMonitor's
        ``tim/is/*`` (pass ``weights`` as ``is_weights``)."""
        stats = CorrectionStats(prefix)
        stats.update(self)
        return stats.compute(sync=False)


class CorrectionStats(Accumulated):
    """``tim/correction/*`` over the batches a correction ran on, mergeable over micro-batches and ranks.

    ``kept_frac`` = kept / input tokens, ``seq_rejected_frac`` = rejected / input rows (rows left with no kept
    token), ``kept_tokens`` and ``invalid_tokens`` (totals), ``empty`` = fraction of batches with no kept token.
    Fractions of an empty input are NaN.
    """

    def __init__(self, prefix: str = "tim/correction") -> None:
        self.prefix = prefix
        self._acc = Accumulator(("input", "kept", "invalid", "seqs", "rejected", "batches", "empty"))

    def update(self, result: CorrectionResult) -> None:
        """Add one :class:`CorrectionResult` (no host sync)."""
        self._acc.add((result.input_tokens, result.kept_tokens, result.invalid_tokens, result.seqs,
                       result.rejected_seqs, torch.ones((), device=result.kept_tokens.device), result.empty))

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        v = self._acc.merged(sync, group)
        frac = lambda a, b: a / b if b > 0 else math.nan  # noqa: E731
        return {
            f"{self.prefix}/kept_frac": frac(v["kept"], v["input"]),
            f"{self.prefix}/seq_rejected_frac": frac(v["rejected"], v["seqs"]),
            f"{self.prefix}/kept_tokens": v["kept"],
            f"{self.prefix}/invalid_tokens": v["invalid"],
            f"{self.prefix}/empty": frac(v["empty"], v["batches"]),
        }


def _run_mode(name: str, cfg: CorrectionConfig, train, rollout, mask):
    if name == "none":
        return no_correction(train, rollout, mask)
    if name == "token_tis":
        return token_tis(train, rollout, mask, clip=cfg.token_clip, log_ratio_clamp=cfg.log_ratio_clamp)
    if name == "token_mis":
        return token_mis(train, rollout, mask, clip=cfg.token_clip, log_ratio_clamp=cfg.log_ratio_clamp)
    if name == "icepop":
        return icepop(train, rollout, mask, band=cfg.icepop_band, log_ratio_clamp=cfg.log_ratio_clamp)
    if name == "seq_tis":
        return seq_tis(train, rollout, mask, clip=cfg.seq_clip)
    if name == "seq_mis":
        return seq_mis(train, rollout, mask, clip=cfg.seq_clip)
    return geo_rs(train, rollout, mask, band=cfg.geo_band)  # _parse_mode admits nothing else


def apply_correction(mode: str | CorrectionConfig, train_logprobs: torch.Tensor,
                     rollout_logprobs: torch.Tensor, mask: torch.Tensor, **options) -> CorrectionResult:
    """Apply one mode (or a '+'-joined combination) and count what it kept.

    Args:
        mode: a mode name (``CORRECTION_MODES``, or joined with '+') — then ``options`` are
            :class:`CorrectionConfig` fields — or a ready :class:`CorrectionConfig`.
        train_logprobs, rollout_logprobs: [B, T] sampled-token log-probs.
        mask: [B, T] bool or 0/1.
    Returns:
        :class:`CorrectionResult`; weights are 0 and the mask False wherever a token was dropped.
    """
    if isinstance(mode, CorrectionConfig):
        if options:
            raise TypeError("apply_correction: pass options either in the CorrectionConfig or as keywords.")
        cfg = mode
    else:
        cfg = CorrectionConfig(mode=mode, **options)
    weights = new_mask = None
    for name in cfg.mode.split("+"):
        w, m = _run_mode(name, cfg, train_logprobs, rollout_logprobs, mask)
        if weights is None:
            weights, new_mask = w, m
        else:
            new_mask = new_mask & m
            weights = torch.where(new_mask, weights * w, torch.zeros((), dtype=w.dtype, device=w.device))
    with torch.no_grad():
        in_mask = mask.detach() != 0
        _d, valid, _m = _prepare(train_logprobs, rollout_logprobs, mask)
        rows_in = in_mask.any(dim=-1)
        return CorrectionResult(
            weights=weights, mask=new_mask,
            input_tokens=in_mask.sum(), kept_tokens=new_mask.sum(), invalid_tokens=(in_mask & ~valid).sum(),
            seqs=rows_in.sum(), rejected_seqs=(rows_in & ~new_mask.any(dim=-1)).sum(),
        )


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / max(Σ mask, 1): the mean over kept entries, 0 (not 0/0 = NaN) when none is kept.

    Masked-out entries are selected away with ``torch.where``: NaN/inf there reach neither the value nor the
    gradient w.r.t. ``values`` (which is 0 there). An op upstream of ``values`` that produced the NaN can still
    turn that 0 into NaN by the chain rule (0 · NaN): keep NaN out of the graph where you can.

    Args:
        values: [B, T] (any shape) per-token values, e.g. weights × per-token loss.
        mask: same shape, bool or 0/1.
        dim: reduce over this dim (e.g. -1 for a per-sequence mean) or all dims when None.
    """
    keep = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    num = torch.where(keep, values, zero)
    if dim is None:
        return num.sum() / keep.sum().clamp(min=1).to(values.dtype)
    return num.sum(dim=dim) / keep.sum(dim=dim).clamp(min=1).to(values.dtype)
