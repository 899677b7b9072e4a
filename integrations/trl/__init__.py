"""TRL adapter: ``trainer.add_callback(TIMCallback(trainer, TIMConfig(...)))`` on a ``GRPOTrainer``.

Taking ``TIMCallback`` or ``TIMConfig`` from it needs ``transformers`` (the callback base class); ``trl`` itself is
checked (installed, version in the supported range) when a callback is created. Importing the package alone imports
neither, so its data module ``.fixes`` loads without them (the offline report).
"""

from importlib import import_module

__all__ = ["TIMCallback", "TIMConfig", "TIMState", "engine_kept_sets"]

_HOME = {"TIMCallback": ".callback", "TIMState": ".callback", "TIMConfig": ".config",
         "engine_kept_sets": ".kept_sets"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
