"""Plain-text tables for the parity CLI (findings, batch-invariance summaries)."""

from __future__ import annotations

import json
import textwrap
from typing import Any, Sequence

__all__ = ["format_table", "FINDINGS_COLUMNS", "findings_rows", "findings_table"]

FINDINGS_COLUMNS = ("severity", "code", "rollout", "trainer", "message", "fix")


def _cell(value: Any) -> str:
    if value is None:
        return "?"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60) -> str:
    """Left-aligned columns; cells longer than `max_width` wrap onto continuation lines."""
    cells = [[textwrap.wrap(_cell(c), max_width, break_long_words=False, break_on_hyphens=False) or [""]
              for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, lines in enumerate(row):
            widths[i] = max(widths[i], *(len(line) for line in lines))
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for row in cells:
        height = max(len(lines) for lines in row)
        for k in range(height):
            out.append("  ".join((lines[k] if k < len(lines) else "").ljust(w)
                                 for lines, w in zip(row, widths)).rstrip())
    return "\n".join(out)


def findings_rows(findings: Sequence[Any], framework: str | None = None) -> list[list[str]]:
    """One row of text cells per finding, in ``FINDINGS_COLUMNS`` order (for a text table, a log line or a
    ``wandb.Table``); the fix cell shows the knob for ``framework`` (``findings.fix_for``)."""
    from tim_plugins.parity.findings import fix_for

    rows = []
    for f in findings:
        rows.append([_cell(c) for c in (f.severity, f.code, f.rollout_value, f.trainer_value, f.message,
                                        fix_for(f.fix, framework))])
    return rows


def findings_table(findings: Sequence[Any], framework: str | None = None) -> str:
    """``findings_rows`` as a plain-text table (a sentence when there is no finding)."""
    rows = findings_rows(findings, framework)
    if not rows:
        return "no findings: the two sides match on every setting that was compared"
    return format_table(FINDINGS_COLUMNS, rows, max_width=48)
