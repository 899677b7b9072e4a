"""Which kept set S the safe vocabulary renormalises over in each trainer framework, and why: the engine's own set
replayed (``tim_plugins.replay``: vLLM's ``sampling_mask``, no boundary tokens by construction) or the sampler's
rule recomputed on the trainer's logits (``tim_plugins.truncation``: a token near the cut can land on the other
side, ``tim/safe_vocab/boundary_frac``).

One source for the adapters' start-up line, the ``tim-plugins doctor`` row and the report's truncation section, so
the three say the same thing. Framework-neutral: it names the frameworks, it imports none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FRAMEWORK_NAMES", "KeptSet", "TRL_SAMPLING_MASK_CONTEXT", "VERL_SAMPLING_MASK_OVERRIDE", "kept_set",
           "kept_set_line"]

# framework key (``summary.json``'s "framework", the adapters' names) -> how the text names it
FRAMEWORK_NAMES = {"trl": "TRL", "verl": "verl"}


@dataclass(frozen=True)
class KeptSet:
    """``mode``: "replay" (the engine's per-token kept set) or "recompute" (the sampler's rule on the trainer's
    logits); ``reason``: why, in one sentence."""

    mode: str
    reason: str


# The verl rollout setting that makes vLLM return its kept sets (tim-plugins' rollout server then carries them).
VERL_SAMPLING_MASK_OVERRIDE = "+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true"
# What builds TRL's colocate engine with them (integrations/trl/kept_sets.py; the callback then captures them).
TRL_SAMPLING_MASK_CONTEXT = "tim_plugins.integrations.trl.engine_kept_sets()"


def kept_set(framework: str | None, version: str | None = None, *, sampling_mask: bool = False) -> KeptSet:
    """The kept set a run of ``framework`` ("trl", "verl"; ``version``: the installed one, named in the reason) uses
    with the safe vocabulary. ``sampling_mask``: the run's engine hands out its per-token kept sets and the adapter
    carries them to the trainer (verl: ``engine_kwargs.vllm.return_sampling_mask``, FSDP or Megatron actor; TRL: the
    colocate engine built inside ``engine_kept_sets()``); a run without them recomputes."""
    name = FRAMEWORK_NAMES.get(framework or "", framework or "this framework")
    named = f"{name} {version}" if version else name
    if framework == "verl" and sampling_mask:
        return KeptSet("replay", "vLLM returns its per-token kept sets (return_sampling_mask) and tim-plugins' verl "
                                 "rollout server carries them to the actor (FSDP or Megatron), which renormalises its "
                                 "log-probs over exactly those sets in each micro-batch whose samples all carry one "
                                 "set per response token (others, and a Megatron actor with context parallelism, "
                                 "recompute, counted in tim/diag/kept_sets_fallback); vLLM accepts the setting only "
                                 "with Model Runner V2 (a GPU build)")
    if framework == "verl":
        return KeptSet("recompute", f"{named} does not carry vLLM's sampling_mask (the sampler's kept set per token) "
                                    "into the training batch by itself; tim-plugins' verl rollout server carries it "
                                    f"with {VERL_SAMPLING_MASK_OVERRIDE} (vLLM with Model Runner V2, a GPU build, "
                                    "and no logits processor: +tim.safe_vocab.enable=true over your top_k / top_p), "
                                    "and the actor then replays the engine's own set (tim_plugins.replay)")
    if framework == "trl" and sampling_mask:
        return KeptSet("replay", "TRL's colocate vLLM engine returns its per-token kept sets (built inside "
                                 f"{TRL_SAMPLING_MASK_CONTEXT}) and tim-plugins captures them from the engine's "
                                 "outputs; the fused lm_head renormalises over exactly those sets in each call whose "
                                 "rows all have them (others recompute, counted in tim/diag/kept_sets_fallback); vLLM "
                                 "accepts the setting only with Model Runner V2 (a GPU build) and top_k > 0")
    if framework == "trl":
        return KeptSet("recompute", f"{named} does not carry vLLM's sampling_mask (the sampler's kept set per token) "
                                    "from the engine into the training batch, so the trainer recomputes the sampler's "
                                    "cut on its own logits; to replay the engine's own set, build the trainer inside "
                                    f"{TRL_SAMPLING_MASK_CONTEXT} with vllm_mode='colocate' and top_k > 0 (vLLM with "
                                    "Model Runner V2, a GPU build; TRL's vLLM server mode does not return the sets)")
    return KeptSet("recompute", f"{named} does not carry vLLM's sampling_mask (the sampler's kept set per token) from "
                                "the engine into the training batch, so the trainer recomputes the sampler's cut on "
                                "its own logits")


def kept_set_line(framework: str | None, version: str | None = None, *, sampling_mask: bool = False) -> str:
    """The one line an adapter logs at start-up when the safe vocabulary is on."""
    k = kept_set(framework, version, sampling_mask=sampling_mask)
    if k.mode == "replay":
        return (f"tim-plugins: safe vocabulary: kept set by replay ({k.reason}; every sampled token is in the "
                "engine's set, so tim/safe_vocab/boundary_frac is 0 where it is replayed).")
    return (f"tim-plugins: safe vocabulary: kept set by {k.mode} ({k.reason}; tokens the sampler kept but the "
            "trainer's recomputed set excludes are counted in tim/safe_vocab/boundary_frac).")
