"""The test-only CPU shims (``cpu_site/megatron_shims.py``) work around named lines of verl 0.9.1, megatron-core
0.19.2 and mbridge 0.15.1. Each line is read from the installed file (not the live, patched object) and must still
say what the shim assumes: a new release that moves one makes us look again (the shim may be unnecessary now, or
wrong). Numbered as in the shims' docstring."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# (shim, module, line, fragment the line holds)
NAMED_LINES = [
    (1, "verl.utils.profiler.performance", 54, "mem_free, mem_total = get_torch_device().mem_get_info()"),
    (1, "verl.workers.engine.megatron.utils", 35, "if is_device_available and get_torch_device().device_count() > 0:"),
    (2, "megatron.core.models.common.embeddings.rotary_pos_embedding", 78, "torch.cuda.current_device()"),
    (2, "megatron.core.distributed.param_and_grad_buffer", 1162, "device=torch.cuda.current_device(),"),
    (2, "megatron.core.transformer.attention", 530, "device=torch.cuda.current_device(),"),
    (2, "megatron.core.utils", 715, "device=torch.cuda.current_device(),"),
    (3, "megatron.core.tensor_parallel.random", 303, "orig_rng_state = torch.cuda.get_rng_state()"),
    (3, "megatron.core.tensor_parallel.random", 104, "def _get_cuda_rng_state("),
    (3, "megatron.core.tensor_parallel.random", 135, "def _set_cuda_rng_state("),
    (3, "megatron.core.tensor_parallel.random", 490, "torch.cuda.manual_seed(data_parallel_seed)"),
    (4, "megatron.core.distributed.param_and_grad_buffer", 632, "current_stream = torch.cuda.current_stream()"),
    (5, "mbridge.core.util", 52, "if model_type == ModelType.encoder_and_decoder:"),
    (5, "mbridge.core.util", 83, "if model_type == ModelType.encoder_and_decoder:"),
    (6, "mbridge.core.llm_bridge", 150, "self.config, use_transformer_engine=True, **extra_args"),
    (6, "mbridge.core.llm_bridge", 145, 'self.has_vp_stage = "vp_stage" in sig.parameters'),
    (6, "mbridge.core.llm_bridge", 177, "if vp_stage is not None and self.has_vp_stage:"),
    (7, "mbridge.core.util", 151, "model_module.cuda(torch.cuda.current_device())"),
    (7, "megatron.core.optimizer.optimizer", 586, "p.data = p.data.cuda()"),
    (8, "mbridge.models.qwen2", 27, '"self_attention.linear_qkv.layer_norm_weight": ['),
    (8, "mbridge.models.qwen2", 52, '"mlp.linear_fc1.layer_norm_weight": ['),
    (9, "megatron.core.optimizer.optimizer", 702, "device='cuda')"),
    (9, "megatron.core.optimizer.clip_grads", 108, "device='cuda')"),
    (9, "megatron.core.optimizer.optimizer", 1009, "if param.type() in ['torch.cuda.HalfTensor',"),
    (9, "megatron.core.optimizer.distrib_optimizer", 401, "'torch.cuda.BFloat16Tensor']:"),
    (10, "verl.models.mcore.util", 708, "attention_mask = torch.zeros(batch_size, local_max_seqlen, dtype=torch.bool"),
    (10, "megatron.core.transformer.dot_product_attention", 142, "def forward("),
    (11, "verl.workers.engine.megatron.transformer_impl", 793,
     "load_megatron_model_to_gpu(self.module, load_grad=True)"),
    (11, "verl.workers.engine.megatron.transformer_impl", 813, "load_megatron_model_to_gpu(self.module)"),
    (12, "megatron.core.transformer.attention", 1469, "query = query.squeeze(1)"),
    (12, "megatron.core.transformer.dot_product_attention", 154,
     '"Packed sequence is not supported by DotProductAttention."'),
    (13, "megatron.core.transformer.torch_norm", 50,
     'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"'),
    (13, "megatron.core.distributed.finalize_model_grads", 452,
     'elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or ('),
    # configuration, not a shim: mbridge turns sequence parallel on with TP > 1 (the harness passes it off)
    (0, "mbridge.core.llm_bridge", 76, '"sequence_parallel": self.mpu.tp_size > 1,'),
]


@pytest.mark.parametrize("shim,module,line,fragment", NAMED_LINES, ids=lambda v: str(v))
def test_named_upstream_line_holds(shim, module, line, fragment):
    lines = Path(importlib.util.find_spec(module).origin).read_text().splitlines()
    assert fragment in lines[line - 1], f"shim {shim}: {module}:{line} is now {lines[line - 1].strip()!r}"


def test_mbridge_has_no_local_spec_names_and_mcore_no_encoder_and_decoder():
    """Shims 5 and 8 add what the installed packages lack (a release that adds it makes the shim unnecessary)."""
    import mbridge.models.qwen2 as qwen2_module

    src = Path(qwen2_module.__file__).read_text()
    assert "pre_mlp_layernorm" not in src and '"input_layernorm.weight"' not in src
    text = Path(importlib.util.find_spec("megatron.core.transformer.enums").origin).read_text()
    assert "encoder_and_decoder" not in text
