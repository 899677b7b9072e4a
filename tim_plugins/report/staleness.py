"""The report's "Mismatch or staleness?" section: the split of the loss passes' log-ratio (``tim/split/*``,
``tim/staleness/*``) per step, by policy lag (``tim/by_lag/*``) and by turn (``tim/by_turn/*``), and a verdict that
names the dominant part and its fix in the run's framework."""

from __future__ import annotations

import math
import re

from tim_plugins.fixes import part_fix

__all__ = ["by_turn", "headline", "lag_verdict", "pooled_by", "split_rows", "staleness_section",
           "staleness_verdict"]


def split_rows(log_history: list[dict]) -> list[dict]:
    """Per logged step with a split: {step, tokens, staleness_share, mismatch_share, cov_share, total_var,
    staleness_k3, mismatch_k3} (the statistics by lag: ``pooled_by(log_history, "lag")``)."""
    rows = []
    for h in log_history:
        if not h.get("tim/split/tokens"):
            continue

        def num(key):
            v = h.get(key)
            return math.nan if v is None else float(v)

        rows.append({"step": int(h.get("step", len(rows) + 1)), "tokens": num("tim/split/tokens"),
                     "staleness_share": num("tim/split/staleness_var_share"),
                     "mismatch_share": num("tim/split/mismatch_var_share"), "cov_share": num("tim/split/cov_share"),
                     "total_var": num("tim/split/total_var"), "staleness_k3": num("tim/staleness/token/kl_k3"),
                     "mismatch_k3": num("tim/token/kl_k3")})
    return rows


def staleness_verdict(rows: list[dict], framework: str | None) -> tuple[str, str]:
    """(headline, fix) over the whole run: each part's share of the total log-ratio variance, pooled over steps
    (weighted by each step's tokens × Var(d))."""
    weights = [r["tokens"] * r["total_var"] for r in rows if math.isfinite(r["total_var"]) and r["total_var"] > 0]
    used = [r for r in rows if math.isfinite(r["total_var"]) and r["total_var"] > 0]
    if not used:
        return "No log-ratio variance to split (no loss-pass tokens with a spread).", ""
    total = sum(weights)
    stale = sum(w * r["staleness_share"] for w, r in zip(weights, used)) / total
    mism = sum(w * r["mismatch_share"] for w, r in zip(weights, used)) / total
    if all(r["staleness_share"] == 0.0 for r in used):
        return ("Mismatch only: no loss pass ran after an update on its batch, so the staleness part is exactly 0 "
                "and the mismatch explains all of the log-ratio variance.", part_fix("mismatch", framework))
    part = "staleness" if stale > mism else "mismatch"
    return (f"{part.capitalize()} dominates: it explains {max(stale, mism):.0%} of the log-ratio variance over the "
            f"run (staleness {stale:.0%}, mismatch {mism:.0%}, covariance {1 - stale - mism:+.0%}).",
            part_fix(part, framework))


def lag_verdict(lags: dict[str, tuple[float, float]], framework: str | None) -> tuple[str, str]:
    """(headline, fix) where π_old is not computed (asynchronous trainers): the split by policy lag. For small
    log-ratios k3 ≈ E[d²]/2 and d = s + m with s = 0 at lag 0, so the lag-0 k3 estimates the mismatch's share of the
    whole run's k3 (the floor), and the rest is staleness."""
    count = sum(n for n, _ in lags.values())
    total = sum(n * k for n, k in lags.values()) / count if count else math.nan
    if "0" not in lags or not math.isfinite(total) or total <= 0:
        lowest = min(lags, key=lambda x: int(x.rstrip("+")), default=None)
        return (f"No token trained at lag 0, so the mismatch floor is not observed; the lowest lag ({lowest}) bounds "
                f"it from above.", part_fix("staleness_async", framework))
    floor = lags["0"][1]
    share = min(max(floor / total, 0.0), 1.0)
    part = "staleness" if share < 0.5 else "mismatch"
    return (f"{part.capitalize()} dominates: the mismatch floor (k3 {floor:.3g} at lag 0) is {share:.2%} of the "
            f"run's k3 ({total:.3g}), staleness the other {1 - share:.2%}.",
            part_fix("staleness_async" if part == "staleness" else part, framework))


def _read(summary: dict) -> tuple[list[dict], dict, str, str] | None:
    """(split rows, pooled statistics by lag, headline, fix) of the run, the exact split's verdict where it logged
    one, else the statistical one by lag; None when it logged neither."""
    history = summary.get("log_history") or []
    rows, lags = split_rows(history), pooled_by(history, "lag")
    if not rows and not lags:
        return None
    verdict = staleness_verdict(rows, summary.get("framework")) if rows else lag_verdict(lags, summary.get("framework"))
    return rows, lags, *verdict


def headline(summary: dict) -> str | None:
    """The section's verdict headline for the report's verdict block, or None when the section has nothing."""
    read = _read(summary)
    return None if read is None else read[2]


def staleness_section(page, summary: dict) -> None:
    """The section, when the run logged a split (TRL runs with the callback's monitor, verl runs with the monitor
    and a dump: its log_history.jsonl) or, where π_old is not computed (AsyncGRPOTrainer), its statistics by lag."""
    read = _read(summary)
    if read is None:
        return
    rows, lags, line, fix = read
    page.h2("Mismatch or staleness?")
    page.raw("<p>Each loss pass sees the log-ratio d = log π<sub>θ</sub> − log π<sub>rollout</sub> = s + m: "
             "<b>staleness</b> s = log π<sub>θ</sub> − log π<sub>old</sub> (the policy moved since the batch was "
             "sampled: batch reuse, asynchronous rollouts) and <b>mismatch</b> m = log π<sub>old</sub> − log "
             "π<sub>rollout</sub> (the same weights scored by two stacks). π<sub>old</sub> is the trainer at the "
             "rollout's weights, the monitor's measurement point. The fixes differ completely.</p>")
    if not rows:
        page.raw("<p>This run has no π<sub>old</sub> at every sample's rollout weights (asynchronous rollouts: a "
                 "sample may be drawn by weights older than the trainer's), so the split is statistical: by policy "
                 "lag.</p>")
    page.raw(f"<p><b>{_escape(line)}</b>" + (f" Fix: {_escape(fix)}." if fix else "") + "</p>")
    shown = {(_pct(r["staleness_share"]), _pct(r["mismatch_share"]), _pct(r["cov_share"]), _g(r["staleness_k3"]))
             for r in rows}
    if len(rows) > 1 and len(shown) == 1:  # every step alike: one line, not a table of identical rows
        stale, mism, cov, k3 = shown.pop()
        page.raw(f"<p>Each of the {len(rows)} steps alike: staleness {stale} of Var(d), mismatch {mism}, 2·Cov "
                 f"{cov}, staleness k3 {k3} nats (the mismatch k3 of each step: the k3 panel of 'Mismatch per "
                 "optimizer step').</p>")
    elif rows:
        page.table(["step", "tokens", "staleness share of Var(d)", "mismatch share", "2·Cov share",
                    "staleness k3 (nats)", "mismatch k3 (nats, when sampled)"],
                   [[r["step"], int(r["tokens"]), _pct(r["staleness_share"]), _pct(r["mismatch_share"]),
                     _pct(r["cov_share"]), _g(r["staleness_k3"]), _g(r["mismatch_k3"])] for r in rows])
        page.note("The three shares add up to 100 %; a negative covariance (the update moved the policy against the "
                  "mismatch) lets a part exceed 100 %. The mismatch k3 is measured once per batch, at the step that "
                  "sampled it (– at a step that reuses the batch of an earlier one).")
    if lags:
        page.raw("<p>By policy lag (optimizer steps between the weights that sampled a token and the loss pass "
                 "that trains it): k3 of the whole log-ratio. Lag 0 is the mismatch floor; its growth with the lag "
                 "is staleness.</p>")
        page.table(["lag", "tokens", "k3 of d (nats)"], [[lag, int(n), _g(k3)] for lag, (n, k3) in lags.items()])
    turns = by_turn(summary.get("log_history") or [])
    if len(turns) > 1:
        page.raw("<p>By turn (multi-turn rollouts; turn k is the model's answer after k environment or tool "
                 "messages): the mismatch at the measurement point. A k3 that grows with the turn points at "
                 "numerics that drift with the context (KV cache, attention kernels over long prompts).</p>")
        page.table(["turn", "tokens", "mismatch k3 (nats)"], [[t, int(n), _g(k3)] for t, (n, k3) in turns.items()])


def pooled_by(log_history: list[dict], keying: str) -> dict[str, tuple[float, float]]:
    """{label: (tokens, k3)} of ``tim/by_<keying>/*`` over every logged step (k3 pooled by token count), labels in
    order; empty when the run logged none."""
    sums: dict[str, list[float]] = {}
    for h in log_history:
        for key, value in h.items():
            m = re.fullmatch(rf"tim/by_{keying}/([^/]+)/count", key)
            if m is None or not value:
                continue
            k3 = h.get(f"tim/by_{keying}/{m.group(1)}/kl_k3")
            acc = sums.setdefault(m.group(1), [0.0, 0.0])
            acc[0] += float(value)
            if k3 is not None and math.isfinite(float(k3)):
                acc[1] += float(value) * float(k3)
    return {t: (n, k / n) for t, (n, k) in sorted(sums.items(), key=lambda x: int(x[0].rstrip("+")))}


def by_turn(log_history: list[dict]) -> dict[str, tuple[float, float]]:
    """{turn label: (tokens, k3)} over every logged step with ``tim/by_turn/*``; empty for single-turn runs."""
    return pooled_by(log_history, "turn")


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.1%}"


def _g(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.3g}"


def _escape(text: str) -> str:
    import html

    return html.escape(text)
