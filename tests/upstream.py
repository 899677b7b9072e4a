"""Reading an upstream framework's source for the guard tests (``test_*_sources.py``): each private use named in a
``*_SOURCES`` registry is resolved by module and qualified name, and its source text checked for the lines the
adapter relies on."""

from __future__ import annotations

import importlib
import inspect
import re

__all__ = ["flat", "has_since", "has_until", "resolve", "source"]


def resolve(module: str, qualname: str):
    """The object at ``module:qualname`` (``Class.method`` walks attributes); AttributeError when it is gone."""
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def source(module: str, qualname: str) -> str:
    """The source text of ``module:qualname`` (a property's getter)."""
    obj = resolve(module, qualname)
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.getsource(obj)


def flat(text: str) -> str:
    """Source with every run of whitespace collapsed to one space (statements split over lines compare)."""
    return re.sub(r"\s+", " ", text)


def has_since(framework: str, since: dict, key) -> bool:
    """Whether the installed ``framework`` (its ``__version__``) has the registry entry ``key``: True unless the
    ``since`` table (``VLLM_SINCE``, ...) names a later release for it."""
    return key not in since or _installed(framework) >= _release(since[key])


def has_until(framework: str, until: dict, key) -> bool:
    """Whether the installed ``framework`` still has the registry entry ``key``: True unless the ``until`` table
    (``VLLM_UNTIL``) names a release at or before the installed one."""
    return key not in until or _installed(framework) < _release(until[key])


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def _installed(framework: str) -> tuple[int, ...]:
    return _release(importlib.import_module(framework).__version__)
