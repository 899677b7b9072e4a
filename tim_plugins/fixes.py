"""The fixes in a trainer framework's own terms, owned by that framework's adapter.

The core names a fix in the vocabulary it compares itself: vLLM engine and sampling arguments, transformers loading
arguments, tim-plugins commands (``parity.findings.CODES``). How a trainer framework spells the same fix (a TRL
``GRPOConfig`` field, a verl Hydra override) is data of its adapter: a module with

- ``FRAMEWORK``: the key the run's summary and the report use (``"trl"``), ``NAME``: how a reader names it;
- ``RUNS_ON``: the core vocabularies whose knobs apply to a run of it when it has none of its own for a code;
- ``FINDING_FIXES``: {finding code: knob}; ``PART_FIXES``: {part of the log-ratio (``PARTS``): what reduces it};
- ``CAUSE_FIXES`` (optional): {cause code (``tim_plugins.causes.CAUSES``): knob};

announced through the ``tim_plugins.fixes`` entry point group (``pyproject.toml``). Those modules import no
framework, so the offline report, the CLI and the README have every framework's fixes with none installed. A module
that fails to load is logged and skipped: a fix column is never worth a crash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points

__all__ = ["ENTRY_POINT_GROUP", "PARTS", "FrameworkFixes", "framework_fixes", "part_fix"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tim_plugins.fixes"

# The parts of the log-ratio a report names a fix for, and the fix where the run's framework has no words of its own.
PARTS = {
    "staleness": "a lower learning rate, or fewer optimizer updates per sampled batch",
    "staleness_async": "fresher samples: a lower staleness bound in the asynchronous trainer (older samples dropped) "
                       "and more frequent weight syncs",
    "mismatch": "the parity fixes in the audit's fix column (dtype, lm_head precision, truncation), and `tim-plugins "
                "measure --compare` to find the setting that removes it",
}


@dataclass(frozen=True)
class FrameworkFixes:
    framework: str
    name: str
    runs_on: tuple = ()
    finding_fixes: dict = field(default_factory=dict)
    part_fixes: dict = field(default_factory=dict)
    cause_fixes: dict = field(default_factory=dict)


@cache
def framework_fixes() -> dict[str, FrameworkFixes]:
    """{framework: its fixes}, from every installed ``tim_plugins.fixes`` entry point, in entry-point name order."""
    found: dict[str, FrameworkFixes] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            module = ep.load()
            fixes = FrameworkFixes(framework=module.FRAMEWORK, name=module.NAME, runs_on=tuple(module.RUNS_ON),
                                   finding_fixes=dict(module.FINDING_FIXES), part_fixes=dict(module.PART_FIXES),
                                   cause_fixes=dict(getattr(module, "CAUSE_FIXES", {})))
        except Exception as err:  # noqa: BLE001 (a broken plugin costs its fix column, not the report)
            logger.warning("tim-plugins: the fixes of entry point %s = %s could not be loaded: %r", ep.name, ep.value,
                           err)
            continue
        found.setdefault(fixes.framework, fixes)
    return found


def part_fix(part: str, framework: str | None) -> str:
    """What reduces ``part`` (a key of ``PARTS``) in a run of ``framework``: its adapter's words, else the core's."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}: must be one of {sorted(PARTS)}")
    fixes = framework_fixes().get(framework or "")
    return (fixes.part_fixes.get(part) if fixes else None) or PARTS[part]
