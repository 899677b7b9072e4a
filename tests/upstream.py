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
    if key not in since:
        return True
    from packaging.version import Version

    installed = Version(importlib.import_module(framework).__version__).release
    return installed >= Version(since[key]).release


def has_until(framework: str, until: dict, key) -> bool:
    """Whether the installed ``framework`` still has the registry entry ``key``: True unless the ``until`` table
    (``VLLM_UNTIL``) names a release at or before the installed one."""
    if key not in until:
        return True
    from packaging.version import Version

    installed = Version(importlib.import_module(framework).__version__).release
    return installed < Version(until[key]).release
