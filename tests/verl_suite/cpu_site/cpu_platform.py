"""Test helper (not shipped to users): a CPU "platform" so verl 0.9.1's FSDP2 engine runs on a CPU-only machine.

verl has no CPU platform. Importing this module registers one under the name ``cpu``; select it with
``VERL_PLATFORM=cpu`` *before* verl first calls ``get_platform()`` (the platform is a cached singleton), and
``VERL_ENGINE_DEVICE=cuda`` so that ``EngineRegistry`` picks the cuda entry (it has no cpu key).
The engine does ``.to(get_device_id())``, so ``current_device()`` returns the string ``"cpu"``; the device-module
shim answers memory statistics with zeros and keeps the CPU RNG state (checkpoint load calls set_rng_state).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["CPUPlatform", "cpu_device_module", "enable_cpu_platform"]


def _zero(*_args, **_kwargs) -> int:
    return 0


def _noop(*_args, **_kwargs) -> None:
    return None


# torch.cuda look-alike for the calls verl makes on its "device module".
cpu_device_module = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    reset_peak_memory_stats=_noop,
    mem_get_info=lambda *a, **k: (0, 0),
    memory_stats=lambda *a, **k: {},
    is_initialized=lambda: True,
    get_device_name=lambda *a, **k: "CPU",  # verl/utils/flops_counter.py get_device_flops
    Stream=None,
)


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Never auto-detected: only VERL_PLATFORM=cpu selects it.
        return False

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's resource pool counts only GPU/NPU and a "CPU" entry would overwrite the bundle's CPU count
        # (single_controller/ray/base.py): the end-to-end test gives Ray one logical GPU instead.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def enable_cpu_platform() -> None:
    """Set the environment so verl picks this platform and the cuda engine entry (call before verl's first
    ``get_platform()``)."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")
