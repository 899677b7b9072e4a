"""The page comparing several training runs (or dump folders) side by side: one verdict per run, the per-step
series overlaid (one colour per run), the truncation row of each run where one used the safe vocabulary, the
per-token figures overlaid, the largest disagreements per run. For before / after a fix, bf16 against fp32
rollouts, one setting against another."""

from __future__ import annotations

import html
from pathlib import Path

__all__ = ["comparison_page"]


def comparison_page(runs: dict[str, tuple[Path, dict | None]], page, decode=None) -> None:
    """Fill ``page`` with the comparison of ``runs`` ({label: (folder, its summary or None)}); ``decode``: a
    decoder for every run, or {label: decoder}."""
    from tim_plugins.report.disagreements import disagreements_html, dump_disagreements
    from tim_plugins.report.tokens import dump_folder, has_dump, load_tokens
    from tim_plugins.report.training_page import _figures_over_tokens, _series_figure, step_table, training_verdict
    from tim_plugins.report.truncation import truncation_comparison

    dumps, tables, frameworks = {}, {}, set()
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
        v = (summary or {}).get("verdict") or training_verdict(summary, tokens, table)
        what = (f"{tokens.size} monitored tokens in {tokens.sequences().length.size} sequences of its dump"
                if tokens is not None else "no per-token dump (per-step series from its log)")
        page.raw(f"<p><b>{html.escape(label)}</b> ({html.escape(str(folder))}; {what}):</p>")
        page.verdict(v, v.get("extra", []))
    framework = frameworks.pop() if len(frameworks) == 1 else None
    if any(t["step"].size for t in tables.values()):
        page.h2("Per optimizer step")
        _series_figure(page, {}, framework, runs={k: t for k, t in tables.items() if t["step"].size})
    truncation_comparison(page, {label: (summary, tables[label]) for label, (_, summary) in runs.items()})
    if dumps:
        page.h2("Per token, over all steps")
        _figures_over_tokens(page, dumps)
        page.h2("Largest disagreements")
        page.raw("<p>Per run, the sampled tokens with the largest |log p<sub>trainer</sub> − log "
                 "p<sub>rollout</sub>|, largest first (the token marked, with a few tokens of its completion on "
                 "each side).</p>")
        for i, (label, tokens) in enumerate(dumps.items()):
            dec = decode.get(label) if isinstance(decode, dict) else decode
            body = disagreements_html(dump_disagreements(tokens, dec))
            page.raw(f"<details{' open' if i == 0 else ''}><summary><b>{html.escape(label)}</b></summary>{body}"
                     "</details>")
