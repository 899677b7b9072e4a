"""The report's "Truncation (safe vocabulary)" section: per logged step the kept mass, the kept-set size, the
boundary fraction and the IS ratio with the trainer renormalised over the kept set S against the full vocabulary;
whether S was replayed from the engine or recomputed (``tim_plugins.kept_set``), and the settings in the run's
framework's words.

The numbers are the run's logged ``tim/safe_vocab/*`` metrics (``SafeVocabStats``: over every response token) and
the monitor's ``tim/token/ratio_mean`` (over the measured tokens, boundary tokens excluded), read from the
summary's ``log_history`` (TRL's, or the ``log_history.jsonl`` beside a dump); ρ falls back to the step's per-token
dump where the run did not log it (the report's ``step_table``). The dump holds no kept-set columns.
"""

from __future__ import annotations

import html
import json
import math

__all__ = ["settings_line", "truncation_comparison", "truncation_headline", "truncation_rows", "truncation_section"]

_PREFIX = "tim/safe_vocab/"


def _num(h: dict, key: str) -> float:
    v = h.get(key)
    return math.nan if v is None else float(v)


def truncation_rows(summary: dict, table: dict | None = None) -> list[dict]:
    """One row per logged step with safe-vocabulary tokens: {step, tokens, kept_mass (1 − pruned_mass_mean),
    kept_mass_min (1 − pruned_mass_max), size_mean, boundary_frac, ratio (ρ mean with S: the logged
    ``tim/token/ratio_mean``, else the step's dump value in ``table``), ratio_source ("logged", "dump" or None),
    ratio_full (≈ ρ × kept mass: the full-vocabulary trainer's ρ of a token is its safe ρ times its kept mass),
    k3, k3_full (``tim/safe_vocab/kl_k3`` / ``kl_k3_full`` where the run logged them)}."""
    dump_ratio = {}
    if table is not None and "ratio_mean" in table:
        dump_ratio = {int(s): float(r) for s, r in zip(table["step"], table["ratio_mean"]) if math.isfinite(r)}
    rows = []
    for h in summary.get("log_history") or []:
        if not h.get(_PREFIX + "tokens"):
            continue
        step = int(h.get("step", len(rows) + 1))
        kept = 1.0 - _num(h, _PREFIX + "pruned_mass_mean")
        ratio, source = _num(h, "tim/token/ratio_mean"), "logged"
        if not math.isfinite(ratio):
            ratio, source = dump_ratio.get(step, math.nan), "dump" if step in dump_ratio else None
        rows.append({"step": step, "tokens": _num(h, _PREFIX + "tokens"), "kept_mass": kept,
                     "kept_mass_min": 1.0 - _num(h, _PREFIX + "pruned_mass_max"),
                     "size_mean": _num(h, _PREFIX + "size_mean"), "boundary_frac": _num(h, _PREFIX + "boundary_frac"),
                     "ratio": ratio, "ratio_source": source, "ratio_full": ratio * kept,
                     "k3": _num(h, _PREFIX + "kl_k3"), "k3_full": _num(h, _PREFIX + "kl_k3_full")})
    return rows


def _weighted_mean(pairs) -> float:
    """The mean of per-step token means, weighted by the steps' token counts: (count, value) pairs; steps with no
    tokens or a non-finite value are left out (NaN when none is left)."""
    used = [(float(n), float(v)) for n, v in pairs if math.isfinite(v) and math.isfinite(n) and n > 0]
    total = sum(n for n, _ in used)
    return sum(n * v for n, v in used) / total if total else math.nan


def _pooled(rows: list[dict], key: str) -> float:
    """``key`` over the run, weighted by each step's safe-vocabulary tokens (the per-step values are token means)."""
    return _weighted_mean((r["tokens"], r[key]) for r in rows)


def _mapping(value) -> dict:
    """A settings entry that is a dict, or a JSON object as text (the verl driver writes JSON strings)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _g(x) -> str:
    return format(x, "g") if isinstance(x, float) else str(x)


def settings_line(summary: dict) -> str | None:
    """The truncation settings as the user writes them in the run's framework, or None when the summary does not
    record them. TRL: ``GRPOConfig(top_p=..., top_k=..., min_p=..., temperature=...)`` and ``TIMConfig(safe_vocab=True
    [, safe_vocab_min_p=...])``; verl: the override that switched the safe vocabulary on (``+tim.safe_vocab.min_p=...``
    with min-p pruning, else ``+tim.safe_vocab.enable=true``) and the ``actor_rollout_ref.rollout.*`` overrides."""
    framework, settings = summary.get("framework"), summary.get("settings") or {}
    if framework == "verl":
        tim = _mapping(settings.get("tim"))
        sampling = _mapping(settings.get("rollout sampling"))
        parts = []
        safe = tim.get("safe_vocab") or {}
        min_p = safe.get("min_p")
        if not min_p and safe.get("enable"):  # SafeVocabSettings.setting: the cut alone, no min-p pruning
            parts.append("+tim.safe_vocab.enable=true")
        elif min_p is not None:
            parts.append(f"+tim.safe_vocab.min_p={_g(min_p)}")
        parts += [f"actor_rollout_ref.rollout.{k}={_g(sampling[k])}" for k in ("top_p", "top_k", "temperature")
                  if sampling.get(k) is not None]
        return " ".join(parts) or None
    if framework == "trl":
        grpo = _mapping(settings.get("GRPOConfig sampling"))
        tim = _mapping(settings.get("TIMConfig safe vocabulary")) or {
            k: v for k, v in ((summary.get("attached") or {}).get("config") or {}).items()
            if k in ("safe_vocab", "safe_vocab_min_p", "mask_boundary_tokens")}
        parts = []
        if grpo:
            parts.append("GRPOConfig(" + ", ".join(f"{k}={_g(grpo[k])}" for k in ("top_p", "top_k", "min_p",
                                                                                  "temperature") if k in grpo) + ")")
        if tim:
            parts.append("TIMConfig(" + ", ".join(f"{k}={_g(v)}" for k, v in tim.items() if v is not None) + ")")
        return ", ".join(parts) or None
    return None


def _version(summary: dict) -> str | None:
    settings = summary.get("settings") or {}
    v = settings.get(summary.get("framework") or "") or settings.get("trl_version")
    return v if isinstance(v, str) else None


def _kept_set(summary: dict):
    """How the run had its kept set (``kept_set.kept_set``), from what its summary records: the framework and
    version, and whether it asked vLLM for its sets (``"sampling mask"``)."""
    from tim_plugins.kept_set import kept_set

    settings = summary.get("settings") or {}
    return kept_set(summary.get("framework"), _version(summary), sampling_mask=settings.get("sampling mask") == "true")


def truncation_headline(summary: dict, rows: list[dict] | None = None) -> str | None:
    """The verdict block's line on truncation, or None when the run had no safe vocabulary."""
    rows = truncation_rows(summary) if rows is None else rows
    if not rows:
        return None
    mode = _kept_set(summary).mode
    kept, boundary = _pooled(rows, "kept_mass"), _pooled(rows, "boundary_frac")
    return (f"Truncation (safe vocabulary, kept set by {mode}): {kept:.4g} of the probability mass kept on average, "
            f"{boundary:.3%} of the sampled tokens outside the trainer's kept set.")


def truncation_section(page, summary: dict | None, table: dict | None = None) -> None:
    """The section, when the run logged ``tim/safe_vocab/*``; ``table``: the report's ``step_table`` (ρ from the
    dump where the run did not log it)."""
    rows = truncation_rows(summary or {}, table)
    if not rows:
        return
    k = _kept_set(summary)
    page.h2("Truncation (safe vocabulary)")
    page.raw("<p>The rollout engine samples from a truncated distribution (min-p, top-k, top-p keep a set S of "
             "tokens) and reports log-probs renormalised over S. The trainer renormalises its own log-probs over "
             "S too, so the IS ratio ρ = π<sub>train</sub> / π<sub>rollout</sub> compares like with like; a "
             "full-vocabulary trainer would read ρ ≈ the kept mass Σ<sub>S</sub> p instead of 1. <b>Kept mass</b>: "
             "the share of the trainer's probability inside S (1 − the pruned mass). <b>Boundary fraction</b>: "
             "sampled tokens the trainer's S excludes (the engine kept them); the loss drops them.</p>")
    line = settings_line(summary)
    if line:
        page.raw(f"<p>Settings, as set in this run: <code>{html.escape(line)}</code></p>")
    page.raw(f"<p><b>Kept set: {k.mode}.</b> {html.escape(k.reason[0].upper() + k.reason[1:])}. "
             + ("A replayed set has no boundary tokens by construction; a recomputed one has them where the two "
                "sides' logits put a token on different sides of the cut." if k.mode == "recompute" else "")
             + "</p>")
    show_k3 = any(math.isfinite(r["k3"]) or math.isfinite(r["k3_full"]) for r in rows)
    header = ["step", "tokens", "kept mass (mean)", "kept mass (lowest token)", "kept-set size |S| (mean)",
              "boundary fraction", "ρ mean, trainer over S", "ρ mean, full vocabulary (≈ ρ × kept mass)"]
    if show_k3:
        header += ["k3 over S", "k3 full vocabulary"]
    body = []
    for r in rows:
        row = [r["step"], int(r["tokens"]), _f(r["kept_mass"]), _f(r["kept_mass_min"]), _f(r["size_mean"], 4),
               _pct(r["boundary_frac"]), _f(r["ratio"]) + (" (dump)" if r["ratio_source"] == "dump" else ""),
               _f(r["ratio_full"])]
        if show_k3:
            row += [_f(r["k3"], 3), _f(r["k3_full"], 3)]
        body.append(row)
    pooled = ["run (token-weighted)", int(sum(r["tokens"] for r in rows)), _f(_pooled(rows, "kept_mass")),
              _f(min((r["kept_mass_min"] for r in rows if math.isfinite(r["kept_mass_min"])), default=math.nan)),
              _f(_pooled(rows, "size_mean"), 4), _pct(_pooled(rows, "boundary_frac")), "", ""]
    if show_k3:
        pooled += ["", ""]
    rows_out = body + [pooled]
    page.table(header, rows_out, [[None, None] + ["num"] * (len(header) - 2)] * len(rows_out))  # text cells, aligned
    page.note("Kept mass, |S| and the boundary fraction are means over every response token of the step "
              "(tim/safe_vocab/*); ρ is the monitor's mean over the measured tokens (tim/token/ratio_mean, boundary "
              "tokens excluded; '(dump)': recomputed from the step's per-token dump). The full-vocabulary ρ is not "
              "measured: it is ρ times the kept mass, since a full-vocabulary trainer's log-prob of a token is its "
              "log-prob over S plus log Σ_S p (exact per token; the product of the step means approximates the mean "
              "of the products).")


def _ratio_without(table: dict | None) -> float:
    """ρ mean over the run of a run without safe vocabulary: the monitor's per-step ``ratio_mean``, weighted by the
    step's monitored tokens (its ``step_table``)."""
    if table is None or "ratio_mean" not in table:
        return math.nan
    return _weighted_mean(zip(table["tokens"], table["ratio_mean"]))


def truncation_comparison(page, runs: dict[str, tuple[dict | None, dict | None]]) -> None:
    """The comparison page's section: one row per run ({label: (summary, step_table)}), when any of them logged
    ``tim/safe_vocab/*``: whether the trainer renormalised over S (and how S was had), the settings as the run set
    them, and the run's token-weighted kept mass, |S|, boundary fraction and ρ. A run without the safe vocabulary
    shows its measured ρ (full vocabulary on the trainer's side): before / after the fix side by side."""
    rows = {label: truncation_rows(summary or {}, table) for label, (summary, table) in runs.items()}
    if not any(rows.values()):
        return
    page.h2("Truncation (safe vocabulary)")
    page.raw("<p>Per run: whether the trainer renormalised its log-probs over the sampler's kept set S, with the "
             "kept mass, |S| and the boundary fraction over the run's response tokens, and the IS ratio ρ over the "
             "measured tokens. With truncated sampling and a full-vocabulary trainer ρ reads about the kept mass "
             "instead of 1; each run's own section (its report) has the per-step table.</p>")
    header = ["run", "trainer over S (kept set)", "settings, as set", "tokens", "kept mass (mean)",
              "kept-set size |S| (mean)", "boundary fraction", "ρ mean"]
    body = []
    for label, (summary, table) in runs.items():
        summary = summary or {}
        r = rows[label]
        line = settings_line(summary) or "–"
        if not r:
            ratio = _ratio_without(table)
            body.append([label, "no (full vocabulary)", line, "–", "–", "–", "–", _f(ratio)])
            continue
        mode = _kept_set(summary).mode
        ratio = _pooled(r, "ratio")
        body.append([label, f"yes ({mode})", line, int(sum(x["tokens"] for x in r)), _f(_pooled(r, "kept_mass")),
                     _f(_pooled(r, "size_mean"), 4), _pct(_pooled(r, "boundary_frac")), _f(ratio)])
    page.table(header, body, [[None, None, None] + ["num"] * (len(header) - 3)] * len(body))
    page.note("Kept mass, |S| and the boundary fraction: token-weighted means of the run's logged tim/safe_vocab/* "
              "per step; ρ: the monitor's tim/token/ratio_mean per step, weighted by the step's tokens (safe-vocabulary "
              "tokens where S was used, monitored tokens otherwise).")


def _f(x: float, digits: int = 6) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}g}"


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.3%}"
