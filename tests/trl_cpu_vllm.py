"""Test-side shims for TRL's vLLM colocate mode on the vLLM CPU build (no source edits, installed at run time).

- ``cpu_sync_weights``: TRL 1.16's weight sync fails on the CPU build ('Parameter' object has no attribute
  'weight_loader': vLLM packs linear weights into a oneDNN handle). It replaces ``VLLMGeneration.sync_weights``
  with vLLM's own ``reload_weights`` path (shared research notes, trl.md).
- ``keep_plain_linear_weights``: the other way round, so that TRL's own ``sync_weights`` runs unmodified: vLLM's
  CPU GEMM dispatch keeps each linear layer's plain weight and computes with ``F.linear`` on the live tensor (as the
  verl suite's shim 4, tests/verl_suite/cpu_site/cpu_shims.py), for the engines built while it is installed.
- ``llm_with``: TRL passes no ``dtype`` to ``vllm.LLM`` in colocate mode (vLLM then follows config.json), so a
  run that wants bf16 rollouts against an fp32 trainer wraps the constructor TRL calls
  (``trl.generation.vllm_generation.LLM``) to add it.
- ``one_plain_engine``: one engine for a test module's TRL runs (TRL builds an ``LLM`` per trainer), with plain
  linear weights, so TRL's own sync runs unmodified. A later trainer gets it back with the global RNG seeded as a
  new engine's worker seeds it (vllm/v1/worker/cpu_worker.py ``init_device``: ``set_random_seed(model_config.seed)``):
  vLLM's sampler draws from that RNG (vllm/v1/sample/ops/topk_topp_sampler.py ``random_sample``), and TRL seeds it
  per process just before building the engine (trl/trainer/grpo_trainer.py L1103, ``set_seed(args.seed,
  device_specific=True)``); the ranks of one tensor-parallel engine that sampled with their own seeds would follow
  different tokens and mix them in their all-reduces.
- ``CauseLines``: the console lines of the named causes (logger ``tim_plugins.causes``), kept while installed.
"""

from __future__ import annotations

import logging

__all__ = ["CauseLines", "cpu_sync_weights", "keep_plain_linear_weights", "llm_with", "one_plain_engine"]


def _named_params(self):
    """The weights under vLLM's names, as TRL's own sync reads them: ``VLLMGeneration._iter_named_params`` (TRL >=
    1.10), or TRL 1.9's loop in ``sync_weights`` for a plain (non-PEFT, non-FSDP) model."""
    if hasattr(self, "_iter_named_params"):
        yield from self._iter_named_params()
        return
    for name, param in self.model.named_parameters():
        yield self._fix_param_name_to_vllm(name), param.data


def cpu_sync_weights(self):
    llm = self.llm
    params = [(name, p.detach().clone()) for name, p in _named_params(self)]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": params, "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def keep_plain_linear_weights(mp) -> None:
    """Install on ``mp`` (a pytest MonkeyPatch): vLLM's CPU GEMM dispatch
    (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``, imported by the layers at weight
    processing time) leaves plain 2-D linear weights in place and computes with ``F.linear`` on them."""
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:  # not a plain linear layer: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)

    mp.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)


def llm_with(llm_cls, **extra):
    """A stand-in for ``llm_cls`` that adds ``extra`` to the keyword arguments TRL passes (TRL sets none of them
    in colocate mode: the stand-in refuses to override one it did set)."""

    def build(*args, **kwargs):
        clash = sorted(set(kwargs) & set(extra))
        if clash:
            raise RuntimeError(f"TRL now passes {clash} to vllm.LLM itself; drop them from the test-side wrapper")
        return llm_cls(*args, **kwargs, **extra)

    return build


def one_plain_engine(mp, **engine_kwargs) -> dict:
    """Install on ``mp``: plain linear weights (``keep_plain_linear_weights``) and a stand-in for the constructor TRL
    calls that builds one engine (TRL's arguments plus ``engine_kwargs``) and hands it back to every later trainer.
    Returns the dict that holds it under "llm" once built."""
    import os

    from trl.generation import vllm_generation

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    keep_plain_linear_weights(mp)
    built, LLM = {}, vllm_generation.LLM

    def one_engine(*args, **kwargs):
        if "llm" not in built:
            built["llm"] = LLM(*args, **kwargs, **engine_kwargs)
        else:
            from vllm.utils.torch_utils import set_random_seed

            set_random_seed(built["llm"].llm_engine.model_config.seed)  # as a new engine's worker does
        return built["llm"]

    mp.setattr(vllm_generation, "LLM", one_engine)
    return built


class CauseLines(logging.Handler):
    """``with CauseLines() as lines:`` the messages logged on ``tim_plugins.causes`` (the causes' console lines)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        logging.getLogger("tim_plugins.causes").addHandler(self)
        return self.lines

    def __exit__(self, *exc) -> None:
        logging.getLogger("tim_plugins.causes").removeHandler(self)
