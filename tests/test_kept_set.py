"""Which kept set the safe vocabulary uses, as the start-up line, the doctor and the report say it
(``tim_plugins.kept_set``): verl replays vLLM's own sets where the run asks vLLM for them (its FSDP and Megatron
actors read them), TRL where its colocate engine was built to hand them out; everything else recomputes the sampler's cut on the
trainer's logits."""

from __future__ import annotations

from tim_plugins.kept_set import TRL_SAMPLING_MASK_CONTEXT, VERL_SAMPLING_MASK_OVERRIDE, kept_set, kept_set_line
from tim_plugins.report.truncation import _kept_set


def test_verl_replays_only_where_the_run_asks_vllm_for_its_sets():
    assert kept_set("verl", "0.9.1").mode == "recompute"
    assert VERL_SAMPLING_MASK_OVERRIDE in kept_set("verl", "0.9.1").reason
    replay = kept_set("verl", "0.9.1", sampling_mask=True)
    assert replay.mode == "replay" and "FSDP or Megatron" in replay.reason  # both actors read the sets


def test_trl_replays_from_a_colocate_engine_built_to_hand_out_its_sets():
    assert kept_set("trl", "1.16.0", sampling_mask=True).mode == "replay"
    recompute = kept_set("trl", "1.16.0")
    assert recompute.mode == "recompute"
    # the way to replay, and where it cannot
    assert TRL_SAMPLING_MASK_CONTEXT in recompute.reason and "server mode does not return" in recompute.reason
    line = kept_set_line("trl", "1.16.0", sampling_mask=True)
    assert line.startswith("tim-plugins: safe vocabulary: kept set by replay (TRL's colocate vLLM engine")
    assert "tim/diag/kept_sets_fallback" in line
    summary = {"framework": "trl", "settings": {"trl": "1.16.0", "sampling mask": "true"}}
    assert _kept_set(summary).mode == "replay"


def test_the_line_names_the_mode_and_the_fallback_counter():
    line = kept_set_line("verl", "0.9.1", sampling_mask=True)
    assert line.startswith("tim-plugins: safe vocabulary: kept set by replay (")
    assert "tim/diag/kept_sets_fallback" in line and "boundary_frac is 0" in line
    assert kept_set_line("verl", "0.9.1").startswith(
        "tim-plugins: safe vocabulary: kept set by recompute (verl 0.9.1 does not carry vLLM's sampling_mask")


def test_the_report_reads_the_mode_from_the_run_summary():
    summary = {"framework": "verl", "settings": {"verl": "0.9.1", "sampling mask": "true", "actor strategy": "fsdp"}}
    assert _kept_set(summary).mode == "replay"
    summary["settings"]["actor strategy"] = "megatron"
    assert _kept_set(summary).mode == "replay"  # the Megatron actor replays too
    assert _kept_set({"framework": "verl", "settings": {"verl": "0.9.1"}}).mode == "recompute"  # older summaries
