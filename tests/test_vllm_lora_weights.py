"""The weight-sync check on a LoRA adapter a live vLLM engine (CPU build, toy model, fp32) holds
(``integrations.vllm.lora_weights.LoRAReads`` through ``weights.VLLMWeights``).

The adapters are written by the test in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) and loaded with vLLM's own ``add_lora``. References:
the tensors the test wrote, and PEFT's scaling (``lora_alpha / r``) restated here: vLLM folds it into ``lora_B``. The
faults are vLLM's own behaviour: an ``add_lora`` under an id it already holds keeps the adapter it holds (the stale
adapter of a sync that did not remove the old one), and a removed adapter leaves nothing.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

pytest.importorskip("vllm")
safetensors = pytest.importorskip("safetensors.torch")

from tim_plugins.integrations.vllm.lora_weights import is_adapter_name, lora_scaling  # noqa: E402
from tim_plugins.integrations.vllm.weights import VLLMWeights  # noqa: E402
from tim_plugins.weight_sync import SyncCheck  # noqa: E402

pytestmark = pytest.mark.vllm

RANK, ALPHA = 8, 10  # scaling 1.25: not a power of two, so vLLM's lora_b *= scaling rounds
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_ID = 7


def _adapter(path, config, seed: int) -> dict:
    """A PEFT-format adapter on every linear layer of the toy model (random A and B), written to ``path``."""
    g = torch.Generator().manual_seed(seed)
    sizes = {"q_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
             "k_proj": (config.hidden_size, config.num_key_value_heads * config.head_dim),
             "v_proj": (config.hidden_size, config.num_key_value_heads * config.head_dim),
             "o_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
             "gate_proj": (config.hidden_size, config.intermediate_size),
             "up_proj": (config.hidden_size, config.intermediate_size),
             "down_proj": (config.intermediate_size, config.hidden_size)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in MODULES:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = sizes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    safetensors.save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES), "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    return tensors


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lora_llm(request, toy_model_path):
    """An engine with LoRA (one adapter slot) in fp32 and in bf16 (the adapter's dtype is the model's)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    env = pytest.MonkeyPatch()
    env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    try:
        llm = LLM(model=str(toy_model_path), dtype=request.param, enforce_eager=True, max_model_len=128, seed=0,
                  kv_cache_memory_bytes=64 * 2**20, enable_lora=True, max_loras=1, max_lora_rank=RANK)
    finally:
        env.undo()
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, toy_model_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(toy_model_path))
    root = tmp_path_factory.mktemp("adapters")
    return {seed: (root / f"a{seed}", _adapter(root / f"a{seed}", config, seed)) for seed in (1, 2)}


def _add(llm, path) -> None:
    from vllm.lora.request import LoRARequest

    llm.llm_engine.add_lora(LoRARequest(f"tim{ADAPTER_ID}", ADAPTER_ID, str(path)))


def _sync(check: SyncCheck, step: int, tensors: dict, load, reader):
    """One checked adapter sync: the test's tensors sampled as a trainer's stream (lora_B times the scaling),
    ``load()`` as the engine's side of the sync, then the check."""
    scaling = lora_scaling({"r": RANK, "lora_alpha": ALPHA})
    record = check.begin(step)
    for name, tensor in tensors.items():
        record.observe(name, tensor, scale=scaling if name.endswith(".lora_B.weight") else None)
    load()
    return check.finish(record, reader)


def test_the_adapter_reads_back_as_vllm_holds_it(lora_llm, adapters):
    """Every element of every adapter matrix: lora_A exactly (the trainer's cast to the engine's dtype), lora_B as
    the tensor times PEFT's scaling within its bound, and that bound under 4 units in the last place of the dtype."""
    path, tensors = adapters[1]
    _add(lora_llm, path)
    reader = VLLMWeights.from_llm(lora_llm)
    dtype = lora_llm.llm_engine.model_config.dtype
    scaling = ALPHA / RANK
    assert lora_scaling({"r": RANK, "lora_alpha": ALPHA}) == scaling
    for name, tensor in tensors.items():
        index = torch.cartesian_prod(torch.arange(tensor.shape[0]), torch.arange(tensor.shape[1]))
        read = reader.read(name, tuple(tensor.shape), index)
        assert read is not None and not read.missing and read.dtype == dtype, name
        if name.endswith(".lora_A.weight"):
            assert not read.quantized, name
            assert torch.equal(read.values.double(), tensor.to(dtype)[tuple(index.T)].double()), name
            continue
        exact = tensor[tuple(index.T)].double() * scaling
        held = (tensor.to(dtype) * scaling)[tuple(index.T)].double()  # vLLM's cast, then its multiply, restated
        assert read.quantized and torch.equal(read.values, held), name
        assert bool(((read.values - exact).abs() <= read.atol).all()), name
        off = exact * (1 + 4 * torch.finfo(dtype).eps)  # 4 ulps away: outside the bound where it is not tiny
        big = exact.abs() > 1e-3
        assert bool(((read.values - off).abs() > read.atol)[big].all()), name
    lora_llm.llm_engine.remove_lora(ADAPTER_ID)


def test_base_weights_read_through_the_lora_wrappers(lora_llm, toy_model_path):
    """With LoRA enabled every linear layer is wrapped (``...WithLoRA``); a base weight is read from the layer it
    wraps, equal to the checkpoint."""
    from pathlib import Path

    checkpoint = {}
    for f in sorted(Path(toy_model_path).glob("*.safetensors")):
        checkpoint.update(safetensors.load_file(str(f)))
    reader = VLLMWeights.from_llm(lora_llm)
    wrapped = reader.model.model.layers[0].self_attn.qkv_proj
    assert "LoRA" in type(wrapped).__name__
    check = SyncCheck()
    record = check.begin(0)
    for name, tensor in checkpoint.items():
        record.observe(name, tensor)
    report = check.finish(record, reader)
    assert report.causes == [] and report.checked_tensors == len(checkpoint)


def test_a_stale_adapter_is_named_and_a_replaced_one_is_not(lora_llm, adapters):
    """Three adapter syncs: the first adapter loaded; the second added under the same id without removing the first
    (vLLM keeps the first: every adapter matrix is stale, a no-op sync); then removed and added (every matrix
    holds the second)."""
    (path1, tensors1), (path2, tensors2) = adapters[1], adapters[2]
    reader = VLLMWeights.from_llm(lora_llm)
    check = SyncCheck()
    first = _sync(check, 0, tensors1, lambda: _add(lora_llm, path1), reader)
    assert first.causes == [] and first.checked_tensors == len(tensors1)
    stale = _sync(check, 1, tensors2, lambda: _add(lora_llm, path2), reader)
    assert [c.code for c in stale.causes] == ["sync-noop"]
    assert set(stale.causes[0].tensors) == set(tensors2) and stale.bad_tensors == len(tensors2)

    def replace():
        lora_llm.llm_engine.remove_lora(ADAPTER_ID)
        _add(lora_llm, path2)

    fixed = _sync(check, 2, tensors2, replace, reader)
    assert fixed.causes == [] and fixed.checked_tensors == len(tensors2)


def test_an_adapter_the_engine_does_not_hold_is_missing(lora_llm, adapters):
    """After remove_lora no adapter is active: every adapter matrix sent is named missing."""
    path, tensors = adapters[1]
    _add(lora_llm, path)
    reader = VLLMWeights.from_llm(lora_llm)
    check = SyncCheck()
    report = _sync(check, 0, tensors, lambda: lora_llm.llm_engine.remove_lora(ADAPTER_ID), reader)
    assert [c.code for c in report.causes] == ["sync-tensors-missing"]
    assert set(report.causes[0].tensors) == set(tensors)


@pytest.mark.parametrize("config, expected", [
    ({"r": 8, "lora_alpha": 16}, 2.0),
    ({"r": 16, "lora_alpha": 8, "use_rslora": True}, 2.0),  # alpha / sqrt(r)
    ({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}}, None),  # per-module: not one number
    ({"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 4}}, None),
    ({"lora_alpha": 16}, None),
])
def test_lora_scaling_is_pefts(config, expected):
    assert lora_scaling(config) == expected


def test_lora_scaling_reads_a_peft_config_object():
    peft = pytest.importorskip("peft")
    assert lora_scaling(peft.LoraConfig(r=4, lora_alpha=6)) == 1.5


def test_adapter_names():
    assert is_adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert is_adapter_name("model.layers.3.mlp.down_proj.lora_B.weight")
    assert not is_adapter_name("model.layers.0.self_attn.q_proj.weight")
    assert not is_adapter_name("model.layers.0.self_attn.q_proj.lora_A.default.weight")  # PEFT's in-model name


def test_the_lora_internals_the_reader_assumes():
    """VLLM_SOURCES, "a LoRA adapter": the statements the reader relies on (the reads above check the behaviour)."""
    from upstream import resolve, source

    assert "self.model.lora_manager = self" in source("vllm.lora.model_manager", "LoRAModelManager.__init__")
    assert "self.lora_index_to_id" in source("vllm.lora.model_manager", "LoRAModelManager.__init__")
    assert "self.lora_b *= self.scaling" in source("vllm.lora.lora_weights", "LoRALayerWeights.optimize")
    create = source("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA.create_lora_weights")
    assert "self.lora_a_stacked = tuple(" in create and "self.lora_b_stacked = tuple(" in create
    assert "self.tp_size = self.base_layer.tp_size" in source("vllm.lora.layers.base_linear",
                                                             "BaseLinearLayerWithLoRA.__init__")
    parse = resolve("vllm.lora.utils", "parse_fine_tuned_lora_name")
    assert parse("base_model.model.model.layers.2.mlp.up_proj.lora_B.weight", None) == ("model.layers.2.mlp.up_proj",
                                                                                       False)
    mapper = resolve("vllm.model_executor.models.utils", "WeightsMapper")
    assert hasattr(mapper, "get_rename_mapper") or hasattr(mapper, "get_unstacked_mapper")
