"""A self-contained HTML report (inline PNG figures) of a run folder or a per-token dump folder.

The source is the output folder of ``tim-plugins measure`` or ``tim-plugins demo`` (with ``summary.json``), or a
bare per-token dump folder (``step_*-rank_*.parquet``, e.g. from ``TIMConfig(dump_dir=...)``). Every figure comes
with a line on how to read it and its healthy range with the source of that range; a verdict block opens the
page. The ``tim-plugins report DIR`` command is ``tim_plugins.apps.report``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_report", "verdict_for"]

def verdict_for(summary: dict, run_dir: str | Path | None = None) -> dict:
    """The verdict block's content for a measure or training summary (see `health.verdict`)."""
    if summary.get("kind") == "measure":
        from tim_plugins.report.measure_page import measure_verdict

        return measure_verdict(summary)
    from tim_plugins.report.tokens import run_tokens
    from tim_plugins.report.training_page import training_verdict

    return training_verdict(summary, None if run_dir is None else run_tokens(summary, Path(run_dir)))


def build_report(source: str | Path, out: str | Path | None = None, *, summary: dict | None = None,
                 title: str | None = None, decode=None) -> Path:
    """Write the report for ``source`` (a run folder with ``summary.json``, or a dump folder) to ``out``
    (default ``source/report.html``); returns its path.

    ``summary`` (else ``source/summary.json`` when present) says what kind of run it was: ``kind`` "measure"
    (settings side by side) or "training" (per-step series, audit, what the callback attached); without a
    kind the folder is read as a per-token dump. ``decode`` (token ids -> text, the run's tokenizer) decodes
    the largest disagreements where the summary does not already hold them decoded; without it they show ids.
    """
    from tim_plugins.report.health import SOURCES
    from tim_plugins.report.page import Page

    source = Path(source)
    if summary is None and (source / "summary.json").exists():
        summary = json.loads((source / "summary.json").read_text())
    from tim_plugins.dump import LOG_HISTORY, read_log_history

    history = source / LOG_HISTORY
    if history.exists() and not (summary or {}).get("log_history"):
        summary = dict(summary or {}, log_history=read_log_history(history))
    kind = (summary or {}).get("kind")
    page = Page(title or (summary or {}).get("title") or "Training-inference mismatch report", SOURCES)
    if kind == "measure":
        from tim_plugins.report.measure_page import measure_page

        measure_page(summary, source, page, decode)
    elif kind == "training":
        from tim_plugins.report.training_page import training_page

        training_page(summary, source, page, decode)
    else:
        from tim_plugins.report.training_page import dump_page

        dump_page(source, summary, page, decode)
    out_path = Path(out) if out is not None else source / "report.html"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(page.html(), encoding="utf-8")
    return out_path
