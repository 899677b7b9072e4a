"""The prefix-cache read of the weight-sync check (``tim_plugins.integrations.vllm.prefix_cache``) on a live engine of
the CPU build (blocks of 32 tokens). The reference is vLLM's own account of the cache: the prompt tokens a repeated
request was served from it (``RequestOutput.num_cached_tokens``) and what ``LLM.reset_prefix_cache`` returns."""

from __future__ import annotations

import gc
import os

import pytest

pytest.importorskip("vllm")

from tim_plugins.integrations.vllm.prefix_cache import cached_prefix  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32


@pytest.fixture(scope="module")
def llm(toy_model_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    env = pytest.MonkeyPatch()
    env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    try:
        engine = LLM(model=str(toy_model_path), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                     kv_cache_memory_bytes=32 * 2**20, block_size=BLOCK)
    finally:
        env.undo()
    yield engine
    del engine
    gc.collect()


def _served_from_cache(llm, prompt: list[int]) -> int:
    """vLLM's own count: the prompt tokens of a request for ``prompt`` served from the prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
    return out.num_cached_tokens


def _blocks(llm) -> int:
    state = cached_prefix(llm)
    assert state is not None and state.block_size == BLOCK
    return state.blocks


P = [5 + i % 90 for i in range(3 * BLOCK + 5)]  # three full blocks and part of a fourth
Q = P[:2 * BLOCK] + [7] * BLOCK + [9]  # shares P's first two blocks


def test_the_read_is_what_a_new_request_is_served_from_the_cache(llm):
    assert llm.reset_prefix_cache() is True and _blocks(llm) == 0
    assert _served_from_cache(llm, P) == 0
    assert _blocks(llm) == 3  # the prompt's full blocks
    assert _served_from_cache(llm, P) == 3 * BLOCK  # what vLLM serves from them
    assert _blocks(llm) == 3
    assert _served_from_cache(llm, Q) == 2 * BLOCK
    assert _blocks(llm) == 4  # Q's own third block
    assert llm.reset_prefix_cache() is True
    assert _blocks(llm) == 0 and _served_from_cache(llm, P) == 0  # after the reset nothing is served from it


def test_a_reset_while_a_request_holds_blocks_fails_and_the_read_says_so(llm):
    """vLLM refuses to reset while a request holds blocks (returns False, keeps every block): the read still counts
    them, and the same request repeated is still served from them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert llm.reset_prefix_cache() is True
    assert _served_from_cache(llm, P) == 0
    engine = llm.llm_engine
    engine.add_request("tim-running", TokensPrompt(prompt_token_ids=Q), SamplingParams(max_tokens=50))
    engine.step()  # Q is scheduled: it holds blocks now
    try:
        assert llm.reset_prefix_cache() is False
        assert _blocks(llm) >= 3
    finally:
        engine.abort_request(["tim-running"])
    assert _served_from_cache(llm, P) == 3 * BLOCK  # the failed reset left P's blocks in the cache
    assert llm.reset_prefix_cache() is True and _blocks(llm) == 0


def test_prefix_caching_off_reads_zero_and_an_engine_core_elsewhere_is_unread(llm, monkeypatch):
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    monkeypatch.setattr(manager, "enable_caching", False)
    state = cached_prefix(llm)
    assert state is not None and state.blocks == 0
    monkeypatch.undo()
    assert cached_prefix(object()) is None  # an engine core in another process: nothing to read here


def test_the_prefix_cache_internals_the_reader_assumes():
    """VLLM_SOURCES, "the prefix cache": the statements the read relies on (the tests above check the behaviour)."""
    from upstream import flat, source

    assert "self.engine_core = EngineCoreClient.make_client(" in flat(source("vllm.v1.engine.llm_engine",
                                                                              "LLMEngine.__init__"))
    assert "self.engine_core = EngineCore(" in source("vllm.v1.engine.core_client", "InprocClient.__init__")
    assert "self.scheduler: SchedulerInterface = " in flat(source("vllm.v1.engine.core", "EngineCore.__init__"))
    assert "self.kv_cache_manager = KVCacheManager(" in source("vllm.v1.core.sched.scheduler", "Scheduler.__init__")
    manager = source("vllm.v1.core.kv_cache_manager", "KVCacheManager.__init__")
    assert "self.enable_caching = enable_caching" in manager
    assert "self.block_pool = self.coordinator.block_pool" in manager
    pool = flat(source("vllm.v1.core.block_pool", "BlockPool.__init__"))
    assert "self.cached_block_hash_to_block: BlockHashToBlockMap = BlockHashToBlockMap(" in pool
    assert "return len(self._cache)" in source("vllm.v1.core.block_pool", "BlockHashToBlockMap.__len__")
    reset = flat(source("vllm.v1.core.block_pool", "BlockPool.reset_prefix_cache"))
    assert "return False" in reset and ("self.cached_block_hash_to_block.clear()" in reset
                                        or "self.cached_block_hash_to_block = BlockHashToBlockMap()" in reset)
