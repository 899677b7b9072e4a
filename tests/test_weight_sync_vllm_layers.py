"""vLLM's weight reader (``VLLMWeights``) on vLLM's own linear layers, built here without an engine (a stand-in
tensor-parallel group of the size a test asks for) and loaded through their own ``weight_loader``: fused q/k/v and
gate/up tensors sent whole (Phi-3's checkpoint, vLLM's ``Phi3ForCausalLM`` name mapping), HF Conv1D weights that
vLLM's GPT-2 loader transposes, and a router gate kept in fp32 inside a bf16 engine. The reference is the trainer's
tensor indexed here at the check's sample, and the faults the test injects."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from tim_plugins.integrations.vllm.weights import VLLMWeights  # noqa: E402
from tim_plugins.weight_sync import SyncCheck  # noqa: E402

pytestmark = pytest.mark.vllm

H, NQ, NKV, D, INTER = 64, 4, 2, 16, 96


def _layers(tp_rank: int = 0, tp_size: int = 1):
    """vLLM's linear layer classes, built under a stand-in tensor-parallel group of ``tp_size`` ranks."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear

    group = types.SimpleNamespace(rank_in_group=tp_rank, world_size=tp_size)
    return linear, mock.patch.object(parallel_state, "get_tp_group", lambda: group), set_current_vllm_config(
        VllmConfig())


def _finish_loading(layer, prepacked: bool) -> None:
    """``prepacked``: vLLM's CPU processing (the weight replaced by a packed handle: read through the forward);
    otherwise the plain weight kept and the forward as on a GPU (``F.linear``)."""
    if prepacked:
        layer.quant_method.process_weights_after_loading(layer)
    else:
        layer.cpu_linear = torch.nn.functional.linear


def _phi3(tp_rank=0, tp_size=1, prepacked=False):
    from vllm.model_executor.models.phi3 import Phi3ForCausalLM

    linear, group, config = _layers(tp_rank, tp_size)
    model = torch.nn.Module()
    model.hf_to_vllm_mapper = Phi3ForCausalLM.hf_to_vllm_mapper
    model.packed_modules_mapping = Phi3ForCausalLM.packed_modules_mapping
    with group, config:
        attn, mlp = torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = linear.QKVParallelLinear(H, D, NQ, NKV, bias=False, params_dtype=torch.bfloat16)
        mlp.gate_up_proj = linear.MergedColumnParallelLinear(H, [INTER, INTER], bias=False,
                                                             params_dtype=torch.bfloat16)
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    model.layers = torch.nn.ModuleList([layer])
    return model


PHI3_NAMES = {"layers.0.self_attn.qkv_proj.weight": "qkv_proj", "layers.0.mlp.gate_up_proj.weight": "gate_up_proj"}


def _phi3_sync(model, weights: dict, prepacked: bool, corrupt: bool):
    check = SyncCheck()
    reader = VLLMWeights(model, torch.bfloat16)
    record = check.begin(1)
    for name, tensor in record.observing(list(weights.items())):  # the fused tensor whole: vLLM splits it itself
        layer = model.get_submodule(name.rpartition(".")[0])
        layer.weight_loader(layer.weight, tensor)
    attn, mlp = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    if corrupt:
        attn.weight.data[NQ * D:] = 0.5  # k and v rows
        mlp.weight.data[INTER:] = 0.5  # up rows
    for layer in (attn, mlp):
        _finish_loading(layer, prepacked)
    return check, reader, check.finish(record, reader)


@pytest.mark.parametrize("prepacked", [False, True])
def test_a_fused_qkv_and_gate_up_sent_whole_are_read_row_for_row(prepacked):
    """Every sampled row of the fused tensor, the k / v and up rows included, reads back as the trainer's value in
    bf16; a fault in the k / v or up rows alone is named."""
    g = torch.Generator().manual_seed(0)
    weights = {"layers.0.self_attn.qkv_proj.weight": torch.randn((NQ + 2 * NKV) * D, H, generator=g) * 0.02,
               "layers.0.mlp.gate_up_proj.weight": torch.randn(2 * INTER, H, generator=g) * 0.02}
    check, reader, report = _phi3_sync(_phi3(prepacked=prepacked), weights, prepacked, corrupt=False)
    assert report.causes == [] and report.statuses == {n: "ok" for n in weights}
    for name, tensor in weights.items():
        index = check.index(name, tuple(tensor.shape))
        assert int((index[:, 0] >= tensor.shape[0] // 2).sum()) > 0  # rows of the later parts are sampled
        read = reader.read(name, tuple(tensor.shape), index)
        assert read.held is None
        assert torch.equal(read.values.double(), tensor.to(torch.bfloat16)[tuple(index.T)].double())
    _, _, report = _phi3_sync(_phi3(prepacked=prepacked), weights, prepacked, corrupt=True)
    assert report.statuses == {n: "differs" for n in weights}
    assert [c.code for c in report.causes] == ["sync-tensors-differ"]


def test_a_fused_tensor_on_a_tensor_parallel_engine_is_unread_not_a_partial_shard():
    """Over 2 ranks each part of the fused tensor is split on its own: no one row range is this rank's, so the
    tensor is counted unread rather than compared in part."""
    model = _phi3(tp_rank=1, tp_size=2)
    reader, check = VLLMWeights(model, torch.bfloat16), SyncCheck()
    for name in PHI3_NAMES:
        rows = (NQ + 2 * NKV) * D if "qkv" in name else 2 * INTER
        assert reader.read(name, (rows, H), check.index(name, (rows, H))) is None


def _gpt2(prepacked: bool):
    """GPT-2's layers as vLLM builds them ([out, in]), named as its HF checkpoint (the reader maps no names)."""
    linear, group, config = _layers()
    model = torch.nn.Module()
    with group, config:
        block, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        attn.c_attn = linear.QKVParallelLinear(H, H // NQ, NQ, bias=True, params_dtype=torch.bfloat16)
        attn.c_proj = linear.RowParallelLinear(H, H, bias=True, params_dtype=torch.bfloat16)
        mlp.c_fc = linear.ColumnParallelLinear(H, 4 * H, bias=True, params_dtype=torch.bfloat16)
        mlp.c_proj = linear.RowParallelLinear(4 * H, H, bias=True, params_dtype=torch.bfloat16)
    block.attn, block.mlp = attn, mlp
    model.h = torch.nn.ModuleList([block])
    return model


@pytest.mark.parametrize("prepacked", [False, True])
def test_hf_conv1d_weights_are_read_in_the_engines_orientation(prepacked):
    """HF Conv1D holds [in, out]; vLLM's GPT-2 loader transposes into [out, in] (its own ``_transpose_conv1d``). A
    correct sync names nothing: a non-square weight reads back as the trainer's [i, j], the square one (either
    orientation fits it) is counted unread, never compared transposed."""
    from vllm.model_executor.models.gpt2 import GPT2Model

    g = torch.Generator().manual_seed(1)
    shapes = {"h.0.attn.c_attn.weight": (H, 3 * H), "h.0.attn.c_attn.bias": (3 * H,),
              "h.0.attn.c_proj.weight": (H, H), "h.0.mlp.c_fc.weight": (H, 4 * H), "h.0.mlp.c_fc.bias": (4 * H,),
              "h.0.mlp.c_proj.weight": (4 * H, H)}
    square = "h.0.attn.c_proj.weight"
    weights = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    for order in (list(weights), [square, *[n for n in weights if n != square]]):  # the square one read first too
        model = _gpt2(prepacked)
        check, reader = SyncCheck(), VLLMWeights(model, torch.bfloat16)
        record = check.begin(0)
        for name, tensor in GPT2Model._transpose_conv1d(None, record.observing([(n, weights[n]) for n in order])):
            layer = model.get_submodule(name.rpartition(".")[0])
            param = getattr(layer, name.rpartition(".")[2])
            param.weight_loader(param, tensor) if hasattr(param, "weight_loader") else layer.weight_loader(param,
                                                                                                          tensor)
        for layer in (model.h[0].attn.c_attn, model.h[0].attn.c_proj, model.h[0].mlp.c_fc, model.h[0].mlp.c_proj):
            _finish_loading(layer, prepacked)
        report = check.finish(record, reader)
        assert report.causes == []
        assert report.statuses == {n: ("unread" if n == square else "ok") for n in order}
        for name, tensor in weights.items():
            if name == square:
                continue
            index = check.index(name, tuple(tensor.shape))
            read = reader.read(name, tuple(tensor.shape), index)
            assert torch.equal(read.values.double(), tensor.to(torch.bfloat16)[tuple(index.T)].double()), name


def test_a_forward_read_out_of_the_layers_range_is_not_made():
    """Indices past the layer's input width or output rows are refused before they reach the device (where an index
    out of range is a device-side assert that ends the process): no read, counted."""
    linear, group, config = _layers()
    with group, config:
        layer = linear.ReplicatedLinear(H, 8, bias=False, params_dtype=torch.bfloat16)
    layer.weight_loader(layer.weight, torch.randn(8, H, generator=torch.Generator().manual_seed(4)))
    _finish_loading(layer, False)
    reader = VLLMWeights(torch.nn.Module(), torch.bfloat16)
    held = torch.ones(2, dtype=torch.bool)
    assert reader._forward_read(layer, torch.tensor([[0, 1], [3, H]]), held, quantized=False) is None  # column
    assert reader._forward_read(layer, torch.tensor([[0, 1], [8, 2]]), held, quantized=False) is None  # row
    read = reader._forward_read(layer, torch.tensor([[0, 1], [7, H - 1]]), held, quantized=False)
    assert torch.equal(read.values.double(), layer.weight.detach()[[0, 7], [1, H - 1]].double())


def test_an_fp32_gate_inside_a_bf16_engine_is_read_through_its_forward():
    """vLLM keeps MoE router gates in fp32 in a bf16 engine; on a GPU its forward is ``F.linear``, which takes no
    bf16 input for an fp32 weight: the one-hot rows are built in the layer's dtype."""
    linear, group, config = _layers()
    with group, config:
        gate = linear.ReplicatedLinear(H, 8, bias=False, params_dtype=torch.float32)
        proj = linear.ReplicatedLinear(H, H, bias=False, params_dtype=torch.bfloat16)
    model = torch.nn.Module()
    model.gate, model.proj = gate, proj
    g = torch.Generator().manual_seed(2)
    weights = {"gate.weight": torch.randn(8, H, generator=g), "proj.weight": torch.randn(H, H, generator=g)}
    check, reader = SyncCheck(), VLLMWeights(model, torch.bfloat16, forward_reads=True)
    record = check.begin(0)
    for name, tensor in record.observing(list(weights.items())):
        layer = getattr(model, name.split(".")[0])
        layer.weight_loader(layer.weight, tensor)
    for layer in (gate, proj):
        _finish_loading(layer, False)
    report = check.finish(record, reader)
    assert report.causes == [] and report.statuses == {n: "ok" for n in weights}
    index = check.index("gate.weight", (8, H))
    read = reader.read("gate.weight", (8, H), index)
    assert read.dtype == torch.float32
    assert torch.equal(read.values.double(), weights["gate.weight"][tuple(index.T)].double())


class FusedMoE(torch.nn.Module):
    """vLLM's MoE layer as the reader sees it (it maps modules by class name; the CPU build has no FusedMoE): every
    expert of a layer in one ``w13_weight`` [E, 2I, H] (gate and up rows) and one ``w2_weight`` [E, H, I]."""

    def __init__(self, experts: int, hidden: int, inter: int):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16),
                                             requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, inter, dtype=torch.bfloat16),
                                            requires_grad=False)


def test_moe_experts_stacked_in_the_engine_are_not_compared_and_never_named_missing():
    """A trainer sends each expert's gate/up/down (``mlp.experts.3.gate_proj.weight``); vLLM's Qwen3-MoE name
    mapping leaves the name as is or packs it, and no module of that name exists: the layer's FusedMoE holds them
    all. Not mapped, so not compared (unread), never named missing; a name outside the experts still is."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    E, I = 4, 16
    model = torch.nn.Module()
    model.hf_to_vllm_mapper = Qwen3MoeForCausalLM.hf_to_vllm_mapper
    model.packed_modules_mapping = dict(Qwen3MoeForCausalLM.packed_modules_mapping)
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    mlp = model.model.layers[0].mlp = torch.nn.Module()
    mlp.experts = FusedMoE(E, H, I)
    g = torch.Generator().manual_seed(5)
    weights = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.randn(shape, generator=g)
               for e in range(E) for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    for e in range(E):  # the engine loads them as vLLM's expert loader does: a healthy sync
        mlp.experts.w13_weight.data[e, :I] = weights[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
        mlp.experts.w13_weight.data[e, I:] = weights[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        mlp.experts.w2_weight.data[e] = weights[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
    weights["model.layers.0.mlp.shared_gate.weight"] = torch.randn(1, H, generator=g)  # no such module anywhere
    check = SyncCheck()
    record = check.begin(1)
    for _ in record.observing(list(weights.items())):
        pass
    report = check.finish(record, VLLMWeights(model, torch.bfloat16))
    experts = {n: "unread" for n in weights if ".experts." in n}
    assert report.statuses == {**experts, "model.layers.0.mlp.shared_gate.weight": "missing"} and len(experts) == 3 * E
    assert [c.code for c in report.causes] == ["sync-tensors-missing"]
    assert "shared_gate" in report.causes[0].message and "experts" not in report.causes[0].message


class _FP8Linear:
    """vLLM's fp8 linear method as the reader meets it (the CPU build has none): a weight held in float8_e4m3fn
    with a per-output-channel ``weight_scale``, whose forward dequantizes and multiplies in the activations' dtype,
    so a one-hot row reads the dequantized value rounded to that dtype."""

    def apply(self, layer, x, bias=None):
        return x @ (layer.weight.float() * layer.weight_scale.float()[:, None]).to(x.dtype).T


def test_a_healthy_sync_into_an_fp8_engine_names_nothing():
    """The trainer's fp32 values quantized by round to nearest (per-channel scale amax / 448) and read through a
    bf16 forward: each read value is within half an fp8 step plus the bf16 rounding of the output (about one read
    in 800 is further than the half step alone), so a healthy sync names nothing, step after step; a tensor the
    sync skips after the step is still named stale."""
    from tim_plugins.weight_sync import SyncCheckConfig

    linear, group, config = _layers()
    model = torch.nn.Module()
    names = [f"layers.{i}.proj.weight" for i in range(8)]
    with group, config:
        for i in range(8):
            setattr(model, f"l{i}", linear.ReplicatedLinear(H, 4 * H, bias=False, params_dtype=torch.bfloat16))
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(8)])
    for i, layer in enumerate(model.layers):
        layer.proj = getattr(model, f"l{i}")
        layer.proj.quant_method = _FP8Linear()
    del model.l0, model.l1, model.l2, model.l3, model.l4, model.l5, model.l6, model.l7

    def load(weights, skip=()):
        for name, t in weights:
            if name in skip:
                continue
            layer = model.get_submodule(name.rpartition(".")[0])
            scale = t.abs().amax(dim=1, keepdim=True).float() / 448.0
            layer.weight = torch.nn.Parameter((t.float() / scale).to(torch.float8_e4m3fn), requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale.reshape(-1), requires_grad=False)

    g = torch.Generator().manual_seed(9)
    weights = {n: torch.randn(4 * H, H, generator=g) * 0.02 for n in names}
    check = SyncCheck(SyncCheckConfig(elements_per_tensor=4 * H * 16, columns_per_tensor=16))
    reader = VLLMWeights(model, torch.bfloat16)
    for step in range(3):
        record = check.begin(step)
        load(record.observing(list(weights.items())))
        report = check.finish(record, reader)
        assert report.causes == [] and set(report.statuses.values()) == {"ok"}, (step, report.detail)
        for t in weights.values():
            t.add_(torch.randn(t.shape, generator=g) * 2e-3)
    record = check.begin(3)
    load(record.observing(list(weights.items())), skip={names[2]})
    report = check.finish(record, reader)
    assert [(c.code, c.tensors) for c in report.causes] == [("sync-tensors-stale", (names[2],))]
