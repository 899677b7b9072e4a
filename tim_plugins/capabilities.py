"""Capability checks: is each upstream hook a feature relies on still there, with the shape the hook expects?

The adapters wrap or read private code of the frameworks (TRL, transformers, verl, vLLM), named in their
``*_SOURCES`` registries. Versions are never refused. Instead, when an adapter attaches, each feature it is about
to switch on is checked here: every `Hook` of the feature must resolve (module importable, attribute chain
present), take the parameters the hook passes or reads, and, where the hook relies on a statement, still contain
that source fragment. A feature whose hook moved is switched off on its own, with one warning that names the
feature, the symbol, the installed version and the fix (`Status.warning`); the adapter counts it under
``tim/diag/feature_off/<feature>``. Everything else keeps working.

This module knows no framework: the adapters supply the `Feature` tables (module and attribute names as data),
``tim-plugins doctor`` prints them.

    status = check(Feature("safe_vocab_fused_head", "safe vocabulary (TRL fused lm_head)", "trl",
                           (Hook("trl.trainer.utils", "_ChunkedLogProbFunction.forward", params=("bias",)),),
                           fix="upgrade TRL to >= 1.16"))
    if not status.available:
        logger.warning(status.warning())
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Callable

from tim_plugins._optional import package_version

__all__ = ["Feature", "Hook", "Status", "check", "registered_hooks", "resolve"]

logger = logging.getLogger(__name__)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def resolve(module: str, qualname: str):
    """The object ``module:qualname`` names (attribute chain, resolved as the owner exposes it). Raises LookupError
    with a one-line reason."""
    try:
        obj = importlib.import_module(module)
    except Exception as err:  # ImportError, or an error raised while the module imports
        raise LookupError(f"module {module} cannot be imported ({type(err).__name__}: {err})") from None
    owner = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{owner} has no attribute {part!r}")
        obj = getattr(obj, part)
        owner = f"{owner}.{part}"
    return obj


@dataclass(frozen=True)
class Hook:
    """One upstream symbol a feature wraps or reads, and what the hook assumes of it.

    Attributes:
        module: importable module name (``"trl.trainer.utils"``).
        qualname: attribute chain inside it (``"_ChunkedLogProbFunction.forward"``).
        params: parameter names the callable must declare (the hook passes or binds them by name).
        fragments: source fragments the hook relies on (compared without whitespace).
    """

    module: str
    qualname: str
    params: tuple[str, ...] = ()
    fragments: tuple[str, ...] = ()

    @property
    def symbol(self) -> str:
        return f"{self.module}:{self.qualname}"

    def problem(self) -> str | None:
        """None when the hook holds, else one line saying what moved."""
        try:
            obj = resolve(self.module, self.qualname)
        except LookupError as err:
            return f"{self.symbol} is missing: {err}"
        if self.params:
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):
                return f"{self.symbol} has no readable signature"
            # named explicitly: the hook binds or passes them by name (a **kwargs catch-all hides where they go)
            missing = [p for p in self.params if p not in sig.parameters]
            if missing:
                return f"{self.symbol}{sig} takes no {', '.join(missing)}"
        if self.fragments:
            try:
                source = _squash(inspect.getsource(obj))
            except (OSError, TypeError):
                return f"{self.symbol}: source not readable to check {self.fragments[0]!r}"
            for fragment in self.fragments:
                if _squash(fragment) not in source:
                    return f"{self.symbol} no longer contains {fragment!r}"
        return None


@dataclass(frozen=True)
class Feature:
    """A capability of an adapter and the hooks it needs (all of them).

    Attributes:
        name: short key (``tim/diag/feature_off/<name>``, the doctor's rows).
        title: what a user reads.
        package: the distribution whose version the warning names (``"trl"``).
        hooks: every upstream symbol the feature needs.
        fix: what makes it available again (an upgrade, a setting).
        needs: import names that must be installed first (``("trl",)``); missing -> off with the install fix.
        extra: the tim-plugins extra that installs them (for the fix line).
        probe: an optional extra check (no argument -> None or the reason it fails).
    """

    name: str
    title: str
    package: str
    hooks: tuple[Hook, ...] = ()
    fix: str = ""
    needs: tuple[str, ...] = ()
    extra: str = ""
    probe: Callable[[], str | None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Status:
    """Whether a feature can run here; ``reason`` and ``fix`` when it cannot."""

    feature: Feature
    available: bool
    reason: str | None = None
    fix: str | None = None
    version: str | None = None

    @property
    def name(self) -> str:
        return self.feature.name

    def warning(self) -> str:
        """The one warning an adapter emits when it switches the feature off."""
        installed = f"{self.feature.package} {self.version}" if self.version else f"{self.feature.package} (not installed)"
        return (f"tim_plugins: {self.feature.title} is off: {self.reason} ({installed}). Fix: {self.fix}. "
                f"Everything else keeps working; counted under tim/diag/feature_off/{self.feature.name}.")

    def line(self) -> str:
        """One row of ``tim-plugins doctor``."""
        if self.available:
            return f"  [ok]  {self.feature.title}"
        return f"  [off] {self.feature.title}: {self.reason}. Fix: {self.fix}"


def check(feature: Feature) -> Status:
    """Check every hook of ``feature`` against the installed packages (never raises)."""
    from tim_plugins._optional import is_available

    version = package_version(feature.package)
    for module in feature.needs:
        if not is_available(module):
            extra = f"pip install 'tim-plugins[{feature.extra}]'" if feature.extra else f"pip install {module}"
            return Status(feature, False, f"{module} is not installed", extra, version)
    for hook in feature.hooks:
        reason = hook.problem()
        if reason is not None:
            return Status(feature, False, reason, feature.fix or "report it with `tim-plugins doctor`'s output",
                          version)
    if feature.probe is not None:
        try:
            reason = feature.probe()
        except Exception as err:  # a probe that fails says why; it never raises into the caller
            reason = f"{type(err).__name__}: {err}"
        if reason is not None:
            return Status(feature, False, reason, feature.fix or "report it with `tim-plugins doctor`'s output",
                          version)
    return Status(feature, True, version=version)


def registered_hooks(registry, name: str) -> Callable[..., Hook]:
    """A `Hook` maker that accepts only entries of an adapter's sources ``registry`` (its dict keyed by (module,
    qualname)): every checked hook is a named, guarded source. ``name`` is the registry's, for the error."""

    def hook(module: str, qualname: str, **kwargs) -> Hook:
        if (module, qualname) not in registry:
            raise KeyError(f"{module}:{qualname} is not in {name}")
        return Hook(module, qualname, **kwargs)

    return hook
