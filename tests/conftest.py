"""Shared fixtures: one toy model per test session, one vLLM CPU engine per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def toy_model_path(tmp_path_factory):
    """Directory of the toy Qwen2 model (trained briefly, byte-level BPE tokenizer, odd vocab)."""
    pytest.importorskip("transformers")
    from tim_plugins.toy_model import build_toy_model

    return build_toy_model()


@pytest.fixture(scope="session")
def vllm_llm(toy_model_path):
    """One vLLM engine (CPU build) on the toy model in fp32, processed log-probs; shared by the session."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    # The TIM injector is registered but inert: it acts only on requests with extra_args["tim_inject"].
    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor

    llm = LLM(
        model=str(toy_model_path), dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs",
        max_model_len=256, seed=0, kv_cache_memory_bytes=128 * 2**20, logits_processors=[TailNoiseLogitsProcessor],
    )
    yield llm
