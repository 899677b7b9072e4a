"""The fixes in a trainer framework's own terms are its adapter's data (``integrations/<framework>/fixes.py``,
announced through the ``tim_plugins.fixes`` entry points), merged into the core's finding registry and the report's
staleness verdict, and available with no framework installed."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tim_plugins import fixes
from tim_plugins.parity.findings import CODES, fix_for, make_finding
from tim_plugins.report.parity import fix_header

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_announces_each_trainer_adapter_and_the_module_says_its_own_key():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][fixes.ENTRY_POINT_GROUP]
    assert set(eps) == {"trl", "verl"}
    for key, target in eps.items():
        assert target == f"tim_plugins.integrations.{key}.fixes"
        assert (ROOT / "integrations" / key / "fixes.py").is_file()
    # the installed metadata says the same (an editable install that predates the entry points reads {} here)
    assert set(fixes.framework_fixes()) == {"trl", "verl"}


@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_each_adapter_names_known_codes_and_parts_and_the_registry_merges_them(framework):
    adapter = fixes.framework_fixes()[framework]
    assert set(adapter.finding_fixes) <= set(CODES) and set(adapter.part_fixes) == set(fixes.PARTS)
    assert all(isinstance(v, str) and v for v in [*adapter.finding_fixes.values(), *adapter.part_fixes.values()])
    for code, knob in adapter.finding_fixes.items():
        # the core keeps its own vocabulary; the adapter adds its words under its key, nothing else moves
        merged = CODES[code].fix
        assert merged[framework] == knob and {k: merged[k] for k in CODES[code].knobs} == CODES[code].knobs
        assert set(merged) <= {*CODES[code].knobs, *fixes.framework_fixes()}
        assert fix_for(make_finding(code, "error", "m").fix, framework) == knob
    assert fix_header(framework) == f"fix ({adapter.name})"


def test_without_framework_knobs_the_framework_gets_the_knobs_it_runs_on():
    # a finding's fix without TRL's words (the registry's core knobs alone) reads as what TRL runs on, each named
    knobs = CODES["attention-backend-mismatch"].knobs
    assert "trl" not in knobs
    assert fix_for(dict(knobs), "trl") == f"vLLM: {knobs['vllm']}; transformers: {knobs['hf']}"



def test_part_fix_reads_the_adapters_words_and_falls_back_to_the_core():
    assert fixes.part_fix("staleness_async", "trl") == fixes.framework_fixes()["trl"].part_fixes["staleness_async"]
    assert "max_staleness" in fixes.part_fix("staleness_async", "trl")
    assert "ppo_epochs" in fixes.part_fix("staleness", "verl")
    for framework in (None, "no-such-framework"):
        assert fixes.part_fix("mismatch", framework) == fixes.PARTS["mismatch"]
    with pytest.raises(ValueError, match="part='stale'"):
        fixes.part_fix("stale", "trl")


def test_a_broken_adapter_module_costs_its_fixes_not_the_report(monkeypatch, caplog):
    good = [EntryPoint("trl", "tim_plugins.integrations.trl.fixes", fixes.ENTRY_POINT_GROUP)]
    broken = EntryPoint("zz", "tim_plugins.integrations.no_such_module", fixes.ENTRY_POINT_GROUP)
    monkeypatch.setattr(fixes, "entry_points", lambda group: [broken, *good] if group == fixes.ENTRY_POINT_GROUP else [])
    fixes.framework_fixes.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tim_plugins.fixes"):
            found = fixes.framework_fixes()
        assert set(found) == {"trl"}
        assert "no_such_module" in caplog.text
        assert "verl" not in CODES["dtype-mismatch"].fix and "trl" in CODES["dtype-mismatch"].fix
    finally:
        fixes.framework_fixes.cache_clear()


def test_the_offline_report_has_every_frameworks_fixes_with_no_framework_importable():
    # A fresh interpreter where importing any framework fails: the adapters' data modules must not need one.
    script = """
import json, sys
for name in ("transformers", "trl", "verl", "vllm", "ray", "accelerate"):
    sys.modules[name] = None
from tim_plugins.parity.findings import make_finding
from tim_plugins.report.parity import finding_fix
from tim_plugins.fixes import part_fix
f = make_finding("dtype-mismatch", "error", "m").to_dict()
print(json.dumps({"trl": finding_fix(f, "trl"), "verl": finding_fix(f, "verl"),
                  "stale": part_fix("staleness", "verl"),
                  "loaded": sorted(m for m in sys.modules if m.startswith("tim_plugins.integrations"))}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    got = json.loads(out.stdout)
    from tim_plugins.integrations.trl.fixes import FINDING_FIXES as TRL
    from tim_plugins.integrations.verl.fixes import FINDING_FIXES as VERL
    from tim_plugins.integrations.verl.fixes import PART_FIXES as VERL_PARTS

    assert got["trl"] == TRL["dtype-mismatch"] and got["verl"] == VERL["dtype-mismatch"]
    assert got["stale"] == VERL_PARTS["staleness"]
    assert got["loaded"] == ["tim_plugins.integrations", "tim_plugins.integrations.trl",
                             "tim_plugins.integrations.trl.fixes", "tim_plugins.integrations.verl",
                             "tim_plugins.integrations.verl.fixes"]

@pytest.mark.parametrize("framework, says", [
    ("verl", "++actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend="),
    ("trl", "--model PATH"),
    ("vllm", "--vllm-args"),
])
def test_an_unknown_setting_is_told_how_to_name_it_in_each_frameworks_terms(framework, says):
    """Printed on a default verl run and on `audit --trl-config` without --model: the words of that run's input,
    not only the Python API's (the verl override is checked against verl's config in the verl suite)."""
    fix = fix_for(make_finding("unknown-setting", "info", "m").fix, framework)
    assert says in fix


# TRL's fixes name GRPOConfig fields (or AsyncGRPOConfig's, TIMConfig's); `quantization` is the LLM() argument TRL
# sets itself for a 4-bit policy, `attn_implementation` a from_pretrained argument (GRPOConfig.model_init_kwargs)
_NOT_FIELDS = {"quantization", "attn_implementation"}


def _trl_texts() -> list[str]:
    adapter = fixes.framework_fixes()["trl"]
    return [*adapter.finding_fixes.values(), *adapter.part_fixes.values(), *adapter.cause_fixes.values()]


def test_trl_fixes_name_real_config_fields():
    pytest.importorskip("trl")
    import dataclasses
    import re

    from trl import GRPOConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from tim_plugins.integrations.trl.config import TIMConfig

    known = {f.name for cls in (GRPOConfig, AsyncGRPOConfig, TIMConfig) for f in dataclasses.fields(cls)}
    named = {m for text in _trl_texts() for m in re.findall(r"(?<![\w.'\"-])([a-z_][a-z0-9_]*)=", text)}
    assert {"cast_lm_head_to_fp32", "use_vllm", "vllm_mode", "top_p", "min_p", "rollout"} <= named
    assert named - known - _NOT_FIELDS == set()


def _serve_commands() -> tuple[list[list[str]], list[list[str]]]:
    """(`trl vllm-serve` argument lists, argument lists appended to it and forwarded to `vllm serve`)."""
    import re
    import shlex

    serve, forwarded = [], []
    for text in _trl_texts():
        text = text.replace("<trainer dtype>", "bfloat16")
        serve += [shlex.split(m) for m in re.findall(r"`trl vllm-serve ([^`]*--[^`]*)`", text)]
        forwarded += [shlex.split(m) for m in re.findall(r"append (.+?) \(forwarded to vllm serve\)", text)]
    return serve, forwarded


def test_trl_vllm_serve_flags_in_the_fixes_parse_and_reach_vllm_serve():
    """Each `trl vllm-serve` flag is one of TRL's ScriptArguments, and the `vllm serve` command TRL builds from it
    (with the flags a fix appends, which TRL forwards) parses with vLLM's own serve parser."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    from transformers import HfArgumentParser
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve, forwarded = _serve_commands()
    assert len(serve) >= 4 and len(forwarded) >= 2
    vllm_serve = make_arg_parser(FlexibleArgumentParser())
    for args, extra in [*((a, []) for a in serve), *(([], e) for e in forwarded)]:
        script_args, rest = HfArgumentParser(ScriptArguments).parse_args_into_dataclasses(
            args=["--model", "m", *args], return_remaining_strings=True)
        assert rest == [], args
        command = build_command(script_args, extra)
        vllm_serve.parse_args(command[command.index("serve") + 1:])  # exits 2 on an unknown flag


def test_trl_colocate_advice_matches_the_llm_call_trl_makes():
    """TRL 1.16 builds the colocated LLM() with a fixed list of keyword arguments (no **kwargs a user could fill):
    the engine arguments of these fixes are not among them, so the TRL fixes send colocate users to server mode."""
    pytest.importorskip("trl")
    import ast
    import inspect
    import textwrap

    from trl.generation.vllm_generation import VLLMGeneration

    tree = ast.parse(textwrap.dedent(inspect.getsource(VLLMGeneration._init_vllm)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LLM"]
    assert len(calls) == 1
    keywords = [k.arg for k in calls[0].keywords]
    assert None not in keywords  # no **kwargs
    assert not {"dtype", "hf_overrides", "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                "kv_cache_dtype", "attention_config"} & set(keywords)
    adapter = fixes.framework_fixes()["trl"]
    for code in ("dtype-mismatch", "lm-head-precision-mismatch", "prefix-caching-on", "chunked-prefill-on",
                 "cudagraph-on"):
        knob = adapter.finding_fixes[code]
        assert "vllm_mode='server'" in knob and "vllm_engine_args" not in knob, code


def test_trl_exact_baseline_advice_states_what_the_exact_sampler_requires():
    """TIMConfig(rollout='exact') refuses vLLM and a truncating or penalised sampler (translate.py): the fix that
    suggests it says both, in the words of those refusals."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from tim_plugins.integrations.trl.config import TIMConfig
    from tim_plugins.integrations.trl.translate import pipeline_config, rollout_source

    knob = fixes.framework_fixes()["trl"].finding_fixes["batch-invariance-off"]
    config = TIMConfig(rollout="exact")
    with pytest.raises(ValueError, match="use_vllm=False") as vllm:
        rollout_source(SimpleNamespace(use_vllm=True), config)
    assert "use_vllm=False" in knob and "GRPOConfig.use_vllm=False" in str(vllm.value)
    trainer = SimpleNamespace(top_p=0.9, top_k=0, min_p=None, repetition_penalty=1.0, use_vllm=False)
    with pytest.raises(ValueError) as sampler:
        pipeline_config(trainer, config, "exact", safe_vocab=False, loss_factor=False)
    settings = "top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0"
    assert settings in str(sampler.value) and settings in knob
