"""The report of a training run (``tim-plugins demo``, or any per-token dump spanning optimizer steps): per-step
series, the per-token figures over all steps, the parity audit and what the callback attached."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["training_verdict", "logged_overall", "training_page", "dump_page", "step_table",
           "disagreements_section", "invalid_rows_text", "no_valid_text", "VERDICT_KEYS"]

VERDICT_KEYS = ("tim/token/kl_k3", "tim/token/abs_diff_p99", "tim/token/ratio_outside_frac",
                "tim/seq/log_ratio_abs_max", "tim/is/ess")


def step_table(summary: dict | None, tokens) -> dict[str, np.ndarray]:
    """Per optimizer step: the series the report draws. The callback's logged rows (``log_history``) where the run
    logged them: each covers its logging window (every token of the steps since the row before; TRL's
    ``logging_steps`` > 1 logs every few steps), so the dump's steps inside a window are not drawn beside it (a
    sample of one step against a window's every token: two populations). The dump's steps after the last logged row
    (a run that stopped or crashed before logging them) are drawn from the dump (the core monitor's metrics over
    each step's sampled rows; ``from_dump`` marks them), and every step where the run logged nothing. ESS: the logged
    ``tim/is/ess`` of the IS weights applied, else the ESS of the uncorrected token ratios ρ of the dump.

    A dump step whose every row is invalid (NaN, inf or placeholder log-probs, or a null key) is a step all the
    same: NaN metrics, so its series break there (a gap, not a line drawn across it), ``tokens`` 0 and
    ``no_valid`` set (``no_valid_text`` says so on the page); ``invalid``: the step's invalid rows (the logged
    ``tim/invalid_tokens``, else the dump's)."""
    from tim_plugins.report.tokens import metrics_by_step

    # every step with a row, also where none is valid (``Dump.step_states``)
    dump_steps, dump_metrics = metrics_by_step(tokens) if tokens is not None else (np.zeros(0), [])
    by_dump = {int(s): m for s, m in zip(dump_steps, dump_metrics)}
    logged = {int(h["step"]): h for h in (summary or {}).get("log_history", []) if "step" in h}
    windows = {s for s, h in logged.items() if "tim/tokens" in h}
    last = max(windows, default=None)
    tail = {s for s in by_dump if last is None or s > last}  # no logged row covers these steps
    steps = np.array(sorted(windows | tail), dtype=np.int64)

    def series(key: str, dump_key: str | None = None, default=np.nan, *, also: tuple = ()) -> np.ndarray:
        """``key`` per step from the logged rows (else ``also``'s keys, in order), else the dump's ``dump_key``."""
        out = []
        for s in steps:
            h = logged.get(int(s), {})
            found = next((k for k in (key, *also) if h.get(k) is not None), None)
            if found is not None:
                out.append(float(h[found]))
            elif dump_key and int(s) in by_dump:
                out.append(float(by_dump[int(s)].get(dump_key, np.nan)))
            else:
                out.append(default)
        return np.array(out, dtype=np.float64)

    table = {
        "step": steps,
        "k3": series("tim/token/kl_k3", "tim/token/kl_k3"),
        "abs_diff_p99": series("tim/token/abs_diff_p99", "tim/token/abs_diff_p99"),
        "seq_log_ratio_abs_max": series("tim/seq/log_ratio_abs_max", "tim/seq/log_ratio_abs_max"),
        "ess": series("tim/is/ess", "tim/is/ess"),
        "lr_scale": series("tim/lr/scale", None, 1.0 if logged else np.nan),
        "reward": series("reward", also=("critic/score/mean",)),  # TRL's, verl's mean sequence score
        "tokens": series("tim/tokens", "tim/tokens"),
        "ratio_mean": series("tim/token/ratio_mean", "tim/token/ratio_mean"),  # the truncation section's ρ
        "invalid": series("tim/invalid_tokens", "tim/invalid_tokens"),
    }
    table["ess_logged"] = np.array([("tim/is/ess" in logged.get(int(s), {})) for s in steps], dtype=bool)
    table["from_dump"] = np.array([int(s) in tail for s in steps], dtype=bool)
    table["no_valid"] = np.array([int(s) in tail and by_dump[int(s)]["tim/tokens"] == 0 for s in steps], dtype=bool)
    return table


def _steps_text(steps) -> str:
    """Steps as text: "step 2", "steps 2, 5 and 9", the first ten of more and how many others."""
    steps = [int(s) for s in steps]
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = steps[:10]
    rest = len(steps) - len(shown)
    listed = ", ".join(map(str, shown[:-1] if not rest else shown))
    return f"steps {listed}" + (f" and {rest} more" if rest else f" and {shown[-1]}")


def no_valid_text(table: dict) -> str | None:
    """The sentence on the dump steps of ``table`` (a ``step_table``) without a valid token, or None."""
    no_valid = table.get("no_valid")
    if no_valid is None or not no_valid.any():
        return None
    steps = table["step"][no_valid]
    invalid = int(np.nansum(table["invalid"][no_valid]))
    one = steps.size == 1
    return (f"No valid token at {_steps_text(steps)} ({'its' if one else 'their'} {invalid} dump rows all invalid: "
            f"NaN, inf or placeholder log-probs, or a missing key): no per-step value there.")


def invalid_rows_text(tokens) -> str:
    """" (N invalid rows skipped)" of a dump (``query.Dump``) with invalid rows, else ""."""
    n = 0 if tokens is None else tokens.invalid
    return f" ({n} invalid row{'' if n == 1 else 's'} skipped)" if n else ""


def logged_overall(summary: dict | None) -> tuple[dict, int]:
    """(the verdict's metrics over the logged steps, how many steps): the per-token means ``tim/token/kl_k3`` and
    ``ratio_outside_frac`` pooled by each step's ``tim/tokens``, the largest ``tim/seq/log_ratio_abs_max``. The p99
    and the ESS do not pool over steps: left out (the per-step panels show them)."""
    import math

    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
    logged = {int(h["step"]): h for h in (summary or {}).get("log_history", []) if "step" in h}
    rows = [h for h in logged.values() if num(h.get("tim/tokens")) and h["tim/tokens"] > 0]
    out = {}
    for key in ("tim/token/kl_k3", "tim/token/ratio_outside_frac"):
        used = [(h["tim/tokens"], h[key]) for h in rows if num(h.get(key))]
        if used:
            out[key] = sum(n * x for n, x in used) / sum(n for n, _ in used)
    seq = [h["tim/seq/log_ratio_abs_max"] for h in rows if num(h.get("tim/seq/log_ratio_abs_max"))]
    if seq:
        out["tim/seq/log_ratio_abs_max"] = max(seq)
    return out, len(rows)


def training_verdict(summary: dict | None, tokens, table: dict | None = None) -> dict:
    from tim_plugins.report.health import verdict
    from tim_plugins.report.tokens import overall_metrics

    extra = []
    logged, logged_steps = logged_overall(summary)
    if tokens is not None and tokens.size:
        # the logged values cover every token the run measured, the dump a sample of them (whose largest values
        # fall short of the run's): the logged ones where the run logged them, the dump's for the rest
        overall = {**overall_metrics(tokens), **logged}
        if logged:
            extra.append(f"k3, the fraction of ρ outside [0.5, 2] and the largest sequence log-ratio are over the "
                         f"{logged_steps} logged rows (every token the run measured); the p99 and the ESS over the "
                         "per-token dump's sampled rows.")
    else:  # no dump rows: the verdict of the metrics the run logged
        overall = logged
        if overall:
            extra.append(f"No per-token dump rows: the verdict is over the {logged_steps} logged steps (k3 and the "
                         "fraction of ρ outside [0.5, 2] pooled by their tokens, the largest sequence log-ratio; the "
                         "p99 and the ESS do not pool over steps: see the per-step panels).")
    v = verdict(overall, VERDICT_KEYS)
    table = table if table is not None else step_table(summary, tokens)
    steps = table["step"]
    if steps.size:
        k3 = table["k3"]
        if np.isfinite(k3).any():
            worst = int(np.nanargmax(k3))
            sampled = table["from_dump"] & bool(logged)  # the dump's steps beside logged windows
            counted = f"{int(np.nansum(table['tokens'][~sampled]))} monitored tokens"
            if sampled.any():  # a sample's count is not added to the logged windows' totals
                after = steps[sampled]
                which = f"step {int(after[0])}" if after.size == 1 else f"steps {int(after[0])}-{int(after[-1])}"
                counted += (f" (and {int(np.nansum(table['tokens'][sampled]))} sampled tokens of {which}, after the "
                            "last logged row: from the dump)")
            extra.append(f"{steps.size} optimizer step{'' if steps.size == 1 else 's'}, {counted}; k3 per step from "
                         f"{np.nanmin(k3):.2g} to {np.nanmax(k3):.2g} nats per token (highest at step "
                         f"{int(steps[worst])}).")
        gap = no_valid_text(table)
        if gap is not None:
            extra.append(gap)
        reward = table["reward"][np.isfinite(table["reward"])]
        if reward.size >= 4:
            q = max(1, reward.size // 4)
            extra.append(f"Mean reward: {reward[:q].mean():.2f} over the first {q} steps, {reward[-q:].mean():.2f} "
                         f"over the last {q}.")
    v["extra"] = extra
    if summary:
        from tim_plugins.report.staleness import headline

        split = headline(summary)
        if split is not None:
            extra.append(f"Mismatch or staleness: {split}")
        from tim_plugins.report.truncation import truncation_headline

        truncation = truncation_headline(summary)
        if truncation is not None:
            extra.append(truncation)
        findings = summary.get("findings", [])
        own = summary.get("own_audit")  # None: one audit (no rollout function of the run's own to audit apart)
        deliberate = summary.get("deliberate") or {}
        if findings or own or "findings" in summary:
            extra.append(audit_line(findings, own, deliberate))
        own = own or []
        if summary.get("kind") == "training":
            extra.append("Which setting removes the mismatch, and at what throughput: tim-plugins measure --compare all.")
        from tim_plugins.report.parity import reconcile

        reconcile(v, findings + own, summary.get("framework"), deliberate)
        from tim_plugins.report.causes import name_causes

        name_causes(v, summary, summary.get("framework"))  # after the audit: a named cause leads the verdict
    return v


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _tally(findings: list, deliberate: dict) -> str:
    """One audit table's counts, in the table's own words: errors and warnings, those deliberate here counted apart
    (their severity cell says "error (deliberate here)")."""
    parts = []
    for level in ("error", "warning"):
        hits = [f for f in findings if f.get("severity") == level]
        on_purpose = sum(str(f.get("code")) in deliberate for f in hits)
        parts.append(_plural(len(hits) - on_purpose, level) + (f" (+{on_purpose} deliberate here)" if on_purpose
                                                               else ""))
    return ", ".join(parts)


def audit_line(findings: list, own: list | None, deliberate: dict) -> str:
    """The verdict's line on the parity audit, agreeing with the tables below it: over both audits (the callback's,
    and the one of the rollout model actually used when the run samples through its own rollout function) the
    errors left to fix and the warnings, those deliberate here named apart as their cells mark them; then each
    table's counts."""
    every = list(findings) + list(own or [])
    parts = []
    for level, word in (("error", "to fix"), ("warning", "")):
        codes = list(dict.fromkeys(str(f.get("code")) for f in every if f.get("severity") == level))
        left = [c for c in codes if c not in deliberate]
        on_purpose = [c for c in codes if c in deliberate]
        text = _plural(len(left), level) + (f" {word}" if word else "") + (f" ({', '.join(left)})" if left else "")
        if on_purpose:
            text += f", {len(on_purpose)} deliberate here ({', '.join(on_purpose)})"
        parts.append(text)
    text = "Parity audit: " + "; ".join(parts)
    if own is None:
        return text + "."
    return (f"{text}. By table: the callback's view (TRL's generation with the trainer's model) "
            f"{_tally(findings, deliberate)}; the rollout model actually used {_tally(own, deliberate)}.")


def _figures_over_tokens(page, dumps: dict, colors: dict | None = None) -> None:
    """The per-token figures of ``dumps`` ({label: ``query.Dump``}, overlaid when several); ``colors``: {label:
    colour} over every run of the page (``figures.colors_of``), so a run has one colour in every figure."""
    import tim_plugins.report.figures as figures
    from tim_plugins.report.health import LOG2, RULES
    from tim_plugins.report.tokens import (abs_histograms, position_profiles, prob_curves, rho_source,
                                           sequence_points)

    page.figure(figures.mismatch_by_probability(prob_curves(dumps, quantile=len(dumps) == 1), colors=colors),
                "Mismatch by token probability (sampled tokens of all steps)",
                "mean |Δ log p| of the sampled tokens against 1 − p (p = the rollout's probability). If every logit "
                "moves by at most ε, |Δ log p| <= 2ε(1 − p): points should follow the dotted c·(1 − p) line, small "
                "at confident tokens and largest in the tail. Points far above it at small 1 − p mean something "
                "other than logit noise (e.g. truncation applied on one side only).", None, "tail")
    page.figure(figures.abs_diff_histogram(*abs_histograms(dumps), colors=colors),
                "|Δ log p| per sampled token (all steps)",
                "log-spaced bins; the bulk should sit orders of magnitude below the tail. A second hump is a "
                "systematic difference (dtype, kernel, truncation applied on one side only).",
                f"p99 {RULES['tim/token/abs_diff_p99'].text}", "band")
    page.figure(figures.ratio_distribution(rho_source(dumps), colors=colors),
                "Importance ratio ρ = π_train / π_rollout per sampled token",
                "ρ = 1 (black line) means both sides agree; the spread around 1 is what an IS correction reweights. "
                "Tokens outside [0.5, 2] are what token-level corrections clip or drop.",
                "ρ inside [0.5, 2] for (almost) every token", "band")
    page.figure(figures.drift_by_position(position_profiles(dumps), colors=colors), "Drift by response position",
                "mean |Δ log p| at each response position. Growth with position points at differences that "
                "accumulate along the sequence (KV cache, attention kernels); a flat line means the mismatch does "
                "not depend on position.")
    page.figure(figures.sequence_log_ratio(sequence_points(dumps), LOG2, colors=colors),
                "Sequence log-ratio against length (all steps)",
                "one point per response; y = Σ_t d is the log of its sequence-level IS weight. Long responses drift "
                "furthest; points beyond the dashed ±log 2 lines get their weight truncated or are rejected by "
                "sequence-level corrections at their default threshold 2.",
                RULES["tim/seq/log_ratio_abs_max"].text, "verl")


def ess_warning_label(framework: str | None, threshold: float) -> str:
    """The ESS panel's warning line: verl's own warning in a verl run; the report's warning level elsewhere (a TRL
    run has no verl warning to show)."""
    return f"{'verl warning' if framework == 'verl' else 'warning'}: ESS < {threshold:g}"


def _series_figure(page, table: dict, framework: str | None = None, runs: dict | None = None,
                   colors: dict | None = None) -> None:
    """The per-step panels of ``table`` (a ``step_table``), or of several runs overlaid: ``runs`` {label: table},
    ``colors`` {label: colour} over every run of the page (``figures.colors_of``)."""
    import tim_plugins.report.figures as figures
    from tim_plugins.report.figures import NATS
    from tim_plugins.report.health import K3_HEALTHY_MAX, LOG2, RULES

    tables = runs if runs is not None else {None: table}
    pick = (lambda key: {k: t[key] for k, t in tables.items()}) if runs is not None else (lambda key: table[key])
    ess_logged = any(t["ess_logged"].any() for t in tables.values())
    ess_title = ("IS weight ESS (weights applied)" if ess_logged and all(t["ess_logged"].any() for t in tables.values())
                 else "IS weight ESS where applied, else ESS of ρ" if ess_logged
                 else "ESS of ρ (no IS correction applied)")
    lr = np.concatenate([t["lr_scale"] for t in tables.values()])
    lr_logged = np.isfinite(lr).any()
    # a panel only where the scale moved; a flat line at 1 (or none logged) is one line under the figure
    lr_moved = lr_logged and (lr[np.isfinite(lr)] != 1).any()
    lr_line = (" The LR scale is below 1 only when the LR decay fired (on the length, or its k3 / grad-norm signal)."
               if lr_moved else " The LR scale stays 1 at every step (lr_decay off, or it never fired): no panel."
               if lr_logged else " The LR scale was not logged (no LR decay): no panel.")
    step_word = {"trl": "TRL's global_step", "verl": "verl's global step"}.get(framework, "the run's step")
    ess_rule = RULES["tim/is/ess"]
    panels = [
        (f"k3 per token {NATS}", pick("k3"), (None, K3_HEALTHY_MAX), True),
        (f"|Δ log p| p99 {NATS}", pick("abs_diff_p99"), (None, LOG2), True),
        (f"max |sequence log-ratio| {NATS}", pick("seq_log_ratio_abs_max"), (None, LOG2), False),
        (ess_title, pick("ess"), (ess_rule.ok_lo, None), False,
         {"ylim": (0.0, 1.05), "marks": [(ess_rule.act_lo, ess_warning_label(framework, ess_rule.act_lo))]}),
        *([("TIM LR scale", pick("lr_scale"), None, False, {"ylim": (0.0, 1.05)})] if lr_moved else []),
        ("mean reward (context)", pick("reward"), None, False),
    ]
    steps = ({k: t["step"].astype(float) for k, t in tables.items()} if runs is not None
             else table["step"].astype(float))
    gaps = [(k, no_valid_text(t)) for k, t in tables.items()]
    gap_line = " ".join((text if k is None else f"{k}: {text}") for k, text in gaps if text is not None)
    if gap_line:  # where the lines break, and why
        gap_line += " The lines break there, at the dotted lines marked \"no valid token\"."
    no_valid = ({k: t["step"][t["no_valid"]] for k, t in tables.items()} if runs is not None
                else table["step"][table["no_valid"]])
    page.figure(figures.step_series(steps, panels, colors=colors, no_valid=no_valid), "Mismatch per optimizer step",
                f"one point per optimizer step ({step_word}), from the tim/* metrics logged at that step where the "
                "run kept them, else recomputed from the step's per-token dump (the ESS panel from the dump when no "
                "IS correction ran). A rising k3 or p99 means "
                "the two pipelines drift apart as the policy changes; a falling ESS means IS weights concentrate on "
                f"few tokens.{lr_line}{' ' + gap_line if gap_line else ''} Green background: "
                "healthy range. The axes do not zoom into step-to-step noise: each reaches its healthy limit, "
                "linear axes start at 0 and the ESS axis is fixed to [0, 1], so a flat-looking line is a steady "
                "metric, and how far a line sits from the green edge is how much margin is left.",
                f"k3 <= {K3_HEALTHY_MAX:g} nats; p99 and max |Σd| <= log 2 nats; ESS >= {ess_rule.ok_lo:g} (warning < "
                f"{ess_rule.act_lo:g})", "k3")


def training_page(summary: dict, run_dir: Path, page, decode=None) -> None:
    from tim_plugins.report.tokens import run_tokens, skipped_files_html

    tokens = run_tokens(summary, run_dir)
    table = step_table(summary, tokens)
    v = summary.get("verdict") or training_verdict(summary, tokens, table)
    # the dump's rows as the bare dump's page counts them: the figures below leave its invalid rows out
    rows = ("" if tokens is None else f"<p>The run's per-token dump: {tokens.size} tokens from "
            f"{tokens.sequences().length.size} sequences{invalid_rows_text(tokens)}.</p>")
    page.raw(rows + "<p>Measured over every monitored token of every step (rollout log-probs vs the trainer's "
             "recomputation of the same tokens):</p>" + skipped_files_html(tokens))
    page.verdict(v, v.get("extra", []))
    from tim_plugins.report.causes import causes_section

    causes_section(page, summary, summary.get("framework"))
    page.h2("Per optimizer step")
    _series_figure(page, table, summary.get("framework"))
    from tim_plugins.report.staleness import staleness_section

    staleness_section(page, summary)
    from tim_plugins.report.truncation import truncation_section

    truncation_section(page, summary, table)
    if tokens is not None and tokens.size:
        page.h2("Per token, over all steps")
        _figures_over_tokens(page, {"all steps": tokens})
    from tim_plugins.report.disagreements import dump_disagreements

    rows = summary.get("disagreements")
    if rows is None and tokens is not None:
        rows = dump_disagreements(tokens, decode)
    if rows is not None:
        disagreements_section(page, rows, "all steps")
    _audit_section(page, summary)
    _attached_section(page, summary)
    page.h2("Run settings")
    page.table(["key", "value"], [[k, v] for k, v in sorted(summary.get("settings", {}).items())])
    _timing_section(page, summary.get("timing") or {})


def _timing_section(page, timing: dict) -> None:
    """Wall-clock time as parts that add up: total = set-up + GRPO loop; the loop = rollouts + the rest (the
    rollouts are timed inside the loop, not next to it)."""
    total, train = timing.get("total_seconds"), timing.get("train_seconds")
    if total is None or train is None:
        return
    setup = timing.get("setup_seconds", total - train)
    rollout = timing.get("rollout_seconds")
    page.h2("Timings")
    rows = [["total: start to the end of training (the report is written after)", total, 1.0],
            ["\u2003set-up: imports, model build or load, trainer construction", setup, setup / total],
            ["\u2003GRPO loop: trainer.train()", train, train / total]]
    if rollout is not None:
        other = timing.get("train_other_seconds", train - rollout)
        tokens = timing.get("rollout_tokens")
        rate = f", {tokens / rollout:.0f} tokens/s" if tokens and rollout > 0 else ""
        rows += [[f"\u2003\u2003of which rollouts: sampling in rollout_func ({tokens} tokens{rate})", rollout,
                  rollout / total],
                 ["\u2003\u2003of which the rest: the trainer's log-probs, loss, backward, optimizer step, "
                  "TIMCallback", other, other / total]]
    page.table(["part", "seconds", "share of total"], [[what, round(sec, 1), f"{share:.0%}"]
                                                        for what, sec, share in rows])
    page.note("The parts add up: total = set-up + GRPO loop, and the loop = rollouts + the rest. TRL calls the "
              "rollout function from inside trainer.train(), so rollout time is part of the loop's time, not "
              "added to it. One run on this machine; other load on it changes the numbers.")


def disagreements_section(page, rows: list[dict], what: str, show_step: bool = True) -> None:
    from tim_plugins.report.disagreements import disagreements_html

    page.h2("Largest disagreements")
    decoded = not rows or "text" in rows[0]
    page.raw(f"<p>The sampled tokens ({what}) with the largest |log p<sub>trainer</sub> − log p<sub>rollout</sub>|, "
             "largest first: the token (marked) with a few tokens of its completion on each side, its position in "
             "the completion (0 = first sampled token), its probability under the rollout and under the trainer. "
             "Large differences at small p are the tail the (1 − p) figure predicts; a large difference at a "
             "confident token points at something other than rounding (a truncation or penalty on one side)."
             + ("" if decoded else " Token ids only: pass the tokenizer to decode them (tim-plugins report DIR "
                                  "--tokenizer PATH).") + "</p>")
    page.raw(disagreements_html(rows, show_step=show_step))


def _findings_table(page, findings: list, empty: str, framework: str | None = None,
                    deliberate: dict | None = None) -> None:
    from tim_plugins.report.parity import findings_rows, fix_header

    if findings:
        page.table(["severity", "code", "rollout", "trainer", "message", fix_header(framework)],
                   findings_rows(findings, framework, deliberate))
    else:
        page.note(empty)


def _audit_section(page, summary: dict) -> None:
    framework, deliberate = summary.get("framework"), summary.get("deliberate") or {}
    page.h2("Parity audit")
    page.raw("<p>At train begin the callback compares the two pipelines' settings (dtype, lm_head precision, "
             "log-prob mode, truncation, temperature, ...). Its findings, each with the setting that fixes it in "
             "this run's framework:</p>")
    _findings_table(page, summary.get("findings", []), "No findings: the callback's view of both pipelines agrees.",
                    framework, deliberate)
    own = summary.get("own_audit")
    if own is not None and summary.get("attached", {}).get("rollout_source") == "custom":
        page.raw("<p>This run samples through TRL's <code>rollout_func</code>, which the callback cannot look into: "
                 "it audits the rollout side as TRL's own generation with the trainer's model. The same audit of "
                 "the rollout model the demo actually samples with:</p>")
        _findings_table(page, own, "No findings.", framework, deliberate)
        found = {str(f.get("code")) for f in own}
        for why in dict.fromkeys(deliberate.values()):
            codes = [c for c, w in deliberate.items() if w == why and c in found]
            if codes:
                page.note(f"{', '.join(codes)}: {why}. The fix column says what to change in your run.")


def _attached_section(page, summary: dict) -> None:
    att = summary.get("attached")
    if not att:
        return
    page.h2("What the callback attached")
    hooks = att.get("hooks") or []
    page.raw("<p>TIMCallback(trainer, TIMConfig(...)) installs reversible instance-attribute wrappers at train "
             "begin and removes them at train end; the metrics go through TRL's own logging (log_history, wandb, "
             "tensorboard).</p>")
    rows = [["rollout log-probs from", att.get("rollout_source")],
            ["hooks installed", ", ".join(hooks) if hooks else "none"],
            ["TIMConfig fields changed from the defaults", att.get("config_changed") or "none"],
            ["diagnostic counters (tim/diag/*)", att.get("diagnostics") or "none"]]
    page.table(["what", "value"], rows)
    page.raw("<details><summary>Full TIMConfig</summary>")
    page.table(["field", "value"], [[k, v] for k, v in sorted((att.get("config") or {}).items())])
    page.raw("</details>")


def dump_page(dump_dir: Path, summary: dict | None, page, decode=None) -> None:
    """A report for a bare per-token dump (e.g. ``TIMConfig(dump_dir=...)``): verdict over all rows, per-step
    series when the dump spans several steps, the per-token figures."""
    from tim_plugins.report.disagreements import dump_disagreements
    from tim_plugins.report.tokens import has_dump, load_tokens, skipped_files_html

    # a run's folder (summary.json, log_history.jsonl) before its first dump file: the logged steps and causes alone
    tokens = load_tokens(dump_dir) if has_dump(dump_dir) or not summary else None
    table = step_table(summary, tokens)
    v = training_verdict(summary, tokens, table)
    if tokens is None:
        page.raw("<p>No per-token rows in the dump yet (the run stopped before a step wrote one, or its sampling "
                 "picked no sequence: <code>sample_rate</code>): the verdict and the series below come from the "
                 "metrics the run logged.</p>")
    else:
        page.raw(f"<p>{tokens.size} tokens from {tokens.sequences().length.size} sequences in the dump"
                 + invalid_rows_text(tokens) + ".</p>"
                 + skipped_files_html(tokens))
    page.verdict(v, v.get("extra", []))
    from tim_plugins.report.causes import causes_section

    causes_section(page, summary, (summary or {}).get("framework"))
    if table["step"].size > 1:
        page.h2("Per optimizer step")
        _series_figure(page, table, (summary or {}).get("framework"))
    if summary:  # the split, where the run logged one beside the dump (verl's log_history.jsonl)
        from tim_plugins.report.staleness import staleness_section

        staleness_section(page, summary)
        from tim_plugins.report.truncation import truncation_section

        truncation_section(page, summary, table)
    if tokens is not None:
        page.h2("Per token")
        _figures_over_tokens(page, {"dump": tokens})
        disagreements_section(page, dump_disagreements(tokens, decode), "every step of the dump")
    if summary and "findings" in summary:
        framework = summary.get("framework")
        page.h2("Parity audit")
        page.raw("<p>At start-up tim-plugins compared the two pipelines' settings (dtype, lm_head precision, "
                 "log-prob mode, truncation, temperature, ...) on the run's composed config. Its findings, each "
                 f"with the setting that fixes it in this run's framework ({framework or 'unknown'}):</p>")
        _findings_table(page, summary["findings"], "No findings: both pipelines' settings agree.", framework,
                        summary.get("deliberate") or {})
    if summary and summary.get("settings"):
        page.h2("Settings")
        page.table(["key", "value"], [[k, v] for k, v in sorted(summary["settings"].items())])
