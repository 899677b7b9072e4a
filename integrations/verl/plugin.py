"""Entry point of the ``verl.plugins`` group: ``import verl`` imports this in every process (driver, Ray workers).

It checks the verl version, registers the tim engine (``EngineRegistry``) and the ``tim_<mode>`` trainer modes.
Registration alone changes no numerics: the engine's hooks stay off until a tim trainer mode configures them.
verl logs plugin import errors at DEBUG level only, so failures are printed to stderr here and re-raised.
"""

from __future__ import annotations

import sys
import traceback

__all__ = ["REGISTERED", "register"]

REGISTERED: dict[str, object] = {}


def register() -> dict[str, object]:
    """Idempotent: registers once per process and returns what was registered."""
    if REGISTERED:
        return REGISTERED
    from tim_plugins._optional import check_version_range

    REGISTERED["verl_version"] = check_version_range("verl")
    from verl.workers.engine import EngineRegistry

    from .engine import TIMFSDPEngineWithLMHead

    # vendor-specific key: looked up before verl's own ("cuda") entry, and no duplicate-key assertion
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda",
                            vendor="nvidia")(TIMFSDPEngineWithLMHead)
    REGISTERED["engine"] = TIMFSDPEngineWithLMHead
    try:
        from .trainer import register_tim_trainers

        REGISTERED["trainer_modes"] = register_tim_trainers()
    except ImportError as err:  # the V1 trainer needs TransferQueue; the engine works without it
        print(f"tim-plugins: verl V1 trainer unavailable ({err}); tim_* trainer modes not registered",
              file=sys.stderr)
        REGISTERED["trainer_modes"] = []
    return REGISTERED


try:
    register()
except Exception:
    print("tim-plugins: loading the verl plugin (tim_plugins.integrations.verl.plugin) failed:", file=sys.stderr)
    traceback.print_exc()
    raise
