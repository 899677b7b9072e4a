"""The vLLM engine of tests/test_vllm_tp2_reads.py: the CPU build with ``tensor_parallel_size=2`` (two worker
processes, ``distributed_executor_backend="mp"``; the engine core in its own process, so every call crosses msgpack as
verl's ``AsyncLLM.collective_rpc`` does), read and synced the way an out-of-process engine is.

Run by the test (bounded, in its own process group), never collected by pytest. It writes one JSON file (``--out``):

- ``layout``: what each worker holds (``TP2Reads.tim_tp_layout``: its TP rank, the QKV layer's kv-head replicas, the
  vocabulary range of its embedding shard), for the test to see that the engine is tensor-parallel;
- ``full``: every element of every checkpoint tensor read from the engine as loaded from the checkpoint: the
  requests (``[[name, shape, index], ...]``) and each worker's plain-data answer (``worker_reads.read_requests``);
- ``syncs``: one entry per ``sync_<i>.safetensors`` of ``--syncs`` (the trainer's tensors, written by the test), each
  a sync through vLLM's own ``reload_weights`` checked with ``SyncCheck``: the tensors named in ``sync_<i>.json``'s
  ``drop`` are sent (observed) but not loaded, those in ``bf16`` are loaded rounded through bfloat16
  (``TP2Reads.tim_reload``: each worker reads the trainer's file itself); then the requests
  (``worker_reads.sync_requests``), every worker's answer (``collective_rpc("tim_read_weights")``) and the report of
  ``SyncCheck.finish`` on ``WorkerReads`` of those answers (statuses, causes and their tensors).

The workers answer through ``TP2Reads``, the ``worker_extension_cls`` of the engine: its ``tim_read_weights`` is
verl's ``TIMWorkerExtension.tim_read_weights`` (integrations/verl/worker_extension.py) without verl's base class.
vLLM's CPU build binds each worker's OpenMP threads to a NUMA node of its own unless ``VLLM_CPU_OMP_THREADS_BIND``
names the CPUs (the test gives each worker half of them): on a one-node machine its automatic binding refuses two
ranks. At the end the engine is shut down and the shared memory its CPU communicator leaves in /dev/shm removed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path


class TP2Reads:
    """Mixed into each vLLM worker (``worker_extension_cls="vllm_tp2_run.TP2Reads"``)."""

    def tim_read_weights(self, requests: list) -> dict:
        from tim_plugins.integrations.vllm.weights import VLLMWeights
        from tim_plugins.integrations.vllm.worker_reads import read_requests

        runner = self.model_runner
        reader = getattr(self, "_tim_reader", None)
        if reader is None or reader.model is not runner.model:
            reader = self._tim_reader = VLLMWeights(runner.model, runner.vllm_config.model_config.dtype)
        return read_requests(reader, requests)

    def tim_reload(self, path: str, drop: list, bf16: list) -> None:
        """vLLM's own ``reload_weights`` (checkpoint format) with the tensors of the file ``path``, in its order, less
        those named in ``drop``, those in ``bf16`` rounded through bfloat16: the trainer's tensors cannot cross
        ``LLM.collective_rpc`` of a multiprocess engine (msgpack hands the engine core memoryviews, which the
        executor's queue to the workers cannot pickle), so each worker loads them from the file the trainer wrote."""
        import torch
        from safetensors.torch import load_file

        tensors = load_file(path)
        weights = [(n, t.to(torch.bfloat16).to(t.dtype) if n in bf16 else t) for n, t in tensors.items()
                   if n not in drop]
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    def tim_tp_layout(self) -> dict:
        model = self.model_runner.model
        attn = model.model.layers[0].self_attn.qkv_proj
        embed = model.model.embed_tokens.shard_indices
        return {"dist_ident": os.environ.get("VLLM_DIST_IDENT", ""), "tp_rank": int(attn.tp_rank),
                "tp_size": int(attn.tp_size), "num_kv_head_replicas": int(attn.num_kv_head_replicas),
                "qkv_weight_numel": int(attn.weight.numel()),
                "vocab": [int(embed.org_vocab_start_index), int(embed.org_vocab_end_index)],
                "padded_vocab_rows": int(model.model.embed_tokens.weight.shape[0])}


def _every_element(shape) -> list:
    import torch

    if len(shape) == 1:
        return torch.arange(shape[0]).view(-1, 1).tolist()
    return torch.cartesian_prod(*[torch.arange(s) for s in shape]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--syncs", required=True, help="folder of sync_<i>.safetensors and sync_<i>.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.time()

    from safetensors.torch import load_file
    from vllm import LLM

    from tim_plugins.integrations.vllm.worker_reads import WorkerReads, sync_requests
    from tim_plugins.weight_sync import SyncCheck

    # The KV cache is allocated whole at start-up: a few MiB is plenty for an engine that is only read and synced.
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=32 * 2**20, tensor_parallel_size=2, distributed_executor_backend="mp",
              worker_extension_cls="vllm_tp2_run.TP2Reads")
    out: dict = {"start_s": time.time() - t0, "layout": llm.collective_rpc("tim_tp_layout")}

    checkpoint = {}
    for f in sorted(Path(args.model).glob("*.safetensors")):
        checkpoint.update(load_file(str(f)))
    requests = [[name, list(t.shape), _every_element(t.shape)] for name, t in checkpoint.items()]
    out["full"] = {"requests": requests,
                   "answers": llm.collective_rpc("tim_read_weights", kwargs={"requests": requests})}

    check, syncs = SyncCheck(), []
    for i in range(len(list(Path(args.syncs).glob("sync_*.safetensors")))):
        tensors = load_file(str(Path(args.syncs) / f"sync_{i}.safetensors"))
        fault = json.loads((Path(args.syncs) / f"sync_{i}.json").read_text())
        record = check.begin(i)
        for _ in record.observing(tensors.items()):  # the trainer's stream, observed as it is sent
            pass
        llm.collective_rpc("tim_reload", kwargs={"path": str(Path(args.syncs) / f"sync_{i}.safetensors"), **fault})
        reqs = sync_requests(record)
        answers = llm.collective_rpc("tim_read_weights", kwargs={"requests": reqs})
        report = check.finish(record, WorkerReads(reqs, answers))
        syncs.append({"requests": reqs, "answers": answers, "statuses": report.statuses,
                      "causes": [[c.code, list(c.tensors)] for c in report.causes],
                      "checked_tensors": report.checked_tensors, "bad_tensors": report.bad_tensors})
    out["syncs"] = syncs
    out["total_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out))
    llm.llm_engine.engine_core.shutdown()  # the workers and their shared-memory queues, before the test's kill
    # vLLM's CPU communicator leaves its shared memory (/dev/shm/<VLLM_DIST_IDENT>-...-cpushm_<rank>) behind
    for ident in {w["dist_ident"] for w in out["layout"] if w["dist_ident"]}:
        for f in glob.glob(f"/dev/shm/{glob.escape(ident)}-*"):
            os.remove(f)


if __name__ == "__main__":
    main()
