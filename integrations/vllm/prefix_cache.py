"""What an in-process vLLM engine's prefix cache can still serve (the weight-sync check's ``sync-prefix-cache``).

vLLM keys a cached block by the tokens it holds, not by the weights that computed it: after a weight sync, a prompt
sharing a cached prefix is served keys and values of the previous weights unless the cache was reset
(``LLM.reset_prefix_cache``, which TRL's and verl's syncs call once the weights are written). A reset fails, and
returns False, while a request holds blocks. So the check reads, right after the sync, how many blocks a new request
could still hit: the scheduler's block pool maps the hash of each such block to it (one entry per block and KV-cache
group), and a reset empties that map.

Only an in-process engine core can be read (colocated: ``distributed_executor_backend="external_launcher"`` or
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's colocate mode runs it); otherwise, or when a step of the path below is
not there, the state is None: not read, never named.
"""

from __future__ import annotations

from typing import Optional

from tim_plugins.weight_sync import CachedPrefix

__all__ = ["cached_prefix"]


def cached_prefix(llm) -> Optional[CachedPrefix]:
    """The blocks ``llm``'s prefix cache can serve now (0 when prefix caching is off), or None when the engine core is
    in another process or its layout is not the one known. A dict's length: cheap enough to read at every sync."""
    # VLLM_SOURCES vllm.entrypoints.llm:LLM.__init__ (llm_engine)
    engine = getattr(llm, "llm_engine", None)
    # VLLM_SOURCES vllm.v1.engine.core_client:InprocClient (engine_core: the EngineCore, in this process)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    # VLLM_SOURCES vllm.v1.engine.core:EngineCore (scheduler)
    scheduler = getattr(core, "scheduler", None)
    # VLLM_SOURCES vllm.v1.core.sched.scheduler:Scheduler (kv_cache_manager)
    manager = getattr(scheduler, "kv_cache_manager", None)
    # VLLM_SOURCES vllm.v1.core.kv_cache_manager:KVCacheManager (enable_caching, block_pool)
    enabled = getattr(manager, "enable_caching", None)
    # VLLM_SOURCES vllm.v1.core.block_pool:BlockPool (cached_block_hash_to_block, sized)
    cached = getattr(getattr(manager, "block_pool", None), "cached_block_hash_to_block", None)
    if not isinstance(enabled, bool) or (enabled and not hasattr(cached, "__len__")):
        return None
    block_size = getattr(getattr(getattr(engine, "vllm_config", None), "cache_config", None), "block_size", None)
    return CachedPrefix(len(cached) if enabled else 0, int(block_size or 0))
