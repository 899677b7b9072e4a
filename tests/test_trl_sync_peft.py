"""What the weight-sync check expects TRL to send for a PEFT model (``integrations/trl/sync_check._peft_tensors``),
against PEFT's own merge: the base model's names (TRL's naming: TRL's own ``_fix_param_name_to_vllm``), each plain
LoRA weight valued as ``merge_and_unload`` writes it, a trained ``modules_to_save`` copy under the base name, and
the merges the check does not model (DoRA, an adapter bias) left uncompared (None). The whole path through
``GRPOTrainer.train()`` with vLLM colocate: tests/test_trl_vllm_sync_check.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("trl")
from transformers import AutoModelForCausalLM  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from tim_plugins.integrations.trl.sync_check import _peft_tensors  # noqa: E402

pytestmark = pytest.mark.trl

# TRL's own name fix; it reads nothing of its instance
FIX = functools.partial(VLLMGeneration._fix_param_name_to_vllm, None)


def _lora(path, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False, **kwargs))
    return lora, base


def _value(v):
    return v() if callable(v) else v.data


def test_plain_lora_is_valued_as_peft_merges_it(toy_model_path):
    model, base = _lora(toy_model_path, modules_to_save=["lm_head"])
    with torch.no_grad():  # the trained copy of lm_head differs from the base one
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    tensors = _peft_tensors(model, FIX)
    merged = {n: p.detach() for n, p in copy.deepcopy(model).merge_and_unload().named_parameters()}
    assert sorted(tensors) == sorted(base) == sorted(merged)
    for name, value in tensors.items():
        assert torch.equal(_value(value), merged[name]), name
    adapted = [n for n in tensors if ".q_proj." in n or ".v_proj." in n]
    assert adapted and all(callable(tensors[n]) for n in adapted if n.endswith(".weight"))
    assert all(not torch.equal(merged[n], base[n]) for n in adapted if n.endswith(".weight"))  # the merge moved them
    assert not torch.equal(merged["lm_head.weight"], base["lm_head.weight"])


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"lora_bias": True}])
def test_merges_the_check_does_not_model_are_not_compared(toy_model_path, variant):
    model, _ = _lora(toy_model_path, **variant)
    tensors = _peft_tensors(model, FIX)
    adapted = {n for n in tensors if ".q_proj." in n or ".v_proj." in n}
    assert adapted and all(tensors[n] is None for n in adapted)
    assert all(tensors[n] is not None for n in set(tensors) - adapted)
