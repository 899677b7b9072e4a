"""The page comparing several training runs (or dump folders) side by side: what differs between them (settings,
the package versions that differ, each run's parity audit), one verdict per run, the per-step series overlaid (one
colour per run), the truncation row of each run where one used the safe vocabulary, the per-token figures overlaid,
the largest disagreements per run. For before / after a fix, bf16 against fp32 rollouts, one setting against
another."""

from __future__ import annotations

import html
import json
from pathlib import Path

__all__ = ["comparison_page", "differences", "same_versions"]

# Settings that name a run's own folders: they differ between any two runs and say nothing about them.
_OWN_FOLDERS = ("out", "TIMConfig.dump_dir", "tim.dump.dir")


def comparison_page(runs: dict[str, tuple[Path, dict | None]], page, decode=None) -> None:
    """Fill ``page`` with the comparison of ``runs`` ({label: (folder, its summary or None)}); ``decode``: a
    decoder for every run, or {label: decoder}."""
    from tim_plugins.report.disagreements import disagreements_html, dump_disagreements
    from tim_plugins.report.tokens import dump_folder, has_dump, load_tokens, skipped_files_html
    from tim_plugins.report.figures import colors_of
    from tim_plugins.report.training_page import _figures_over_tokens, _series_figure, step_table, training_verdict
    from tim_plugins.report.truncation import truncation_comparison

    dumps, tables, frameworks, verdicts, blocks = {}, {}, set(), {}, []
    for label, (folder, summary) in runs.items():
        if (summary or {}).get("kind") == "measure":
            raise ValueError(f"{folder}: a measure report compares its settings itself (tim-plugins report "
                             f"{folder}); a comparison takes training runs or dump folders.")
        where = Path(folder) if has_dump(Path(folder)) else dump_folder(summary, folder)
        tokens = load_tokens(where) if has_dump(where) else None
        if tokens is not None:
            dumps[label] = tokens
        tables[label] = table = step_table(summary, tokens)
        frameworks.add((summary or {}).get("framework"))
        verdicts[label] = (summary or {}).get("verdict") or training_verdict(summary, tokens, table)
        what = (f"{tokens.size} monitored tokens in {tokens.sequences().length.size} sequences of its dump"
                + (f", {tokens.invalid} invalid row{'' if tokens.invalid == 1 else 's'} skipped" if tokens.invalid
                   else "") if tokens is not None
                else "no per-token dump (per-step series from its log)")
        blocks.append(f"<p><b>{html.escape(label)}</b> ({html.escape(str(folder))}; {what}):</p>"
                      + skipped_files_html(tokens))
    _differences_section(page, runs, verdicts)
    page.h2("Verdict per run")
    for block, (label, v) in zip(blocks, verdicts.items()):
        page.raw(block)
        # its audit is a row of the table above (the run's own report has its tables)
        page.verdict(v, [line for line in v.get("extra", []) if not line.startswith("Parity audit:")])
    framework = frameworks.pop() if len(frameworks) == 1 else None
    # one colour per run in every figure: a figure without some runs (no dump, no steps) shifts no other's colour
    colors = colors_of(runs)
    if any(t["step"].size for t in tables.values()):
        page.h2("Per optimizer step")
        _series_figure(page, {}, framework, runs={k: t for k, t in tables.items() if t["step"].size},
                       colors=colors)
    truncation_comparison(page, {label: (summary, tables[label]) for label, (_, summary) in runs.items()})
    if dumps:
        page.h2("Per token, over all steps")
        _figures_over_tokens(page, dumps, colors)
        page.h2("Largest disagreements")
        page.raw("<p>Per run, the sampled tokens with the largest |log p<sub>trainer</sub> − log "
                 "p<sub>rollout</sub>|, largest first (the token marked, with a few tokens of its completion on "
                 "each side).</p>")
        for i, (label, tokens) in enumerate(dumps.items()):
            dec = decode.get(label) if isinstance(decode, dict) else decode
            body = disagreements_html(dump_disagreements(tokens, dec))
            page.raw(f"<details{' open' if i == 0 else ''}><summary><b>{html.escape(label)}</b></summary>{body}"
                     "</details>")


def _flat(prefix: str, value) -> dict[str, object]:
    """A setting as {dotted name: value}: a dict (or a JSON object as text, as verl's summary writes it) one entry
    per leaf."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            out.update(_flat(f"{prefix}.{key}", sub))
        return out
    return {prefix: value}


def _settings(summary: dict) -> dict[str, object]:
    """Every setting a run's summary records, flat: its settings, and the TIMConfig the callback ran with."""
    out = {}
    for key, value in (summary.get("settings") or {}).items():
        out.update(_flat(key, value))
    config = (summary.get("attached") or {}).get("config")
    if config:
        out.update(_flat("TIMConfig", config))
    return {k: v for k, v in out.items() if k not in _OWN_FOLDERS}


def _audit_cell(summary: dict) -> str:
    """A run's parity audit in one cell: errors and warnings with their codes over its audits (the callback's, and
    the rollout model's own where the run samples through its own function), those it made on purpose marked."""
    findings = list(summary.get("findings") or []) + list(summary.get("own_audit") or [])
    if not findings and "findings" not in summary:
        return "no audit recorded"
    deliberate = summary.get("deliberate") or {}
    parts = []
    for level in ("error", "warning"):
        codes = list(dict.fromkeys(str(f.get("code")) for f in findings if f.get("severity") == level))
        words = [c + (" (deliberate)" if c in deliberate else "") for c in codes]
        parts.append(f"{len(codes)} {level}{'' if len(codes) == 1 else 's'}" + (f": {', '.join(words)}" if words else ""))
    return "; ".join(parts)


def _text(value) -> str:
    return "–" if value is None else json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)


def differences(runs: dict[str, dict | None], verdicts: dict[str, dict] | None = None
                ) -> tuple[list[list[str]], int]:
    """The rows of the "What differs" table ({label: summary}): each run's verdict (``verdicts``, where given), every
    setting whose value differs between the runs (a setting one run lacks reads "–"), every package version that
    differs (``same_versions`` has the others), each run's parity audit; and the number of settings equal in every
    run."""
    settings = {label: _settings(s or {}) for label, s in runs.items()}
    names = sorted(set().union(*settings.values()))
    differ = [n for n in names if len({_text(s.get(n)) for s in settings.values()}) > 1]
    # a run setting that is a TIMConfig field (the demo's --safe-vocab): one row, not its twin under TIMConfig.
    twin = lambda n: n.startswith("TIMConfig.") and n[len("TIMConfig."):] in differ and all(  # noqa: E731
        _text(s.get(n)) == _text(s.get(n[len("TIMConfig."):])) for s in settings.values())
    shown = [n for n in differ if not twin(n)]
    rows = [["verdict", *[verdicts[label]["status"].upper() for label in runs]]] if verdicts else []
    rows += [[f"setting: {n}", *[_text(settings[label].get(n)) for label in runs]] for n in shown]
    versions = _versions(runs)
    for dist in sorted(set().union(*versions.values())):
        values = [versions[label].get(dist) for label in runs]
        if len(set(values)) > 1:
            rows.append([f"version: {dist}", *[_text(v) for v in values]])
    rows.append(["parity audit", *[_audit_cell(s or {}) for s in runs.values()]])
    return rows, len(names) - len(differ)


def _versions(runs: dict[str, dict | None]) -> dict[str, dict]:
    return {label: (s or {}).get("versions") or {} for label, s in runs.items()}


def same_versions(runs: dict[str, dict | None]) -> dict[str, str]:
    """{distribution: version} of the packages every run recorded at the same version."""
    versions = list(_versions(runs).values())
    first = versions[0] if versions else {}
    return {dist: v for dist, v in sorted(first.items()) if all(other.get(dist) == v for other in versions[1:])}


def _differences_section(page, runs: dict[str, tuple[Path, dict | None]], verdicts: dict[str, dict]) -> None:
    summaries = {label: summary for label, (_, summary) in runs.items()}
    rows, same = differences(summaries, verdicts)
    equal = same_versions(summaries)
    equal_text = (f" (the same in every run: {html.escape(', '.join(f'{d} {v}' for d, v in equal.items()))})"
                  if equal else "")
    page.h2("What differs between the runs")
    page.raw(f"<p>Each run's verdict (below, with its lines), the settings whose values differ (the other {same} are "
             "the same in every run; each run's report lists them all), the package versions that differ"
             f"{equal_text}, and each run's parity audit (its report has the findings with their fixes).</p>")
    page.table(["", *runs], rows)
