"""Entry point of the ``verl.plugins`` group: ``import verl`` imports this in every process (driver, Ray workers)
(VERL_SOURCES verl: the entry-point loading in verl/__init__.py).

It notes the verl version (a warning outside the tested range, never a refusal), checks each feature's hooks
(``features.py``) and registers the tim engine (``EngineRegistry``) and the ``tim_<mode>`` trainer modes where they
hold.
Registration alone changes no numerics: the engine's hooks stay off until a tim trainer mode configures them.
verl logs plugin import errors at DEBUG level only, so failures are printed to stderr here and re-raised.
"""

from __future__ import annotations

import sys
import traceback

__all__ = ["REGISTERED", "V1_TRAINER_PACKAGES", "register", "register_deferred"]

REGISTERED: dict[str, object] = {}

# The modules a script may import before verl (to subclass an engine, say), each with the name it defines last: their
# own verl imports load verl's plugins, this one, while they are half-imported, and registering then would import
# them again half-built. The plugin defers instead, and each of them completes it when its import ends
# (``register_deferred`` on its last line).
_IMPORTED_BEFORE_VERL = {"engine_mixin": "TIMEngineMixin", "engine": "TIMFSDPEngineWithLMHead",
                         "megatron_engine": "TIMMegatronEngineWithLMHead"}
_DEFERRED: list[str] = []  # the half-imported module a registration waits for


def _half_imported() -> str | None:
    """The module of ``_IMPORTED_BEFORE_VERL`` whose import is in progress (in ``sys.modules`` without its class)."""
    package = __name__.rsplit(".", 1)[0]
    for name, defined in _IMPORTED_BEFORE_VERL.items():
        module = sys.modules.get(f"{package}.{name}")
        if module is not None and not hasattr(module, defined):
            return module.__name__
    return None


def register_deferred() -> None:
    """The registration a half-imported module deferred (``_IMPORTED_BEFORE_VERL``), once no such import is in
    progress: called by those modules when their import ends; nothing when none was deferred."""
    if _DEFERRED and _half_imported() is None:
        _DEFERRED.clear()
        register()

# Modules verl 0.9's V1 trainer (its default) imports without declaring them -> the distribution that provides
# each; the ``[verl]`` extra installs them.
V1_TRAINER_PACKAGES = {"transfer_queue": "TransferQueue", "zmq": "pyzmq", "msgspec": "msgspec",
                       "cachetools": "cachetools", "uvicorn": "uvicorn", "fastapi": "fastapi"}


def _missing_package_hint(err: ImportError) -> str:
    top = (getattr(err, "name", None) or "").split(".")[0]
    dist = V1_TRAINER_PACKAGES.get(top)
    if dist is None:
        return "pip install 'tim-plugins[verl]'"
    return f"pip install {dist} (or pip install 'tim-plugins[verl]', which includes it)"


def _register_megatron(off: dict) -> object | None:
    """The Megatron engine subclass, where verl's Megatron backend is installed (megatron-core; without it, nothing
    and no message: an FSDP user has no Megatron backend). A hook that moved switches it off with one line."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return None
    from tim_plugins.capabilities import check

    from .features import MEGATRON_ENGINE

    status = check(MEGATRON_ENGINE)
    if not status.available:
        print(status.warning(), file=sys.stderr)
        off[MEGATRON_ENGINE.name] = status
        return None
    from verl.workers.engine import EngineRegistry

    from .composed import MEGATRON_BACKEND
    from .megatron_engine import TIMMegatronEngineWithLMHead

    # verl registers its Megatron engine under the device-only key "cuda": the (device, vendor) key is new and is
    # looked up first, as for the FSDP engine above.
    # VERL_SOURCES verl.workers.engine.base:EngineRegistry.register
    EngineRegistry.register(model_type="language_model", backend=MEGATRON_BACKEND, device="cuda",
                            vendor="nvidia")(TIMMegatronEngineWithLMHead)
    return TIMMegatronEngineWithLMHead


def _vllm_replica_loader():
    """The loader registered under verl's rollout name ``vllm``: verl's replica with the tim server's parts whose hooks
    hold (the kept sets, the sync reads; checked here, when the rollout is built, the process that imports vLLM
    anyway), one line for each part that is off, verl's own replica when none holds."""
    from tim_plugins.capabilities import check

    from .features import ROLLOUT_KEPT_SETS, ROLLOUT_SYNC_READS

    statuses = {f.name: check(f) for f in (ROLLOUT_KEPT_SETS, ROLLOUT_SYNC_READS)}
    for status in statuses.values():
        if not status.available:
            print(status.warning(), file=sys.stderr)
    kept, reads = (statuses[f.name].available for f in (ROLLOUT_KEPT_SETS, ROLLOUT_SYNC_READS))
    if not (kept or reads):
        # VERL_SOURCES verl.workers.rollout.replica:_load_vllm
        from verl.workers.rollout.replica import _load_vllm

        return _load_vllm()
    from .rollout import replica_class

    return replica_class(kept_sets=kept, sync_reads=reads)


def _register_rollout() -> object | None:
    """Replace verl's loader for ``vllm`` by ours (the name stays ``vllm``: the user's ``rollout.name`` is unchanged).
    Nothing of vLLM is imported here. Inert where the engine returns no sampling mask (the server adds no field) and
    no actor asks for the sync reads."""
    try:
        # VERL_SOURCES verl.workers.rollout.replica:RolloutReplicaRegistry.register
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except Exception as err:  # the engine and trainer modes do not need it: verl's own vLLM replica stays
        print(f"tim-plugins: verl's rollout registry cannot be imported ({type(err).__name__}: {err}), so vLLM's "
              "kept sets are not carried into the batch (the trainer recomputes them) and the weight-sync check cannot "
              "read the engine", file=sys.stderr)
        return None
    RolloutReplicaRegistry.register("vllm", _vllm_replica_loader)
    return _vllm_replica_loader


def _guard_legacy_trainer(off: dict) -> object | None:
    """verl's legacy trainer (``trainer.use_v1=false``) consults no registry or plugin class, so a tim node there
    would be silently ignored: wrap the ``validate_config`` main_ppo calls on the composed config before it starts Ray
    (bound by name when main_ppo imports, after this plugin loaded) so that it stops with the fix first
    (``trainer.refuse_tim_node_under_legacy_trainer``). Kept for the process's life, like the registrations; a
    ``Patch``, so it can be undone. Returns it (None when the hook moved: one line, and the guard is off)."""
    import functools

    from tim_plugins.capabilities import check
    from tim_plugins.patching import Patch

    from .features import LEGACY_GUARD
    from .trainer import refuse_tim_node_under_legacy_trainer

    status = check(LEGACY_GUARD)
    if not status.available:
        print(status.warning(), file=sys.stderr)
        off[LEGACY_GUARD.name] = status
        return None
    # VERL_SOURCES verl.utils.config:validate_config (imported by `import verl` before the plugins load)
    # VERL_SOURCES verl.trainer.main_ppo:main
    import verl.utils.config as verl_config

    def make(original):
        @functools.wraps(original)
        def validate_config(config, *args, **kwargs):
            refuse_tim_node_under_legacy_trainer(config)
            return original(config, *args, **kwargs)

        return validate_config

    return Patch(verl_config, "validate_config", make)


def register() -> dict[str, object]:
    """Idempotent: registers once per process and returns what was registered ({} while deferred: verl loaded this
    plugin from inside a half-imported module of this package, ``register_deferred``)."""
    if REGISTERED:
        return REGISTERED
    half = _half_imported()
    if half is not None:
        _DEFERRED[:] = [half]
        return REGISTERED
    from tim_plugins._optional import note_version

    REGISTERED["verl_version"] = note_version("verl")
    from tim_plugins.capabilities import check

    from .features import ENGINE, TRAINER_MODES

    # Each feature is registered only where its hooks are where they were (features.py); one that moved is
    # reported in one line and left out, the others still register.
    off = {f.name: s for f in (ENGINE, TRAINER_MODES) if not (s := check(f)).available}
    for status in off.values():
        print(status.warning(), file=sys.stderr)
    REGISTERED["features_off"] = sorted(off)
    REGISTERED["engine"] = None
    if ENGINE.name not in off:
        from verl.workers.engine import EngineRegistry

        from .composed import FSDP_BACKENDS  # the backends the driver's check accepts (composed.py)
        from .engine import TIMFSDPEngineWithLMHead

        # A (device, vendor) key of our own: looked up before verl's device-only "cuda" entry, and new, so verl's
        # duplicate-key assertion does not trip.
        # VERL_SOURCES verl.workers.engine.base:EngineRegistry.register
        # VERL_SOURCES verl.workers.engine.base:EngineRegistry.get_engine_cls
        # VERL_SOURCES verl.plugin.platform.platform_cuda:PlatformCUDA.vendor_name
        EngineRegistry.register(model_type="language_model", backend=list(FSDP_BACKENDS), device="cuda",
                                vendor="nvidia")(TIMFSDPEngineWithLMHead)
        REGISTERED["engine"] = TIMFSDPEngineWithLMHead
    REGISTERED["megatron_engine"] = _register_megatron(off)
    REGISTERED["legacy_guard"] = _guard_legacy_trainer(off)
    REGISTERED["rollout_loader"] = _register_rollout()
    REGISTERED["features_off"] = sorted(off)
    if TRAINER_MODES.name in off:
        REGISTERED["trainer_modes"] = []
        return REGISTERED
    try:
        from .trainer import register_tim_trainers

        REGISTERED["trainer_modes"] = register_tim_trainers()
    except ImportError as err:  # the engine works without the V1 trainer; the tim_* trainer modes do not
        print(f"tim-plugins: verl's V1 trainer cannot be imported ({err}), so the tim_* trainer modes "
              f"(trainer.v1.trainer_mode=tim_sync ...) are not registered. Fix: {_missing_package_hint(err)}",
              file=sys.stderr)
        REGISTERED["trainer_modes"] = []
    return REGISTERED


try:
    register()
except Exception:
    print("tim-plugins: loading the verl plugin (tim_plugins.integrations.verl.plugin) failed:", file=sys.stderr)
    traceback.print_exc()
    raise
