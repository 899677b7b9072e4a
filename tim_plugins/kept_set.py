"""Which kept set S the safe vocabulary renormalises over in each trainer framework, and why: the engine's own set
replayed (``tim_plugins.replay``: vLLM's ``sampling_mask``, no boundary tokens by construction) or the sampler's
rule recomputed on the trainer's logits (``tim_plugins.truncation``: a token near the cut can land on the other
side, ``tim/safe_vocab/boundary_frac``).

One source for the adapters' start-up line, the ``tim-plugins doctor`` row and the report's truncation section, so
the three say the same thing. Framework-neutral: it names the frameworks, it imports none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FRAMEWORK_NAMES", "KeptSet", "kept_set", "kept_set_line"]

# framework key (``summary.json``'s "framework", the adapters' names) -> how the text names it
FRAMEWORK_NAMES = {"trl": "TRL", "verl": "verl"}


@dataclass(frozen=True)
class KeptSet:
    """``mode``: "replay" (the engine's per-token kept set) or "recompute" (the sampler's rule on the trainer's
    logits); ``reason``: why, in one sentence."""

    mode: str
    reason: str


def kept_set(framework: str | None, version: str | None = None) -> KeptSet:
    """The kept set a run of ``framework`` ("trl", "verl"; ``version``: the installed one, named in the reason) uses
    with the safe vocabulary. Neither adapter receives the engine's set today, so both recompute."""
    name = FRAMEWORK_NAMES.get(framework or "", framework or "this framework")
    named = f"{name} {version}" if version else name
    return KeptSet("recompute", f"{named} does not carry vLLM's sampling_mask (the sampler's kept set per token) from "
                                "the engine into the training batch, so the trainer recomputes the sampler's cut on "
                                "its own logits; the core can replay an engine's own set (tim_plugins.replay) once "
                                "the framework passes it through")


def kept_set_line(framework: str | None, version: str | None = None) -> str:
    """The one line an adapter logs at start-up when the safe vocabulary is on."""
    k = kept_set(framework, version)
    return (f"tim-plugins: safe vocabulary: kept set by {k.mode} ({k.reason}; tokens the sampler kept but the "
            "trainer's recomputed set excludes are counted in tim/safe_vocab/boundary_frac).")
