"""Read the LoRA adapter an in-process vLLM model computes with, under the trainer's (PEFT) names: the engine side of
the weight-sync check for an adapter sync (verl with ``actor_rollout_ref.model.lora.merge=false``: the trainer sends
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` and vLLM loads them with ``add_lora``, apart from the
base weights).

What is read is what the forward uses: vLLM's LoRA model manager (``model.lora_manager``) copies an active adapter
into per-layer slot buffers, ``layer.lora_a_stacked[s][slot, 0, :r, :in]`` and ``layer.lora_b_stacked[s][slot, 0,
:out, :r]``, ``s`` the part of a packed layer (q / k / v of ``qkv_proj``, gate / up of ``gate_up_proj``). Not the
adapter's copy the manager keeps for reloading: an adapter that was registered and never copied into its slot
differs from it.

- ``lora_B`` is held with the adapter's scaling folded in (``lora_b *= scaling``): the trainer's side multiplies its
  sample by the same scaling (``lora_scaling``) and the two are compared within one rounding of the cast and one of
  the multiply (the read's ``atol``, ``quantized=True``: compared unrounded).
- The adapter read is the one active adapter; none active, or an engine without LoRA: the tensor is missing from the
  engine; several active (a server with many adapters): not read. Tensor-parallel shards and fully sharded LoRA
  layers: not read (counted, never named).

Every vLLM internal used is named in ``sources.VLLM_SOURCES`` (``# VLLM_SOURCES <module>:<qualname>``). Importing this
module imports no vLLM.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import torch

from tim_plugins.weight_sync import EngineRead

__all__ = ["LoRAReads", "is_adapter_name", "lora_scaling"]

_ADAPTER = re.compile(r"\.lora_[AB]\.weight$")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter matrix as PEFT names it (``...<module>.lora_A.weight`` / ``lora_B``)."""
    return _ADAPTER.search(name) is not None


def lora_scaling(peft_config) -> Optional[float]:
    """The scaling vLLM folds into ``lora_B`` for the adapter of ``peft_config`` (a PEFT ``LoraConfig`` or its dict):
    ``lora_alpha / r``, ``lora_alpha / sqrt(r)`` with ``use_rslora``; None where it is not one number (per-module
    ``rank_pattern`` / ``alpha_pattern``) or not given."""
    get = peft_config.get if isinstance(peft_config, dict) else (lambda k, d=None: getattr(peft_config, k, d))
    r, alpha = get("r"), get("lora_alpha")
    if get("rank_pattern") or get("alpha_pattern") or not r or alpha is None:
        return None
    return float(alpha) / (math.sqrt(r) if get("use_rslora", False) else float(r))


class LoRAReads:
    """The adapter matrices of an in-process vLLM ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # VLLM_SOURCES vllm.lora.model_manager:LoRAModelManager (sets model.lora_manager = itself; .modules,
        # .packed_modules_mapping, .lora_index_to_id)
        self.manager = getattr(model, "lora_manager", None)
        self._where: dict[str, Optional[tuple]] = {}

    def _mapper(self):
        # VLLM_SOURCES vllm.model_executor.models.utils:WeightsMapper (get_rename_mapper: renames only, what vLLM's
        # own adapter loader maps LoRA names with; get_unstacked_mapper before vLLM 0.31)
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        for method in ("get_rename_mapper", "get_unstacked_mapper"):
            if mapper is not None and hasattr(mapper, method):
                return getattr(mapper, method)()
        return mapper

    def _locate(self, name: str) -> Optional[tuple]:
        """(layer, part, is lora_A) of an adapter matrix, or None when no LoRA layer of the engine takes it."""
        if name in self._where:
            return self._where[name]
        from vllm.lora.utils import parse_fine_tuned_lora_name

        # VLLM_SOURCES vllm.lora.utils:parse_fine_tuned_lora_name ((name, weights_mapper) -> (module, is_lora_a))
        module, is_a = parse_fine_tuned_lora_name(name, self._mapper())
        found = None
        layer = self.manager.modules.get(module)
        if layer is not None:
            found = (layer, 0, is_a)
        else:
            parent, _, last = module.rpartition(".")
            for packed, parts in (self.manager.packed_modules_mapping or {}).items():
                if last in parts:
                    layer = self.manager.modules.get(f"{parent}.{packed}" if parent else packed)
                    if layer is not None:
                        found = (layer, parts.index(last), is_a)
                    break
        self._where[name] = found
        return found

    def _slot(self) -> Optional[int]:
        """The slot of the one active adapter, -1 when none is active, None when several are."""
        active = [i for i, adapter in enumerate(self.manager.lora_index_to_id) if adapter is not None]
        if len(active) > 1:
            return None
        return active[0] if active else -1

    def read(self, name: str, shape: tuple, index: torch.Tensor) -> Optional[EngineRead]:
        """The engine's values of adapter matrix ``name`` (PEFT shape ``shape``: lora_A [r, in], lora_B [out, r]) at
        the [K, 2] ``index``."""
        if self.manager is None:  # an engine without LoRA holds no adapter
            return EngineRead(missing=True)
        if len(shape) != 2:
            return None
        slot = self._slot()
        if slot is None:
            return None
        if slot < 0:
            return EngineRead(missing=True)
        where = self._locate(name)
        if where is None:
            return None
        layer, part, is_a = where
        # VLLM_SOURCES vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA (tp_size; lora_a_stacked /
        # lora_b_stacked: one [max_loras, 1, rows, cols] buffer per part, the adapter at [slot, 0, :r, :in] and
        # [slot, 0, :out, :r])
        stacked = layer.lora_a_stacked if is_a else layer.lora_b_stacked
        if int(getattr(layer, "tp_size", 1)) != 1 or part >= len(stacked):
            return None
        buffer = stacked[part][slot, 0]
        if any(int(n) > int(b) for n, b in zip(shape, buffer.shape)):
            return None
        values = buffer[index[:, 0].to(buffer.device), index[:, 1].to(buffer.device)].detach()
        if is_a:
            return EngineRead(values=values, dtype=buffer.dtype)
        # VLLM_SOURCES vllm.lora.lora_weights:LoRALayerWeights.optimize (lora_b *= scaling, in the adapter's dtype)
        values = values.to("cpu", torch.float64)
        eps = torch.finfo(buffer.dtype).eps
        atol = values.abs() * (eps * 1.01) + torch.finfo(buffer.dtype).smallest_normal
        return EngineRead(values=values, dtype=buffer.dtype, atol=atol, quantized=True)
