"""The report's "Mismatch or staleness?" section: the split of the loss passes' log-ratio (``tim/split/*``,
``tim/staleness/*``) per step, by policy lag (``tim/by_lag/*``) and by turn (``tim/by_turn/*``), and a verdict that
names the dominant part and its fix in the run's framework."""

from __future__ import annotations

import math
import re

from tim_plugins.fixes import part_fix

__all__ = ["by_turn", "headline", "lag_verdict", "left_out_by", "pooled_by", "split_rows", "staleness_section",
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
    unmeasured = "0" in lags and not (lags["0"][0] > 0 and math.isfinite(lags["0"][1]))
    # a lag without a finite k3 in any window (pooled_by's (0, NaN)) has no k3 to weigh
    lags = {lag: (n, k) for lag, (n, k) in lags.items() if n > 0 and math.isfinite(k)}
    count = sum(n for n, _ in lags.values())
    total = sum(n * k for n, k in lags.values()) / count if count else math.nan
    if "0" not in lags or not math.isfinite(total) or total <= 0:
        lowest = min(lags, key=_order, default=None)
        said = ("No lag-0 window has a finite k3 (see the windows left out below)" if unmeasured else
                "No token trained at lag 0")
        return (f"{said}, so the mismatch floor is not observed; the lowest lag ({lowest}) bounds it from above.",
                part_fix("staleness_async", framework))
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
        _pooled_table(page, "lag", "k3 of d (nats)", lags, left_out_by(summary.get("log_history") or [], "lag"))
    turns = by_turn(summary.get("log_history") or [])
    if len(turns) > 1:
        page.raw("<p>By turn (multi-turn rollouts; turn k is the model's answer after k environment or tool "
                 "messages): the mismatch at the measurement point. A k3 that grows with the turn points at "
                 "numerics that drift with the context (KV cache, attention kernels over long prompts).</p>")
        _pooled_table(page, "turn", "mismatch k3 (nats)", turns, left_out_by(summary.get("log_history") or [], "turn"))


def _pooled_table(page, what: str, k3_label: str, pooled: dict, left_out: dict) -> None:
    """The table of ``pooled_by`` with, where a window was left out of the pooling (k3 not finite), a column that
    counts them: the pooled k3 is then the finite windows' only, and the reader sees how much is missing."""
    if not left_out:
        page.table([what, "tokens", k3_label], [[t, int(n), _g(k3)] for t, (n, k3) in pooled.items()])
        return
    page.table([what, "tokens", k3_label, "left out: windows with k3 not finite (tokens)"],
               [[t, int(n), _g(k3), _left_out(left_out.get(t))] for t, (n, k3) in pooled.items()])
    windows = sum(w for w, _, _ in left_out.values())
    inf = sum(i for _, _, i in left_out.values())
    page.note(f"{windows} logged window{'' if windows == 1 else 's'} had a k3 that is not finite ({inf} at +inf: a "
              "token one side gave probability 0, or an overflow; the others NaN or not logged). Their tokens and "
              "k3 are left out of the pooled k3 together, so each k3 shown is that of the windows with a finite one.")


def _left_out(out: tuple[int, float, int] | None) -> str:
    if not out:
        return "–"
    windows, tokens, inf = out
    return f"{windows} ({int(tokens)} tokens" + (f"; {inf} at +inf)" if inf else ")")


def pooled_by(log_history: list[dict], keying: str) -> dict[str, tuple[float, float]]:
    """{label: (tokens, k3)} of ``tim/by_<keying>/*`` over every logged step (k3 pooled by token count over the
    windows whose k3 is finite: ``left_out_by`` counts the others), labels in order; (0, NaN) for a label none of
    whose windows has a finite k3; empty when the run logged none."""
    return {t: (n, k / n if n else math.nan) for t, (n, k, _) in _pool(log_history, keying).items()}


def left_out_by(log_history: list[dict], keying: str) -> dict[str, tuple[int, float, int]]:
    """{label: (windows, tokens, of them windows with k3 = +inf)} of the logged windows ``pooled_by`` leaves out
    (k3 NaN, inf or not logged); only labels with such a window."""
    return {t: (len(out), sum(n for n, _ in out), sum(1 for _, k3 in out if k3 == math.inf))
            for t, (_, _, out) in _pool(log_history, keying).items() if out}


def _pool(log_history: list[dict], keying: str) -> dict[str, tuple[float, float, list]]:
    """{label: (tokens, Σ tokens·k3, [(tokens, k3) left out])} over the windows, labels in order.

    A window enters the numerator and the denominator together, and only with a finite k3: one whose tokens were
    counted without its k3 would dilute the pooled k3 (three windows of 100 tokens at k3 2e-3, NaN and inf read
    6.7e-4, a third of every window that was measured). Pooling an inf to an inf would hide the finite windows'
    level for the whole run behind one window; an RL engineer reads the finite windows' k3 and the count of
    windows left out (the section shows it beside the table), and a window at +inf (a token one side gave
    probability 0) is counted as such."""
    sums: dict[str, list] = {}
    for h in log_history:
        for key, value in h.items():
            m = re.fullmatch(rf"tim/by_{keying}/([^/]+)/count", key)
            n = _float(value)
            if m is None or not n > 0 or not math.isfinite(n):  # no tokens (0, NaN, not a number): no window
                continue
            k3 = _float(h.get(f"tim/by_{keying}/{m.group(1)}/kl_k3"))
            acc = sums.setdefault(m.group(1), [0.0, 0.0, []])
            if math.isfinite(k3):
                acc[0] += n
                acc[1] += n * k3
            else:
                acc[2].append((n, k3))
    return {t: tuple(acc) for t, acc in sorted(sums.items(), key=lambda x: _order(x[0]))}


def _float(x) -> float:
    """``x`` as a float; NaN for None or anything that is not a number (a log is data, not to be raised on)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _order(label: str) -> tuple:
    """Sort key of a lag or turn label ("0", "1", ..., "8+"); a label of another form after them, as text."""
    try:
        return 0, int(label.rstrip("+")), label
    except ValueError:
        return 1, 0, label


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
