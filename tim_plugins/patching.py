"""The one reversible patch the adapters put on framework objects: ``setattr(owner, name, make(original))`` with an
exact undo. Framework-free (any object or module); both the TRL adapter (``integrations/trl/hooks.py``) and the HF
adapter (``integrations/hf/recorder.py``) use it, since adapters never import each other.

An instance attribute shadows the class's for that object only, so patching an *instance* leaves every other object
of the class untouched; ``undo`` restores exactly what was there: the object's own previous attribute, or nothing
(the instance attribute is deleted, the class's shows through again). Used as a context manager it is undone on
every exit of the block, an exception included.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

__all__ = ["Patch"]

logger = logging.getLogger(__name__)


def _owner_name(obj: Any) -> str:
    if inspect.ismodule(obj) or inspect.isclass(obj):
        return obj.__name__
    return type(obj).__name__


class Patch:
    """``setattr(obj, name, make(original))`` now; ``undo()`` restores an own attribute or deletes ours (idempotent).

    ``original`` is what ``getattr(obj, name)`` gave before (a bound method for an instance), ``replacement`` what
    ``make`` returned. If someone else replaced ``obj.name`` after us, ``undo`` warns and restores anyway: the state
    before our patch is the one the owner expects back."""

    def __init__(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.obj, self.name = obj, name
        own = obj.__dict__
        self._had_own = name in own
        self._previous = own.get(name)
        self.original = getattr(obj, name)
        self.replacement = make(self.original)
        setattr(obj, name, self.replacement)
        self.active = True

    @property
    def label(self) -> str:
        """``Owner.name`` (the module's or class's own name, else the object's type)."""
        return f"{_owner_name(self.obj)}.{self.name}"

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        if getattr(self.obj, self.name, None) is not self.replacement:
            logger.warning("tim_plugins: %s was re-patched by someone else; restoring the value before ours anyway",
                           self.label)
        if self._had_own:
            setattr(self.obj, self.name, self._previous)
        else:
            delattr(self.obj, self.name)

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()
