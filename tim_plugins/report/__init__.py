"""A self-contained HTML report (inline PNG figures) of a run folder or a per-token dump folder.

The source is the output folder of ``tim-plugins measure`` or ``tim-plugins demo`` (with ``summary.json``), or a
bare per-token dump folder (``step_*-rank_*.parquet``, e.g. from ``TIMConfig(dump_dir=...)``). Every figure comes
with a line on how to read it and its healthy range with the source of that range; a verdict block opens the
page; ``build_comparison`` overlays several runs on one page. The ``tim-plugins report DIR [DIR ...]`` command
is ``tim_plugins.apps.report``.

A dump is read by streaming queries over its files (``report.query``, DuckDB), never whole: ``memory_limit``
(default ``query.DEFAULT_MEMORY_LIMIT``, env ``TIM_REPORT_MEMORY_LIMIT``) caps the engine's memory whatever the
dump's size, and ``threads`` its threads.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["COMPARISON_FILE", "build_report", "build_comparison", "verdict_for"]

# Beside a comparison page (`tim-plugins demo`'s OUT/report.html): its runs (folders relative to OUT), labels and
# title, from which `tim-plugins report OUT` rebuilds the page.
COMPARISON_FILE = "comparison.json"


def verdict_for(summary: dict, run_dir: str | Path | None = None, *, memory_limit=None, threads=None) -> dict:
    """The verdict block's content for a measure or training summary (see `health.verdict`)."""
    if summary.get("kind") == "measure":
        from tim_plugins.report.measure_page import measure_verdict

        return measure_verdict(summary)
    from tim_plugins.report.causes import with_causes
    from tim_plugins.report.training_page import training_verdict

    summary = with_causes(summary, run_dir)
    if run_dir is None:
        return training_verdict(summary, None)
    from tim_plugins.report.query import engine
    from tim_plugins.report.tokens import run_tokens

    with engine(memory_limit, threads):
        return training_verdict(summary, run_tokens(summary, Path(run_dir)))


def read_summary(source: Path, summary: dict | None = None) -> dict | None:
    """``source/summary.json`` (unless ``summary`` is given), with ``source/log_history.jsonl`` as its
    ``log_history`` where it has none (one row per step: ``last_row_per_step``)."""
    from tim_plugins.dump import LOG_HISTORY, last_row_per_step, read_log_history

    if summary is None and (source / "summary.json").exists():
        summary = json.loads((source / "summary.json").read_text())
    history = source / LOG_HISTORY
    if history.exists() and not (summary or {}).get("log_history"):
        summary = dict(summary or {}, log_history=last_row_per_step(read_log_history(history)))
    from tim_plugins.report.causes import with_causes

    return with_causes(summary, source)  # the causes the run named (causes.jsonl)


def build_report(source: str | Path, out: str | Path | None = None, *, summary: dict | None = None,
                 title: str | None = None, decode=None, memory_limit=None, threads: int | None = None) -> Path:
    """Write the report for ``source`` (a run folder with ``summary.json``, or a dump folder) to ``out``
    (default ``source/report.html``); returns its path.

    ``summary`` (else ``source/summary.json`` when present) says what kind of run it was: ``kind`` "measure"
    (settings side by side) or "training" (per-step series, audit, what the callback attached); without a
    kind the folder is read as a per-token dump. ``decode`` (token ids -> text, the run's tokenizer) decodes
    the largest disagreements where the summary does not already hold them decoded; without it they show ids.
    ``memory_limit`` and ``threads``: the query engine's (``report.query.Engine``).
    """
    from tim_plugins.report.health import SOURCES
    from tim_plugins.report.page import Page

    from tim_plugins.report.query import engine

    source = Path(source)
    summary = read_summary(source, summary)
    kind = (summary or {}).get("kind")
    page = Page(title or (summary or {}).get("title") or "Training-inference mismatch report", SOURCES)
    with engine(memory_limit, threads):
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
    out_path.write_text(page.html(), encoding="utf-8", errors="backslashreplace")  # a lone surrogate (a path)
    return out_path


def build_comparison(sources: list[str | Path], out: str | Path, *, labels: list[str] | None = None,
                     title: str | None = None, decode=None, memory_limit=None, threads: int | None = None) -> Path:
    """Write one page comparing several training runs or dump folders (``sources``, each labelled by ``labels``
    or its folder name) to ``out``: a verdict per run, the per-step series and the per-token figures overlaid, the
    largest disagreements per run. ``decode``: one decoder for every run, or {label: decoder}."""
    from tim_plugins.report.compare_page import comparison_page
    from tim_plugins.report.health import SOURCES
    from tim_plugins.report.page import Page
    from tim_plugins.report.query import engine

    sources = [Path(s) for s in sources]
    labels = list(labels) if labels else run_labels(sources)
    if len(labels) != len(sources) or len(set(labels)) != len(labels):
        raise ValueError(f"labels={labels!r} is invalid: give one distinct label per run ({len(sources)} runs).")
    runs = {label: (source, read_summary(source)) for label, source in zip(labels, sources)}
    page = Page(title or "Training-inference mismatch: " + " vs ".join(labels), SOURCES)
    with engine(memory_limit, threads):
        comparison_page(runs, page, decode)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(page.html(), encoding="utf-8", errors="backslashreplace")  # a lone surrogate (a path)
    return out_path


def run_labels(sources: list[Path]) -> list[str]:
    """Each run's folder name; where names repeat, as many trailing path parts as tell them apart."""
    parts = [Path(s).resolve().parts for s in sources]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(s) for s in sources]
