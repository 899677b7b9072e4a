"""The registries of private upstream uses and the code agree: every entry of ``TRL_SOURCES``, ``VERL_SOURCES``,
``VLLM_SOURCES``, ``TRANSFORMERS_SOURCES`` and ``BENCHMARK_SOURCES`` is named at a use site
(``<REGISTRY> <module>:<qualname>`` in a comment or docstring of the library, the adapters, the applications or the
benchmarks), and every such name is an entry. The entries themselves are checked against the installed frameworks
by ``test_trl_hook_guards.py``, ``test_vllm_sources.py``, ``test_transformers_sources.py``,
``test_benchmark_sources.py`` and ``verl_suite/test_verl_sources.py``; this test imports no framework.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_ROOTS = (ROOT / "tim_plugins", ROOT / "integrations", ROOT / "benchmarks")
# registry name -> the file that defines it
REGISTRIES = {
    "TRL_SOURCES": ROOT / "integrations" / "trl" / "hooks.py",
    "BENCHMARK_SOURCES": ROOT / "benchmarks" / "sources.py",
    "VERL_SOURCES": ROOT / "integrations" / "verl" / "sources.py",
    "VERL_MEGATRON_SOURCES": ROOT / "integrations" / "verl" / "sources.py",  # checked by tests/megatron_suite
    "VLLM_SOURCES": ROOT / "integrations" / "vllm" / "sources.py",
    "TRANSFORMERS_SOURCES": ROOT / "integrations" / "hf" / "sources.py",
}


def _registry(name: str) -> dict:
    """The registry, executed from its file alone: the sources modules import nothing (their packages would
    import the framework), the TRL hooks torch and the core (not TRL)."""
    spec = importlib.util.spec_from_file_location(f"_registry_{name}", REGISTRIES[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _named(name: str) -> dict[str, list[str]]:
    """'module:qualname' -> the files naming it after ``name``."""
    pattern = re.compile(rf"\b{name}\s+([A-Za-z_][\w.]*:[\w.]*)")
    found: dict[str, list[str]] = {}
    for root in CODE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            for ref in pattern.findall(path.read_text()):
                found.setdefault(ref.rstrip("."), []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("name", sorted(REGISTRIES))
def test_every_entry_is_named_where_it_is_used_and_every_name_is_an_entry(name):
    keys = {f"{module}:{qualname}" for module, qualname in _registry(name)}
    named = _named(name)
    assert sorted(set(named) - keys) == [], f"{name} names that are not entries (stale or mistyped)"
    assert sorted(keys - set(named)) == [], f"{name} entries named at no use site"

