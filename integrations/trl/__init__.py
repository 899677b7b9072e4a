"""TRL adapter: ``trainer.add_callback(TIMCallback(trainer, TIMConfig(...)))`` on a ``GRPOTrainer``.

Importing this package needs ``transformers`` (the callback base class); ``trl`` itself is checked (installed,
version in the supported range) when a callback is created.
"""

from .callback import TIMCallback, TIMState
from .config import TIMConfig

__all__ = ["TIMCallback", "TIMConfig", "TIMState"]
