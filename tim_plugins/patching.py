"""The one reversible patch the adapters put on framework objects: ``setattr(owner, name, make(original))`` with an
exact undo. Framework-free (any object or module); both the TRL adapter (``integrations/trl/hooks.py``) and the HF
adapter (``integrations/hf/recorder.py``) use it, since adapters never import each other.

An instance attribute shadows the class's for that object only, so patching an *instance* leaves every other object
of the class untouched; ``undo`` restores exactly what was there: the object's own previous attribute, or nothing
(the instance attribute is deleted, the class's shows through again). Used as a context manager it is undone on
every exit of the block, an exception included.

``Installation``: the patches one callback holds on a trainer with a ``train()`` method (transformers' ``Trainer``
and the TRL trainers built on it), all of them undone on every exit of ``train()``.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any, Callable

__all__ = ["Installation", "Patch"]

logger = logging.getLogger(__name__)

# Our live patches per (object, attribute), in the order they went on: two trainers in one process (on two threads)
# patch the same class or module attribute, and their undos need not come in reverse order. Weak references: a patch
# that nobody holds any more (a trainer dropped without detach) must not keep its trainer, and its model, alive.
_LIVE: dict[tuple[int, str], list[weakref.ref]] = {}
_LIVE_LOCK = threading.Lock()


def _owner_name(obj: Any) -> str:
    if inspect.ismodule(obj) or inspect.isclass(obj):
        return obj.__name__
    return type(obj).__name__


class Patch:
    """``setattr(obj, name, make(original))`` now; ``undo()`` restores an own attribute or deletes ours (idempotent).

    ``original`` is what ``getattr(obj, name)`` gave before (a bound method for an instance), ``replacement`` what
    ``make`` returned. If someone else replaced ``obj.name`` after us, ``undo`` warns and restores anyway: the state
    before our patch is the one the owner expects back. If another ``Patch`` of ours went on after this one and is
    still on, ``undo`` leaves the attribute to it and hands it what to restore (this patch's previous state), so the
    two undos restore the original in either order; this patch's wrapper stays inside the later one's until that
    one is undone."""

    def __init__(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.obj, self.name = obj, name
        own = obj.__dict__
        self._had_own = name in own
        self._previous = own.get(name)
        self.original = getattr(obj, name)
        self.replacement = make(self.original)
        setattr(obj, name, self.replacement)
        self.active = True
        with _LIVE_LOCK:
            _LIVE.setdefault((id(obj), name), []).append(weakref.ref(self))

    @property
    def label(self) -> str:
        """``Owner.name`` (the module's or class's own name, else the object's type)."""
        return f"{_owner_name(self.obj)}.{self.name}"

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        key = (id(self.obj), self.name)
        with _LIVE_LOCK:
            # the live ones on this very object (an id can be reused once its object is gone), in order
            live = [p for p in (r() for r in _LIVE.get(key, [])) if p is not None and p.obj is self.obj]
            at = next(i for i, p in enumerate(live) if p is self)
            later = live[at + 1] if at + 1 < len(live) else None
            del live[at]
            if live:
                _LIVE[key] = [weakref.ref(p) for p in live]
            else:
                _LIVE.pop(key, None)
            if later is not None:  # ours on top of this one: it restores what this one would have
                later._had_own, later._previous = self._had_own, self._previous
                return
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


class Installation:
    """The patches one callback holds on its trainer, all of them inside ``train()``: a wrapper of ``train`` itself
    (from creation until ``remove``) installs the ``before_train`` patches when ``train()`` is entered (what TRL
    reads before any callback event, e.g. the dataloader's source) and undoes every patch on every exit of
    ``train()`` (transformers skips ``on_train_end`` when ``train()`` raises); the wrappers of the training run
    proper are installed at train begin (``install``) and undone at train end (``undo``)."""

    def __init__(self, trainer, before_train: Callable[[], list] | None = None) -> None:
        self.trainer = trainer
        self.before_train = before_train  # () -> [(owner, name, make_wrapper)], installed as train() starts
        self.patches: list[Patch] = []  # installed at train begin
        self.train_patches: list[Patch] = []  # installed as train() starts
        self._train = Patch(trainer, "train", self._guard)

    def _guard(self, original):
        def train(*args, **kwargs):
            try:
                if self.before_train is not None and not self.train_patches:
                    for owner, name, make in self.before_train():
                        self.train_patches.append(Patch(owner, name, make))
                return original(*args, **kwargs)
            finally:  # on success on_train_end has undone them already
                self.undo()

        return train

    def install(self, wrappers: list[tuple[Any, str, Callable]]) -> None:
        """``(owner, name, make_wrapper)`` in order (a later wrapper of the same name goes around an earlier one)."""
        for owner, name, make in wrappers:
            self.patches.append(Patch(owner, name, make))

    def undo(self) -> None:
        """Undo every patch but the ``train`` guard, the latest first."""
        for patches in (self.patches, self.train_patches):
            while patches:
                patches.pop().undo()

    def remove(self) -> None:
        """Undo everything, the ``train`` guard too (idempotent)."""
        self.undo()
        if self._train is not None:
            self._train.undo()
            self._train = None

    @property
    def installed(self) -> list[str]:
        """What is wrapped now, as ``Owner.name`` (the module's or class's name for one of theirs)."""
        return [p.label for p in self.train_patches + self.patches]
