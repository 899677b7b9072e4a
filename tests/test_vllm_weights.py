"""vLLM's weight reader (``tim_plugins.integrations.vllm.weights.VLLMWeights``) on a live engine of the CPU build, whose
linear layers are prepacked (oneDNN / sgl: ``layer.weight`` is an empty tensor), so every linear weight is read through
the layer's own forward. The reference is the checkpoint itself, mapped onto vLLM's merged tensors by the test (q/k/v
rows stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, the vocabulary padded), and vLLM's own
``reload_weights`` as the sync: what it loads, the reader must read back exactly; what it is not given, the check must
name as stale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
safetensors = pytest.importorskip("safetensors.torch")

from tim_plugins.integrations.vllm.weights import VLLMWeights  # noqa: E402
from tim_plugins.weight_sync import SyncCheck  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def checkpoint(toy_model_path):
    tensors = {}
    for f in sorted(Path(toy_model_path).glob("*.safetensors")):
        tensors.update(safetensors.load_file(str(f)))
    return tensors


@pytest.fixture(scope="module")
def reader(vllm_llm):
    r = VLLMWeights.from_llm(vllm_llm)
    assert r is not None and r.dtype == torch.float32
    return r


def _reference(checkpoint: dict, name: str, index: torch.Tensor) -> torch.Tensor:
    return checkpoint[name][tuple(index.T)].double()


@pytest.mark.parametrize("forward_reads", [False, True])
def test_every_element_reads_back_exactly(vllm_llm, checkpoint, forward_reads):
    """Every element of every tensor, direct where a plain weight is there and through the layer's forward where it
    is prepacked (the CPU build with oneDNN / sgl kernels: ``layer.weight`` empty), or through the forward always."""
    reader = VLLMWeights.from_llm(vllm_llm, forward_reads=forward_reads)
    for name, tensor in checkpoint.items():
        index = torch.cartesian_prod(*[torch.arange(s) for s in tensor.shape]) if tensor.dim() > 1 else \
            torch.arange(tensor.shape[0]).view(-1, 1)
        read = reader.read(name, tuple(tensor.shape), index)  # every element, not a sample
        assert read is not None and not read.missing, name
        assert torch.equal(read.values, _reference(checkpoint, name, index)), name


def test_merged_rows_land_where_vllm_stacks_them(reader, checkpoint):
    """The q, k and v rows the reader maps are the rows of the stacked weight the layer computes with: its forward
    on a one-hot row equals the concatenation the test builds from the checkpoint."""
    layer = reader.model.model.layers[1].self_attn.qkv_proj
    x = torch.zeros(1, layer.input_size, dtype=torch.float32)
    x[0, 5] = 1
    column = layer.quant_method.apply(layer, x, bias=None)[0]
    stacked = torch.cat([checkpoint[f"model.layers.1.self_attn.{p}_proj.weight"][:, 5] for p in "qkv"])
    assert torch.equal(column, stacked)


def test_names_the_engine_does_not_hold_are_missing(reader):
    index = torch.zeros(1, 2, dtype=torch.long)
    assert reader.read("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 64), index).missing
    assert reader.read("model.decoder.layers.0.fc1.weight", (4, 64), index).missing


def test_a_sync_through_vllms_own_reload_is_checked(vllm_llm, reader, checkpoint):
    """Two syncs with vLLM's reload_weights (what the TRL suite's CPU sync uses): one complete, one that leaves
    layer 1 out; the check passes the first and names exactly layer 1's tensors in the second."""
    check = SyncCheck()
    record = check.begin(0)
    vllm_llm.collective_rpc("reload_weights", kwargs={
        "weights_iterator": list(record.observing(checkpoint.items())), "is_checkpoint_format": True})
    assert check.finish(record, reader).causes == []
    g = torch.Generator().manual_seed(0)
    moved = {n: t + 1e-2 * torch.randn(t.shape, generator=g) for n, t in checkpoint.items()}
    record = check.begin(1)
    sent = list(record.observing(moved.items()))
    kept = [(n, t) for n, t in sent if not n.startswith("model.layers.1.")]
    vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": kept, "is_checkpoint_format": True})
    try:
        report = check.finish(record, reader)
        (cause,) = report.causes
        assert cause.code == "sync-tensors-stale"
        assert set(cause.tensors) == {n for n in checkpoint if n.startswith("model.layers.1.")}
    finally:  # the module's engine back to the checkpoint
        vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(checkpoint.items()),
                                                          "is_checkpoint_format": True})


def test_nan_weights_loaded_into_the_engine_are_named(vllm_llm, reader, checkpoint):
    """A sync that loads NaN (a corrupted cast or scale) into vLLM: a weight read through the layer's forward (q of
    the stacked qkv) and one read directly (a norm, half NaN) are named ``differs`` with the count of sampled NaN
    values: a NaN the engine holds is its value, not an element held elsewhere. Reference: what the test loaded."""
    q, norm = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.input_layernorm.weight"
    check = SyncCheck()
    record = check.begin(0)
    sent = list(record.observing(checkpoint.items()))
    corrupt = {q: torch.full_like(checkpoint[q], float("nan")), norm: checkpoint[norm].clone()}
    corrupt[norm][::2] = float("nan")
    loaded = [(n, corrupt.get(n, t)) for n, t in sent]
    vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": loaded, "is_checkpoint_format": True})
    try:
        report = check.finish(record, reader)
        assert {c.code: set(c.tensors) for c in report.causes} == {"sync-tensors-differ": {q, norm}}
        for name in (q, norm):
            index = check.index(name, tuple(checkpoint[name].shape))
            n_nan = int(torch.isnan(corrupt[name][tuple(index.T)]).sum())
            assert n_nan > 0 and report.detail[name].startswith(f"{n_nan} of {index.shape[0]} sampled values NaN")
    finally:  # the module's engine back to the checkpoint
        vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(checkpoint.items()),
                                                          "is_checkpoint_format": True})


def test_a_workers_reader_kept_across_syncs_reads_each_sync_afresh(vllm_llm, checkpoint):
    """verl's worker keeps one reader for the run and answers each sync's requests with it
    (``worker_reads.read_requests``): the second sync's reads, through the layers' forward, are the weights loaded
    at that sync, not the first sync's (the reader caches a layer's forward output within one check). Reference:
    the tensors vLLM's reload_weights was given."""
    from tim_plugins.integrations.vllm.worker_reads import WorkerReads, read_requests, sync_requests

    reader = VLLMWeights.from_llm(vllm_llm, forward_reads=True)
    check = SyncCheck()
    g = torch.Generator().manual_seed(1)
    try:
        for step, scale in enumerate((0.0, 1e-2, 2e-2)):
            sent = {n: t + scale * torch.randn(t.shape, generator=g) for n, t in checkpoint.items()}
            record = check.begin(step)
            weights = list(record.observing(sent.items()))
            vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            requests = sync_requests(record)
            report = check.finish(record, WorkerReads(requests, [read_requests(reader, requests)]))
            assert report.causes == [] and report.bad_tensors == 0, (step, report.statuses)
            assert report.checked_tensors == len(checkpoint)
    finally:  # the module's engine back to the checkpoint
        vllm_llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(checkpoint.items()),
                                                          "is_checkpoint_format": True})


def test_a_replaced_parameter_is_read_where_it_is_now():
    """After a first read, a name is read with one gather from its module's parameter, fetched again at each read:
    a parameter the engine replaced (new storage, or another shape, as a reload that re-lays weights out does) is
    read where it is now, not from what the first read saw. Reference: the parameter itself, indexed here."""
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.arange(8, dtype=torch.float32))
    reader = VLLMWeights(model, torch.float32)
    index = torch.tensor([[1], [6], [3]])
    for _ in range(2):  # the second read takes the cached path
        read = reader.read("norm.weight", (8,), index)
        assert torch.equal(read.values.double(), torch.tensor([1.0, 6.0, 3.0], dtype=torch.float64))
    model.norm.weight = torch.nn.Parameter(torch.arange(8, dtype=torch.float32) * 10)  # new storage
    read = reader.read("norm.weight", (8,), index)
    assert torch.equal(read.values.double(), torch.tensor([10.0, 60.0, 30.0], dtype=torch.float64))
    model.norm.weight = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))  # shorter: index 6 not there
    assert reader.read("norm.weight", (8,), index) is None  # not readable: counted, never named
    model.norm.weight = torch.nn.Parameter(torch.arange(8, dtype=torch.bfloat16) - 1)
    read = reader.read("norm.weight", (8,), index)
    assert read.dtype == torch.bfloat16 and torch.equal(read.values.double(), torch.tensor([0.0, 5.0, 2.0],
                                                                                            dtype=torch.float64))


def test_a_new_sample_index_reads_its_own_elements():
    """A reader kept across a change of the check's sample (another seed, another elements_per_tensor) is handed a
    new index for a name it read before: it reads that index's elements, not the first one's. Reference: the
    parameter indexed here, each read against a fresh reader too."""
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.arange(10, dtype=torch.float32))
    model.embed = torch.nn.Module()
    model.embed.weight = torch.nn.Parameter(torch.arange(24, dtype=torch.float32).view(6, 4))
    reader = VLLMWeights(model, torch.float32)
    samples = [("norm.weight", torch.tensor([[1], [2], [3]])), ("norm.weight", torch.tensor([[7], [8], [9]])),
               ("norm.weight", torch.tensor([[0], [5]])),  # fewer elements per tensor
               ("embed.weight", torch.tensor([[0, 1], [5, 3]])), ("embed.weight", torch.tensor([[2, 2], [4, 0]])),
               ("norm.weight", torch.tensor([[1], [2], [3]]))]  # the first sample again, as a new tensor
    for name, index in samples:
        param = getattr(model, name.split(".")[0]).weight
        want = param.detach()[tuple(index.T)].double()
        for _ in range(2):  # the second read of the same index takes the cached path
            read = reader.read(name, tuple(param.shape), index)
            assert torch.equal(read.values.double(), want), (name, index.tolist())
        fresh = VLLMWeights(model, torch.float32).read(name, tuple(param.shape), index)
        assert torch.equal(fresh.values.double(), want)
