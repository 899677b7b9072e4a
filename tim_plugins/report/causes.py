"""What is causing it, in the report: the causes the run named (``causes.jsonl`` beside its dump, written by the
pipeline, ``tim_plugins.causes``) in the verdict and in a section of their own.

The rule that puts them in the verdict (``name_causes``), after the audit's (``report.parity.reconcile``):

- a broken pipeline (a ``sync-*`` or ``probe-*`` cause, ``engine-stale``, ``floor-jump``) makes the status ACT and leads the
  headline: the engine sampled from other weights than the trainer scored (``sync-prefix-cache`` alone: through keys
  and values its prefix cache kept from earlier weights), so the mismatch measured below is not numerics and the
  dtype fixes would not remove it;
- staleness or truncation raise the status to at least WATCH and say which part of the log-ratio it is;
- a run whose log counts named causes (``tim/cause/named``) that no causes file holds (missing beside the dump)
  gets one line saying so, and at least WATCH: never "nothing named";
- a run that logged ``tim/cause/*`` and named nothing gets one line saying so, with what was checked: the measured
  mismatch is then the numerics of the two stacks (the audit's fixes), plus the bias of sampler processing the
  trainer does not recompute where the audit found some (``UNMATCHED_PROCESSING``).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["FAULT_CODES", "causes_section", "name_causes", "read_causes", "with_causes"]

FAULT_CODES = ("sync-noop", "sync-tensors-stale", "sync-precision", "sync-tensors-missing", "sync-tensors-differ",
               "sync-prefix-cache", "probe-engine-unchanged", "probe-engine-drift", "engine-stale", "floor-jump")


def read_causes(folder: str | Path) -> list[dict] | None:
    """The rows of ``folder/causes.jsonl`` (a torn line skipped: ``dump.read_json_lines``), or None without that
    file."""
    from tim_plugins.dump import CAUSES_LOG, read_json_lines

    path = Path(folder) / CAUSES_LOG
    if not path.exists():
        return None
    return read_json_lines(path, "code")


def with_causes(summary: dict | None, run_dir: str | Path | None) -> dict | None:
    """``summary`` with ``causes`` read from ``run_dir`` or its dump folders (``summary["dumps"]``) where it has
    none; unchanged when no file is found."""
    if run_dir is None or (summary or {}).get("causes") is not None:
        return summary
    folders = [Path(run_dir)] + [Path(run_dir) / d for d in ((summary or {}).get("dumps") or {}).values()]
    for folder in folders:
        rows = read_causes(folder)
        if rows is not None:
            return dict(summary or {}, causes=rows)
    return summary


def _first_by_code(causes: list[dict]) -> dict[str, tuple[dict, list[int]]]:
    out: dict[str, tuple[dict, list[int]]] = {}
    for c in causes:
        first, steps = out.setdefault(c["code"], (c, []))
        steps.append(int(c.get("step", 0)))
    return out


def _steps(steps: list[int]) -> str:
    steps = sorted(set(steps))
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps[:8]))}" + (
        f" (+{len(steps) - 8} more)" if len(steps) > 8 else "")


def name_causes(v: dict, summary: dict | None, framework: str | None) -> dict:
    """``v`` (a verdict dict) with the run's causes (module docstring); adds ``v["causes"]`` (code -> steps)."""
    from tim_plugins.cause_registry import CAUSES, cause_fix
    from tim_plugins.parity.findings import framework_name

    summary = summary or {}
    v.setdefault("extra", [])
    causes = [c for c in (summary.get("causes") or []) if c.get("code") in CAUSES]
    by_code = _first_by_code(causes)
    v["causes"] = {code: sorted(set(steps)) for code, (_, steps) in by_code.items()}
    where = f" ({framework_name(framework)})" if framework else ""
    if not by_code:
        unread = _named_unread(summary.get("log_history") or [])
        if unread:
            # the log says the run named causes the report cannot read: never "nothing named"
            if v["status"] in ("ok", "n/a"):
                v["status"] = "watch"
            v["extra"] = list(v.get("extra", [])) + [unread]
            return v
        line = _none_named(summary.get("log_history") or [], summary.get("findings") or [])
        if line:
            v["extra"] = list(v.get("extra", [])) + [line]
        return v
    lines = [f"{code} at {_steps(steps)}: {first['message']}. Fix{where}: {cause_fix(code, framework)}"
             for code, (first, steps) in by_code.items()]
    v["extra"] = lines + list(v.get("extra", []))
    faults = [code for code in by_code if code in FAULT_CODES]
    measured = v["headline"].split(":", 1)[1].strip() if ":" in v["headline"] else v["headline"]
    if faults:
        v["status"] = "act"
        named = ", ".join(f"{code} (first at step {min(by_code[code][1])})" for code in faults)
        what = ("the engine sampled through keys and values its prefix cache kept from earlier weights"
                if faults == ["sync-prefix-cache"] else "the engine sampled from other weights than the trainer scored")
        v["headline"] = (f"ACT: {what}: {named}. The mismatch measured below is not the numerics of the two stacks: "
                         f"fix the weight sync first. Measured: {measured}")
    else:
        if v["status"] in ("ok", "n/a"):
            v["status"] = "watch"
        named = ", ".join(by_code)
        v["headline"] = f"{v['status'].upper()}: {named} makes the log-ratio unhealthy, not the numerics " \
                        f"of the two stacks. Measured: {measured}"
    return v


def _named_unread(log_history: list[dict]) -> str | None:
    """The line of a run whose log counts named causes (``tim/cause/named`` > 0) that its causes file does not hold
    (no ``causes.jsonl`` found beside the dump, or rows of codes this version does not know); None otherwise."""
    from tim_plugins.dump import CAUSES_LOG

    rows = [h for h in log_history if _num(h.get("tim/cause/named")) and h["tim/cause/named"] > 0]
    if not rows:
        return None
    total = int(sum(h["tim/cause/named"] for h in rows))
    steps = _steps([int(h.get("step", 0)) for h in rows])
    return (f"What is causing it: the run's log counts {total} named cause{'' if total == 1 else 's'} "
            f"(tim/cause/named at {steps}), but no {CAUSES_LOG} beside its dump holds them, so this report cannot say "
            "which: the run's console printed each with its fix when it was named, and its closing lines list them.")


def _none_named(log_history: list[dict], findings: list[dict]) -> str | None:
    """The line of a run that watched for causes and named none (None: the run logged no ``tim/cause/*``). Where the
    start-up audit found sampler processing the trainer does not recompute (``UNMATCHED_PROCESSING``), the measured
    mismatch carries that processing's bias, and the floor's moves were not judged (they are that bias's); where it
    found ``sampler-truncation-unmatched``, the confident lag-0 tokens were not judged either (``tim_plugins.causes``:
    the kept-mass renormalisation moves them on any weights). Otherwise the rules judged each window's count on its
    own: each was below the threshold, not the run's total, which the line gives with the largest window's."""
    from tim_plugins.cause_registry import UNMATCHED_PROCESSING

    rows = [h for h in log_history if "tim/cause/named" in h]
    if not rows:
        return None
    processing = sorted({f.get("code") for f in findings if f.get("code") in UNMATCHED_PROCESSING})
    syncs = [h["tim/cause/sync_checked_tensors"] for h in rows if _num(h.get("tim/cause/sync_checked_tensors"))]
    counts = [h["tim/cause/confident_disagreements"] for h in rows if _num(h.get("tim/cause/confident_disagreements"))]
    confident = int(sum(counts))
    # inf is a measurement (FloorHistory.judge: a floor above a trailing median of 0), NaN none (no history yet)
    floor = [float(h["tim/cause/floor_jump"]) for h in rows if _ratio(h.get("tim/cause/floor_jump"))]
    said = ("no confident lag-0 disagreement" if not confident else
            f"{confident} confident lag-0 disagreement{'' if confident == 1 else 's'}")
    if "sampler-truncation-unmatched" in processing:
        # neither engine-stale nor sampler-constrained reads the tokens then: no count was held to the threshold
        parts = [f"{said}, not judged: the engine's log-probs are renormalised over the tokens the sampler kept (the "
                 f"audit's sampler-truncation-unmatched), which moves a confident token that far on any weights"]
    elif confident:
        # the threshold holds a window's count (the rule's evidence is one window), never the run's total
        most = int(max(counts))
        parts = [f"{said} (" + (f"at most {most} in a window: " if len(counts) > 1 else "") +
                 "below the rule's per-window threshold)"]
    else:
        parts = [said]
    if floor:
        parts.append(_floor_said(floor, bool(processing)) + (
            ", not judged: it is the bias of the sampler processing the audit found" if processing else ""))
    if syncs:
        parts.append(f"the weight-sync check found the engine holding the trainer's weights at every checked sync "
                     f"({len(syncs)} windows, {int(max(syncs))} tensors each)")
    measured = ("the two stacks' numerics plus the bias of sampler processing the trainer does not recompute (the "
                f"audit's {', '.join(processing)}: its fix column)" if processing else "the two stacks' numerics")
    return ("What is causing it: no broken weight sync, stale engine or floor jump was named over "
            f"{len(rows)} logged steps ({'; '.join(parts)}): the mismatch measured is {measured}.")


def _num(x) -> bool:
    """A finite number (NaN: not measured; inf: a floor over a trailing median of 0)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ratio(x) -> bool:
    """A floor ratio that was measured: a number, +inf included (a floor over a trailing median of 0), NaN not."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (math.isfinite(x) or x == math.inf)




def _floor_said(ratios: list[float], processing: bool) -> str:
    """What the floor's logged ratios say. An inf is no ratio to quote as "at most Nx": the floor rose above a
    trailing median of 0 there, and (the rule judged it: ``processing`` False) was not named, so it stayed within
    the rule's floor_jump_min margin above that 0 (``FloorHistory.judge``: a jump needs both the factor and the
    margin, and any rise over 0 passes the factor)."""
    from tim_plugins.cause_registry import FLOOR_JUMP_MIN

    finite = [r for r in ratios if math.isfinite(r)]
    zero = len(ratios) - len(finite)
    if not zero:
        return f"the lag-0 floor at most {max(finite):.2g}x its trailing median"
    above = f"above a trailing median of 0 in {zero} window{'' if zero == 1 else 's'}" + (
        "" if processing else
        f", by no more than the rule's floor_jump_min margin ({FLOOR_JUMP_MIN:g} nats by default)")
    if not finite:
        return f"the lag-0 floor {above}"
    return f"the lag-0 floor at most {max(finite):.2g}x its trailing median where that median was above 0, and {above}"


def causes_section(page, summary: dict | None, framework: str | None = None) -> None:
    """The "What is causing it" section: one row per named cause (step, code, what was seen, tensors, fix)."""
    from tim_plugins.cause_registry import CAUSES, cause_fix
    from tim_plugins.report.parity import fix_header

    causes = [c for c in ((summary or {}).get("causes") or []) if c.get("code") in CAUSES]
    if not causes:
        return
    page.h2("What is causing it")
    page.raw("<p>Causes named during the run (docs/causes.md): a broken weight sync, found by comparing the engine's "
             "weights with the trainer's at the sync and reading what its prefix cache kept, or (a remote server) "
             "by a probe batch both sides score after the sync; an engine sampling from other weights, found by "
             "confident lag-0 disagreements or a jump of the lag-0 floor; staleness or truncation making the log-ratio "
             "unhealthy. Each with the setting that fixes it in this run's framework:</p>")
    rows = [[c.get("step"), c["code"], c.get("message", ""), ", ".join(c.get("tensors") or [])[:400],
             cause_fix(c["code"], framework)] for c in causes[:200]]
    page.table(["step", "cause", "what was seen", "tensors", fix_header(framework)], rows)
    if len(causes) > 200:
        page.note(f"{len(causes) - 200} more in causes.jsonl.")
