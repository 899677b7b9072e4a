"""Static parity audit: codes against hand-written specs, enforce round trips, engine-args reader, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_plugins.parity import CODES, ParityError, PipelineSpec, audit, enforce
from tim_plugins.parity.findings import codes_markdown
from tim_plugins.parity.audit import FIXABLE
from tim_plugins.parity.vllm_spec import apply_engine_args, parse_engine_args, spec_from_engine_args

# The stable codes (issue 4). Renaming one breaks users' filters: this list is the contract.
EXPECTED_CODES = [
    "dtype-mismatch", "lm-head-precision-mismatch", "logprobs-mode-not-processed", "sampler-truncation-unmatched",
    "temperature-mismatch", "sampler-penalties-unmatched", "quantized-rollout", "prefix-caching-on",
    "chunked-prefill-on", "cudagraph-on", "batch-invariance-off", "attention-backend-mismatch", "unknown-setting",
]

MATCHED = dict(
    dtype="float32", lm_head_dtype=None, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
    presence_penalty=0.0, frequency_penalty=0.0, logit_bias=False, bad_words=False, custom_logits_processors=(),
    weight_quantization="none", kv_cache_dtype="auto", prefix_caching=False, chunked_prefill=False,
    cudagraph=False, compile=False, batch_invariant=True, attention_backend="FLASH_ATTN",
)


def matched_pair(**rollout_changes):
    rollout = PipelineSpec(side="rollout", **{**MATCHED, "logprobs_mode": "processed_logprobs", **rollout_changes})
    trainer = PipelineSpec(side="trainer", **{**MATCHED, "attention_backend": "flash_attention_2"})
    return rollout, trainer


def codes(findings):
    return {(f.code, f.severity) for f in findings}


def test_codes_are_stable_and_each_has_knobs():
    assert list(CODES) == EXPECTED_CODES
    for info in CODES.values():
        assert info.fix, info.code
        assert info.why, info.code


def test_readme_documents_every_code():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "parity.md").read_text()
    section = readme.split("<!-- section:parity -->")[1].split("<!-- /section:parity -->")[0]
    for code in EXPECTED_CODES:
        assert f"`{code}`" in section, code
    # the list is the registry's, with every installed adapter's knobs (tim_plugins.fixes)
    codes = section.split("<!-- codes: tim_plugins.parity.findings.codes_markdown() -->\n")[1].split("\n<!-- /codes -->")[0]
    assert codes == codes_markdown(), "docs/parity.md: paste tim_plugins.parity.findings.codes_markdown() between the markers"


def test_matched_specs_have_no_findings():
    rollout, trainer = matched_pair()
    assert audit(rollout, trainer) == []


# one field changed on the rollout side → exactly this (code, severity)
CASES = [
    (dict(dtype="bfloat16"), {("dtype-mismatch", "error"), ("lm-head-precision-mismatch", "warning")}),
    (dict(lm_head_dtype="bfloat16"), {("lm-head-precision-mismatch", "warning")}),
    (dict(logprobs_mode="raw_logprobs"), {("logprobs-mode-not-processed", "warning")}),
    (dict(logprobs_mode="processed_logits"), {("logprobs-mode-not-processed", "error")}),
    (dict(logprobs_mode="raw_logprobs", temperature=0.7),
     {("logprobs-mode-not-processed", "error"), ("temperature-mismatch", "error")}),
    (dict(top_p=0.9), {("sampler-truncation-unmatched", "error")}),
    (dict(top_k=50), {("sampler-truncation-unmatched", "error")}),
    (dict(min_p=0.05), {("sampler-truncation-unmatched", "error")}),
    (dict(temperature=0.7), {("temperature-mismatch", "error")}),
    (dict(repetition_penalty=1.1), {("sampler-penalties-unmatched", "error")}),
    (dict(presence_penalty=0.5), {("sampler-penalties-unmatched", "error")}),
    (dict(logit_bias=True), {("sampler-penalties-unmatched", "error")}),
    (dict(bad_words=True), {("sampler-penalties-unmatched", "error")}),
    (dict(custom_logits_processors=("my.Proc",)), {("sampler-penalties-unmatched", "error")}),
    (dict(weight_quantization="fp8"), {("quantized-rollout", "error")}),
    (dict(kv_cache_dtype="fp8_e4m3"), {("quantized-rollout", "error")}),
    (dict(prefix_caching=True), {("prefix-caching-on", "warning")}),
    (dict(chunked_prefill=True), {("chunked-prefill-on", "warning")}),
    (dict(cudagraph=True), {("cudagraph-on", "warning")}),
    (dict(compile=True), {("cudagraph-on", "warning")}),
    (dict(batch_invariant=False), {("batch-invariance-off", "warning")}),
    (dict(attention_backend="TRITON_ATTN"), {("attention-backend-mismatch", "warning")}),
    (dict(top_k=-1), set()),  # -1 and 0 both mean "off"
    (dict(temperature=0.0), set()),  # greedy rows are not divided by T: their log-probs are T = 1
    (dict(dtype="bf16", lm_head_dtype="fp32"), {("dtype-mismatch", "error")}),
]


@pytest.mark.parametrize("changes,expected", CASES, ids=[",".join(c) + f"={list(c.values())[0]}" for c, _ in CASES])
def test_each_code_from_one_changed_field(changes, expected):
    rollout, trainer = matched_pair(**changes)
    assert codes(audit(rollout, trainer)) == expected


def test_findings_carry_both_values_and_knobs():
    rollout, trainer = matched_pair(dtype="bfloat16", top_p=0.9)
    by_code = {f.code: f for f in audit(rollout, trainer)}
    f = by_code["dtype-mismatch"]
    assert (f.rollout_value, f.trainer_value) == ("bfloat16", "float32")
    assert "actor_rollout_ref.rollout.dtype" in f.fix["verl"] and "dtype" in f.fix["vllm"]
    t = by_code["sampler-truncation-unmatched"]
    assert t.rollout_value == {"top_p": 0.9} and t.trainer_value == {"top_p": 1.0}
    # verl's fix keeps the user's top_p: the actor applies the rollout's truncation with the safe vocabulary
    assert "+tim.safe_vocab.min_p=" in t.fix["verl"] and "top_p=1.0" not in t.fix["verl"]


def test_neither_side_batch_invariant_is_info_and_unknowns_are_reported_not_guessed():
    rollout, trainer = matched_pair(batch_invariant=False)
    trainer = trainer.replace(batch_invariant=False, attention_backend=None)
    found = audit(rollout, trainer)
    assert codes(found) == {("batch-invariance-off", "info"), ("unknown-setting", "info")}
    unknown = next(f for f in found if f.code == "unknown-setting")
    assert unknown.trainer_value == ["attention_backend"] and unknown.rollout_value == []
    # a fully unknown rollout produces only the unknown-setting finding
    only = audit(PipelineSpec(side="rollout"), trainer)
    assert [f.code for f in only] == ["unknown-setting"]


def test_sides_must_be_in_order():
    rollout, trainer = matched_pair()
    with pytest.raises(ValueError, match="rollout spec first"):
        audit(trainer, rollout)


def test_spec_validation_quotes_the_bad_value():
    with pytest.raises(ValueError, match="'fp12'"):
        PipelineSpec(dtype="fp12")
    with pytest.raises(ValueError, match="top_p=1.5"):
        PipelineSpec(top_p=1.5)
    assert PipelineSpec(dtype="bf16", top_k=-1).dtype == "bfloat16"
    assert PipelineSpec(top_k=-1).top_k == 0


WORST_ARGS = "--dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8"
WORST_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.2,
                  "bad_words": ["x"]}


def _trainer():
    return PipelineSpec(side="trainer", **{**MATCHED, "batch_invariant": False, "attention_backend": "sdpa"})


def test_enforce_default_changes_numerics_only_and_strict_raises_on_the_rest():
    rollout = spec_from_engine_args(WORST_ARGS, sampling=WORST_SAMPLING, device="cuda")
    result = enforce(rollout, _trainer())
    changed = {(c.side, c.field) for c in result.changes}
    assert changed == {("rollout", "dtype"), ("rollout", "logprobs_mode"), ("trainer", "temperature"),
                       ("rollout", "prefix_caching"), ("rollout", "chunked_prefill"), ("rollout", "cudagraph"),
                       ("rollout", "compile")}
    assert result.vllm_engine_args == {"dtype": "float32", "logprobs_mode": "processed_logprobs",
                                       "enable_prefix_caching": False, "enable_chunked_prefill": False,
                                       "enforce_eager": True}
    assert result.trainer_settings == {"temperature": 0.7}
    assert {f.code for f in result.errors} == {"sampler-truncation-unmatched", "sampler-penalties-unmatched",
                                               "quantized-rollout"}
    with pytest.raises(ParityError) as err:
        enforce(rollout, _trainer(), strict=True)
    assert "sampler-truncation-unmatched" in str(err.value) and len(err.value.findings) == 3


@pytest.mark.parametrize("truncation_side", ["rollout", "trainer"])
def test_enforce_round_trip_through_engine_args(truncation_side):
    """enforce → apply the patches to the engine args / sampling params → re-read → audit: no errors."""
    rollout = spec_from_engine_args(WORST_ARGS, sampling=WORST_SAMPLING, device="cuda")
    result = enforce(rollout, _trainer(), fix=FIXABLE, truncation_side=truncation_side, strict=True)
    assert result.errors == []
    args = apply_engine_args(WORST_ARGS, result.vllm_engine_args)
    sampling = {**WORST_SAMPLING, **result.vllm_sampling_params}
    reread = spec_from_engine_args(args, sampling=sampling, device="cuda")
    trainer = _trainer().replace(**result.trainer_settings)
    assert [f for f in audit(reread, trainer) if f.severity == "error"] == []
    if truncation_side == "trainer":
        assert result.trainer_settings["top_p"] == 0.9 and result.trainer_settings["top_k"] == 50
        assert "top_p" not in result.vllm_sampling_params


def test_enforce_lm_head_follows_trainer_head():
    rollout, trainer = matched_pair(dtype="bfloat16")
    trainer = trainer.replace(dtype="bfloat16", lm_head_dtype="float32")
    result = enforce(rollout, trainer)
    assert result.vllm_engine_args == {"hf_overrides": {"head_dtype": "float32"}}
    merged = apply_engine_args({"hf_overrides": {"rope_theta": 1e6}}, result.vllm_engine_args)
    assert merged["hf_overrides"] == {"rope_theta": 1e6, "head_dtype": "float32"}
    assert audit(result.rollout, result.trainer) == []


_dt = st.sampled_from(["float32", "bfloat16", "float16"])
_spec_values = st.fixed_dictionaries(dict(
    dtype=_dt, lm_head_dtype=st.one_of(st.none(), _dt), temperature=st.sampled_from([0.0, 0.6, 1.0]),
    top_p=st.sampled_from([0.8, 1.0]), top_k=st.sampled_from([-1, 0, 20]), min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.3]), presence_penalty=st.sampled_from([0.0, 0.4]),
    frequency_penalty=st.sampled_from([0.0, 0.2]), logit_bias=st.booleans(), bad_words=st.booleans(),
    weight_quantization=st.sampled_from(["none", "fp8", "awq"]), kv_cache_dtype=st.sampled_from(["auto", "fp8"]),
    prefix_caching=st.booleans(), chunked_prefill=st.booleans(), cudagraph=st.booleans(), compile=st.booleans(),
    batch_invariant=st.booleans(), attention_backend=st.sampled_from(["FLASH_ATTN", "sdpa", "eager"]),
))


@settings(max_examples=150, deadline=None)
@given(r=_spec_values, t=_spec_values, mode=st.sampled_from(["raw_logprobs", "processed_logprobs", "raw_logits"]),
       side=st.sampled_from(["rollout", "trainer"]))
def test_enforce_with_every_fix_leaves_no_error(r, t, mode, side):
    t = {**t, "weight_quantization": "none", "kv_cache_dtype": "auto", "logit_bias": False, "bad_words": False,
         "temperature": 1.0 if t["temperature"] == 0.0 else t["temperature"]}
    rollout = PipelineSpec(side="rollout", logprobs_mode=mode, custom_logits_processors=(), **r)
    trainer = PipelineSpec(side="trainer", custom_logits_processors=(), **t)
    result = enforce(rollout, trainer, fix=FIXABLE, truncation_side=side)
    assert result.errors == []
    # every change is a real change and is recorded against the side it touched
    for c in result.changes:
        spec = result.rollout if c.side == "rollout" else result.trainer
        assert getattr(spec, c.field) == c.new


def test_enforce_rejects_unfixable_codes():
    rollout, trainer = matched_pair()
    with pytest.raises(ValueError, match="attention-backend-mismatch"):
        enforce(rollout, trainer, fix={"attention-backend-mismatch"})


def test_parse_engine_args_forms():
    cli = parse_engine_args("vllm serve /m --dtype=bfloat16 --enforce-eager --no-enable-prefix-caching "
                            "--max-model-len 256 --hf-overrides '{\"head_dtype\": \"float32\"}'")
    assert cli == {"model": "/m", "dtype": "bfloat16", "enforce_eager": True, "enable_prefix_caching": False,
                   "max_model_len": 256, "hf_overrides": {"head_dtype": "float32"}}
    assert parse_engine_args('{"enable-chunked-prefill": false}') == {"enable_chunked_prefill": False}
    with pytest.raises(ValueError, match="JSON"):
        parse_engine_args("{not json")


def test_engine_args_defaults_and_auto_dtype(tmp_path):
    default = spec_from_engine_args({}, checkpoint_dtype="float32", device="cuda", env={})
    assert default.dtype == "bfloat16"  # vLLM 'auto' downcasts fp32 checkpoints
    assert default.logprobs_mode == "raw_logprobs"
    assert default.prefix_caching and default.chunked_prefill and default.cudagraph and default.compile
    assert default.batch_invariant is False
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert spec_from_engine_args({"model": str(tmp_path)}).dtype == "float16"
    assert spec_from_engine_args({}).dtype is None  # unknown checkpoint: not guessed
    cpu = spec_from_engine_args("--enforce-eager", device="cpu", env={"VLLM_BATCH_INVARIANT": "1"})
    assert (cpu.cudagraph, cpu.compile, cpu.attention_backend, cpu.batch_invariant) == (False, False, "cpu_attn", True)
    graphs_off = spec_from_engine_args({"compilation_config": {"cudagraph_mode": "NONE"}})
    assert graphs_off.cudagraph is False and graphs_off.compile is True


def test_cli_audit_vllm_args(capsys):
    from tim_plugins.apps.cli import main

    rc = main(["audit", "--vllm-args", "--dtype bfloat16", "--sampling", '{"top_p": 0.9}',
               "--trainer-dtype", "float32", "--trainer-temperature", "1.0", "--trainer-attn", "sdpa"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "dtype-mismatch" in out and "sampler-truncation-unmatched" in out and "logprobs-mode-not-processed" in out
    rc = main(["audit", "--vllm-args", "--dtype float32 --logprobs-mode processed_logprobs --enforce-eager "
               "--no-enable-prefix-caching --no-enable-chunked-prefill", "--device", "cpu",
               "--trainer-dtype", "float32", "--trainer-temperature", "1.0", "--trainer-attn", "sdpa", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {f["code"] for f in data["findings"]} == {"attention-backend-mismatch", "batch-invariance-off"}


def test_cli_audit_enforce_exit_code(capsys):
    from tim_plugins.apps.cli import main

    rc = main(["audit", "--vllm-args", "--dtype bfloat16", "--trainer-dtype", "float32", "--trainer-temperature",
               "1", "--trainer-attn", "sdpa", "--enforce"])
    out = capsys.readouterr().out
    assert rc == 0 and "enforce() changed" in out and "vllm dtype='float32'" in out


def test_cli_audit_verl_without_verl_fails_clearly(capsys):
    from tim_plugins._optional import package_version
    from tim_plugins.apps.cli import main

    if package_version("verl") is not None:
        pytest.skip("verl is installed here: covered by tests/verl_suite/test_parity_verl_spec.py")
    rc = main(["audit", "--verl", "actor_rollout_ref.rollout.top_p=0.9"])
    assert rc == 2
    assert "needs verl installed" in capsys.readouterr().err


def test_findings_rows_and_table_show_each_finding_with_its_frameworks_knob():
    from tim_plugins.parity.table import FINDINGS_COLUMNS, findings_rows, findings_table

    rollout, trainer = matched_pair(dtype="bfloat16")
    findings = audit(rollout, trainer)
    rows = findings_rows(findings, framework="verl")
    assert len(rows) == len(findings) == 2 and all(len(row) == len(FINDINGS_COLUMNS) for row in rows)
    dtype_row = next(row for row in rows if row[1] == "dtype-mismatch")
    assert dtype_row[:4] == ["error", "dtype-mismatch", "bfloat16", "float32"]
    assert dtype_row[5] == CODES["dtype-mismatch"].fix["verl"]
    assert all(isinstance(cell, str) for row in rows for cell in row)  # ready for a log line or a wandb.Table
    unknown = findings_rows(findings, framework="no-such-framework")[0][5]
    # every knob, each named, when the framework is not listed
    names = {"vllm": "vLLM", "hf": "transformers", "trl": "TRL", "verl": "verl"}  # the adapters' NAME for trl, verl
    assert unknown == "; ".join(f"{names[k]}: {v}" for k, v in findings[0].fix.items())
    text = findings_table(findings, framework="verl")
    assert text.splitlines()[0].split() == list(FINDINGS_COLUMNS) and "dtype-mismatch" in text
    assert findings_table([]).startswith("no findings")


def test_fix_for_picks_the_run_s_framework_then_what_it_runs_on():
    from tim_plugins.parity.findings import fix_for

    dtype = CODES["dtype-mismatch"].fix
    assert fix_for(dtype, "trl") == dtype["trl"] and fix_for(dtype, "verl") == dtype["verl"]
    # a code without a knob of the run's framework: the knobs of what it runs on (vLLM, transformers, tim-plugins),
    # not verl's; a knob that is already a command of that name is not prefixed with it again
    bi = CODES["batch-invariance-off"].fix
    assert bi["tim_plugins"].startswith("tim-plugins measure")
    assert fix_for(bi, "hf") == bi["tim_plugins"]
    hf_only = {k: v for k, v in bi.items() if k != "trl"}
    assert fix_for(hf_only, "trl") == f"vLLM: {bi['vllm']}; {bi['tim_plugins']}"
    # no framework: every knob, the core's vocabularies first, then the adapters'
    assert fix_for(hf_only, None) == f"vLLM: {bi['vllm']}; {bi['tim_plugins']}; verl: {bi['verl']}"


def test_truncation_fix_keeps_the_users_sampling_first():
    from tim_plugins.truncation import DEFAULT_MIN_P

    """The first fix offered for a truncating sampler keeps it: the trainer applies the same truncation."""
    rollout, trainer = matched_pair(top_p=0.8)
    (finding,) = [f for f in audit(rollout, trainer) if f.code == "sampler-truncation-unmatched"]
    trl = finding.fix["trl"]  # TRL keeps it as set too: no min-p to add
    assert trl.startswith("keep your sampling: TIMConfig(safe_vocab=True)") and "GRPOConfig(min_p=" not in trl
    assert trl.index("TIMConfig(safe_vocab=True)") < trl.index("top_p=1.0")
    verl = finding.fix["verl"]  # verl keeps the sampling outright: the actor applies top_p / top_k as set
    assert verl.startswith("keep your sampling: ") and f"+tim.safe_vocab.min_p={DEFAULT_MIN_P:g}" in verl
    assert "top_p=1.0" not in verl and "use_fused_kernels=false" not in verl


def test_audit_and_report_is_the_one_sequence_every_caller_runs():
    """audit → title line with the counts → the one table format → strict, written once
    (``tim_plugins.parity.report``): the reference is the parts computed by hand from ``audit`` and
    ``findings_table``; the TRL callback, verl's driver and the CLI all call it."""
    from tim_plugins.parity.report import audit_and_report
    from tim_plugins.parity.table import findings_table

    rollout, trainer = matched_pair(dtype="bfloat16")
    findings = audit(rollout, trainer)
    errors = [f for f in findings if f.severity == "error"]
    n = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    assert n["error"] >= 1
    shown = []
    report = audit_and_report(rollout, trainer, framework="verl", title="T", emit=shown.append)
    assert shown == [report] and report.findings == findings and report.worst == "error" and report.has_errors
    assert report.text == (f"T: {n['error']} error(s), {n['warning']} warning(s), {n['info']} info\n"
                           + findings_table(findings, framework="verl"))
    # strict: shown first, then stopped, every error named with the way out
    shown.clear()
    with pytest.raises(ParityError) as err:
        audit_and_report(rollout, trainer, framework="verl", title="T", emit=shown.append, strict=True,
                         strict_off="set X=false")
    assert len(shown) == 1 and err.value.findings == findings
    message = str(err.value)
    assert message.startswith("T (strict): ") and message.endswith("or set X=false to only report them.")
    assert all(f"{f.code}: {f.message}" in message for f in errors)
    # no error: strict lets it through; findings given (enforce's) are reported as they are
    clean = audit_and_report(*matched_pair(), framework=None, title="T", strict=True)
    assert clean.findings == [] and clean.text.startswith("T: 0 error(s), 0 warning(s), 0 info\nno findings")
    given_findings = audit_and_report(rollout, trainer, framework="verl", title="T", findings=errors)
    assert given_findings.findings == errors
    # the three callers
    root = Path(__file__).resolve().parents[1]
    for path in ("integrations/trl/_parity.py", "integrations/verl/trainer.py", "tim_plugins/apps/audit.py"):
        text = (root / path).read_text()
        assert "audit_and_report(" in text and "severity_counts(" not in text and "has_errors(" not in text, path


def test_engine_args_with_the_min_p_processor_cut_every_request():
    """tim-plugins' min-p processor registered with an engine-wide tim_min_p cuts every request there, the larger of
    it and the request's min_p winning (integrations/vllm/min_p.py); registered without it, or tim_min_p without the
    processor, cuts nothing. `tim-plugins audit --vllm-args` and TRL's server mode read engine args this way."""
    cli = ("--logits-processors tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor "
           "--additional-config '{\"tim_min_p\": 0.001}'")
    assert spec_from_engine_args(cli, sampling={"min_p": 1e-5}).min_p == 1e-3
    assert spec_from_engine_args(cli, sampling={"min_p": 0.01}).min_p == 0.01
    assert spec_from_engine_args("--additional-config '{\"tim_min_p\": 0.001}'").min_p == 0.0
    served = {"logits_processors": ["tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor"],
              "additional_config": {"tim_min_p": 0.001}}  # as engine_args_from_server_info reads /server_info
    assert spec_from_engine_args(served).min_p == 1e-3


# ------------------------------------------------------------------ request processing no spec field held
_EAGER_F32 = ("--dtype float32 --logprobs-mode processed_logprobs --no-enable-prefix-caching "
              "--no-enable-chunked-prefill --enforce-eager")


@pytest.mark.parametrize("sampling,label", [
    ({"min_tokens": 32}, "min_tokens=32"),  # MinTokensLogitsProcessor: stop tokens masked until 32 are out
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),  # the grammar masks the logits
    ({"thinking_token_budget": 8}, "thinking_token_budget=8"),  # end-of-thinking forced past 8 tokens
])
def test_sampling_processing_vllm_applies_is_reported(sampling, label):
    """vLLM 0.31 SamplingParams settings that change the sampled distribution the trainer never recomputes are the
    rollout's processing: sampler-penalties-unmatched, and raw log-probs are then not the sampled distribution's."""
    trainer = matched_pair()[1]
    rollout = spec_from_engine_args(_EAGER_F32, sampling=sampling, device="cpu")
    assert rollout.custom_logits_processors == (label,)
    found = {f.code: f for f in audit(rollout.replace(attention_backend="FLASH_ATTN", batch_invariant=True), trainer)}
    assert set(found) == {"sampler-penalties-unmatched"} and found["sampler-penalties-unmatched"].severity == "error"
    assert label in found["sampler-penalties-unmatched"].message
    raw = spec_from_engine_args(_EAGER_F32.replace("processed_logprobs", "raw_logprobs"), sampling=sampling)
    assert codes(audit(raw, trainer)) >= {("logprobs-mode-not-processed", "error")}


def test_sampling_processing_at_vllms_own_defaults_is_none():
    vllm = pytest.importorskip("vllm")
    from tim_plugins.parity.vllm_spec import sampling_processors

    # vLLM's own SamplingParams: its defaults, and -1 ("unlimited") for the thinking budget, process nothing
    assert sampling_processors(vllm.SamplingParams()) == ()
    assert sampling_processors(vllm.SamplingParams(thinking_token_budget=-1)) == ()
    assert sampling_processors({"thinking_token_budget": -1, "min_tokens": 0, "structured_outputs": None}) == ()
    assert sampling_processors(vllm.SamplingParams(min_tokens=4, max_tokens=16)) == ("min_tokens=4",)
    with pytest.raises(ValueError, match="min_tokens"):
        sampling_processors({"min_tokens": -1})


def test_cli_audit_reads_min_tokens_from_sampling(capsys):
    from tim_plugins.apps.cli import main

    rc = main(["audit", "--vllm-args", _EAGER_F32, "--device", "cpu", "--sampling", '{"min_tokens": 8}',
               "--trainer-dtype", "float32", "--trainer-temperature", "1.0", "--trainer-attn", "sdpa", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and "sampler-penalties-unmatched" in {f["code"] for f in data["findings"]}


def test_cli_audit_bad_sampling_json_names_the_flag(capsys):
    from tim_plugins.apps.cli import main

    assert main(["audit", "--vllm-args", "--dtype bfloat16", "--sampling", "{bad"]) == 2
    err = capsys.readouterr().err
    assert "--sampling" in err and "'{bad'" in err
    assert main(["audit", "--vllm-args", "--dtype bfloat16", "--sampling", "[1]"]) == 2
    assert "--sampling '[1]' must be a JSON object" in capsys.readouterr().err


# ------------------------------------------------------------------ CUDA graphs and torch.compile
def _cudagraph_fix_alternatives() -> list:
    """Each alternative the cudagraph-on fix prints, as (Python engine kwargs, CLI string): "LLM(k=v) / --cli"."""
    import ast

    out = []
    for part in CODES["cudagraph-on"].knobs["vllm"].split(" (")[0].split(", or "):
        python, cli = (p.strip() for p in part.removeprefix("or ").split(" / "))
        call = ast.parse(python, mode="eval").body
        out.append(({k.arg: ast.literal_eval(k.value) for k in call.keywords}, cli))
    return out


def test_every_printed_cudagraph_fix_clears_the_finding():
    alternatives = _cudagraph_fix_alternatives()
    assert len(alternatives) == 3  # enforce_eager, -O0, compilation_config mode 0 + no graphs
    trainer = matched_pair()[1]
    for kwargs, cli in alternatives:
        for args in (kwargs, cli, f"--dtype float32 {cli}"):
            spec = spec_from_engine_args(args, env={})
            assert (spec.cudagraph, spec.compile) == (False, False), args
            assert "cudagraph-on" not in {f.code for f in audit(spec, trainer)}, args
        assert parse_engine_args(cli) == kwargs  # the CLI form is the same setting


# (engine args, environment) -> (CUDA graphs, torch.compile) on a GPU, as vLLM 0.31's VllmConfig.__post_init__
# (vllm/config/vllm.py) resolves them: OPTIMIZATION_LEVEL_00.._03's cudagraph_mode, mode NONE at -O0,
# CUDAGraphMode.without_piecewise without VLLM_COMPILE, enforce_eager over all
GRAPHS_AND_COMPILE = [
    ({}, {}, (True, True)),  # -O2: VLLM_COMPILE, FULL_AND_PIECEWISE
    ({"compilation_config": {"cudagraph_mode": "NONE"}}, {}, (False, True)),  # graphs off, still compiled
    ({"optimization_level": 0}, {}, (False, False)),  # -O0: mode NONE, cudagraph_mode NONE
    ({"optimization_level": 1, "compilation_config": {"mode": 0}}, {}, (False, False)),  # PIECEWISE -> NONE
    ({"compilation_config": {"mode": "none"}}, {}, (True, False)),  # FULL_AND_PIECEWISE -> FULL_DECODE_ONLY
    ("-O0 -cc.cudagraph_mode=FULL", {}, (True, False)),  # full graphs need no compilation
    ("-O3 --enforce-eager", {}, (False, False)),
    ({}, {"TORCH_COMPILE_DISABLE": "1"}, (True, False)),
    ({}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, (True, False)),  # breakable graphs: uncompiled, graphs kept
]


def test_graphs_and_compile_as_vllm_resolves_them():
    for args, env, expected in GRAPHS_AND_COMPILE:
        spec = spec_from_engine_args(args, device="cuda", env=env)
        assert (spec.cudagraph, spec.compile) == expected, (args, env)


def test_parse_engine_args_reads_vllms_short_flags():
    # vLLM's FlexibleArgumentParser: -O<n> / -O <n> / -O=<n> is --optimization-level, -cc / -q aliases, dotted keys
    assert parse_engine_args("--dtype float32 -O0") == {"dtype": "float32", "optimization_level": 0}
    assert parse_engine_args("-O 1") == parse_engine_args("-O=1") == {"optimization_level": 1}
    assert parse_engine_args("--optimization-level 0") == {"optimization_level": 0}  # a level, not False
    assert parse_engine_args("--enforce-eager -O3") == {"enforce_eager": True, "optimization_level": 3}
    assert parse_engine_args("-cc.mode=0 --compilation-config.cudagraph_mode NONE") == \
        {"compilation_config": {"mode": 0, "cudagraph_mode": "NONE"}}
    assert parse_engine_args("-q fp8 --seed -1") == {"quantization": "fp8", "seed": -1}
    for bad in ("-O9", "-x 1", "-cc.mode"):
        with pytest.raises(ValueError):
            parse_engine_args(bad)


# ------------------------------------------------------------------ raw log-probs, processing unknown
def test_raw_logprobs_with_unknown_processing_says_it_is_unknown():
    rollout = PipelineSpec(side="rollout", dtype="float32", logprobs_mode="raw_logprobs", temperature=None)
    trainer = PipelineSpec(side="trainer", dtype="float32", temperature=1.0)
    finding = next(f for f in audit(rollout, trainer) if f.code == "logprobs-mode-not-processed")
    assert finding.severity == "error"
    assert "unknown" in finding.message and "temperature" in finding.message
    assert "no sampler processing is active" not in finding.message
    quiet = next(f for f in audit(*matched_pair(logprobs_mode="raw_logprobs"))
                 if f.code == "logprobs-mode-not-processed")
    assert quiet.severity == "warning" and "no sampler processing is active" in quiet.message


def test_cli_enforce_in_trl_colocate_keeps_what_grpoconfig_cannot_reach(tmp_path, toy_model_path, capsys):
    """TRL's colocate mode builds LLM() itself: an engine-argument fix is not applied by `audit --enforce`; its
    finding stays, listed as not applied, as its own TRL fix text says (colocate mode cannot set it)."""
    pytest.importorskip("trl")
    from tim_plugins.apps.cli import main

    yml = tmp_path / "grpo.yaml"
    yml.write_text("use_vllm: true\ntop_p: 0.9\ntemperature: 0.7\n")  # vllm_mode: TRL's default, colocate
    def report(*flags):  # importing TRL may print a line of its own before the JSON
        main(["audit", "--trl-config", str(yml), "--model", str(toy_model_path), *flags, "--json"])
        out = capsys.readouterr().out
        return json.loads(out[out.index("{"):])

    before = {f["code"] for f in report()["findings"]}
    data = report("--enforce")
    after = {f["code"] for f in data["findings"]}
    not_applied = {row["code"] for row in data["not_applied"]}
    assert {"prefix-caching-on", "chunked-prefill-on", "cudagraph-on"} <= not_applied <= before
    assert not_applied <= after  # not fixed, so still reported
    for code in not_applied:
        assert "colocate mode cannot set it" in CODES[code].fix["trl"], code
    assert not any(c["side"] == "rollout" and c["knob"].startswith("vllm ") for c in data["changes"]), data["changes"]
    main(["audit", "--trl-config", str(yml), "--model", str(toy_model_path), "--enforce"])
    assert "not reachable from GRPOConfig" in capsys.readouterr().out
