"""Healthy ranges of the mismatch metrics, where each comes from, and the verdict built from them.

One table (`RULES`) drives the report's verdict block, the healthy bands drawn on figures and the "healthy
range" line under each figure. Every range names its source (`SOURCES`); where no published threshold exists
the range is derived from one that does, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Rule", "RULES", "SOURCES", "STATUSES", "status", "verdict", "K3_HEALTHY_MAX", "LOG2"]

STATUSES = ("ok", "watch", "act")
LOG2 = math.log(2.0)


def _probe_k3_limit() -> float:
    # The live probe's default limit is the one number the project already uses for "k3 too high".
    from tim_plugins.parity.probe import ParityProbeConfig

    return float(ParityProbeConfig().kl_k3_max)


K3_HEALTHY_MAX = _probe_k3_limit()
# Typical k3 of MoE models reaches 1e-1: beyond the MoE range, act.
K3_ACT_ABOVE = 1e-1

SOURCES = {
    "k3": ("Typical k3 per token: 1e-5…1e-3 for dense models, 1e-3…1e-1 for MoE models (published magnitudes "
           "collected in the tim-plugins research notes, 'Metrics and typical magnitudes'); tim-plugins' "
           f"ParityProbe trips at kl_k3_max = {K3_HEALTHY_MAX:g} by default."),
    "verl": ("verl documentation, Rollout Correction (docs/algo/rollout_corr.md, "
             "https://verl.readthedocs.io/en/latest/algo/rollout_corr.html): health warnings at mean IS weight "
             "outside [0.5, 2], effective sample size < 0.3 (0.5 drawn as 'good'), |kl| > 0.1, chi2_token > 1; "
             "default IS threshold 2.0."),
    "band": ("Token-level corrections' default band: IcePop masks ρ outside [0.5, 5], token MIS/TIS in verl cap "
             "at 2 (verl docs above), tim-plugins' TIMConfig.ratio_band = (0.5, 2.0): a token with |Δ log p| > "
             "log 2 ≈ 0.69 is one these corrections clip or drop."),
    "tail": ("Taming the Tail / Dynamic Vocabulary Pruning (arXiv 2512.23087): if every logit moves by at most ε, "
             "|Δ log p| <= 2ε(1 − p) to first order, so low-probability tokens carry the largest mismatch."),
    "pinsker": ("Pinsker's inequality TV <= sqrt(KL / 2): the k3 range above bounds the total variation "
                f"(KL <= {K3_HEALTHY_MAX:g} gives TV <= {math.sqrt(K3_HEALTHY_MAX / 2):.3g})."),
    "lr": ("Beyond Precision (arXiv 2602.01826): a response-length surge is an early warning; shrinking the "
           "update suppresses the mismatch. tim-plugins' LengthTriggeredLRDecay scales the LR when it fires."),
}


@dataclass(frozen=True)
class Rule:
    """Healthy range of one metric: ``ok`` inside [ok_lo, ok_hi], ``act`` outside [act_lo, act_hi], else
    ``watch``. None = unbounded on that side."""

    key: str
    label: str
    ok_lo: float | None
    ok_hi: float | None
    act_lo: float | None
    act_hi: float | None
    source: str
    text: str  # the healthy range in words, in the unit the value is shown in
    unit: str = ""  # shown after the value ("nats"); "%": the value is a fraction, shown as a percentage

    def status(self, value) -> str | None:
        if value is None or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        if (self.act_lo is not None and value < self.act_lo) or (self.act_hi is not None and value > self.act_hi):
            return "act"
        if (self.ok_lo is not None and value < self.ok_lo) or (self.ok_hi is not None and value > self.ok_hi):
            return "watch"
        return "ok"


_TV_OK = math.sqrt(K3_HEALTHY_MAX / 2)
_TV_ACT = math.sqrt(K3_ACT_ABOVE / 2)
RULES: dict[str, Rule] = {r.key: r for r in (
    Rule("tim/token/kl_k3", "k3 per sampled token", None, K3_HEALTHY_MAX, None, K3_ACT_ABOVE, "k3",
         f"<= {K3_HEALTHY_MAX:g} nats for dense models; above {K3_ACT_ABOVE:g} beyond even MoE models", "nats"),
    Rule("tim/dist/kl_rollout_train_mean", "KL(rollout ‖ trainer) per position, exact", None, K3_HEALTHY_MAX, None,
         K3_ACT_ABOVE, "k3", f"as k3 (k3 estimates this KL): <= {K3_HEALTHY_MAX:g} nats", "nats"),
    Rule("tim/dist/kl_train_rollout_mean", "KL(trainer ‖ rollout) per position, exact", None, K3_HEALTHY_MAX, None,
         K3_ACT_ABOVE, "k3", f"as k3: <= {K3_HEALTHY_MAX:g} nats", "nats"),
    Rule("tim/dist/tv_mean", "total variation", None, _TV_OK, None, _TV_ACT, "pinsker",
         f"<= {_TV_OK:.3g} (Pinsker from the k3 range)"),
    Rule("tim/token/abs_diff_p99", "|Δ log p| p99", None, LOG2, None, LOG2, "band",
         "<= log 2 ≈ 0.69 nats (ρ inside [0.5, 2])", "nats"),
    Rule("tim/token/ratio_outside_frac", "tokens with ρ outside [0.5, 2]", None, 0.0, None, 0.01, "band",
         "0 %; above 1 % of tokens, corrections reshape the gradient", "%"),
    Rule("tim/seq/log_ratio_abs_max", "max |sequence log-ratio|", None, LOG2, None, None, "verl",
         "<= log 2 ≈ 0.69 nats (a sequence IS weight beyond 2 is truncated or rejected by sequence-level "
         "corrections)", "nats"),
    Rule("tim/is/ess", "effective sample size of the IS weights (of ρ when no correction runs)", 0.5, None, 0.3, None, "verl",
         ">= 0.5 good, < 0.3 warning"),
    Rule("tim/token/ratio_mean", "mean IS ratio ρ", 0.5, 2.0, 0.5, 2.0, "verl", "inside [0.5, 2]"),
    Rule("tim/token/kl_k1", "k1", -0.1, 0.1, -0.1, 0.1, "verl", "|k1| <= 0.1"),
    Rule("tim/token/chi2", "chi2 (token)", None, 1.0, None, 1.0, "verl", "<= 1"),
)}


def status(key: str, value) -> str | None:
    """'ok' / 'watch' / 'act' for a metric with a rule, None otherwise (or for a missing / NaN value)."""
    rule = RULES.get(key)
    return rule.status(value) if rule is not None else None


def _fmt(v: float, unit: str = "") -> str:
    """A value in its rule's unit: a fraction as a percentage, else 3 significant digits and the unit."""
    if unit == "%":
        return f"{100 * v:.3g} %"
    return f"{v:.3g}" + (f" {unit}" if unit else "")


def verdict(metrics: dict, keys: tuple[str, ...], next_step: str | None = None) -> dict:
    """Worst status over ``keys`` that have a value, and one line per checked metric. ``next_step``: what the page
    offers beyond the verdict (the measure page: the settings it compares), added to a WATCH headline; the verdict
    names nothing the page does not show.

    Returns {"status": 'ok'|'watch'|'act'|'n/a', "lines": [(status, text, source)], "headline": str}.
    """
    lines = []
    worst = -1
    for key in keys:
        rule = RULES[key]
        st = rule.status(metrics.get(key))
        if st is None:
            continue
        worst = max(worst, STATUSES.index(st))
        lines.append((st, f"{rule.label} = {_fmt(float(metrics[key]), rule.unit)} (healthy: {rule.text})",
                      rule.source))
    overall = STATUSES[worst] if worst >= 0 else "n/a"
    headline = {
        "ok": "OK: every checked metric is inside its healthy range.",
        "watch": "WATCH: the mismatch is measurable beyond a healthy range: the lines below say which metric."
                 + (f" {next_step}" if next_step else ""),
        "act": "ACT: the mismatch is large enough to bias or destabilise RL training; fix it before training.",
        "n/a": "No metric with a healthy range was measured.",
    }[overall]
    return {"status": overall, "lines": lines, "headline": headline}
