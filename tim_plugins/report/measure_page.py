"""The report of ``tim-plugins measure``: one or several rollout settings against one trainer, side by side."""

from __future__ import annotations

import html
import math
from pathlib import Path

__all__ = ["measure_verdict", "measure_page", "VERDICT_KEYS"]

# The metrics the verdict checks (each has a healthy range in health.RULES).
VERDICT_KEYS = ("tim/token/kl_k3", "tim/dist/kl_rollout_train_mean", "tim/dist/tv_mean", "tim/token/abs_diff_p99",
                "tim/token/ratio_outside_frac", "tim/seq/log_ratio_abs_max")

_TABLE = (  # (key, column label)
    ("tim/token/kl_k3", "k3"),
    ("tim/dist/kl_rollout_train_mean", "KL(r‖t) exact"),
    ("tim/dist/kl_train_rollout_mean", "KL(t‖r) exact"),
    ("tim/dist/tv_mean", "TV"),
    ("tim/dist/topk_overlap_mean", "top-k overlap"),
    ("tim/dist/sampled_rank_changed_frac", "rank changed"),
    ("tim/token/abs_diff_p99", "|Δ| p99"),
    ("tim/token/abs_diff_max", "|Δ| max"),
    ("tim/seq/log_ratio_abs_max", "max |Σd|"),
    ("tim/safe_vocab/pruned_mass_mean", "pruned mass"),
    ("rollout/tokens_per_s", "tokens/s"),
)

_DIST_TABLE = (
    ("tim/dist/positions", "positions"),
    ("tim/dist/kl_rollout_train_mean", "KL(r‖t) mean"),
    ("tim/dist/kl_rollout_train_max", "KL(r‖t) max"),
    ("tim/dist/kl_train_rollout_mean", "KL(t‖r) mean"),
    ("tim/dist/kl_train_rollout_max", "KL(t‖r) max"),
    ("tim/dist/tv_mean", "TV mean"),
    ("tim/dist/tv_max", "TV max"),
    ("tim/dist/topk_overlap_mean", "top-k overlap"),
    ("tim/dist/top1_agree_frac", "argmax agrees"),
    ("tim/dist/sampled_rank_rollout_mean", "rank (rollout)"),
    ("tim/dist/sampled_rank_train_mean", "rank (trainer)"),
    ("tim/dist/sampled_rank_changed_frac", "rank changed"),
    ("tim/dist/support_mismatch_frac", "support differs"),
)


def _ratio_text(new: float, base: float) -> str:
    if any(not isinstance(x, (int, float)) or math.isnan(x) for x in (new, base)):
        return "n/a"
    if new == base:
        return "unchanged"
    if new == 0:
        return "down to exactly 0"
    if base == 0:
        return f"up from 0 to {new:.2g}"
    r = new / base
    return f"{1 / r:.3g}× lower" if r < 1 else f"{r:.3g}× higher"


def measure_verdict(summary: dict) -> dict:
    from tim_plugins.report.health import verdict

    comps = summary["comparisons"]
    primary = summary.get("primary") or next(iter(comps))
    v = verdict(comps[primary], VERDICT_KEYS,
                next_step="Try the settings compared below." if len(comps) > 1 else None)
    v["setting"] = primary
    extra = []
    names = list(comps)
    if len(names) > 1:
        base = summary.get("baseline", names[0])
        b = comps[base]
        for name in names:
            if name == base:
                continue
            m = comps[name]
            extra.append(
                f"{name} vs {base}: k3 {_ratio_text(m.get('tim/token/kl_k3'), b.get('tim/token/kl_k3'))}, "
                f"|Δ| p99 {_ratio_text(m.get('tim/token/abs_diff_p99'), b.get('tim/token/abs_diff_p99'))}, "
                f"exact KL {_ratio_text(m.get('tim/dist/kl_rollout_train_mean'), b.get('tim/dist/kl_rollout_train_mean'))}"
                f"; throughput {_ratio_text(m.get('rollout/tokens_per_s'), b.get('rollout/tokens_per_s'))}.")
        best_k3 = min(names, key=lambda n: _key(comps[n], "tim/token/kl_k3"))
        best_tail = min(names, key=lambda n: _key(comps[n], "tim/token/abs_diff_p99"))
        engines = [n for n in names if not n.startswith("exact")]
        line = f"Lowest k3: {best_k3}; lowest tail mismatch (|Δ| p99): {best_tail}"
        if engines and best_k3 not in engines:
            best_engine = min(engines, key=lambda n: _key(comps[n], "tim/token/kl_k3"))
            line += f"; lowest k3 without the (slow) exact sampler: {best_engine}"
        extra.insert(0, line + ".")
    v["extra"] = [f"Not run: {name}: {why}." for name, why in (summary.get("skipped") or {}).items()] + extra
    audit = (summary.get("audits") or {}).get(primary)
    if audit is not None:
        from tim_plugins.report.parity import reconcile

        # What the audit finds in a measured setting is that setting itself (hf-bf16 is a bf16 rollout).
        why = f"{primary} is the setting this run measures"
        reconcile(v, audit, summary.get("framework"), {str(f.get("code")): why for f in audit})
    return v


def _key(m: dict, key: str) -> float:
    x = m.get(key)
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else x


def measure_page(summary: dict, run_dir: Path, page, decode=None) -> None:
    """Fill ``page`` (a `Page`) with the measure report of ``summary`` (dumps read below ``run_dir``)."""
    import tim_plugins.report.figures as figures
    from tim_plugins.report.health import K3_HEALTHY_MAX, LOG2, RULES, status
    from tim_plugins.report.page import fmt
    from tim_plugins.report.tokens import run_tokens, skipped_files_html

    comps = summary["comparisons"]
    names = list(comps)
    setups = summary.get("setups", {})
    v = summary.get("verdict") or measure_verdict(summary)
    many = len(names) > 1
    # the setting and baseline are summary.json text (a setting's name is the user's): escaped like every label
    page.raw(f"<p>Verdict for <b>{html.escape(str(v.get('setting', names[-1])))}</b>"
             + (f" (the baseline of the comparison is <b>{html.escape(str(summary.get('baseline', names[0])))}</b>)"
                if many else "") + ":</p>")
    page.verdict(v, v.get("extra", []))

    tokens = {name: t for name in names if (t := run_tokens(summary, run_dir, name)) is not None}
    for name, t in tokens.items():  # a setting's torn or foreign dump files, left out
        if skipped_files_html(t):
            page.raw(f"<p><b>{html.escape(name)}</b>:</p>" + skipped_files_html(t))

    page.h2("Settings side by side" if many else "Result")
    header = ["setting"] + [label for _, label in _TABLE]
    rows, classes = [], []
    for name in names:
        m = comps[name]
        rows.append([name] + [m.get(k) for k, _ in _TABLE])
        classes.append([None] + [status(k, m.get(k)) for k, _ in _TABLE])
    page.table(header, rows, classes)
    page.raw("<p class='note'>k3 and |Δ| come from the sampled tokens (d = log p_train − log p_rollout, "
             "ρ = e<sup>d</sup>); KL, TV, top-k overlap and ranks come from the whole next-token distributions of "
             "both sides on the same prefixes. Tokens/s: tokens sampled per second of the rollout call on this "
             "machine (one run). Cells are coloured by the healthy ranges cited below.</p>")

    if many:
        panels = [
            (f"k3 per sampled token {figures.NATS}", [comps[n].get("tim/token/kl_k3") for n in names],
             (None, K3_HEALTHY_MAX), True),
            ("KL(rollout ‖ trainer), exact", [comps[n].get("tim/dist/kl_rollout_train_mean") for n in names],
             (None, K3_HEALTHY_MAX), True),
            ("|Δ log p| p99 (tail)", [comps[n].get("tim/token/abs_diff_p99") for n in names], (None, LOG2), True),
            ("rollout tokens / s", [comps[n].get("rollout/tokens_per_s") for n in names], None, False),
        ]
        page.figure(figures.comparison_bars(names, panels), "Which setting brings the mismatch down, at what cost",
                    "one bar per setting; on the first three panels a shorter bar is less mismatch (log scale), "
                    "the last panel is the cost (sampled tokens per second, longer is faster). 'exactly 0' marks a "
                    "setting with zero mismatch (the exact sampler). The green band is the healthy range.",
                    f"k3 and KL <= {K3_HEALTHY_MAX:g}; |Δ| p99 <= log 2", "k3")
    from tim_plugins.report.tokens import (abs_histograms, position_profiles, prob_curves, rho_source,
                                           sequence_points)

    if tokens:
        profiles = summary.get("profiles")
        page.figure(figures.mismatch_by_probability(prob_curves(tokens, quantile=len(tokens) == 1 and not profiles),
                                                    profiles),
                    "Mismatch by token probability, from the whole distributions",
                    "left: |Δ log p| against 1 − p (p = the rollout's probability of the token; lines: every "
                    "vocabulary entry of every compared position, markers: the sampled tokens). If every logit moves "
                    "by at most ε, |Δ log p| <= 2ε(1 − p): points should follow the dotted c·(1 − p) line, small at "
                    "confident tokens. Points far above it at small 1 − p mean something other than logit noise "
                    "(e.g. truncation on one side only). Right: the same against p, the tail min-p pruning removes.",
                    None, "tail")
        page.figure(figures.abs_diff_histogram(*abs_histograms(tokens)),
                    "|Δ log p| per sampled token",
                    "log-spaced bins; the bulk should sit orders of magnitude below the tail, and a curve further "
                    "left is less mismatch. A second hump is a systematic difference (dtype, kernel, truncation "
                    "applied on one side only).", f"p99 {RULES['tim/token/abs_diff_p99'].text}",
                    "band")
        page.figure(figures.ratio_distribution(rho_source(tokens)),
                    "Importance ratio ρ = π_train / π_rollout per sampled token",
                    "ρ = 1 (black line) means both sides agree; the spread around 1 is what an IS correction "
                    "reweights. Tokens outside [0.5, 2] are what token-level corrections clip or drop.",
                    "ρ inside [0.5, 2] for (almost) every token", "band")
        page.figure(figures.drift_by_position(position_profiles(tokens)),
                    "Drift by response position",
                    "mean |Δ log p| at each response position. Growth with position points at differences that "
                    "accumulate along the sequence (KV cache, attention kernels); a flat line means the mismatch "
                    "does not depend on position.", None, None)
        page.figure(figures.sequence_log_ratio(sequence_points(tokens), LOG2),
                    "Sequence log-ratio against length",
                    "one point per response; y = Σ_t d is the log of its sequence-level IS weight. Long responses "
                    "drift furthest; points beyond the dashed ±log 2 lines get their weight truncated or are "
                    "rejected by sequence-level corrections at their default threshold 2.",
                    RULES["tim/seq/log_ratio_abs_max"].text, "verl")

    _disagreements_section(summary, run_dir, page, names, v.get("setting", names[0]), decode)
    _frameworks_section(summary, page, names)
    _audit_section(summary, page, names)

    page.h2("Full next-token distributions on the same prefixes")
    page.raw("<p>At every scored position both sides' whole next-token distributions are compared: exact KL in both "
             "directions, total variation ½Σ|p<sub>r</sub> − p<sub>t</sub>|, the overlap of the top-k tokens, and "
             "the sampled token's rank under each (1 = most likely). Sampled-token agreement does not prove the "
             "distributions agree; these numbers do. 'support differs': positions where one side gives mass to a "
             "token the other excludes (there the KL is infinite and left out of the KL means).</p>")
    rows = [[n] + [comps[n].get(k) for k, _ in _DIST_TABLE] for n in names]
    page.table(["setting"] + [label for _, label in _DIST_TABLE], rows)
    exactness = "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(setups.get(n, {}).get('full_distribution', ''))}"
                        "</li>" for n in names)
    page.raw(f"<p>What is exact and what is truncated:</p><ul>{exactness}</ul>")

    page.h2("How each side computed its numbers")
    rows = [[n, s.get("rollout"), s.get("trainer"), s.get("threads"), s.get("engine_start_s")]
            for n, s in setups.items()]
    page.table(["setting", "rollout log-probs", "trainer log-probs", "torch threads", "engine start (s)"], rows)
    for note in summary.get("notes", []):
        page.note(note)
    page.h2("Run settings")
    page.table(["key", "value"], [[k, v] for k, v in sorted(summary.get("settings", {}).items())])
    keys = sorted({k for m in comps.values() for k in m})
    body = "".join(f"<tr><td>{html.escape(k)}</td>" + "".join(
        f"<td class='num'>{fmt(comps[n].get(k))}</td>" for n in names) + "</tr>" for k in keys)
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    page.raw(f"<details><summary>All metrics</summary><table><tr><th>metric</th>{head}</tr>{body}</table></details>")



def _disagreements_section(summary: dict, run_dir: Path, page, names: list[str], first: str, decode) -> None:
    """The largest disagreements per setting: the verdict's setting open, the others folded."""
    from tim_plugins.report.disagreements import disagreements_html, dump_disagreements
    from tim_plugins.report.tokens import has_dump

    stored = summary.get("disagreements") or {}
    page.h2("Largest disagreements")
    page.raw("<p>Per setting, the scored tokens with the largest |log p<sub>trainer</sub> − log p<sub>rollout</sub>|, "
             "largest first: the token (marked) inside its response (⟨start⟩ = the first sampled token), its "
             "position in the response (0 = first), and its probability under the rollout and under the trainer. "
             "Large differences at small p are the tail the (1 − p) figure predicts; a large difference at a "
             "confident token points at something other than rounding.</p>")
    for name in sorted(names, key=lambda n: n != first):
        rows = stored.get(name)
        if rows is None:
            folder = Path(run_dir) / summary.get("dumps", {}).get(name, "")
            rows = dump_disagreements(folder, decode) if has_dump(folder) else None
        if rows is None:
            continue
        if rows and max(abs(r["diff"]) for r in rows) == 0:
            body = "<p class='note'>Every scored token has the same log-prob on both sides (Δ = 0).</p>"
        else:
            body = disagreements_html(rows, show_step=False)
        label = html.escape(name)
        if name == first:
            page.raw(f"<p><b>{label}</b> (the verdict's setting):</p>{body}")
        else:
            page.raw(f"<details><summary><b>{label}</b></summary>{body}</details>")


def _frameworks_section(summary: dict, page, names: list[str]) -> None:
    setups = summary.get("setups", {})
    rows = []
    for n in names:
        texts = setups.get(n, {}).get("frameworks") or {}
        if len(set(texts.values())) == 1:  # the same in every framework (the exact sampler)
            rows.append([n, ", ".join(texts), next(iter(texts.values()))])
        else:
            rows += [[n if i == 0 else "", fw, text] for i, (fw, text) in enumerate(texts.items())]
    if not rows:
        return
    page.h2("Each setting in your framework")
    page.raw("<p>The configuration whose rollout runs the numerics of each setting, against the trainer of this "
             "run: what to set (or what you already run) in TRL, verl and vLLM.</p>")
    page.table(["setting", "framework", "configuration"], rows)


def _audit_section(summary: dict, page, names: list[str]) -> None:
    from tim_plugins.report.parity import findings_rows, fix_header

    audits = summary.get("audits") or {}
    if not audits:
        return
    framework = summary.get("framework")
    page.h2("Parity audit of each setting")
    page.raw("<p>Each setting's rollout pipeline against the trainer's, as the parity audit compares them (dtype, "
             "lm_head precision, log-prob mode, truncation, temperature, ...). A finding here is the setting "
             "itself (hf-bf16 is a bf16 rollout); the fix column is the rollout engine's argument that removes "
             "it (the TRL and verl spelling of each setting is in the table above).</p>")
    # A finding every setting has (e.g. batch-invariance-off) is listed once.
    key = lambda f: tuple(str(f.get(k)) for k in ("code", "severity", "rollout", "trainer"))  # noqa: E731
    common = set.intersection(*(set(map(key, audits.get(n, []))) for n in names)) if len(names) > 1 else set()
    rows = []
    for n in names:
        found = [f for f in audits.get(n, []) if key(f) not in common]
        rows += [[n] + r for r in findings_rows(found, framework)] or [[n, "—", "no other finding", None, None,
                                                                         None, None]]
    shared = [f for f in audits.get(names[0], []) if key(f) in common]
    rows += [["every setting"] + r for r in findings_rows(shared, framework)]
    page.table(["setting", "severity", "code", "rollout", "trainer", "message", fix_header(framework)], rows)
