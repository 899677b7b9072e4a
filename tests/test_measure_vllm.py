"""``measure --rollout vllm`` on the vLLM CPU build (shares the session's engine: fp32, processed log-probs)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tim_plugins.apps.measure import MeasureConfig, run_measure  # noqa: E402


def test_vllm_fp32_rollout_matches_fp32_trainer(vllm_llm, toy_model_path, tmp_path):
    cfg = MeasureConfig(model=str(toy_model_path), rollout="vllm", num_prompts=6, max_new_tokens=12,
                        min_new_tokens=12, batch_size=6, out=str(tmp_path / "v"))
    summary = run_measure(cfg, llm=vllm_llm)
    m = summary["metrics"]
    assert m["tim/tokens"] == 6 * 12 and m["tim/invalid_tokens"] == 0
    # Research measured vLLM fp32 vs transformers fp32 at max |Δlogp| 4.6e-5 on a tiny model.
    assert m["tim/token/abs_diff_max"] < 1e-3
    assert m["tim/token/kl_k3"] < 1e-6
    # The session engine returns at most 20 log-probs per token (max_logprobs default): the full-distribution
    # numbers are then lower bounds on the top 20 + rest partition, and the report says so.
    setup = summary["setups"]["vllm"]
    assert setup["full_distribution"].startswith("truncated: vLLM returned its top 20 of 383")
    assert "float32" in setup["rollout"]
    assert m["tim/dist/positions"] == 72 and m["tim/dist/kl_rollout_train_mean"] < 1e-6
    assert m["tim/dist/topk_overlap_mean"] > 0.97 and m["tim/dist/tv_mean"] < 1e-3
    # The setting in each framework names the engine's own dtype; the audit reads the live engine (same dtype as
    # the trainer: no dtype finding), each finding with the registry's vLLM knob.
    from tim_plugins.parity.findings import CODES
    from tim_plugins.dump import read_dump

    assert setup["frameworks"]["vLLM"].startswith("LLM(dtype='float32'")
    found = summary["audits"]["vllm"]
    assert "dtype-mismatch" not in {f["code"] for f in found}
    assert all(f["fix"] == CODES[f["code"]].fix for f in found)
    # Largest disagreements from the run's own tensors: the naive sort of its dump.
    rows = read_dump(tmp_path / "v" / summary["dumps"]["vllm"]).to_pylist()
    want = sorted(rows, key=lambda r: -abs(r["train_logprob"] - r["rollout_logprob"]))[:15]
    assert [(r["sequence"], r["position"], r["token_id"]) for r in summary["disagreements"]["vllm"]] == [
        (r["sequence"], r["position"], r["token_id"]) for r in want]


def test_vllm_min_p_processed_logprobs_match_safe_vocab(vllm_llm, toy_model_path, tmp_path):
    cfg = MeasureConfig(model=str(toy_model_path), rollout="vllm", num_prompts=6, max_new_tokens=12,
                        batch_size=6, min_p=0.1, temperature=1.2, out=str(tmp_path / "p"))
    comps = run_measure(cfg, llm=vllm_llm)["comparisons"]
    pruned = comps["vllm+min-p=0.1"]
    # vLLM renormalises over S; the trainer's safe log-probs do the same: fp32 noise only, while the
    # full-vocabulary trainer is off by log(kept mass) on every token.
    assert pruned["tim/safe_vocab/pruned_mass_mean"] > 1e-3
    assert pruned["tim/token/abs_diff_max"] < 1e-3
    assert pruned["tim/full_vocab/abs_diff_mean"] > 10 * pruned["tim/token/abs_diff_mean"]
