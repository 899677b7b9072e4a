"""The vLLM worker extension of verl's rollout server with one method more: the weight-sync check's reads.

verl's vLLM server starts its engine with ``worker_extension_cls`` = its own ``vLLMColocateWorkerExtension`` (vLLM
mixes that class into each worker, the process that holds the model and receives the weight buckets). The tim server
(``rollout.py``) names this subclass instead: everything of verl's is inherited unchanged, and ``tim_read_weights``
answers the sync check's requests from the model the sync just wrote (``tim_plugins.integrations.vllm.worker_reads``),
called through the server's ``engine.collective_rpc`` (one answer per tensor-parallel worker).

vLLM imports this module by name in each worker process; it imports verl's extension module (and so vLLM), nothing
else.
"""

from __future__ import annotations

# VERL_SOURCES verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from tim_plugins.integrations.vllm.worker_reads import read_requests

__all__ = ["EXTENSION", "TIMWorkerExtension"]


class TIMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocate worker extension plus ``tim_read_weights``."""

    def tim_read_weights(self, requests: list) -> dict:
        """The engine's values of the sent tensors at the requested elements (``worker_reads.read_requests``'s
        answer); the reader of this worker's model is built once (it keeps where each name lives)."""
        from tim_plugins.integrations.vllm.weights import VLLMWeights

        # VERL_SOURCES verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension (self.model_runner: the
        # worker's model runner; .model the model verl's update_weights_from_ipc loads into)
        runner = self.model_runner
        reader = getattr(self, "_tim_reader", None)
        if reader is None or reader.model is not runner.model:
            reader = self._tim_reader = VLLMWeights(runner.model, runner.vllm_config.model_config.dtype)
        return read_requests(reader, requests)


# what the tim server passes to vLLM as worker_extension_cls
EXTENSION = f"{TIMWorkerExtension.__module__}.{TIMWorkerExtension.__qualname__}"
