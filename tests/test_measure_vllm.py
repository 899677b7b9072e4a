"""``measure --rollout vllm`` on the vLLM CPU build (shares the session's engine: fp32, processed log-probs)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from tim_plugins.apps.measure import MeasureConfig, run_measure  # noqa: E402
from tim_plugins.dump import read_dump  # noqa: E402

pytestmark = pytest.mark.vllm


def dumped_reference(out, summary, name) -> dict[str, float]:
    """The setting's token metrics recomputed in float64 from its dump (every scored token, the loss mask's):
    d = train − rollout, k3 = expm1(d) − d."""
    table = read_dump(out / summary["dumps"][name])
    d = [t - r for r, t in zip(table.column("rollout_logprob").to_pylist(), table.column("train_logprob").to_pylist())]
    return {"tim/tokens": float(len(d)), "tim/token/abs_diff_max": max(abs(x) for x in d),
            "tim/token/abs_diff_mean": sum(abs(x) for x in d) / len(d),
            "tim/token/kl_k3": sum(math.expm1(x) - x for x in d) / len(d)}


def assert_matches_dump(metrics, ref) -> None:
    # The monitor sums float32 per-token terms in float64 (k3 by its float32 series): ~1e-7 relative.
    for key, value in ref.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=0), key


def test_vllm_fp32_rollout_matches_fp32_trainer(vllm_llm, toy_model_path, tmp_path):
    cfg = MeasureConfig(model=str(toy_model_path), rollout="vllm", num_prompts=6, max_new_tokens=12,
                        min_new_tokens=12, batch_size=6, out=str(tmp_path / "v"))
    summary = run_measure(cfg, llm=vllm_llm)
    m = summary["metrics"]
    assert m["tim/tokens"] == 6 * 12 and m["tim/invalid_tokens"] == 0
    # The monitor's numbers are those of the run's own tensors (its dump), and in the range research measured
    # for vLLM fp32 vs transformers fp32 on a tiny model (max |Δlogp| 4.6e-5): small but not zero.
    ref = dumped_reference(tmp_path / "v", summary, "vllm")
    assert ref["tim/tokens"] == 6 * 12
    assert_matches_dump(m, ref)
    assert 0 < m["tim/token/abs_diff_max"] < 1e-3
    assert 0 < m["tim/token/kl_k3"] < 1e-6
    # The session engine returns at most 20 log-probs per token (max_logprobs default): the full-distribution
    # numbers are then lower bounds on the top 20 + rest partition, and the report says so.
    setup = summary["setups"]["vllm"]
    assert setup["full_distribution"].startswith("truncated: vLLM returned its top 20 of 383")
    assert "float32" in setup["rollout"]
    # The sampled tokens' log-probs differ (above), so the two distributions do: KL and TV are positive.
    assert m["tim/dist/positions"] == 72 and 0 < m["tim/dist/kl_rollout_train_mean"] < 1e-6
    assert 0.97 < m["tim/dist/topk_overlap_mean"] <= 1 and 0 < m["tim/dist/tv_mean"] < 1e-3
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
    summary = run_measure(cfg, llm=vllm_llm)
    pruned = summary["comparisons"]["vllm+min-p=0.1"]
    # vLLM renormalises over S; the trainer's safe log-probs do the same: fp32 noise only (the run's own tensors,
    # from its dump), while the full-vocabulary trainer is off by d = log p(a) − log(p(a) / kept) = log(kept mass)
    # on every sampled token, and −log(1 − pruned) >= pruned.
    assert_matches_dump(pruned, dumped_reference(tmp_path / "p", summary, "vllm+min-p=0.1"))
    assert pruned["tim/safe_vocab/pruned_mass_mean"] > 1e-3
    assert 0 < pruned["tim/token/abs_diff_max"] < 1e-3
    assert pruned["tim/full_vocab/abs_diff_mean"] > 10 * pruned["tim/token/abs_diff_mean"]
    assert pruned["tim/full_vocab/abs_diff_mean"] >= 0.9 * pruned["tim/safe_vocab/pruned_mass_mean"]


# The module engine's max_model_len (conftest ``vllm_llm``): vLLM ends a request there without an error.
MAX_MODEL_LEN = 256


def _long_and_short_prompt(tokenizer, long_tokens: int) -> list[str]:
    from tim_plugins.toy_model import synthetic_prompts

    text = " ".join(synthetic_prompts(64, seed=3))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > long_tokens
    return [tokenizer.decode(ids[:long_tokens]), synthetic_prompts(1, seed=4)[0]]


def test_a_completion_the_engine_cut_at_max_model_len_scores_its_sampled_tokens_only(vllm_llm, toy_model_path,
                                                                                       tmp_path, monkeypatch):
    """A prompt near the engine's max_model_len gets fewer than max_new_tokens tokens from vLLM (silently): the
    rollout's completion mask ends where vLLM's tokens end, and ``measure`` scores those tokens only, not the zero
    padding after them (token 0, the toy model's EOS, with log-prob 0). Reference: max_model_len − prompt length,
    from the prompts' own token counts."""
    import torch
    from transformers import AutoTokenizer

    import tim_plugins.toy_model as toy_model
    from tim_plugins.integrations.vllm.rollout import vllm_rollout

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    tok.padding_side = "left"
    prompts = _long_and_short_prompt(tok, 240)
    enc = tok(prompts, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1).tolist()
    assert MAX_MODEL_LEN - 40 < lengths[0] < MAX_MODEL_LEN - 1 and lengths[1] < MAX_MODEL_LEN - 40
    want = [min(40, MAX_MODEL_LEN - n) for n in lengths]
    assert want[0] < 40
    roll = vllm_rollout(vllm_llm, enc, max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                        num_logprobs=5, vocab=383)
    for row, n in enumerate(want):
        assert roll.completion_mask[row].tolist() == [1] * n + [0] * (40 - n), row
        assert bool((roll.logprobs[row, :n] < 0).all()) and bool(torch.isfinite(roll.logprobs[row, :n]).all())

    monkeypatch.setattr(toy_model, "synthetic_prompts", lambda n, seed=0: prompts[:n])
    cfg = MeasureConfig(model=str(toy_model_path), rollout="vllm", num_prompts=2, max_new_tokens=40,
                        min_new_tokens=40, batch_size=2, out=str(tmp_path / "cut"))
    summary = run_measure(cfg, llm=vllm_llm)
    m = summary["metrics"]
    assert m["tim/tokens"] == sum(want) and m["tim/invalid_tokens"] == 0
    ref = dumped_reference(tmp_path / "cut", summary, "vllm")
    assert ref["tim/tokens"] == sum(want)
    assert_matches_dump(m, ref)
    assert m["tim/dist/positions"] == sum(want) and m["rollout/tokens_sampled"] == sum(want)


def test_an_injector_seed_beyond_int64_runs_in_the_engine(vllm_llm):
    """An injector seed of 64 bits (``random.getrandbits(64)``: 2**63 and above, outside int64) runs through the
    engine step and perturbs as the seed with the same 64 bits (-2**63) does; the engine serves the next request.
    Kept last in the module: before the seed was reduced, the engine step raised and the in-process engine hung."""
    from vllm import SamplingParams

    from tim_plugins.rollout.inject import TailNoiseInjector

    def run(extra_args):
        # ignore_eos: six tokens whatever is sampled (the toy model's EOS is drawn early on some CPUs' kernels)
        params = SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=7, ignore_eos=True,
                                extra_args=extra_args)
        out = vllm_llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)]

    wide = run(TailNoiseInjector(4.0, tau=1.0, seed=2**63).to_extra_args())
    assert wide == run(TailNoiseInjector(4.0, tau=1.0, seed=-2**63).to_extra_args())
    assert wide != run(None)  # the perturbation acts (tau = 1: every token moves)
    assert len(run(None)[0]) == 6
