"""Code as other libraries leave it, for the capability checks' tests: a method wrapped with or without
``functools.wraps`` (and with the original out of any check's reach), and TRL's GRPOTrainer rebuilt from its module's
own source after an edit, as patching libraries rebuild trainer classes (``inspect.getsource`` of the module, edit
the text, compile it into a new module), from a string (its source then unreadable) or from a file."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types
from typing import Callable


def plain(original):
    """A wrapper without ``functools.wraps``: the original only in its closure."""
    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    return wrapper


def wraps(original):
    """A wrapper with ``functools.wraps`` (``__wrapped__`` leads to the original)."""
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    return wrapper


def opaque(original):
    """A wrapper that keeps the original where no check can tell it from any other value (no closure to it, no
    global, no ``__wrapped__``)."""
    registry = {"original": original}

    def wrapper(self, *args, **kwargs):
        return registry["original"](self, *args, **kwargs)

    return wrapper


def rebuilt_grpo_module(edit: Callable[[str], str], monkeypatch, tmp_path=None, name: str = "rebuilt_grpo_trainer",
                        register: bool = True) -> types.ModuleType:
    """``trl.trainer.grpo_trainer`` rebuilt from ``edit(its source)`` into the new module ``trl.trainer.<name>``:
    compiled from a string when ``tmp_path`` is None, else loaded from a file written there; ``register``: put in
    ``sys.modules`` (undone by ``monkeypatch``), as a library that imports its rebuilt file does."""
    import trl.trainer.grpo_trainer as grpo

    text = inspect.getsource(grpo)
    edited = edit(text)
    assert edited != text, "the edit changed nothing"
    full = f"trl.trainer.{name}"
    if tmp_path is None:
        module = types.ModuleType(full)
        module.__package__ = "trl.trainer"  # its relative imports resolve as the original's
        if register:
            monkeypatch.setitem(sys.modules, full, module)
        exec(compile(edited, f"<{name}>", "exec", dont_inherit=True), module.__dict__)  # noqa: S102
        return module
    path = tmp_path / f"{name}.py"
    path.write_text(edited)
    spec = importlib.util.spec_from_file_location(full, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        monkeypatch.setitem(sys.modules, full, module)
    spec.loader.exec_module(module)
    return module


def replace_grpo_trainer(cls, monkeypatch) -> None:
    """Make ``cls`` TRL's GRPOTrainer where users and the adapter's checks import it (as patching libraries do)."""
    import trl
    import trl.trainer
    import trl.trainer.grpo_trainer as grpo

    for owner in (grpo, trl.trainer, trl):
        monkeypatch.setattr(owner, "GRPOTrainer", cls)
