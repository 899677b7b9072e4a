"""Deprecated aliases of modules that moved to an adapter: the old import path keeps working for one release."""

from __future__ import annotations

import importlib
import warnings

__all__ = ["moved_to"]


def moved_to(old: str, new: str, names: tuple[str, ...]):
    """A module ``__getattr__`` for the alias module ``old``: each of ``names`` is ``new``'s own object, imported
    when first asked for (so importing the alias imports nothing of the adapter or its framework), with a
    DeprecationWarning that names the new path."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old} is deprecated and will be removed in the next release: import {name} from {new} "
                      f"(in vLLM's logits_processors: '{new}:{name}').", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
