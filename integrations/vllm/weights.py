"""Read an in-process vLLM model's weights under the trainer's (HF) names: the engine side of the weight-sync check
(``tim_plugins.weight_sync.EngineWeights``).

A trainer sends ``model.layers.0.self_attn.q_proj.weight``; vLLM holds it as rows of ``qkv_proj.weight`` (the model's
``hf_to_vllm_mapper`` stacked names, else its ``packed_modules_mapping``), sharded over tensor-parallel ranks
(column-parallel layers by rows, row-parallel by columns, vocab-parallel embeddings by padded vocab ranges). For each
sent tensor the reader finds the module and the element range this rank holds, then reads the sampled elements:

- directly from the parameter when it is a plain tensor of the expected shape (norms, embeddings, GPU linear
  weights, a CPU engine that keeps plain weights);
- otherwise through the layer's own forward: ``layer.quant_method.apply(layer, x)`` with one-hot rows x gives exact
  columns of the *effective* weight, whatever the layout (the CPU build's oneDNN / sgl prepacked handle, which
  replaces ``layer.weight`` by an empty tensor) and, for an fp8 layer, its dequantized values, compared within the
  quantizer's own half-step.

A linear layer read directly is checked once against its forward read of the same columns: where they differ (a
kernel that transposes or shuffles after loading), the forward is used from then on. Whatever cannot be mapped (MoE
expert stacks, other quantization schemes) is read as None: counted as not compared, never named.

An engine with LoRA enabled wraps its linear layers (``...WithLoRA``, the layer itself as ``base_layer``): a base
weight is read from the wrapped layer, and an adapter matrix (``...lora_A.weight`` / ``lora_B.weight``) from the
adapter's slot buffers (``lora_weights.LoRAReads``).

Every vLLM internal used is named in ``sources.VLLM_SOURCES`` (``# VLLM_SOURCES <module>:<qualname>``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from tim_plugins.integrations.vllm.lora_weights import LoRAReads, is_adapter_name
from tim_plugins.weight_sync import EngineRead, ravel

__all__ = ["VLLMWeights", "engine_model"]

logger = logging.getLogger("tim_plugins.vllm")


def engine_model(llm):
    """(model, configured dtype) of an in-process ``vllm.LLM`` (colocated: ``distributed_executor_backend=
    "external_launcher"`` or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None when its model lives in another
    process."""
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine) and vllm.v1.engine.llm_engine:LLMEngine.__init__
    engine = getattr(llm, "llm_engine", None)
    # VLLM_SOURCES vllm.v1.worker.gpu_model_runner:GPUModelRunner (.model), the path TRL's colocate sync writes;
    # VLLM_SOURCES vllm.v1.worker.gpu.model_runner:GPUModelRunner (the V2 runner, the only one from 0.34: .model)
    runner = getattr(getattr(getattr(engine, "model_executor", None), "driver_worker", None), "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None:
        return None
    return model, engine.model_config.dtype


@dataclass
class _Where:
    """Where one sent tensor lives on this rank: ``module.<leaf>``; along ``dim`` of the sent tensor this rank holds
    [start, stop), at ``offset`` of the engine tensor (the part's place in a merged tensor)."""

    module: torch.nn.Module
    leaf: str
    dim: Optional[int]
    start: int
    stop: int
    offset: int
    linear: bool  # a linear layer's weight: readable through the layer's forward
    transposed: bool = False  # the trainer's tensor is the engine's transposed (HF Conv1D: [in, out])


def _class_names(obj) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


_COLUMN = "ColumnParallelLinear"  # MergedColumnParallelLinear and QKVParallelLinear are subclasses
_ROW = "RowParallelLinear"
_LINEAR = {_COLUMN, _ROW, "ReplicatedLinear"}
_VOCAB = "VocabParallelEmbedding"  # ParallelLMHead is a subclass


class VLLMWeights:
    """``EngineWeights`` of an in-process vLLM ``model`` (its ``dtype``: the engine's configured dtype)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, *, forward_reads: bool = False) -> None:
        """``forward_reads``: read every linear weight through its layer's forward, also where a plain one is
        there."""
        self.model, self.dtype, self.forward_reads = model, dtype, forward_reads
        # VLLM_SOURCES vllm.lora.layers.base:BaseLayerWithLoRA (every LoRA wrapper subclasses it; .base_layer: the layer
        # it wraps, which holds the base weight and computes with it)
        self._modules = {name: m.base_layer if "BaseLayerWithLoRA" in _class_names(m) and hasattr(m, "base_layer")
                         else m for name, m in model.named_modules()}
        self._lora = LoRAReads(model)
        self._where: dict[str, Optional[_Where] | str] = {}
        self._forward_only: set[int] = set()  # ids of modules whose direct read disagreed with their forward
        self._validated: set[int] = set()
        self._columns: dict[tuple, torch.Tensor] = {}  # (module id, columns) -> forward output, within one check
        self._plans: dict[str, tuple] = {}  # name -> (the index it was planned for, its plan)
        self._flat: dict[str, tuple] = {}  # name -> (local index, parameter shape, device, flat positions)
        # name -> (index, module, leaf, parameter shape, flat positions): a whole, plain parameter read directly
        self._direct: dict[str, tuple] = {}
        # some linear weight was sent as the transpose of its layer's (HF Conv1D, GPT-2: vLLM's loader transposes
        # it): a square one could be either way, so it is not read
        self._transposed_seen = False

    def plan_reads(self, shapes: dict) -> None:
        """Map every tensor of a check ({name: shape}) before the first read: a transposed weight anywhere in the
        model decides how its square weights are read, whatever order they are read in."""
        for name, shape in shapes.items():
            if not is_adapter_name(name):
                self._locate(name, tuple(shape))

    def fresh_read(self) -> None:
        """A new check: the engine's weights may have changed since the cached forward reads."""
        self._columns.clear()

    @classmethod
    def from_llm(cls, llm, **options) -> Optional["VLLMWeights"]:
        found = engine_model(llm)
        return cls(*found, **options) if found is not None else None

    # ------------------------------------------------------------------------------------------ names
    def _map(self, name: str) -> tuple[str, object]:
        """(vLLM parameter name, shard id or None) of HF name ``name``: the model's own mapper, else its
        ``packed_modules_mapping``."""
        # VLLM_SOURCES vllm.model_executor.models.utils:WeightsMapper._map_name_with_shard (stacked names, vLLM >=
        # 0.31); the models' packed_modules_mapping otherwise
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
            found = mapper._map_name_with_shard(name)
            if found is None:
                return "", None
            mapped, shard = found
            if shard is not None:
                return mapped, shard[0] if isinstance(shard, list) else shard
            name = mapped
        elif mapper is not None and hasattr(mapper, "_map_name"):
            name = mapper._map_name(name) or ""
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        for packed, parts in (getattr(self.model, "packed_modules_mapping", None) or {}).items():
            if last == packed:  # the trainer holds the merged tensor whole (Phi-3's qkv_proj, gate_up_proj)
                return name, None
            if last in parts:
                shard = parts.index(last)
                target = self._modules.get(f"{parent}.{packed}" if parent else packed)
                if target is not None and "QKVParallelLinear" in _class_names(target):
                    shard = "qkv"[shard]
                return f"{parent}.{packed}.{leaf}" if parent else f"{packed}.{leaf}", shard
        return name, None

    def _locate(self, name: str, shape: tuple) -> Optional[_Where] | str:
        """The ``_Where`` of a sent tensor, "missing" when the engine has no such module or parameter, None when it
        cannot be mapped (an unknown layout)."""
        if name in self._where:
            return self._where[name]
        mapped, shard = self._map(name)
        module_name, _, leaf = mapped.rpartition(".")
        module = self._modules.get(module_name)
        where: Optional[_Where] | str
        if not mapped or module is None or not isinstance(getattr(module, leaf, None), torch.Tensor):
            where = None if self._in_experts(mapped or name) else "missing"
        else:
            try:
                where = self._oriented(module, leaf, shard, shape)
            except Exception as err:  # an unknown layout is not compared, never named
                logger.info("tim_plugins: cannot map %s onto the vLLM engine: %r", name, err)
                where = None
        self._where[name] = where
        return where

    def _in_experts(self, name: str) -> bool:
        """Whether an ancestor module of ``name`` stacks MoE experts: a trainer's per-expert tensor
        (``mlp.experts.3.gate_proj.weight``) has no module of its own in the engine, whose ``FusedMoE`` holds every
        expert of the layer in one ``w13_weight`` / ``w2_weight``. Not mapped in this version, so not compared."""
        parts = name.split(".")
        return any("FusedMoE" in _class_names(module) for k in range(len(parts) - 1, 0, -1)
                   if (module := self._modules.get(".".join(parts[:k]))) is not None)

    def _oriented(self, module, leaf: str, shard, shape: tuple) -> Optional[_Where]:
        """``_shard`` of a sent tensor, in the engine's orientation: a linear weight whose columns are not the
        layer's input but whose rows are was sent transposed (HF Conv1D, [in, out]; vLLM's GPT-2 loader transposes
        it), so its element [i, j] is the engine's [j, i]; None where neither dimension is the layer's input."""
        # VLLM_SOURCES vllm.model_executor.layers.linear:LinearBase (input_size: the full input width)
        width = getattr(module, "input_size", None)
        is_linear = leaf == "weight" and len(shape) == 2 and bool(_class_names(module) & _LINEAR)
        if not is_linear or width is None or int(shape[1]) == int(width):
            return self._shard(module, leaf, shard, shape)
        if int(shape[0]) != int(width):
            return None  # an unknown layout: not compared
        if not self._transposed_seen:
            self._transposed_seen = True
            self._direct.clear()  # a square weight read directly before is not read any more
        where = self._shard(module, leaf, shard, (shape[1], shape[0]))
        if where is not None:
            where.transposed = True
        return where

    @staticmethod
    def _shard(module, leaf: str, shard, shape: tuple) -> Optional[_Where]:
        names = _class_names(module)
        linear = leaf == "weight" and len(shape) == 2 and (_COLUMN in names or _ROW in names
                                                           or "ReplicatedLinear" in names)
        if _COLUMN in names:
            # VLLM_SOURCES vllm.model_executor.layers.linear:ColumnParallelLinear (tp_rank, tp_size, output_sizes /
            # output_size) and VLLM_SOURCES vllm.model_executor.layers.linear:QKVParallelLinear
            # (_get_shard_offset_mapping, _get_shard_size_mapping, num_kv_head_replicas)
            tp_rank, tp_size = int(module.tp_rank), int(module.tp_size)
            merged = "QKVParallelLinear" in names or len(getattr(module, "output_sizes", None) or ()) > 1
            if shard is None and merged and tp_size > 1:
                return None  # sent whole, each part split over the ranks on its own: no one range of rows
            if shard is None:
                size = int(shape[0]) // tp_size
                return _Where(module, leaf, 0, tp_rank * size, (tp_rank + 1) * size, 0, linear)
            if isinstance(shard, str):  # q / k / v of a QKV layer
                size = int(module._get_shard_size_mapping(shard))
                offset = int(module._get_shard_offset_mapping(shard))
                rank = tp_rank if shard == "q" else tp_rank // int(module.num_kv_head_replicas)
                return _Where(module, leaf, 0, rank * size, (rank + 1) * size, offset, linear)
            parts = [int(s) // tp_size for s in module.output_sizes]
            span = shard if isinstance(shard, tuple) else (shard,)
            offset, size = sum(parts[:span[0]]), sum(parts[i] for i in span)
            return _Where(module, leaf, 0, tp_rank * size, (tp_rank + 1) * size, offset, linear)
        if _ROW in names:
            # VLLM_SOURCES vllm.model_executor.layers.linear:RowParallelLinear (tp_rank, tp_size; the bias whole)
            if leaf != "weight" or len(shape) != 2:
                return _Where(module, leaf, None, 0, int(shape[0]), 0, False)
            tp_rank, tp_size = int(module.tp_rank), int(module.tp_size)
            size = int(shape[1]) // tp_size
            return _Where(module, leaf, 1, tp_rank * size, (tp_rank + 1) * size, 0, linear)
        if _VOCAB in names:
            # VLLM_SOURCES vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding (shard_indices)
            s = module.shard_indices
            return _Where(module, leaf, 0, int(s.org_vocab_start_index), int(s.org_vocab_end_index), 0, False)
        if "FusedMoE" in names:
            return None  # experts stacked per layer: not mapped in this version
        return _Where(module, leaf, None, 0, int(shape[0]) if shape else 0, 0, linear)

    # ------------------------------------------------------------------------------------------ values
    def _plan(self, name: str, shape: tuple, index: torch.Tensor):
        """(where, local index [K, ndim], held [K], all held, the largest local index per dimension) of a sent
        tensor's sampled elements, computed once per tensor (the check hands the same index at every sync)."""
        cached = self._plans.get(name)
        if cached is not None and cached[0] is index:
            return cached[1]
        where = self._locate(name, tuple(shape))
        plan = where
        if isinstance(where, _Where):
            engine_index = index[:, [1, 0]] if where.transposed else index  # the engine's [row, column]
            local = engine_index.long().clone()
            held = torch.ones(index.shape[0], dtype=torch.bool)
            if where.dim is not None:
                along = engine_index[:, where.dim].long()
                held = (along >= where.start) & (along < where.stop)
                local[:, where.dim] = along - where.start + where.offset
            rows = local[held]
            top = [int(rows[:, d].max()) if rows.numel() else -1 for d in range(rows.shape[1])]
            plan = (where, local, held, bool(held.all()), top)
        self._plans[name] = (index, plan)
        return plan

    def _take_index(self, name: str, local: torch.Tensor, held: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The held elements' flat positions in ``param`` (on its device), for ``torch.take``: built once per
        tensor, sample index (its plan's ``local``, by identity as ``_plan`` keys on the index) and parameter
        shape."""
        shape = tuple(param.shape)
        cached = self._flat.get(name)
        if cached is None or cached[0] is not local or cached[1] != shape or cached[2] != param.device:
            cached = self._flat[name] = (local, shape, param.device, ravel(local[held], shape).to(param.device))
        return cached[3]

    def read(self, name: str, shape: tuple, index: torch.Tensor) -> Optional[EngineRead]:
        if is_adapter_name(name):
            return self._lora.read(name, tuple(shape), index)
        fast = self._direct.get(name)
        if fast is not None and fast[0] is index:  # a plain parameter read before: one gather
            _, module, leaf, pshape, flat = fast
            param = getattr(module, leaf)
            if param.shape == pshape and param.device == flat.device:
                return EngineRead(values=torch.take(param.detach(), flat), dtype=param.dtype)
        plan = self._plan(name, tuple(shape), index)
        if plan is None:
            return None
        if plan == "missing":
            return EngineRead(missing=True)
        where, local, held, all_held, top = plan
        if not all_held and not held.any():
            return None
        if where.linear and self._transposed_seen and not where.transposed and shape[0] == shape[1]:
            return None  # in a model that takes some weights transposed, a square one's orientation is unknown
        module = where.module
        if where.linear and self._quantized(module):
            return self._forward_read(module, local, held, quantized=True)
        param = getattr(module, where.leaf)
        direct = param.dim() == len(shape) and param.numel() > 0 and all(
            t < n for t, n in zip(top, param.shape))
        if where.linear and (not direct or self.forward_reads or id(module) in self._forward_only):
            return self._forward_read(module, local, held, quantized=False)
        if not direct:
            return None
        gathered = torch.take(param.detach(), self._take_index(name, local, held, param))
        if all_held:
            values = gathered  # in the stored dtype, on the engine's device: the check converts all reads at once
        else:
            values = torch.full((index.shape[0],), float("nan"), dtype=torch.float64)
            values[held] = gathered.to("cpu", torch.float64)
        mask = None if all_held else held.to("cpu").clone()
        if where.linear and id(module) not in self._validated:
            self._validated.add(id(module))
            through = self._forward_read(module, local, held, quantized=False)
            mine = values.to("cpu", torch.float64)[held]
            same = through is not None and torch.allclose(through.values[held], mine, rtol=0.0, atol=0.0,
                                                          equal_nan=True)  # exact, a NaN equal to a NaN
            if not same:
                logger.info("tim_plugins: %s: the weight vLLM holds is not what its layer computes with; reading "
                            "it through the layer's forward", name)
                self._forward_only.add(id(module))
                return through
        if all_held:
            self._direct[name] = (index, module, where.leaf, param.shape, self._take_index(name, local, held, param))
        return EngineRead(values=values, dtype=param.dtype, held=mask)

    @staticmethod
    def _quantized(module) -> bool:
        # VLLM_SOURCES vllm.model_executor.layers.linear:UnquantizedLinearMethod
        return type(getattr(module, "quant_method", None)).__name__ != "UnquantizedLinearMethod"

    def _forward_read(self, module, local: torch.Tensor, held: torch.Tensor, *, quantized: bool
                      ) -> Optional[EngineRead]:
        """Elements (row, column) of a linear layer's effective weight: one one-hot input row per distinct column
        through ``quant_method.apply`` (no bias), whose output row is that column of W."""
        if not held.any():
            return None
        # VLLM_SOURCES vllm.model_executor.layers.linear:LinearBase (quant_method.apply(layer, x, bias=None)) and
        # the local input size a one-hot row spans (input_size_per_partition, else input_size)
        width = int(getattr(module, "input_size_per_partition", getattr(module, "input_size", 0)))
        rows, cols = local[held, 0], local[held, 1]
        # checked on the host before any index reaches the device: there an index out of range is a device-side
        # assert that ends the process, not an error the check can count
        if width <= 0 or int(cols.min()) < 0 or int(cols.max()) >= width or int(rows.min()) < 0:
            return None
        unique, position = torch.unique(cols, return_inverse=True)
        bound = None
        if quantized:
            bound = self._quantizer_bound(module)
            if bound is None:
                return None
        device = next((p.device for p in module.parameters() if p.numel()), torch.device("cpu"))
        key = (id(module), tuple(unique.tolist()))
        y = self._columns.get(key)
        if y is None:  # the parts of a merged matrix share their sampled columns: one forward for all of them
            # an unquantized layer computes in its weight's dtype (vLLM keeps MoE router gates in fp32 inside a
            # bf16 engine); a quantized one takes the engine's activations
            weight = getattr(module, "weight", None)
            dtype = (weight.dtype if not quantized and isinstance(weight, torch.Tensor)
                     and weight.dtype.is_floating_point else self.dtype)
            x = torch.zeros(unique.numel(), width, dtype=dtype, device=device)
            x[torch.arange(unique.numel(), device=device), unique.to(device)] = 1
            with torch.no_grad():
                y = self._columns[key] = module.quant_method.apply(module, x, bias=None)
        if y.dim() != 2 or int(rows.max()) >= y.shape[1]:
            return None
        values = torch.full((local.shape[0],), float("nan"), dtype=torch.float64)
        values[held] = y[position.to(device), rows.to(device)].to("cpu", torch.float64)
        mask = None if bool(held.all()) else held.to("cpu").clone()
        if not quantized:
            return EngineRead(values=values, dtype=y.dtype, held=mask)
        stored, scale = bound
        return EngineRead(values=values, dtype=stored, quantized=True, held=mask,
                          atol=_half_step(values, stored, scale, y.dtype))

    @staticmethod
    def _quantizer_bound(module) -> Optional[tuple[torch.dtype, torch.Tensor]]:
        """(stored dtype, per-output-row scale) of an fp8 layer with a per-tensor or per-channel ``weight_scale``;
        None for other schemes (not compared)."""
        weight = getattr(module, "weight", None)
        scale = getattr(module, "weight_scale", None)
        if weight is None or scale is None or weight.dtype not in _FP8:
            return None
        return weight.dtype, scale.detach().float().reshape(-1).cpu()


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _half_step(values: torch.Tensor, stored: torch.dtype, scale: torch.Tensor,
               read: torch.dtype = torch.float32) -> torch.Tensor:
    """The bound on |trainer value − value read| of a quantized weight read through its forward, whose output is in
    ``read`` (the engine's activations): half a quantization step at the value, |v| · 2^-(mantissa bits + 1), plus
    two roundings to ``read``, |v| · eps(read) (the forward's output, and a weight the engine loaded in its own dtype
    before quantizing it online), all relative to the dequantized value, within a 2^-7 margin of |v|; and at least
    half the smallest subnormal times the largest scale (a conservative bound when the per-row scale is not
    mapped)."""
    mantissa = {"float8_e4m3fn": 3, "float8_e5m2": 2}[str(stored).replace("torch.", "")]
    tiny = torch.finfo(stored).smallest_normal * 2.0 ** -mantissa
    floor = float(scale.max()) * tiny / 2
    relative = (2.0 ** -(mantissa + 1) + torch.finfo(read).eps) * (1 + 2.0 ** -7)
    return torch.nan_to_num(values.abs() * relative, nan=0.0) + floor
