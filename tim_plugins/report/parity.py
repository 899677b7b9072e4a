"""The parity audit inside a report: each finding with the knob that fixes it in the run's framework, and the
verdict reconciled with the audit.

Findings arrive as the dicts of ``Finding.to_dict`` (from ``summary.json``); their fix comes from the one
registry (``tim_plugins.parity.findings.CODES``) and is picked for the run's framework by ``fix_for``.

The rule that reconciles the measured verdict with the audit (``reconcile``):

- The status comes from the measured metrics (``health.verdict``); warnings and infos of the audit leave it.
- An audit **error** the run made on purpose (listed in ``deliberate``, code -> why, by the application that
  set the run up, e.g. the demo's bf16 rollout copy) leaves the status as measured; the headline says it is
  deliberate and a line says what to change in your run.
- Any other audit error raises the status to at least WATCH: the ratio π_train/π_rollout is biased by
  configuration even where this run's numbers stay small; the headline names the code and a line the fix.
"""

from __future__ import annotations

__all__ = ["finding_fix", "findings_rows", "reconcile", "fix_header"]


_SHOWN = ("code", "severity", "message", "rollout", "trainer", "fix")  # a finding's fields with a column of their own


def finding_fix(finding: dict, framework: str | None) -> str:
    """The knob that fixes ``finding`` (a ``Finding.to_dict``) in ``framework``.

    A finding from ``summary.json`` may come from another version of tim-plugins: its stored ``fix`` is used as
    written; a code this version's registry does not know, stored without a fix, is described generically (its
    code and its other stored fields) instead of raised on, so the rest of the report still renders."""
    from tim_plugins.parity.findings import CODES, fix_for

    fix = finding.get("fix")
    if isinstance(fix, str) and fix:
        return fix
    if not (isinstance(fix, dict) and fix):
        info = CODES.get(finding.get("code")) if isinstance(finding.get("code"), str) else None
        if info is None:
            return _unknown_fix(finding)
        fix = info.fix
    return fix_for({str(k): str(knob) for k, knob in fix.items()}, framework)


def _unknown_fix(finding: dict) -> str:
    """The fix column of a finding whose code this version does not know (plain text; the page escapes it)."""
    other = "; ".join(f"{k}: {v}" for k, v in finding.items() if k not in _SHOWN)
    return (f"no fix known for code {finding.get('code')!s} in this version of tim-plugins (a summary written by "
            f"another version?)" + (f"; its other stored fields: {other}" if other else ""))


def fix_header(framework: str | None) -> str:
    from tim_plugins.parity.findings import framework_name

    return f"fix ({framework_name(framework)})" if framework else "fix"


def findings_rows(findings: list[dict], framework: str | None, deliberate: dict | None = None) -> list[list]:
    """Table rows: severity (marked when deliberate), code, rollout, trainer, message, fix."""
    deliberate = deliberate or {}
    return [[str(f.get("severity")) + (" (deliberate here)" if str(f.get("code")) in deliberate else ""),
             str(f.get("code")), f.get("rollout"), f.get("trainer"), f.get("message"), finding_fix(f, framework)]
            for f in findings]


_RAISED = {"ok": "watch", "n/a": "watch"}


def reconcile(v: dict, findings: list[dict], framework: str | None, deliberate: dict | None = None) -> dict:
    """``v`` (a ``health.verdict`` dict) reconciled with the audit ``findings`` (module docstring).

    Adds ``v["audit"]``: one entry per audit error (code, deliberate reason or None, fix), and puts one line per
    error in front of ``v["extra"]``. Returns ``v``."""
    deliberate = deliberate or {}
    errors, seen = [], set()
    for f in findings:
        code = str(f.get("code"))  # a stored finding is data: a missing field is shown, not raised on
        if f.get("severity") == "error" and code not in seen:
            seen.add(code)
            errors.append({"code": code, "message": f.get("message"), "deliberate": deliberate.get(code),
                           "fix": finding_fix(f, framework)})
    v["audit"] = errors
    if not errors:
        return v
    from tim_plugins.parity.findings import framework_name

    where = f" ({framework_name(framework)})" if framework else ""
    accidental = [e for e in errors if not e["deliberate"]]
    lines = []
    for e in errors:
        if e["deliberate"]:
            lines.append(f"{e['code']} is deliberate here; in your run, fix it{where}: {e['fix']}")
        else:
            lines.append(f"{e['code']} ({e['message']}): fix it{where}: {e['fix']}")
    v["extra"] = lines + list(v.get("extra", []))
    if accidental:
        v["status"] = _RAISED.get(v["status"], v["status"])
        codes = ", ".join(e["code"] for e in accidental)
        measured = v["headline"].split(":", 1)[1].strip() if ":" in v["headline"] else v["headline"]
        v["headline"] = (f"{v['status'].upper()}: the parity audit found a configuration error ({codes}) that "
                         f"biases the ratio π_train/π_rollout; fix it before a real run. Measured: {measured}")
    else:
        reasons = "; ".join(dict.fromkeys(e["deliberate"] for e in errors))
        v["headline"] = f"{v['headline'].rstrip('.')} — {reasons}; in your run, change the setting below."
    return v
