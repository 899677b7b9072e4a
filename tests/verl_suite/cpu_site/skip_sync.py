"""Test-only fault (never shipped), for the main_ppo run whose weight sync skips a layer: with
``TIM_TEST_SYNC_SKIP=<name prefix>`` set, verl's vLLM worker extension drops every tensor whose name starts with the
prefix from each bucket it receives, before loading the bucket into the engine (``vLLMColocateWorkerExtension.
_update_weights``, called by ``update_weights_from_ipc`` once per bucket, in the vLLM worker process). The actor
streams every tensor; the rollout engine keeps whatever that layer held (verl starts it on dummy weights).
``TIM_TEST_SYNC_SKIP_FROM=<n>`` (default 0) starts skipping at each worker's n-th sync (``update_weights_from_ipc``
calls, counted from 0): the syncs before it are whole, and from it on the layer keeps what the last whole sync loaded
(a sync that breaks during the run).

With ``TIM_TEST_LORA_KEEP=1`` (a LoRA adapter sync, ``lora.merge=false``), verl's ``remove_lora`` of the old adapter
before each adapter sync does nothing (``update_weights_from_ipc`` finds a no-op on the worker instance): vLLM's
``add_lora`` then finds an adapter under verl's one id and only touches it (vllm/lora/worker_manager.py
``LRUCacheWorkerLoRAManager.add_adapter``), so the engine keeps the first adapter it loaded.

Installed by ``sitecustomize.py`` through the CPU shims' after-import hook on verl's worker-extension module, in
every process that imports it (the vLLM workers load the weights).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "FROM_ENV", "KEEP_ENV", "install"]

ENV = "TIM_TEST_SYNC_SKIP"
FROM_ENV = "TIM_TEST_SYNC_SKIP_FROM"
KEEP_ENV = "TIM_TEST_LORA_KEEP"
MODULE = "verl.workers.rollout.vllm_rollout.utils"


def _faults(module) -> None:
    if os.environ.get(ENV):
        _skip(module)
    if os.environ.get(KEEP_ENV) == "1":
        _keep_adapter(module)


def _keep_adapter(module) -> None:
    original = module.vLLMColocateWorkerExtension.update_weights_from_ipc

    def update_weights_from_ipc(self, *args, **kwargs):
        self.remove_lora = lambda lora_id: False  # shadows the worker's method for this call
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.remove_lora

    module.vLLMColocateWorkerExtension.update_weights_from_ipc = update_weights_from_ipc


def _skip(module) -> None:
    prefix, first = os.environ[ENV], int(os.environ.get(FROM_ENV) or 0)
    extension = module.vLLMColocateWorkerExtension
    original, sync = extension._update_weights, extension.update_weights_from_ipc

    def update_weights_from_ipc(self, *args, **kwargs):  # one call per sync, its buckets loaded inside
        self._tim_test_syncs = getattr(self, "_tim_test_syncs", -1) + 1
        return sync(self, *args, **kwargs)

    def _update_weights(self, weights, peft_config, base_sync_done):
        if getattr(self, "_tim_test_syncs", 0) >= first:
            weights = [(name, tensor) for name, tensor in weights if not name.startswith(prefix)]
        return original(self, weights, peft_config, base_sync_done)

    extension.update_weights_from_ipc = update_weights_from_ipc
    extension._update_weights = _update_weights


def install() -> None:
    """Register the hook (the CPU shims' after-import finder must be installed as well)."""
    import cpu_shims

    cpu_shims.HOOKS[MODULE] = _faults
