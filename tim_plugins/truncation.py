"""Sampler truncation (min-p, top-k, top-p) with the engines' semantics, and HF ``generate``'s settings for it
(vLLM's ``SamplingParams`` for it: ``tim_plugins.integrations.vllm.sampling``).

The trainer can only reproduce the distribution a rollout engine sampled from if it truncates the vocabulary
with the same rule and in the same order. The two engines we support differ in order:

* vLLM (VLLM_SOURCES vllm.v1.sample.sampler:Sampler.sample and
  VLLM_SOURCES vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_pytorch, registry in
  ``integrations/vllm/sources.py``): temperature → min-p (argmax-invariant logits processor) → top-k → top-p.
* HF ``generate`` (TRANSFORMERS_SOURCES transformers.generation.utils:GenerationMixin._get_logits_processor,
  registry in ``integrations/hf/sources.py``): temperature → top-k → top-p → min-p.

min-p and top-k commute (each keeps an upper set of logits, and min-p's ratio test p_a >= min_p · max_b p_b is
unchanged by renormalisation), so the two orders differ only when top-p is combined with min-p: vLLM takes the
nucleus of the min-p-renormalised distribution, HF takes it before min-p and then intersects.

Every rule keeps an *upper set* of logits, so the kept set of a row is {a : z_a >= tau} for one per-row
threshold tau (the smallest kept logit). ``truncation_threshold`` returns tau; callers recompute the mask as
``z >= tau`` bit-exactly in backward. Ties at the top-p cut are all kept. vLLM keeps part of such a tie: its sort-
based masking drops tied copies until the cumulative mass passes 1 - top_p, and its Triton kernel (GPU) keeps
exactly k of a tie at the top-k cut. Ties are rare for fp32 logits but common for bf16 ones (8 mantissa bits): a
trainer that computes its kept set from bf16 logits keeps the whole tie, a superset of vLLM's, and its safe log-probs
are lower on those rows (random bf16 logits, V = 32,000: up to 2.5e-3 nats at top_p = 0.9, up to 0.07 with top_k =
50 as well). Replaying vLLM's own kept sets (``kept_set``) is exact.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .min_p import MIN_P_RULE, min_p_accepted

__all__ = [
    "DEFAULT_MIN_P",
    "MIN_P_RULE",
    "ORDERS",
    "STEP_ORDER",
    "Truncation",
    "truncation_threshold",
    "hf_generate_kwargs",
    "min_p_accepted",
]

# Default min-p for "extreme tail only" pruning: drop tokens whose probability is below 1e-5 × the top token's.
# From benchmarks/ablate_min_p.py (benchmarks/results/ablate_min_p.json): the largest grid value (1e-6 … 5e-2) whose
# mean pruned mass stays <= 1e-3 on the trained toy model (bf16 vs fp32: 2.9e-4 mean, 2.2e-3 max). Under logit
# error that grows in the tail it removes ~46% of the worst per-token log-prob mismatch (max |Δ| 1.06 → 0.57);
# under uniform/bf16-rounding error the mean mismatch and k3 barely move at any small min_p (the mass-weighted
# mismatch lives in the head), so larger values buy bias without benefit there.
DEFAULT_MIN_P: float = 1e-5

ORDERS = ("vllm", "hf")
# Each engine's order of the three cuts (module docstring): the one place both threshold rules (this module's and
# the vocab-parallel one, ``safe_vocab_tp``) read it from.
STEP_ORDER = {"vllm": ("min_p", "top_k", "top_p"), "hf": ("top_k", "top_p", "min_p")}
# min-p keeps the tokens with p >= min_p * p_max. The engines accept [0, 1] (vLLM's SamplingParams, transformers'
# MinPLogitsWarper), but at 1 only the most likely token (and exact ties) is kept: sampling is greedy, and a safe set
# of one token has log-prob 0 whatever either side computes, so there is no mismatch left to measure or mask (as with
# a temperature below vLLM's greedy threshold, refused below too). Every min-p of ours (Truncation, both adapters'
# safe vocabulary through tim_plugins.options, the vLLM processor's, measure and its --compare settings) is checked
# by this one rule; parity.spec.PipelineSpec, which describes an engine's own settings, keeps the engines' range.
# vLLM treats temperatures below this as greedy and then skips min-p: VLLM_SOURCES vllm.v1.sample.sampler:_SAMPLING_EPS
_GREEDY_EPS = 1e-5
# Rows are sorted in slices of at most this many elements for top-p (sort values + int64 indices are 12 B/elt).
_SORT_BUDGET = 1 << 24


@dataclass(frozen=True)
class Truncation:
    """Sampler truncation, as configured on the rollout engine; the trainer applies the same rule."""

    min_p: float = field(default=0.0, metadata={"help": "keep a if p_T(a) >= min_p * max_b p_T(b), in [0, 1); 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass in (0, 1]; 1 = off"})
    top_k: int = field(default=0, metadata={"help": "keep the k largest logits (ties kept); 0 or -1 = off"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature T > 0; logits are divided by T"})
    order: str = field(default="vllm", metadata={"help": "'vllm' (min_p, top_k, top_p) or 'hf' (top_k, top_p, min_p)"})

    def __post_init__(self) -> None:
        if not min_p_accepted(self.min_p):
            raise ValueError(f"min_p={self.min_p!r}: {MIN_P_RULE}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]; use 1.0 to disable the nucleus cut")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be an int >= 1, or 0 / -1 to disable")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number > 0")
        if self.temperature < _GREEDY_EPS:
            raise ValueError(
                f"temperature={self.temperature!r}: below {_GREEDY_EPS} the engines sample greedily and skip "
                "min-p/top-p, so there is no truncated distribution to match; use a temperature > 0"
            )
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}: must be one of {ORDERS} (the engine that sampled)")

    @property
    def k(self) -> int:
        return self.top_k if self.top_k > 0 else 0

    @property
    def active(self) -> bool:
        """Whether any token can be cut (otherwise the kept set is the whole vocabulary)."""
        return self.min_p > 0.0 or self.top_p < 1.0 or self.k > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nucleus_cut(vals: torch.Tensor, top_p: float, log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Smallest logit of the nucleus of softmax(vals); vals [n, m] ascending (-inf for tokens already cut) -> [n].

    As vLLM ``apply_top_k_top_p_pytorch`` / HF ``TopPLogitsWarper``: renormalised cumulative probability over the
    ascending values, drop positions with cumsum <= 1 - top_p, always keep the largest. ``log_mass``: each
    position's log of unnormalised mass when it is not ``vals`` itself (a position standing for several equal
    logits: value + log count).
    """
    cum = (vals if log_mass is None else log_mass).softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= 1.0 - top_p
    drop[:, -1] = False
    # index of the first kept sorted position = number of dropped positions (they form a prefix: cum is monotone)
    first = drop.sum(dim=-1, keepdim=True)
    return vals.gather(-1, first).squeeze(-1)


def _top_p_threshold(z: torch.Tensor, tau: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest logit of the nucleus of softmax(z) restricted to {z >= tau}; [n, V] fp32, tau [n] -> [n]: a sort of
    every row."""
    out = torch.empty_like(tau)
    rows = max(1, _SORT_BUDGET // max(1, z.shape[1]))
    for s in range(0, z.shape[0], rows):
        zs = z[s : s + rows]
        masked = zs.masked_fill(zs < tau[s : s + rows, None], -math.inf)
        out[s : s + rows] = _nucleus_cut(masked.sort(dim=-1).values, top_p)
    return out


def _top_p_threshold_in_top_k(z: torch.Tensor, tau: torch.Tensor, top_k_desc: torch.Tensor, k: int,
                              top_p: float, ties: torch.Tensor | None = None) -> torch.Tensor:
    """``_top_p_threshold`` once top-k has cut: the kept set {z >= tau} lies among the k largest logits and the
    copies of the k-th value beyond them (top-k keeps the whole tie), so the nucleus needs only the k values, not a
    sort of V. ``top_k_desc``: the k largest logits, descending. ``ties``: [n] how many logits of the row equal the
    k-th (counted on ``z`` when None; a caller holding a shard of the row passes the whole row's count).

    The copies beyond the k are the smallest kept values: they enter as one position of value v_k carrying their
    mass, so the cut lands in the tie (threshold v_k) or above it exactly where a sort of the whole row puts it,
    without a host read to find the tied rows."""
    vals = top_k_desc[:, :k].flip(-1)  # ascending
    kth = vals[:, :1]
    if ties is None:
        ties = (z == kth).sum(dim=-1)
    extra = (ties - (vals == kth).sum(dim=-1)).clamp_(min=0).to(vals.dtype)
    vals = torch.cat([kth, vals], dim=-1)
    log_mass = torch.cat([kth + extra.log()[:, None], vals[:, 1:]], dim=-1)  # log(0) = -inf: no extra copy
    cut = vals < tau[:, None]
    return _nucleus_cut(vals.masked_fill(cut, -math.inf), top_p, log_mass.masked_fill(cut, -math.inf))


@torch.no_grad()
def truncation_threshold(z: torch.Tensor, trunc: Truncation, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row logit threshold tau of the kept set {a : z_a >= tau}.

    Args:
        z: [n, V] fp32 logits already divided by the temperature.
        trunc: the sampler's truncation.
        row_max: optional [n] ``z.amax(-1)``, if the caller already has it.
    Returns:
        [n] fp32; ``-inf`` where nothing is cut.
    """
    n = z.shape[0]
    tau = torch.full((n,), -math.inf, dtype=z.dtype, device=z.device)
    if not trunc.active:
        return tau
    m = z.amax(dim=-1) if row_max is None else row_max
    top_k_desc: list[torch.Tensor] = []  # the k largest logits, once top-k has run

    def min_p_cut() -> None:
        if trunc.min_p > 0.0:
            # p_a >= min_p * p_max  <=>  z_a - z_max >= log(min_p): the engines' test, in logit space
            torch.maximum(tau, m + math.log(trunc.min_p), out=tau)

    def top_k_cut() -> None:
        if 0 < trunc.k < z.shape[1]:
            # k-th largest logit; every logit >= it is kept (vLLM/HF both mask only `logits < kth`)
            if trunc.top_p < 1.0:  # top-p then runs among these k values
                vals = z.topk(trunc.k, dim=-1, sorted=True).values
                top_k_desc.append(vals)
                kth = vals[:, trunc.k - 1]
            else:
                kth = z.topk(trunc.k, dim=-1, sorted=False).values.amin(dim=-1)
            torch.maximum(tau, kth, out=tau)

    def top_p_cut() -> None:
        # top-k runs before top-p in both orders: the nucleus is then found among the k values
        if trunc.top_p < 1.0:
            cut = (_top_p_threshold_in_top_k(z, tau, top_k_desc[0], trunc.k, trunc.top_p) if top_k_desc
                   else _top_p_threshold(z, tau, trunc.top_p))
            torch.maximum(tau, cut, out=tau)

    cuts = {"min_p": min_p_cut, "top_k": top_k_cut, "top_p": top_p_cut}
    for step in STEP_ORDER[trunc.order]:
        cuts[step]()
    return tau


# --------------------------------------------------------------------------------------------------------------
# Rollout side: HF generate
# --------------------------------------------------------------------------------------------------------------


def hf_generate_kwargs(trunc: Truncation) -> dict[str, Any]:
    """``generate`` kwargs for ``trunc``: sampling on, every knob explicit (a model's generation_config may carry
    its own top_k/top_p defaults that would silently truncate more), scores returned for processed log-probs.

    The other knobs of ``generate`` that cut or reshape the sampling distribution, and that a model's
    generation_config may set (typical_p, epsilon_cutoff, eta_cutoff, top_h; repetition_penalty, as
    Qwen2.5-Instruct's 1.05; no_repeat_ngram_size), are turned off: the trainer's safe vocabulary applies
    temperature, top-k, top-p and min-p only, so any other would make the rollout's log-probs differ from it."""
    if trunc.order != "hf":
        raise ValueError(
            f"order={trunc.order!r}: HF generate applies top_k, then top_p, then min_p; build the Truncation with "
            "order='hf' so the trainer truncates in the same order"
        )
    return {
        "do_sample": True,
        "temperature": float(trunc.temperature),
        "top_k": int(trunc.k),  # 0 disables TopKLogitsWarper
        "top_p": float(trunc.top_p),
        "min_p": float(trunc.min_p) if trunc.min_p > 0.0 else None,
        # off, whatever the model's generation_config says (transformers' values that disable each warper)
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "top_h": None,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
