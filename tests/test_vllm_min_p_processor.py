"""The min-p logits processor on the vLLM CPU build (V1 model runner), its V2-runner path on vLLM's own request
dataclasses (vLLM >= 0.31; before it the class is V1 only), and the engine-args chain verl uses to load it (verl's
CLI builder + vLLM's own argument parser)."""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tim_plugins.rollout.vllm_min_p_config import (
    CONFIG_KEY,
    ENV_VAR,
    PROCESSOR_FQCN,
    engine_min_p,
    vllm_engine_kwargs,
)
from tim_plugins.safe_vocab import safe_logprobs_from_logits
from tim_plugins.truncation import Truncation, truncation_threshold
from upstream import has_since, has_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

MIN_P = 0.05
TEMPERATURE = 0.7
PROMPTS = ["the cat sat on the", "a b c d e f", "hello world, this is", "once upon a time"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def min_p_llm(toy_model_path):
    """The only engine of this module: every request is pruned with MIN_P unless it overrides it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(model=str(toy_model_path), dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs",
              max_model_len=96, seed=0, kv_cache_memory_bytes=64 << 20, **vllm_engine_kwargs(MIN_P))
    yield llm


@pytest.fixture(scope="module")
def hf_model(toy_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    return tok, AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()


def _generate(llm, tok, **sampling):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, logprobs=0, seed=3, ignore_eos=True,
                        **sampling)
    prompts = [{"prompt_token_ids": tok(p)["input_ids"]} for p in PROMPTS]
    rows = []
    for prompt, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        comp = out.outputs[0]
        lp = torch.tensor([step[t].logprob for step, t in zip(comp.logprobs, comp.token_ids)])
        rows.append((list(prompt["prompt_token_ids"]), list(comp.token_ids), lp))
    return rows


def _hf_logits(model, prompt, completion):
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]


def test_processed_logprobs_equal_trainer_safe_logprobs(min_p_llm, hf_model):
    """(a) vLLM's processed log-probs with the processor = safe_logprobs_from_logits on the HF fp32 forward;
    (b) every sampled token is in the trainer's S; and pruning really changed the values."""
    tok, model = hf_model
    worst, pruned_rows, full_gap = 0.0, 0, 0.0
    for prompt, completion, engine_lp in _generate(min_p_llm, tok):
        logits = _hf_logits(model, prompt, completion)
        new = torch.tensor(completion)
        mine = safe_logprobs_from_logits(logits, new, min_p=MIN_P, temperature=TEMPERATURE, order="vllm")
        assert mine.in_safe.all(), "vLLM sampled a token outside the trainer's fp32 safe set"
        worst = max(worst, (mine.logprobs - engine_lp).abs().max().item())
        pruned_rows += int((mine.pruned_mass > 0).sum())
        full = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, new[:, None]).squeeze(-1)
        full_gap = max(full_gap, (full - engine_lp).abs().max().item())
    assert worst < 1e-4, f"max |vLLM processed − trainer safe| = {worst:.3g}"
    assert pruned_rows > MAX_TOKENS and full_gap > 1e-3  # the comparison can tell pruned from unpruned


def test_equals_vllm_builtin_min_p_and_per_request_override(min_p_llm, hf_model):
    """(c) the processor = vLLM's own SamplingParams(min_p=X) on the same seed (processor off for that request via
    extra_args); extra_args tim_min_p=0 with no built-in min_p gives the unpruned distribution."""
    tok, model = hf_model
    ours = _generate(min_p_llm, tok)
    builtin = _generate(min_p_llm, tok, min_p=MIN_P, extra_args={CONFIG_KEY: 0.0})
    for (_, c_ours, lp_ours), (_, c_builtin, lp_builtin) in zip(ours, builtin):
        assert c_ours == c_builtin
        torch.testing.assert_close(lp_ours, lp_builtin, rtol=0, atol=1e-6)
    for prompt, completion, engine_lp in _generate(min_p_llm, tok, extra_args={CONFIG_KEY: 0.0}):
        logits = _hf_logits(model, prompt, completion)
        full = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        assert (full - engine_lp).abs().max().item() < 1e-4


def test_bad_request_value_is_refused(min_p_llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"tim_min_p.*1\.5"):
        min_p_llm.generate(["a b"], SamplingParams(max_tokens=2, extra_args={CONFIG_KEY: 1.5}), use_tqdm=False)


def test_engine_min_p_sources():
    assert engine_min_p({CONFIG_KEY: 0.01}, env={ENV_VAR: "0.2"}) == 0.01
    assert engine_min_p({}, env={ENV_VAR: "0.2"}) == 0.2
    assert engine_min_p(None, env={}) == 0.0
    with pytest.raises(ValueError, match=r"additional_config\['tim_min_p'\]=-0.1"):
        engine_min_p({CONFIG_KEY: -0.1}, env={})


def test_v2_runner_path_matches_tempered_min_p():
    """The V2-runner path (called before temperature, per request slot) on vLLM's own request dataclasses:
    after dividing by each request's T, the kept set is the trainer's {z/T >= max z/T + log(min_p)}."""
    from vllm import SamplingParams
    from vllm.config import VllmConfig

    from tim_plugins.integrations.vllm import min_p
    from tim_plugins.integrations.vllm.min_p import TIMMinPLogitsProcessor
    from tim_plugins.integrations.vllm.sources import VLLM_SINCE

    v2 = "vllm.v1.worker.gpu.sample.logits_processor"
    if not has_since("vllm", VLLM_SINCE, (v2, "LogitsProcessor")):  # vLLM < 0.31: no V2 custom processors
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(v2)
        assert min_p._V2LogitsProcessor is None  # V1 only; its engine path is tested above
        return
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

    vocab, slots = 1001, 6
    state = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=slots, vocab_size=vocab,
                                   all_token_ids=None, prompt_len=None, prefill_len=None, total_len=None)
    from vllm.platforms import current_platform

    # a CUDA build on this CPU machine (the gpu-sources stack) cannot build a VllmConfig: the one field read, alone
    config = (SimpleNamespace if current_platform.is_unspecified() else VllmConfig)(
        additional_config={CONFIG_KEY: 0.02})
    proc = TIMMinPLogitsProcessor(config, state)
    requests = {0: (0.7, None), 1: (1.3, 0.1), 2: (1.0, 0.0), 3: (0.0, None), 5: (0.9, None)}  # slot: (T, override)
    for slot, (temp, override) in requests.items():
        extra = None if override is None else {CONFIG_KEY: override}
        proc.add_request(slot, SamplingParams(temperature=temp, extra_args=extra))
    proc.apply_staged_writes()
    rows = torch.tensor([5, 0, 1, 2, 3, 0])  # rows are reordered and may repeat a slot (spec decoding)
    z = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    ctx = LogitsContext(expanded_idx_mapping=rows, idx_mapping=rows.unique(), idx_mapping_np=rows.unique().numpy(),
                        expanded_local_pos=torch.zeros_like(rows), input_ids=torch.zeros_like(rows),
                        pos=torch.zeros_like(rows), seq_lens_upper_bound_np=rows.unique().numpy())
    kept = torch.isfinite(proc.apply(z.clone(), ctx))
    for i, slot in enumerate(rows.tolist()):
        temp, override = requests[slot]
        min_p = 0.02 if override is None else override
        if temp == 0.0 or min_p == 0.0:
            assert kept[i].all()
            continue
        zt = z[i : i + 1] / temp
        tau = truncation_threshold(zt, Truncation(min_p=min_p, temperature=temp))
        assert torch.equal(kept[i], (zt >= tau[:, None])[0]), slot
        assert 1 < int(kept[i].sum()) < vocab


def _verl_cli_builder():
    """verl 0.9.1's own ``build_cli_args_from_config`` (vllm_rollout/utils.py), read from verl's installed source.

    That verl module imports vLLM-GPU pieces at import time, so the two functions are taken from its source and
    run here next to the real vLLM argument parser (of the CPU build)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    src = Path(spec.submodule_search_locations[0]) / "workers" / "rollout" / "vllm_rollout" / "utils.py"
    if not src.exists():
        pytest.skip(f"verl's source not found at {src}")
    tree = ast.parse(src.read_text())
    wanted = {"build_cli_args_from_config", "_optional_bool_vllm_args"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in funcs} == wanted, "verl's CLI builder moved: update this test"
    import dataclasses
    import functools
    from typing import Any, get_args

    namespace = {"dataclasses": dataclasses, "functools": functools, "json": json, "Any": Any, "get_args": get_args}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(src), "exec"), namespace)  # noqa: S102
    return namespace["build_cli_args_from_config"]


def test_verl_engine_kwargs_reach_vllm_config(toy_model_path):
    """engine_kwargs.vllm as verl composes them -> verl's CLI builder -> vLLM's parser -> VllmConfig -> the
    processor's min_p. Same dict as tests/verl_suite/test_verl_config.py asserts on the composed recipe config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    build = _verl_cli_builder()
    engine_kwargs = vllm_engine_kwargs(1e-4)
    args = {"dtype": "float32", "max_model_len": 96, "logprobs_mode": "processed_logprobs", **engine_kwargs}
    cli = build(args)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", str(toy_model_path), *cli])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    assert list(config.model_config.logits_processors) == [PROCESSOR_FQCN]
    assert engine_min_p(config.additional_config, env={}) == 1e-4
    assert math.isclose(json.loads(cli[cli.index("--additional_config") + 1])[CONFIG_KEY], 1e-4)


def test_processor_fqcn_loads_the_adapter_class_through_vllm():
    """``PROCESSOR_FQCN`` (what the verl adapter and the docs pass to vLLM) loads the adapter's class through
    vLLM's own loader (what ``LLM(logits_processors=[...])`` and ``--logits-processors`` run): each runner's that
    the installed vLLM has (the V1 runner's before 0.34, the V2 runner's from 0.31)."""
    from tim_plugins.integrations.vllm import TIMMinPLogitsProcessor
    from tim_plugins.integrations.vllm.sources import VLLM_SINCE, VLLM_UNTIL

    assert PROCESSOR_FQCN == "tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor"
    v1, v2 = "vllm.v1.sample.logits_processor", "vllm.v1.worker.gpu.sample.logits_processor.loader"
    loaders = []
    if has_until("vllm", VLLM_UNTIL, (v1, "_load_logitsprocs_by_fqcns")):
        loaders.append(importlib.import_module(v1)._load_logitsprocs_by_fqcns)
    if has_since("vllm", VLLM_SINCE, (v2, "_load_v2_logitsprocs_by_fqcns")):
        loaders.append(importlib.import_module(v2)._load_v2_logitsprocs_by_fqcns)
    assert loaders
    for load in loaders:
        assert load([PROCESSOR_FQCN]) == [TIMMinPLogitsProcessor], load
