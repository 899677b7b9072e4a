"""verl's vLLM rollout server, carrying vLLM's per-token kept sets (``return_sampling_mask``) into the training batch.

With ``+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true`` vLLM attaches to each finished
``CompletionOutput`` a ``vllm.outputs.SamplingMask`` (one id list per generated token: the sampler's kept set);
verl 0.9.1's ``vLLMHttpServer.generate`` reads the final output's token ids and log-probs and drops it. The
subclass here wraps its own engine's ``generate`` (on this server's engine instance only) to note the final
output's mask by request id, runs verl's ``generate`` unchanged, and puts the mask, packed, into the returned
``TokenOutput.extra_fields[KEPT_SETS_KEY]``, which verl carries unchanged to the training batch (agent loop ->
``AgentLoopOutput.extra_fields`` -> the V1 trainer's ``extra_fields`` field -> the actor's micro-batch).

Inert when the engine returns no mask (no field added): a server without the setting behaves as verl's.
The replica is registered under verl's own name ``vllm`` (``plugin.register``) through a loader that checks the
hooks when the rollout is built (the only process that imports vLLM), and falls back to verl's class, with one
line, where they moved.

Importing this module imports verl's vLLM server (and vLLM); ``plugin`` imports it only inside the loader.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from tim_plugins.integrations.vllm.sampling_mask import kept_sets_from_mask

from .config import KEPT_SETS_KEY

__all__ = ["KEPT_SETS_KEY", "TIMvLLMHttpServer", "TIMvLLMReplica", "pack_sampling_mask"]


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


class TIMvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server; ``generate`` also returns the sampler's kept sets where the engine hands them out."""

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


class TIMvLLMReplica(vLLMReplica):
    """verl's vLLM replica with ``TIMvLLMHttpServer`` as its server class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica.__init__
        self.server_class = ray.remote(TIMvLLMHttpServer)
