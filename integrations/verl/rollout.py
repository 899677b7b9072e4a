"""verl's vLLM rollout server with what the tim hooks need of it: vLLM's per-token kept sets carried into the training
batch, and the weight-sync check's reads of the engine's weights.

Kept sets. With ``+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true`` vLLM attaches to each
finished ``CompletionOutput`` a ``vllm.outputs.SamplingMask`` (one id list per generated token: the sampler's kept
set); verl 0.9.1's ``vLLMHttpServer.generate`` reads the final output's token ids and log-probs and drops it. The
server here wraps its own engine's ``generate`` (on this server's engine instance only) to note the final output's
mask by request id, runs verl's ``generate`` unchanged, and puts the mask, packed, into the returned
``TokenOutput.extra_fields[KEPT_SETS_KEY]``, which verl carries unchanged to the training batch (agent loop ->
``AgentLoopOutput.extra_fields`` -> the V1 trainer's ``extra_fields`` field -> the actor's micro-batch). Inert when
the engine returns no mask (no field added): a server without the setting behaves as verl's.

Sync reads. The engine's weights live in vLLM's worker processes. The server starts vLLM with
``worker_extension.TIMWorkerExtension`` (verl's colocate extension plus ``tim_read_weights``) and answers
``tim_read_weights(requests)`` with every worker's reads: verl's own ``collective_rpc`` drops the workers' results.
Inert until the actor worker asks (``worker.TIMActorRolloutRefWorker.update_weights``).

The replica is registered under verl's own name ``vllm`` (``plugin.register``) through a loader that checks each
part's hooks when the rollout is built (the only process that imports vLLM) and picks the server with the parts
that hold (``replica_class``), falling back to verl's class, with one line per part, where none does.

Importing this module imports verl's vLLM server (and vLLM); ``plugin`` imports it only inside the loader.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_mask

from .config import KEPT_SETS_KEY

__all__ = ["KEPT_SETS_KEY", "TIMKeptSetsHttpServer", "TIMKeptSetsReplica", "TIMSyncReadsHttpServer",
           "TIMSyncReadsReplica", "TIMvLLMHttpServer", "TIMvLLMReplica", "pack_sampling_mask", "replica_class"]


def pack_sampling_mask(mask: Any, n_tokens: int) -> dict[str, np.ndarray] | None:
    """A ``vllm.outputs.SamplingMask`` (``token_ids``: one id list per generated token) as the compact CSR pair
    that travels with the sample: ``{"ids": int32 [total kept], "offsets": int64 [n_tokens + 1]}`` (two arrays, not
    a Python list per token: the field is pickled through Ray and TransferQueue for every sample).

    Returns None (nothing recorded) when the mask does not have one set per generated token: a set list that does
    not line up with the tokens cannot be placed, and the trainer then recomputes for that batch.
    """
    # VERL_SOURCES vllm.outputs:SamplingMask
    try:
        kept = kept_sets_from_mask(mask)  # the vLLM adapter's one conversion to the core's CSR form
    except ValueError:
        return None
    if len(kept) != n_tokens:
        return None
    return {"ids": kept.ids.numpy(), "offsets": kept.offsets.numpy()}


class _KeptSets:
    """In front of verl's vLLM server: ``generate`` also returns the sampler's kept sets where the engine hands them
    out."""

    # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.generate
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        masks = self._tim_capture_masks()
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            # popped whatever happens, so an aborted or failed request leaves nothing behind
            mask = masks.pop(request_id, None)
        if mask is not None and out.token_ids:
            packed = pack_sampling_mask(mask, len(out.token_ids))
            if packed is not None:
                # VERL_SOURCES verl.workers.rollout.replica:TokenOutput
                out.extra_fields[KEPT_SETS_KEY] = packed
        return out

    def _tim_capture_masks(self) -> dict[str, Any]:
        """Wrap this server's engine's ``generate`` once (the instance attribute, not AsyncLLM's class: another
        engine in the process is untouched) so that the last output of each request leaves its first completion's
        ``sampling_mask`` in ``self._tim_masks[request_id]``. Re-installed if the engine object is replaced."""
        engine = self.engine
        if getattr(engine, "_tim_masks_owner", None) is not self:
            masks = self.__dict__.setdefault("_tim_masks", {})
            inner = engine.generate

            # VERL_SOURCES vllm.outputs:CompletionOutput
            async def generate(*a, **kw):
                request_id = kw.get("request_id")
                last = None
                async for output in inner(*a, **kw):
                    last = output
                    yield output
                outs = getattr(last, "outputs", None)
                if outs:
                    mask = getattr(outs[0], "sampling_mask", None)
                    if mask is not None and request_id is not None:
                        masks[request_id] = mask

            engine.generate = generate
            engine._tim_masks_owner = self
        return self._tim_masks


class _SyncReads:
    """In front of verl's vLLM server: vLLM's workers get ``TIMWorkerExtension``, and ``tim_read_weights`` returns
    their answers to the sync check's requests."""

    # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer._get_worker_extension_cls
    def _get_worker_extension_cls(self) -> str:
        from .worker_extension import EXTENSION  # imported here: only a server with this part needs it

        return EXTENSION

    async def tim_read_weights(self, requests: list) -> list:
        """Every worker's ``TIMWorkerExtension.tim_read_weights(requests)``, one answer per worker."""
        # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.collective_rpc (self.engine:
        # vLLM's AsyncLLM, VERL_SOURCES vllm.v1.engine.async_llm:AsyncLLM.collective_rpc, returns the workers'
        # results; verl's wrapper drops them)
        return list(await self.engine.collective_rpc("tim_read_weights", kwargs={"requests": requests}))


class TIMvLLMHttpServer(_KeptSets, _SyncReads, vLLMHttpServer):
    """verl's vLLM server with the kept sets and the sync reads."""


class TIMKeptSetsHttpServer(_KeptSets, vLLMHttpServer):
    """verl's vLLM server with the kept sets only (the sync reads' hooks moved)."""


class TIMSyncReadsHttpServer(_SyncReads, vLLMHttpServer):
    """verl's vLLM server with the sync reads only (the kept sets' hooks moved)."""


class TIMvLLMReplica(vLLMReplica):
    """verl's vLLM replica with ``SERVER`` as its server class."""

    SERVER = TIMvLLMHttpServer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica.__init__
        self.server_class = ray.remote(self.SERVER)


class TIMKeptSetsReplica(TIMvLLMReplica):
    SERVER = TIMKeptSetsHttpServer


class TIMSyncReadsReplica(TIMvLLMReplica):
    SERVER = TIMSyncReadsHttpServer


def replica_class(*, kept_sets: bool, sync_reads: bool) -> type:
    """The replica whose server has the parts whose hooks hold (verl's own when neither does)."""
    return {(True, True): TIMvLLMReplica, (True, False): TIMKeptSetsReplica, (False, True): TIMSyncReadsReplica,
            (False, False): vLLMReplica}[(bool(kept_sets), bool(sync_reads))]
