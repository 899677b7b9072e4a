"""The start-up audit every caller runs, written once: audit the two sides, render the findings in the one table
format (``table.findings_table``) under a title line with the counts, hand that text to the caller's output, and
stop on an error-level finding in strict mode.

The TRL callback logs the text, verl's driver prints it, ``tim-plugins audit`` prints the table and the counts
(its exit status is the strict decision). Each passes its own title and the words that turn strict mode off; the
findings, their order, the table and the message of the ``ParityError`` are the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from tim_plugins.parity.audit import audit, has_errors
from tim_plugins.parity.findings import Finding, ParityError, max_severity, severity_counts
from tim_plugins.parity.spec import PipelineSpec
from tim_plugins.parity.table import findings_table

__all__ = ["AuditReport", "audit_and_report", "counts_line"]


def counts_line(counts: dict[str, int]) -> str:
    """``2 error(s), 1 warning(s), 3 info``: the counts the title line and the CLI show."""
    return f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"


@dataclass(frozen=True)
class AuditReport:
    """What ``audit_and_report`` found and showed."""

    findings: list[Finding]
    counts: dict[str, int]  # every severity, 0 when none
    table: str  # findings_table(findings, framework)
    text: str  # "<title>: <counts>" then the table

    @property
    def worst(self) -> Optional[str]:
        """The worst severity found ("error", "warning", "info"), None without findings."""
        return max_severity(self.findings)

    @property
    def has_errors(self) -> bool:
        return has_errors(self.findings)


def audit_and_report(rollout: PipelineSpec, trainer: PipelineSpec, *, framework: Optional[str], title: str,
                     emit: Optional[Callable[["AuditReport"], None]] = None, strict: bool = False,
                     strict_off: str = "", findings: Optional[Sequence[Finding]] = None) -> AuditReport:
    """Audit ``rollout`` against ``trainer`` and report it.

    Args:
        framework: whose knobs the fix column names (``findings.fix_for``: "trl", "verl", "vllm", or None).
        title: the first words of the text (which run, which sides).
        emit: called once with the report (its ``text``, its ``worst`` severity, ...), before strict decides.
        strict: raise ``ParityError`` (every error-level finding in the message) when one is found.
        strict_off: how the user turns strict mode off, quoted in that message.
        findings: already audited findings (``enforce``'s, after its changes) instead of ``audit(rollout, trainer)``.
    """
    found = list(audit(rollout, trainer) if findings is None else findings)
    counts = severity_counts(found)
    table = findings_table(found, framework=framework)
    report = AuditReport(found, counts, table, f"{title}: {counts_line(counts)}\n{table}")
    if emit is not None:
        emit(report)
    if strict and report.has_errors:
        errors = [f for f in found if f.severity == "error"]
        raise ParityError(
            f"{title} (strict): " + "; ".join(f"{f.code}: {f.message}" for f in errors)
            + ". Fix the settings named in each finding (the table's fix column)"
            + (f", or {strict_off} to only report them." if strict_off else "."),
            findings=found)
    return report
