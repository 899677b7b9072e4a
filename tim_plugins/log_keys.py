"""Which ``tim/`` metrics go to the framework's own log at each logging step (TRL's console line and
``log_history``, wandb, tensorboard; verl's tracker): by default the few a user reads every step, the rest with the
``log_detail`` setting (TRL ``TIMConfig(log_detail=True)``, verl ``+tim.monitor.log_detail=true``).

The default set (`STEP_KEYS`, `STEP_FAMILIES`), at most 15 keys and two families, each logged only where its
part runs:

- the mismatch at the measurement point: ``tim/tokens``, ``tim/token/kl_k3`` (the KL estimate the healthy range is
  read on), ``tim/token/abs_diff_mean``, ``tim/token/abs_diff_p99``, ``tim/token/ratio_mean`` (the kept mass under
  one-sided truncation), ``tim/token/ratio_outside_frac`` and ``tim/seq/log_ratio_abs_max`` (what IS corrections
  clip); ``tim/staleness/token/kl_k3``, the k3 of the policy's move since the batch was sampled (0 without batch
  reuse; the one key of a step that reuses a batch);
- with an IS correction: ``tim/is/ess`` and ``tim/correction/kept_frac``; with the safe vocabulary:
  ``tim/safe_vocab/pruned_mass_mean`` and ``tim/safe_vocab/boundary_frac``; with the LR decay: ``tim/lr/scale``;
  with the live probe: ``tim/probe/tripped``; with the causes: ``tim/cause/named`` (the causes named in the window;
  each named cause also prints one console line with what was seen and its fix);
- the families ``tim/diag/`` (a problem counted: only logged once one happened) and ``tim/parity/`` (the audit's
  counts, at the first logging step).

Everything else is detail: the causes' evidence (``tim/cause/*`` but ``named``), the statistics by probability,
position, lag and turn (``tim/by_*``), the staleness split (``tim/split/*``, ``tim/staleness/*``), the other token and sequence statistics and the controllers' state.
The per-token dump's ``log_history.jsonl`` always holds every metric, and the report reads it, so the report loses
nothing when the framework's log is compact.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["STEP_KEYS", "STEP_FAMILIES", "in_step_log", "for_step_log"]

STEP_KEYS = (
    "tim/tokens",
    "tim/token/kl_k3",
    "tim/token/abs_diff_mean",
    "tim/token/abs_diff_p99",
    "tim/token/ratio_mean",
    "tim/token/ratio_outside_frac",
    "tim/seq/log_ratio_abs_max",
    "tim/staleness/token/kl_k3",
    "tim/is/ess",
    "tim/correction/kept_frac",
    "tim/safe_vocab/pruned_mass_mean",
    "tim/safe_vocab/boundary_frac",
    "tim/lr/scale",
    "tim/probe/tripped",
    "tim/cause/named",
)
STEP_FAMILIES = ("tim/diag/", "tim/parity/")
_STEP_KEYS = frozenset(STEP_KEYS)


def in_step_log(key: str) -> bool:
    """Whether ``key`` goes to the framework's log by default: not a ``tim/`` metric (the framework's own), one of
    `STEP_KEYS`, or of a family in `STEP_FAMILIES`."""
    return not key.startswith("tim/") or key in _STEP_KEYS or key.startswith(STEP_FAMILIES)


def for_step_log(metrics: Mapping[str, float], detail: bool) -> dict[str, float]:
    """``metrics`` as the framework's log gets them: all of them with ``detail``, else those `in_step_log`."""
    return dict(metrics) if detail else {k: v for k, v in metrics.items() if in_step_log(k)}
