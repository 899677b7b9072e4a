"""The named causes' registry (torch-free): each cause's code, title, why it matters, the rule that names it and
its fixes; a named cause as the console, the dump's ``causes.jsonl`` and the report read it.

``tim_plugins.causes`` holds the rules that name them (on torch tensors) and re-exports all of this; the report and the
command line read the registry from here without importing torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from tim_plugins.fixes import framework_fixes

__all__ = ["CAUSES", "CAUSE_KEYS", "CAUSE_PREFIX", "Cause", "CauseInfo", "FLOOR_JUMP_MIN", "UNMATCHED_PROCESSING",
           "cause_fix", "causes_markdown", "run_summary_lines", "summarize_names", "tally_cause", "tally_window"]

CAUSE_PREFIX = "tim/cause"
# CauseConfig.floor_jump_min's default, here (torch-free) for the report, which quotes it
FLOOR_JUMP_MIN = 0.05
# The tim/cause/* keys every window computes (the compact log carries only the first: tim_plugins.log_keys).
CAUSE_KEYS = (
    f"{CAUSE_PREFIX}/named",  # distinct causes named in the window (0 on a healthy run)
    f"{CAUSE_PREFIX}/confident_disagreements",  # lag-0 tokens: confident_p <= p_rollout < 1, trainer > confident_gap lower
    f"{CAUSE_PREFIX}/floor_jump",  # the window's lag-0 mean |Δ log p| over its trailing median (NaN without history)
    f"{CAUSE_PREFIX}/sync_bad_tensors",  # tensors a sync check found not holding what was sent (NaN: no check)
    f"{CAUSE_PREFIX}/sync_checked_tensors",  # tensors the window's sync checks compared (NaN: no check)
)

# The parity audit's findings of sampler processing the trainer does not recompute: where one was found, the lag-0
# log-probs carry that processing's bias (the kept mass, the penalties), so the floor is not the two stacks' numerics.
UNMATCHED_PROCESSING = ("sampler-truncation-unmatched", "sampler-penalties-unmatched")


@dataclass(frozen=True)
class CauseInfo:
    code: str
    family: str  # "sync" | "probe" | "stream" | "split"
    title: str
    why: str
    rule: str
    knobs: dict = field(default_factory=dict)  # the core's vocabulary (vllm, tim_plugins) -> knob

    @property
    def fix(self) -> dict:
        """{vocabulary or framework: knob}: the core's knobs, then each installed adapter's (``CAUSE_FIXES``)."""
        merged = dict(self.knobs)
        for key, fixes in framework_fixes().items():
            if self.code in fixes.cause_fixes:
                merged[key] = fixes.cause_fixes[self.code]
        return merged


_SYNC_FIX = ("check the weight sync: every tensor the trainer holds must reach the engine, in the engine's dtype "
             "(names mapped, shards complete), and the engine must not be asleep or reloaded from disk afterwards")
_C = CauseInfo
CAUSES: dict[str, CauseInfo] = {c.code: c for c in (
    _C("sync-noop", "sync", "the weight sync changed nothing in the engine",
       "The engine keeps sampling from the weights it held before the sync while the trainer scores its updated "
       "weights: every token's ratio carries the policy's whole change since then, and grows each step.",
       "after a sync, every checked tensor whose trainer value changed since the previous check, as the engine "
       "would hold it (in its dtype; beyond a quantizer's bound), still holds its previous value in the engine",
       {"tim_plugins": _SYNC_FIX}),
    _C("sync-tensors-stale", "sync", "some tensors were not updated by the weight sync",
       "A layer skipped by the sync (a name the engine's loader drops, a shard never sent) keeps the old policy's "
       "weights inside the new one: the engine samples from a model nobody trains.",
       "after a sync, a checked tensor still holds its previous value although the trainer's changed",
       {"tim_plugins": _SYNC_FIX}),
    _C("sync-precision", "sync", "tensors were written in another precision than the engine runs",
       "Weights rounded through a coarser dtype (bf16 or fp8 where the engine is configured otherwise, verl#7519) "
       "move every logit of the layer; the parity audit reads the configuration and cannot see it.",
       "an engine tensor's dtype differs from the engine's configured dtype, or its values equal the trainer's "
       "rounded through a coarser dtype and not the trainer's cast to the engine's dtype",
       {"tim_plugins": "write each tensor in the engine's dtype (quantized engines: through the quantizer of the "
                       "layer), and check the per-layer dtypes the refit leaves"}),
    _C("sync-tensors-missing", "sync", "tensors the trainer sent have no place in the engine",
       "A name the engine does not hold (a prefix not stripped, a renamed module) is dropped by most loaders "
       "without an error: that tensor keeps its initial value.",
       "the engine holds no tensor under a sent name (after the engine's own name mapping)",
       {"tim_plugins": "map the trainer's names to the engine's (wrapper prefixes, tied or renamed modules)"}),
    _C("sync-tensors-differ", "sync", "engine tensors hold values that are neither the trainer's nor the previous "
       "ones",
       "The engine holds other numbers than any version of the trainer's weights: a corrupted or misrouted write "
       "(a shard into the wrong slice, a quantized refit beyond its scale, NaN or infinite values from a bad cast or "
       "scale: the report gives their count).",
       "a checked tensor's values match neither the trainer's cast to the engine's dtype (within the quantizer's "
       "bound), nor its previous value, nor the trainer's rounded through a coarser dtype",
       {"tim_plugins": _SYNC_FIX}),
    _C("sync-prefix-cache", "sync", "the engine's prefix cache outlived the weight sync",
       "The weights were written, but the keys and values cached for prompts served before the sync were not "
       "dropped: every later prompt sharing such a prefix (the same prompt, a shared system prompt or chat template, "
       "the other samples of a group) is answered partly from the previous weights, the weight-parity check passes, "
       "and the mismatch grows with the cache's age (NeMo RL #4018, SkyRL #2246).",
       "after a sync, the engine's prefix cache still holds blocks (its reset was not called after the weights were "
       "written, or failed: vLLM's reset_prefix_cache returns False and keeps every block while a request holds "
       "some)",
       {"vllm": "LLM.reset_prefix_cache() (AsyncLLM: await reset_prefix_cache()) after the weights are written, "
                "with no request in flight, and check that it returns True; or enable_prefix_caching=False",
        "tim_plugins": "reset the engine's prefix cache after every weight sync, once no request is in flight"}),
    _C("probe-engine-unchanged", "probe", "the engine's answers did not change at the weight sync",
       "Where the engine's weights cannot be read (a remote server), a fixed batch is scored by both sides after each "
       "sync: the trainer's log-probs moved further than the two stacks' numerics blur and the engine's stayed where "
       "they were, so the sync never reached the engine and it keeps sampling from older weights.",
       "after a sync, the trainer's log-probs of the probe batch moved more than moved_factor x the floor (and "
       "moved_min) since the previous probe, and the engine's moved less than unchanged_ratio x that",
       {"tim_plugins": _SYNC_FIX + "; a server must receive and load the weights it is sent"}),
    _C("probe-engine-drift", "probe", "the engine moves at the weight sync, but not with the trainer",
       "The per-token gap between the engine's and the trainer's log-probs of the probe batch, right after the sync, "
       "moved away from the one measured at lag 0 on the same weights: part of the engine did not take the update "
       "(a layer skipped, a tensor written wrongly), or a stale engine drifts away step by step.",
       "after a sync, mean |(e - t) - (e_ref - t_ref)| over the probe batch > drift_factor x the floor (the reference "
       "scoring's mean |e - t|, at lag 0 on the same weights), > the floor + drift_min and > drift_share x the "
       "trainer's own move since the reference (mean |t - t_ref|: a healthy engine's numerics grow with a fast "
       "policy move, but stay a small share of it)",
       {"tim_plugins": _SYNC_FIX}),
    _C("engine-stale", "stream", "the engine samples from other weights than the trainer scores",
       "Tokens the engine was confident in are scored far lower by the trainer at lag 0: numerics cannot move a "
       "confident token that far, other weights do (a sync that did not apply, an engine that kept the initial "
       "policy).",
       "at least confident_min_tokens lag-0 tokens in a window with confident_p <= p_rollout < 1 and log p_train < "
       "log p_rollout - confident_gap, and no sampler-penalties-unmatched in the parity audit (then the tokens count "
       "for sampler-constrained) nor sampler-truncation-unmatched (the engine's log-probs renormalised over a kept "
       "set move confident tokens that far on any weights: truncation names it)",
       {"tim_plugins": "turn the weight-sync check on where the engine's weights can be read (colocated engines), "
                       "and check that the sync reaches the engine (server mode: that it reloads and resets its "
                       "prefix cache)"}),
    _C("sampler-constrained", "stream", "the sampler constrained tokens the trainer scores freely",
       "A constraint applied in the engine's sampler only (structured outputs or a grammar, a logits processor, a "
       "forced tool call) left one or a few tokens at some positions: the engine reports p = 1 (or close) there and "
       "the trainer the unconstrained model's p, so the ratio, the monitor's mismatch and an importance-sampling "
       "correction read the constraint, not numerics or weights, and no parity fix removes it. A sequence-level "
       "correction multiplies those ratios: the loss of a constrained sequence can vanish.",
       "at least confident_min_tokens lag-0 tokens in a window with p_rollout = 1 (log-prob 0, or a rounding above) and "
       "log p_train < -confident_gap, counted with engine-stale's confident disagreements where the parity audit "
       "found sampler-penalties-unmatched (then engine-stale is not named), never with sampler-truncation-unmatched "
       "(truncation names it), else named only where engine-stale is "
       "not (an engine on other weights moves the tokens it did not force as well)",
       {"tim_plugins": "drop the constraint from the sampler and reward the format instead; tokens a program "
                       "wrote rather than sampled belong out of the loss mask, as tool output is; a constraint you "
                       "keep makes these ratios its own: leave them out of any importance-sampling correction"}),
    _C("floor-jump", "stream", "the lag-0 mismatch floor jumped",
       "The lag-0 floor is the numerics of two stacks on the same weights; it drifts slowly with the policy. A jump "
       "means the pipeline changed under the run: a broken sync, a setting changed at run time, a collapse.",
       "the window's lag-0 mean |Δ log p| > floor_jump_factor x the median of the trailing floor_window windows "
       "and > that median + floor_jump_min, over at least floor_min_tokens lag-0 tokens (a smaller window is "
       "neither judged nor kept), and the parity audit found no sampler-truncation-unmatched nor "
       "sampler-penalties-unmatched (the floor is then the processing's bias, which moves with each batch's "
       "distributions, not the two stacks' numerics)",
       {"tim_plugins": "look at the weight sync (and the reset of the engine's prefix cache after it) and the "
                       "engine's settings at that step; the report's per-step panels show when it started"}),
    _C("staleness", "split", "staleness, not mismatch, makes the log-ratio unhealthy",
       "The trainer reuses a batch after optimizer steps, or an asynchronous trainer trains samples drawn by "
       "older weights: the policy moved since sampling. The parity fixes cannot reduce that part.",
       "over the tokens trained after at least one optimizer step since sampling (tim/split/reused_*: a window's "
       "fresh tokens, staleness 0, are left out), the staleness part explains >= staleness_share of Var(log-ratio) "
       "and its own k3 (the policy's move since sampling) is above staleness_k3, PPO's usual early stop on a reused "
       "batch (1.5 x a target KL of 0.01); "
       "without an exact split (an asynchronous trainer: no π_old at each sample's weights; verl's bypass mode: "
       "π_old is the rollout), by policy lag: the k3 of "
       "the tokens trained at lag >= 1 less the lag-0 floor is >= staleness_share of their k3 and above "
       "staleness_k3",
       {"tim_plugins": "a lower learning rate, or fewer optimizer updates per sampled batch; in an asynchronous "
                       "trainer, fresher samples (a lower staleness bound)"}),
    _C("truncation", "split", "the sampler's truncation, applied on the rollout side only",
       "Processed rollout log-probs are renormalised over the kept set, the trainer's over the full vocabulary: "
       "every ratio reads the kept mass (TRL #6789, verl #6240).",
       "the parity audit found sampler-truncation-unmatched and the measured mean ρ is below 1 - "
       "truncation_bias",
       {"tim_plugins": "apply the sampler's truncation in the trainer too (the safe vocabulary), or sample "
                       "without truncation"}),
)}


def cause_fix(code: str, framework: Optional[str] = None) -> str:
    """The knob that fixes cause ``code`` in a run of ``framework`` (its adapter's words, else the core's)."""
    from tim_plugins.parity.findings import fix_for

    return fix_for(CAUSES[code].fix, framework)


def causes_markdown() -> str:
    """Markdown documentation of every cause (rendered into docs/causes.md)."""
    lines = []
    for info in CAUSES.values():
        lines.append(f"- **`{info.code}`**: {info.title}. {info.why} Named when: {info.rule}.")
        for framework, knob in info.fix.items():
            from tim_plugins.parity.findings import framework_name

            lines.append(f"  - {framework_name(framework)}: {knob}")
    return "\n".join(lines)


def summarize_names(names: Iterable[str], limit: int = 6) -> str:
    """Tensor names for a line a person reads: the tensors of one layer (``...layers.N.``) as ``...layers.N.*
    (k tensors)`` when there are several, the others in full; at most ``limit`` items, then a count of the rest."""
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        m = re.match(r"(.*?\blayers\.\d+\.)", name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    items = [f"{key}* ({len(members)} tensors)" if len(members) > 1 else members[0]
             for key, members in groups.items()]
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def tally_window(tally: dict[str, dict], causes: Iterable["Cause"]) -> None:
    """Count the causes named in one window in ``tally`` ({code: {"first", "last": the lowest and highest step it was
    named at, "windows": how many windows named it, "message": the first one's}}): what a run named, however long,
    for the lines that close it (``run_summary_lines``). Each code counts once per window whatever its causes' steps:
    a sync cause carries its own sync's step, and a TRL logging window holds one sync per optimizer step (its
    ``tim/cause/named`` counts the code once too). The caller hands each window once (``CauseTracker._keep``)."""
    by_code: dict[str, list] = {}
    for cause in causes:
        by_code.setdefault(cause.code, []).append(cause)
    for code, same in by_code.items():
        low = min(same, key=lambda c: c.step)  # the first of the lowest step: the message the console printed first
        high = max(c.step for c in same)
        seen = tally.get(code)
        if seen is None:
            tally[code] = {"first": low.step, "last": high, "windows": 1, "message": low.message}
        else:
            seen["first"], seen["last"] = min(seen["first"], low.step), max(seen["last"], high)
            seen["windows"] += 1


def tally_cause(tally: dict[str, dict], cause: "Cause") -> None:
    """Count one ``cause`` whose window is not known in ``tally`` (``tally_window``'s format), a later step than the
    code's last as another window: the approximation for a state saved before the tally, which kept the causes alone
    (a TRL window's several syncs count as several windows there). A window's causes go through ``tally_window``."""
    seen = tally.get(cause.code)
    if seen is None:
        tally[cause.code] = {"first": cause.step, "last": cause.step, "windows": 1, "message": cause.message}
    elif cause.step > seen["last"]:
        seen["last"], seen["windows"] = cause.step, seen["windows"] + 1


def run_summary_lines(tally: dict[str, dict], framework: Optional[str] = None) -> list[str]:
    """The console lines that close a run which named causes, one per code in the order first named, with the windows
    and steps it was named in and the fix in ``framework``'s words ([] when none was named): each cause's own line is
    printed once, at its first step, and a long run's console has scrolled past it by the end. One window can span
    several steps (a TRL window's syncs, each named with its own step): "in 1 window, steps a to b"."""
    from tim_plugins.parity.findings import framework_name

    where = f" ({framework_name(framework)})" if framework else ""
    out = []
    for code, seen in sorted(tally.items(), key=lambda item: (item[1]["first"], item[0])):
        first, last, windows = seen["first"], seen["last"], seen["windows"]
        steps = f"at step {first}" if first == last else f"steps {first} to {last}"
        span = steps if windows == 1 and first == last else \
            f"in {windows} window{'' if windows == 1 else 's'}, {steps}"
        out.append(f"tim-plugins: this run named [{code}] {span} (first: {seen['message']}). Fix{where}: "
                   f"{cause_fix(code, framework)}")
    return out


@dataclass
class Cause:
    """One named cause: a code of ``CAUSES``, the step it was named at, what was seen, which tensors (sync causes)
    and the numbers behind it."""

    code: str
    step: int
    message: str
    tensors: tuple = ()
    evidence: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in CAUSES:
            raise ValueError(f"unknown cause code {self.code!r}; known codes: {sorted(CAUSES)}")
        self.tensors = tuple(self.tensors)

    @classmethod
    def from_dict(cls, d: dict) -> "Cause":
        """The cause ``to_dict`` wrote (a checkpoint's, a row of causes.jsonl)."""
        return cls(d["code"], d["step"], d["message"], tuple(d.get("tensors", ())), d.get("evidence") or {})

    def to_dict(self) -> dict:
        return {"code": self.code, "step": int(self.step), "title": CAUSES[self.code].title, "message": self.message,
                "tensors": list(self.tensors), "evidence": {k: _plain(v) for k, v in self.evidence.items()}}

    def line(self, framework: Optional[str] = None) -> str:
        """The console line (doctor style): code, step, what was seen, the fix in ``framework``'s words."""
        from tim_plugins.parity.findings import framework_name

        where = f" ({framework_name(framework)})" if framework else ""
        return f"tim-plugins cause [{self.code}] at step {self.step}: {self.message}. Fix{where}: " \
               f"{cause_fix(self.code, framework)}"


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)
