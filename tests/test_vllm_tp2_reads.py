"""The weight-sync check's reads of a tensor-parallel vLLM engine: a real CPU engine with ``tensor_parallel_size=2``
(two worker processes, each holding its shard), read the way an out-of-process engine is read in production (verl's
rollout server): ``collective_rpc`` to every worker, which answers with ``worker_reads.read_requests`` over
``weights.VLLMWeights`` of its own model (``_shard``: the rows of column-parallel q/k/v and gate/up, the columns of
row-parallel o/down, the padded vocabulary range of the embedding and lm_head, replicated norms and kv heads), and
``worker_reads.WorkerReads`` merging the two answers element by element.

The engine runs in a child process (tests/vllm_tp2_run.py, bounded, its process group killed at the end): vLLM's
multiprocess executor, the engine core in its own process (every call crosses msgpack). Two engines:
- ``toy-fp32``: the toy model (2 heads, 1 KV head, so the KV head is replicated on both ranks; vocabulary 383, odd,
  padded by vLLM to 384: 192 rows per rank, the last one padding), float32;
- ``gqa-bf16``: the toy model's config widened to 4 heads and 2 KV heads (one KV head per rank, not replicated),
  random weights, engine in bfloat16 (the values compared are the checkpoint's cast to bfloat16; vLLM's CPU GEMM
  keeps the q/k/v biases in float32 after loading them in bfloat16, and its reload then writes them in float32).

References, independent of the reader: the checkpoint's tensors read here (safetensors), cast to the engine's dtype,
at every element of every tensor, for each worker's own answer (the elements it says it holds) and for the merged one;
which tensors are sharded (every one but the norms and, where KV heads are replicated, k/v) from the model's config;
and for the syncs, the trainer's tensors this test wrote and the faults it chose: a sync through vLLM's own
``reload_weights`` that loads everything is checked clean; one that leaves layer 1 out names exactly layer 1's
tensors stale (their values the previous sync's); on the float32 engine, one that loads five tensors of five layouts
rounded through bfloat16 names exactly those five ``sync-precision`` (their values the rounded ones).

Each sync is vLLM's ``reload_weights`` in each worker, of the trainer's tensors from a file the test wrote (tensors
cannot cross ``LLM.collective_rpc`` to a multiprocess engine's workers), observed by the check as the trainer sends.

Cost on the shared 2-core machine: each engine's run 33-45 s (its start, three processes importing vLLM, 25-35 s;
the reads and syncs ~2 s), the module 80-95 s, with another test process on the same cores.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
safetensors = pytest.importorskip("safetensors.torch")

from bounded import run_bounded  # noqa: E402

from tim_plugins.integrations.vllm.worker_reads import WorkerReads, decode_read  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("vllm_tp2_run.py")
TIMEOUT_S = 400  # ~40 s idle per engine; several times that under other load
TP = 2
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: the vocabulary is padded to a multiple of it, then split
LAYER_1 = "model.layers.1."
# one tensor of each layout, loaded rounded through bfloat16 into the float32 engine
ROUNDED = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
           "model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight")
ENGINES = {"toy-fp32": torch.float32, "gqa-bf16": torch.bfloat16}


def _load(path: Path) -> dict:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors.load_file(str(f)))
    return tensors


def _gqa_model(toy: Path, path: Path) -> Path:
    """The toy model's config with 4 attention heads and 2 KV heads (hidden 128, head_dim 32, intermediate 192, the
    toy vocabulary), random weights (the q/k/v biases too), the toy tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_pretrained(toy)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 128, 4, 2
    config.intermediate_size = 192
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # biases are initialised to zeros: values that bfloat16 rounds instead
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(toy).save_pretrained(path)
    return path


def _omp_bind() -> str:
    """One half of the CPUs this process may use per worker (vLLM's automatic binding wants a NUMA node per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < TP:
        return "nobind"
    half = len(cpus) // TP
    return "|".join(",".join(map(str, cpus[i * half:(i + 1) * half])) for i in range(TP))


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, toy_model_path, tmp_path_factory):
    dtype = ENGINES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    model = Path(toy_model_path) if request.param == "toy-fp32" else _gqa_model(Path(toy_model_path), work / "model")
    checkpoint = _load(model)
    faults = [{"drop": [], "bf16": []}, {"drop": [n for n in checkpoint if n.startswith(LAYER_1)], "bf16": []}]
    if dtype == torch.float32:
        faults.append({"drop": [], "bf16": list(ROUNDED)})
    syncs = []
    for i, fault in enumerate(faults):
        g = torch.Generator().manual_seed(i)
        sent = {n: (t + 1e-2 * torch.randn(t.shape, generator=g)).contiguous() for n, t in checkpoint.items()}
        safetensors.save_file(sent, str(work / f"sync_{i}.safetensors"))
        (work / f"sync_{i}.json").write_text(json.dumps(fault))
        syncs.append((sent, fault))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would replace the KV size
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND=_omp_bind(),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(RUNNER.parent), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-u", str(RUNNER), "--model", str(model), "--dtype", str(dtype).replace("torch.", ""),
           "--syncs", str(work), "--out", str(work / "out.json")]
    t0 = time.time()
    proc, timed_out = run_bounded(cmd, TIMEOUT_S, cwd=ROOT, env=env)
    if timed_out:
        pytest.fail(f"ran past {TIMEOUT_S} s and was killed:\n{proc.stdout[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}:\n{proc.stdout[-6000:]}")
    out = json.loads((work / "out.json").read_text())
    print(f"\n[vllm tp2 {request.param}] {time.time() - t0:.0f} s wall, engine start {out['start_s']:.0f} s")
    config = json.loads((model / "config.json").read_text())
    return SimpleNamespace(name=request.param, dtype=dtype, checkpoint=checkpoint, syncs=syncs, out=out,
                           config=config)


def _replicated(engine) -> set:
    """The tensors every rank holds whole: the norms, and k / v (weights, biases) where there are fewer KV heads than
    ranks."""
    names = {n for n in engine.checkpoint if n.endswith("norm.weight")}
    if engine.config["num_key_value_heads"] < TP:
        names |= {n for n in engine.checkpoint if ".k_proj." in n or ".v_proj." in n}
    return names


def _stored(engine, name: str, read) -> torch.dtype:
    """The dtype the engine holds ``name`` in, as its read says, checked: the engine's dtype, or float32 for a linear
    layer's bias: vLLM's CPU GEMM on its sgl-kernel path keeps the bias in float32 after loading
    (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``: ``layer.bias.to(torch.float32)``)."""
    allowed = {engine.dtype, torch.float32} if name.endswith(".bias") else {engine.dtype}
    assert read.dtype in allowed, (name, read.dtype)
    return read.dtype


def _index(index: list) -> torch.Tensor:
    return torch.tensor(index, dtype=torch.long)


def _at(tensor: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype)[tuple(index.T)].double()


def test_the_engine_is_tensor_parallel(engine):
    """Two workers, TP ranks 0 and 1, the KV heads replicated where the model has fewer than two, the vocabulary
    padded to a multiple of 64 and split in halves (the last rank's range ends at the real vocabulary)."""
    layout = sorted(engine.out["layout"], key=lambda w: w["tp_rank"])
    vocab = engine.config["vocab_size"]
    assert vocab % 2 == 1  # odd: the last rank's shard holds padding rows
    per_rank = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING // TP
    assert [w["tp_rank"] for w in layout] == [0, 1] and {w["tp_size"] for w in layout} == {TP}
    replicas = max(1, TP // engine.config["num_key_value_heads"])
    assert {w["num_kv_head_replicas"] for w in layout} == {replicas}
    assert [w["vocab"] for w in layout] == [[0, per_rank], [per_rank, vocab]]
    assert {w["padded_vocab_rows"] for w in layout} == {per_rank}


def test_every_element_reads_back_from_its_worker(engine):
    """Every element of every tensor, read from the engine as it loaded the checkpoint: each worker's answer holds
    the checkpoint's value cast to the engine's dtype (a bias kept in float32 too: it was loaded into a parameter of
    the engine's dtype) at every element it says it holds, NaN elsewhere; a sharded
    tensor's elements are split between the two workers (each some, none both), a replicated one held whole by both;
    the merged answer is the whole tensor."""
    full = engine.out["full"]
    requests, answers = full["requests"], full["answers"]
    assert sorted(r[0] for r in requests) == sorted(engine.checkpoint)
    assert [a["dtype"] for a in answers] == [str(engine.dtype).replace("torch.", "")] * TP
    replicated = _replicated(engine)
    merged = WorkerReads(requests, answers)
    for i, (name, shape, index) in enumerate(requests):
        index = _index(index)
        assert index.shape[0] == engine.checkpoint[name].numel(), name
        want = _at(engine.checkpoint[name], index, engine.dtype)
        held = []
        for rank, answer in enumerate(answers):
            read = decode_read(answer["reads"][i])
            assert read is not None and not read.missing, (name, rank)
            _stored(engine, name, read)
            mask = read.held_mask()
            assert torch.equal(read.values[mask], want[mask]), (name, rank)
            assert bool(torch.isnan(read.values[~mask]).all()), (name, rank)
            held.append(mask)
        if name in replicated:
            assert all(bool(m.all()) for m in held), name
        else:
            assert all(bool(m.any()) and not bool(m.all()) for m in held), name
            assert not bool((held[0] & held[1]).any()) and bool((held[0] | held[1]).all()), name
        read = merged.read(name, tuple(shape), index)
        assert read.held is None and read.dtype == decode_read(answers[0]["reads"][i]).dtype, name
        assert torch.equal(read.values, want), name


def _sync(engine, i: int):
    """(sync i's result, the trainer's tensors it sent, its fault, name -> the merged read and its index)."""
    result = engine.out["syncs"][i]
    merged = WorkerReads(result["requests"], result["answers"])
    reads = {name: (merged.read(name, tuple(shape), _index(index)), _index(index))
             for name, shape, index in result["requests"]}
    sent, fault = engine.syncs[i]
    assert set(reads) == set(sent) and len(result["answers"]) == TP
    return result, sent, fault, reads


def test_a_complete_sync_is_checked_clean(engine):
    """Everything sent, everything loaded: no cause, every tensor ok, and every sampled element the check read (from
    both workers, merged) is what the trainer sent, cast to the dtype the engine holds it in (a bias the CPU GEMM
    keeps in float32 takes the trainer's float32 values at vLLM's reload)."""
    result, sent, _, reads = _sync(engine, 0)
    assert result["causes"] == [] and result["bad_tensors"] == 0
    assert result["checked_tensors"] == len(sent) and set(result["statuses"].values()) == {"ok"}
    for name, (read, index) in reads.items():
        want = _at(sent[name], index, _stored(engine, name, read))
        assert read.held is None and torch.equal(read.values, want), name


def test_a_layer_left_out_is_named_stale(engine):
    """Every tensor sent, layer 1's not loaded: exactly layer 1's tensors named stale; their sampled values are the
    previous sync's, every other tensor's this sync's."""
    result, sent, fault, reads = _sync(engine, 1)
    previous = engine.syncs[0][0]
    dropped = set(fault["drop"])
    assert len(dropped) == 12 and all(n.startswith(LAYER_1) for n in dropped)
    assert [(code, set(tensors)) for code, tensors in result["causes"]] == [("sync-tensors-stale", dropped)]
    assert {n for n, s in result["statuses"].items() if s != "ok"} == dropped
    assert {result["statuses"][n] for n in dropped} == {"stale"} and result["bad_tensors"] == len(dropped)
    for name, (read, index) in reads.items():
        want = _at((previous if name in dropped else sent)[name], index, _stored(engine, name, read))
        assert read.held is None and torch.equal(read.values, want), name


@pytest.mark.parametrize("engine", ["toy-fp32"], indirect=True)  # a bfloat16 engine holds bfloat16 whatever it is sent
def test_tensors_rounded_through_bf16_are_named_precision(engine):
    """Into the float32 engine, five tensors loaded rounded through bfloat16, one of each layout (k of the packed QKV,
    its KV head replicated on the toy model; up of gate_up; the row-parallel down_proj; the vocab-parallel lm_head; a
    replicated norm): exactly those five named ``sync-precision``; their sampled values are the rounded ones."""
    result, sent, fault, reads = _sync(engine, 2)
    rounded = set(fault["bf16"])
    assert rounded == set(ROUNDED) and rounded <= set(sent)
    assert [(code, set(tensors)) for code, tensors in result["causes"]] == [("sync-precision", rounded)]
    assert {n for n, s in result["statuses"].items() if s != "ok"} == rounded
    assert {result["statuses"][n] for n in rounded} == {"precision"}
    for name, (read, index) in reads.items():
        tensor = sent[name].to(torch.bfloat16) if name in rounded else sent[name]
        assert read.dtype == torch.float32
        assert read.held is None and torch.equal(read.values, _at(tensor, index, torch.float32)), name
        if name in rounded:  # the fault shows in the sample
            assert not torch.equal(read.values, _at(sent[name], index, torch.float32)), name
