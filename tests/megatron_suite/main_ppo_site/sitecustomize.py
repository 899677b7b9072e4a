"""Test-only start-up hook (never shipped) for ``test_megatron_main_ppo.py``: every Python process of a
``verl.trainer.main_ppo`` run with a Megatron actor (the driver, Ray's TaskRunner and workers, the vLLM server and
its engine-core process) gets this folder on PYTHONPATH, so Python imports this module at start-up. With
``TIM_TEST_CPU_SHIMS=1`` it installs the FSDP suite's CPU shims (``tests/verl_suite/cpu_site/cpu_shims.py``, vLLM's
plain linear weights included: verl's weight sync loads into them) and the Megatron ones
(``tests/megatron_suite/cpu_site/megatron_shims.py``), each right after its module's first import; with
``TIM_TEST_SYNC_SKIP`` as well, the FSDP suite's broken weight sync (``skip_sync.py``). Two differences
from the in-process suite, both because of how Ray runs these processes:

- The torch-level Megatron shims (``megatron_shims._torch_cuda`` and ``_cuda_free_optimizer``) wait for the first
  ``import torch``: Ray's own helper processes (dashboard agent, log monitor) never import torch, and importing it at
  their start-up delays the dashboard agent past the raylet's wait for its metrics port (the raylet then aborts:
  "Timed out waiting for file ... metrics_agent_port").
- ``_cuda_free_optimizer`` enters a ``TorchFunctionMode``, and torch keeps that mode stack per thread. verl's worker
  is an async Ray actor, whose synchronous methods (``init_model``, ``update_actor``) run on a thread pool, so the
  mode is entered in every thread started after torch is imported (without it Megatron's optimizer asks for
  ``device='cuda'``, megatron/core/optimizer/optimizer.py:702, and torch raises "Found no NVIDIA driver").
"""

import os
import sys

if os.environ.get("TIM_TEST_CPU_SHIMS") == "1":
    _SUITE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(os.path.dirname(_SUITE), "verl_suite", "cpu_site"), os.path.join(_SUITE, "cpu_site")]

    import cpu_shims
    import megatron_shims

    def _after_torch(_torch) -> None:
        import threading

        megatron_shims._torch_cuda()
        megatron_shims._cuda_free_optimizer()
        run = threading.Thread.run

        def run_with_cpu_devices(self):
            megatron_shims._cuda_free_optimizer()
            return run(self)

        threading.Thread.run = run_with_cpu_devices

    cpu_shims.HOOKS.update(megatron_shims.HOOKS)
    cpu_shims.HOOKS["torch"] = _after_torch
    if os.environ.get("TIM_TEST_SYNC_SKIP"):  # the FSDP suite's broken weight sync (skip_sync.py), same servers
        import skip_sync

        skip_sync.install()
    cpu_shims.install()
