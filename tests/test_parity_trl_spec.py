"""TRL GRPOConfig (+ model) → parity specs, with real GRPOConfig objects; the `--trl-config` CLI."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl")

from tim_plugins.integrations.trl.parity_spec import (  # noqa: E402
    load_grpo_config,
    rollout_spec_from_trl,
    specs_from_grpo_config,
    trainer_spec_from_trl,
)
from tim_plugins.parity import audit, enforce  # noqa: E402


def _config(tmp_path, **kw):
    from trl import GRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    base.update(kw)
    return GRPOConfig(**base)


@pytest.fixture(scope="module")
def model(toy_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32)


def _codes(findings, severity=None):
    return {f.code for f in findings if severity is None or f.severity == severity}


def test_colocate_defaults_mirror_what_trl_passes_to_llm(tmp_path, model):
    args = _config(tmp_path, use_vllm=True, vllm_mode="colocate")
    rollout, trainer = specs_from_grpo_config(args, model)
    # TRL passes no dtype: vLLM 'auto' turns the fp32 checkpoint into bf16; processed log-probs are requested
    assert rollout.dtype == "bfloat16" and rollout.logprobs_mode == "processed_logprobs"
    assert rollout.prefix_caching and rollout.chunked_prefill and rollout.cudagraph  # vLLM defaults, untouched
    assert trainer.dtype == "float32" and trainer.temperature == 1.0 and trainer.top_p == 1.0
    assert trainer.attention_backend == "sdpa"
    findings = audit(rollout, trainer)
    assert _codes(findings, "error") == {"dtype-mismatch"}
    assert {"lm-head-precision-mismatch", "prefix-caching-on", "chunked-prefill-on", "cudagraph-on"} <= \
        _codes(findings, "warning")


def test_sampler_fields_and_lm_head(tmp_path, model):
    args = _config(tmp_path, use_vllm=True, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                   repetition_penalty=1.1, cast_lm_head_to_fp32=True, generation_kwargs={"presence_penalty": 0.3})
    rollout, trainer = specs_from_grpo_config(args, model)
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.min_p) == (0.7, 0.9, 20, 0.05)
    assert (rollout.repetition_penalty, rollout.presence_penalty) == (1.1, 0.3)
    assert trainer.temperature == 0.7 and trainer.lm_head_dtype == "float32"
    errors = _codes(audit(rollout, trainer), "error")
    # TRL's trainer divides by T (no temperature finding) but applies no truncation or penalties
    assert errors == {"dtype-mismatch", "sampler-truncation-unmatched", "sampler-penalties-unmatched"}
    fixed = enforce(rollout, trainer)
    assert fixed.vllm_engine_args["dtype"] == "float32"
    assert "hf_overrides" not in fixed.vllm_engine_args  # an fp32 rollout's head already matches the fp32 head
    # a bf16 trainer (bf16 weights) with an fp32 head: the rollout keeps bf16 but needs the fp32 head too
    bf16 = _config(tmp_path, use_vllm=True, bf16=True, cast_lm_head_to_fp32=True)
    rollout, trainer = specs_from_grpo_config(bf16, model.to(torch.bfloat16))
    model.to(torch.float32)  # the module fixture, as the other tests read it
    assert trainer.dtype == "bfloat16" and "dtype-mismatch" not in _codes(audit(rollout, trainer))
    fixed = enforce(rollout, trainer)
    assert fixed.vllm_engine_args == {"hf_overrides": {"head_dtype": "float32"}, "enable_prefix_caching": False,
                                      "enable_chunked_prefill": False, "enforce_eager": True}


@pytest.mark.parametrize("kwargs,label", [({"min_tokens": 4}, "min_tokens=4"),
                                          ({"thinking_token_budget": 8}, "thinking_token_budget=8")])
def test_generation_kwargs_processing_reaches_the_colocate_rollout(tmp_path, model, kwargs, label):
    """TRL lays generation_kwargs over its vLLM SamplingParams: a min_tokens or a thinking budget there (real
    SamplingParams fields: vLLM's own class takes them) is sampler processing the trainer does not recompute, as the
    vLLM reader says of the same SamplingParams."""
    from vllm import SamplingParams

    from tim_plugins.parity.vllm_spec import sampling_processors

    assert sampling_processors(SamplingParams(**kwargs)) == (label,)
    rollout, trainer = specs_from_grpo_config(
        _config(tmp_path, use_vllm=True, vllm_mode="colocate", generation_kwargs=kwargs), model)
    assert rollout.custom_logits_processors == (label,) and trainer.custom_logits_processors == ()
    assert "sampler-penalties-unmatched" in _codes(audit(rollout, trainer))


@pytest.mark.parametrize("mode", ["colocate", "server"])
@pytest.mark.parametrize("how", ["regex", "generation_kwargs"])
def test_structured_outputs_are_sampler_processing_the_trainer_does_not_recompute(tmp_path, model, mode, how):
    """TRL builds vLLM's StructuredOutputsParams per request from vllm_structured_outputs_regex or
    generation_kwargs['structured_outputs']; its trainer scores the unconstrained model."""
    from tim_plugins.integrations.trl.fixes import FINDING_FIXES

    kw = ({"vllm_structured_outputs_regex": r"<answer>\d+</answer>"} if how == "regex" else
          {"generation_kwargs": {"structured_outputs": {"choice": ["yes", "no"]}}})
    rollout, trainer = specs_from_grpo_config(_config(tmp_path, use_vllm=True, vllm_mode=mode, **kw), model)
    assert rollout.custom_logits_processors == ("structured_outputs",) and trainer.custom_logits_processors == ()
    (finding,) = [f for f in audit(rollout, trainer) if f.code == "sampler-penalties-unmatched"]
    assert finding.severity == "error" and finding.rollout_value == {"custom_logits_processors": (
        "structured_outputs",)}, finding
    assert "vllm_structured_outputs_regex" in FINDING_FIXES["sampler-penalties-unmatched"]
    plain, _ = specs_from_grpo_config(_config(tmp_path, use_vllm=True, vllm_mode=mode), model)
    assert not plain.custom_logits_processors  # () in colocate; None (unknown) in server mode without its args


def test_bf16_autocast_and_model_init_kwargs(tmp_path):
    args = _config(tmp_path, bf16=True, use_cpu=True, model_init_kwargs={"dtype": "bfloat16",
                                                                         "attn_implementation": "eager"})
    trainer = trainer_spec_from_trl(args)  # no model loaded: read from the config
    assert trainer.dtype == "bfloat16" and trainer.attention_backend == "eager"
    plain = trainer_spec_from_trl(_config(tmp_path))
    assert plain.dtype == "float32"  # TRL's default for a model path


def _trl_loaded_dtype(args, path) -> str:
    """The dtype of the weights TRL's own loader gives GRPOTrainer for a model path (trl/trainer/utils.py
    ``create_model_from_path`` with ``args.model_init_kwargs``, as GRPOTrainer.__init__ calls it)."""
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(args.model_init_kwargs or {})
    return str(create_model_from_path(str(path), **kwargs).dtype).replace("torch.", "")


@pytest.mark.parametrize("init", [None, {"dtype": "bfloat16"}, {"dtype": "float32"}])
def test_bf16_autocast_reads_as_the_weights_trl_loads(tmp_path, toy_model_path, init):
    """GRPOConfig's bf16=True is accelerate autocast over the weights TRL loaded (float32 for a model path unless
    model_init_kwargs['dtype'] says otherwise): the trainer reads as those weights' dtype (TRL's own loader, the
    reference), so TRL's default config (bf16=True, fp32 weights) against vLLM's bf16 is a dtype-mismatch, whose TRL
    fix names the setting that gives bf16 weights; bf16 weights against the bf16 rollout are none."""
    from tim_plugins.integrations.trl.fixes import FINDING_FIXES

    args = _config(tmp_path, use_vllm=True, bf16=True, model_init_kwargs=init)
    loaded = _trl_loaded_dtype(args, toy_model_path)
    rollout, trainer = specs_from_grpo_config(args, str(toy_model_path))
    assert rollout.dtype == "bfloat16"  # vLLM's 'auto' on the fp32 toy checkpoint
    assert trainer.dtype == loaded, (trainer.dtype, loaded)
    findings = {f.code: f for f in audit(rollout, trainer)}
    if loaded == "bfloat16":
        assert "dtype-mismatch" not in findings
        return
    assert trainer.autocast == "bfloat16"
    assert findings["dtype-mismatch"].trainer_value == "bfloat16 autocast over float32 weights"
    assert "bfloat16 autocast over float32 weights" in trainer.notes["dtype"], trainer.notes
    # nor is it vLLM's fp32 model: an engine in the weights' dtype leaves the finding (and enforce() cannot clear
    # it: an engine does not autocast), while bf16=False with that engine is the fp32 pair
    fp32_engine = rollout.replace(dtype="float32")
    assert "dtype-mismatch" in _codes(audit(fp32_engine, trainer))
    assert "dtype-mismatch" in _codes(enforce(rollout, trainer).findings)
    plain = trainer_spec_from_trl(_config(tmp_path, use_vllm=True, bf16=False, model_init_kwargs=init))
    assert plain.autocast is None and "dtype-mismatch" not in _codes(audit(fp32_engine, plain))
    # the fix names a real GRPOConfig field with a value TRL's loader takes, and that value gives bf16 weights
    fix = findings["dtype-mismatch"].fix["trl"]
    assert "GRPOConfig(model_init_kwargs={'dtype': 'bfloat16'})" in fix, fix
    fixed = _config(tmp_path, use_vllm=True, bf16=True, model_init_kwargs={"dtype": "bfloat16"})
    assert _trl_loaded_dtype(fixed, toy_model_path) == "bfloat16"
    assert "dtype-mismatch" not in _codes(audit(*specs_from_grpo_config(fixed, str(toy_model_path))))
    assert "model_init_kwargs={'dtype': 'bfloat16'}" in FINDING_FIXES["dtype-mismatch"]


def test_hf_generation_under_autocast_matches_the_trainer(tmp_path, model):
    """TRL's transformers generation runs the trainer's own (fp32, bf16-autocast) model: the two sides read the
    same dtype, no dtype-mismatch; a live bf16 model is bf16 on both."""
    args = _config(tmp_path, use_vllm=False, bf16=True)
    rollout, trainer = specs_from_grpo_config(args, model)
    assert rollout.dtype == trainer.dtype == str(next(model.parameters()).dtype).replace("torch.", "") == "float32"
    assert "dtype-mismatch" not in _codes(audit(rollout, trainer))


def test_hf_generation_and_server_mode(tmp_path, model):
    hf = rollout_spec_from_trl(_config(tmp_path, use_vllm=False), model)
    assert hf.framework.startswith("hf-generate") and hf.dtype == "float32" and hf.logprobs_mode is None
    server = rollout_spec_from_trl(_config(tmp_path, use_vllm=True, vllm_mode="server"), model)
    assert server.dtype is None and server.logprobs_mode is None  # unknown: configured by `trl vllm-serve`
    served = rollout_spec_from_trl(_config(tmp_path, use_vllm=True, vllm_mode="server"), model,
                                   server_args="--dtype float32 --logprobs-mode processed_logprobs --enforce-eager")
    assert served.dtype == "float32" and served.logprobs_mode == "processed_logprobs" and not served.cudagraph


def test_load_grpo_config_and_cli(tmp_path, toy_model_path, capsys):
    from tim_plugins.apps.cli import main

    yml = tmp_path / "grpo.yaml"
    yml.write_text("use_vllm: true\nvllm_mode: colocate\ntemperature: 0.8\ntop_p: 0.95\nuse_cpu: true\nbf16: false\n")
    args = load_grpo_config(yml)
    assert args.temperature == 0.8 and args.top_p == 0.95
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"temprature": 0.8}))
    with pytest.raises(ValueError, match="temprature"):
        load_grpo_config(bad)
    rc = main(["audit", "--trl-config", str(yml), "--model", str(toy_model_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "sampler-truncation-unmatched" in out and "dtype-mismatch" in out
    rc = main(["audit", "--trl-config", str(bad)])
    assert rc == 2 and "temprature" in capsys.readouterr().err


def test_audit_of_a_gpu_runs_config_on_a_machine_without_one(tmp_path, capsys):
    """`tim-plugins audit --trl-config grpo.yaml` (docs/parity.md) is a static check: a GPU run's config, which leaves
    bf16 to GRPOConfig's default (True) and sets no use_cpu, is audited on a CPU-only machine too (transformers
    refuses bf16 there unless use_cpu: the audit must not), the trainer read in bfloat16 as that run trains; a
    missing file is one line naming it, without the raw OS error."""
    from tim_plugins.apps.cli import main

    yml = tmp_path / "grpo.yaml"
    yml.write_text("use_vllm: true\nvllm_mode: colocate\ntop_p: 0.95\n")
    rc = main(["audit", "--trl-config", str(yml), "--json"])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    report = json.loads(captured.out)
    # GRPOConfig's bf16 default, as on the GPU it is written for: autocast over the float32 weights TRL loads
    assert report["trainer"]["dtype"] == "float32" and "bfloat16 autocast" in report["trainer"]["notes"]["dtype"]
    assert "sampler-truncation-unmatched" in {f["code"] for f in report["findings"]}
    rc = main(["audit", "--trl-config", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "missing.yaml: no such file" in err and "[Errno" not in err, err


def test_server_reply_without_a_dtype_leaves_it_unknown():
    """A /server_info reply that names no dtype (an older `trl vllm-serve`, or a trimmed reply) leaves the dtype
    unknown, as the other missing fields are, instead of the string "None" that no dtype rule accepts."""
    from types import SimpleNamespace

    from tim_plugins.integrations.trl._parity import server_engine_args

    def trainer_with(model_config):
        info = {"model_config": model_config, "cache_config": {"cache_dtype": "auto"},
                "scheduler_config": {}, "device_config": {"device": "cpu"}}
        return SimpleNamespace(vllm_generation=SimpleNamespace(vllm_client=SimpleNamespace(get_server_info=lambda: info)))

    args, device = server_engine_args(trainer_with({"model": "m"}))
    assert args == {"model": "m", "kv_cache_dtype": "auto"} and device == "cpu"
    args, _ = server_engine_args(trainer_with({"model": "m", "dtype": "torch.bfloat16"}))
    assert args["dtype"] == "bfloat16"
