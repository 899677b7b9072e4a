"""Old import paths of code that left the core for an adapter (#38: no framework knowledge in the core).

The core may not re-export what moved (it never imports an adapter, ``tests/test_layering.py``), so a module that
lost public names lists them with their new module, and its ``__getattr__`` turns an import of one into an
ImportError that names where it went: ``from tim_plugins.parity import spec_from_hf_model`` fails with the line to
write instead, not with a bare "cannot import name". An ImportError, not an AttributeError: ``from m import x``
replaces an AttributeError by its own message.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["moved_attribute"]


def moved_attribute(module: str, name: str, moved: dict[str, str]) -> NoReturn:
    """For a module's ``__getattr__``: ImportError naming the new home of ``name`` if ``moved`` (name -> new module)
    lists it, else the usual AttributeError."""
    if name in moved:
        raise ImportError(f"{module}.{name} moved to {moved[name]} (framework code lives in the adapters): "
                          f"from {moved[name]} import {name}", name=module)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
