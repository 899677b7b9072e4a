"""Test-only CPU shims that let verl 0.9.1's Megatron LM-head engine (megatron-core 0.19.2, mbridge 0.15.1,
``vanilla_mbridge=True``, no Transformer Engine, no Apex) initialise, infer, train and checkpoint on a machine
without an accelerator, with gloo. Nothing here is shipped: the plugin's Megatron engine is the same on CPU and GPU.

``install()`` must run before anything imports verl (``conftest.py`` and ``ranks.py`` call it first). It reuses
the FSDP suite's CPU platform and import-hook mechanism (``tests/verl_suite/cpu_site``: ``cpu_platform.py``,
``cpu_shims.py``), so there is one CPU platform for both suites, and adds the Megatron ones. Each shim names the
installed source it works around (``tests/megatron_suite/test_megatron_shims.py`` fails when a named line changes):

1. verl has no CPU platform: the FSDP suite's test platform (``VERL_PLATFORM=cpu``), so ``get_device_id()`` is
   ``"cpu"``, ``get_torch_device()`` answers memory queries with zeros (verl/utils/profiler/performance.py:54
   ``mem_get_info``) and verl seeds Megatron's model-parallel RNG tracker (verl/workers/engine/megatron/utils.py:35
   skips it when ``device_count()`` is 0, and Megatron's layers then fork an unseeded tracker).
2. megatron-core places buffers with ``torch.cuda.current_device()`` (models/common/embeddings/
   rotary_pos_embedding.py:78, distributed/param_and_grad_buffer.py:1162, transformer/attention.py:530, utils.py:715):
   answered ``"cpu"``.
3. Megatron's RNG tracker keeps CUDA generator states (tensor_parallel/random.py:303-306 ``CudaRNGStatesTracker.add``,
   :104 ``_get_cuda_rng_state``, :135 ``_set_cuda_rng_state``, :490 ``model_parallel_cuda_manual_seed``): the same
   calls on the CPU generator.
4. The DDP grad buffer waits on CUDA streams (distributed/param_and_grad_buffer.py:632 ``torch.cuda.current_stream``,
   ``torch.cuda.synchronize``): a stream that does nothing (CPU work is synchronous).
5. mbridge 0.15.1 predates mcore 0.19.2's removal of ``ModelType.encoder_and_decoder`` (mbridge/core/util.py:52, :83):
   added back as a value no model has.
6. mbridge hard-codes Transformer Engine's layer spec (mbridge/core/llm_bridge.py:150
   ``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``): the local (torch) spec instead, and the
   ``has_vp_stage`` flag that method sets (mbridge/core/llm_bridge.py:145), which the model provider reads under
   virtual pipeline parallelism (:177).
7. mbridge moves the model to the GPU (mbridge/core/util.py:151 ``model_module.cuda(...)``), Megatron's optimizer moves
   state (optimizer/optimizer.py:586, :591): ``Module.cuda`` / ``Tensor.cuda`` return the object itself.
8. The local spec has stand-alone layer norms (``input_layernorm``, ``pre_mlp_layernorm``) where TE fuses them into
   ``linear_qkv`` / ``linear_fc1``; mbridge's Qwen2 name map (mbridge/models/qwen2.py:27, :52) knows the fused names
   only: the two stand-alone names are mapped to the same HF weights.
9. Megatron's optimizer makes its scalars on ``device='cuda'`` (optimizer/optimizer.py:690, :698, :702;
   optimizer/clip_grads.py:96, :108, :112) and accepts parameters only of type ``torch.cuda.*Tensor``
   (optimizer/optimizer.py:1009, :1028; distrib_optimizer.py:401, :466): a ``TorchFunctionMode`` maps a CUDA device
   argument to the CPU, and ``Tensor.type()`` called from ``megatron.core.optimizer`` answers the CUDA type name.
10. verl's bshd path (verl/models/mcore/util.py:708 ``preprocess_bshd_engine``) passes a [b, s] mask of *valid* tokens
    (Transformer Engine's convention); the local ``DotProductAttention`` (transformer/dot_product_attention.py:142)
    wants a [b, 1, s, s] mask of *masked-out* positions, causal part included: converted.
11. verl treats a module on the CPU as offloaded and loads it "to the GPU" before a checkpoint
    (verl/workers/engine/megatron/transformer_impl.py:791-793, :813; megatron_utils ``load_megatron_model_to_gpu``
    then reads ``buffer.param_data``, which is None here): on the CPU there is nothing to move, the helpers are no-ops.
12. verl's remove-padding path (and its fused forward, which needs it) packs the micro-batch's sequences into one
    thd row (``packed_seq_params``, qkv_format "thd"); Megatron squeezes the batch dimension off the query, key and
    value for it (transformer/attention.py:1469) and the local ``DotProductAttention`` refuses packed sequences
    (transformer/dot_product_attention.py:154): the squeezed dimension put back, and the packing turned into a
    [1, 1, t, t] mask that keeps each position causal inside its own sequence of ``cu_seqlens_q_padded``.
13. The local spec's layer norm (``WrappedTorchNorm``, transformer/torch_norm.py:50) refuses sequence parallelism
    (its sequence-parallel norm is Apex's ``FusedLayerNorm``, a CUDA extension): with ``sequence_parallel`` the torch
    norm is built as without it and its parameters marked ``sequence_parallel``, which is what makes Megatron sum
    their gradients over the TP group (distributed/finalize_model_grads.py:452), as it does for the fused norm.
Not shims but configuration (``harness.build_engine``): ``sequence_parallel=False`` unless a test asks for it
(mbridge turns it on whenever TP > 1, mbridge/core/llm_bridge.py:76; shim 13), fusions off,
``attention_backend="local"``, ``use_cpu_initialization=True``; ``use_remove_padding=False`` (bshd) except where a
test asks for the packed thd layout (``remove_padding=True``, shim 12).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

__all__ = ["install", "HOOKS", "VERL_CPU_SITE"]

VERL_CPU_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "verl_suite", "cpu_site")


class _NullStream:
    """torch.cuda's stream API where all work is synchronous (shim 4)."""

    def wait_event(self, *args, **kwargs) -> None:
        return None

    def wait_stream(self, *args, **kwargs) -> None:
        return None

    def record_event(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _torch_cuda() -> None:
    """Shims 2-4 and 7 (torch is imported by the time verl or Megatron is)."""
    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # the CPU generator alone: torch.manual_seed itself calls torch.cuda.manual_seed_all
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kwargs: self


def _rng_tracker(module) -> None:
    import torch

    module._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    module._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _model_type(module) -> None:
    if not hasattr(module.ModelType, "encoder_and_decoder"):
        module.ModelType.encoder_and_decoder = object()


def _local_layer_spec(module) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def _get_transformer_layer_spec(self, vp_stage=None):
        self.has_vp_stage = True  # as mbridge's own method sets it (megatron-core >= 0.13 takes vp_stage): the
        # model provider reads it under virtual pipeline parallelism
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)

    module.LLMBridge._get_transformer_layer_spec = _get_transformer_layer_spec


def _local_layernorm_names(module) -> None:
    qwen2 = module.Qwen2Bridge
    qwen2._OTHER_MAPPING = {**qwen2._OTHER_MAPPING,
                            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    # "pre_mlp_layernorm" contains "mlp": mbridge looks it up in the MLP map
    qwen2._MLP_MAPPING = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
                          **qwen2._MLP_MAPPING}


def _cuda_free_optimizer() -> None:
    """Shim 9: entered once for the process (test processes only)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(device):
        if isinstance(device, int) and not isinstance(device, bool):
            return "cpu"
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return device

    class CPUDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs:
                kwargs = {**kwargs, "device": cpu(kwargs["device"])}
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], cpu(args[1]), *args[2:])
            out = func(*args, **kwargs)
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str) \
                    and out.startswith("torch.") and not out.startswith("torch.cuda.") \
                    and sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core.optimizer"):
                out = "torch.cuda." + out[len("torch."):]
            return out

    CPUDevice().__enter__()


def _bshd_attention_mask(module) -> None:
    import torch

    forward = module.DotProductAttention.forward

    def dot_product_attention_forward(self, query, key, value, attention_mask, attn_mask_type=None,
                                      attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, np, hn] packed sequences: one [t, 1, np, hn] row whose mask keeps each position causal inside
            # its own (padded) sequence of cu_seqlens_q_padded
            bounds = packed_seq_params.cu_seqlens_q_padded.to(query.device)
            t = query.shape[0]
            seg = torch.bucketize(torch.arange(t, device=query.device), bounds[1:], right=True)
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=query.device), 1)
            attention_mask = ((seg[:, None] != seg[None, :]) | causal)[None, None]
            return forward(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), attention_mask,
                           attn_mask_type, attention_bias, None)
        if attention_mask is not None and attention_mask.dim() == 2:
            s = attention_mask.shape[1]
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attention_mask.device), 1)
            attention_mask = (~attention_mask.bool())[:, None, None, :] | causal[None, None]
        return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    module.DotProductAttention.forward = dot_product_attention_forward


def _sequence_parallel_torch_norm(module) -> None:
    import copy

    new = module.WrappedTorchNorm.__new__

    def wrapped_torch_norm(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = new(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    module.WrappedTorchNorm.__new__ = wrapped_torch_norm


def _no_device_moves(module) -> None:
    module.load_megatron_model_to_gpu = lambda *args, **kwargs: None
    module.offload_megatron_model_to_cpu = lambda *args, **kwargs: None


HOOKS: dict[str, Callable] = {
    "megatron.core.tensor_parallel.random": _rng_tracker,
    "megatron.core.enums": _model_type,
    "megatron.core.transformer.enums": _model_type,
    "mbridge.core.llm_bridge": _local_layer_spec,
    "mbridge.models.qwen2": _local_layernorm_names,
    "megatron.core.transformer.dot_product_attention": _bshd_attention_mask,
    "verl.workers.engine.megatron.transformer_impl": _no_device_moves,
    "megatron.core.transformer.torch_norm": _sequence_parallel_torch_norm,
}


def install() -> None:
    """Install the shims in this process (idempotent); call before verl, Megatron or mbridge is imported."""
    if any(name in sys.modules for name in ("verl", "megatron.core", "mbridge")):
        raise RuntimeError("tests/megatron_suite: verl, megatron or mbridge was imported before the CPU shims; "
                           "run the Megatron suite in its own process (make test-megatron does)")
    if VERL_CPU_SITE not in sys.path:
        sys.path.insert(0, VERL_CPU_SITE)
    import cpu_shims  # the FSDP suite's import hooks and CPU platform (shim 1)

    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl's engine registry has no "cpu" key
    os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")
    _torch_cuda()
    _cuda_free_optimizer()
    cpu_shims.HOOKS.update(HOOKS)
    cpu_shims.install(vllm_plain_linear=False)
