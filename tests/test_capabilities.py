"""The core capability checks (``tim_plugins.capabilities``) on a small package written here, as other libraries
leave upstream code: wrapped with and without ``functools.wraps``, rebuilt from its own source (from a string or a
file), changed in its own file (a release that moved a statement), and live objects missing an attribute.

Each check is compared with what the package's code really is (the test wrote it), and each fix with the rule: it
names something that changes here (the wrapper, the rebuilt class, a reinstall, an install of another release),
never an install of the release already installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import textwrap
import types

import pytest
from touched import opaque, plain, wraps

from tim_plugins import capabilities
from tim_plugins.capabilities import Feature, Hook, check, look_through, upstream_source

PKG = "tim_fakepkg"
SOURCE = '''
import dataclasses


class Trainer:
    def __init__(self, args):
        self.top_p = args["top_p"]
        self.use_vllm = args["use_vllm"]

    def step(self, model, inputs):
        advantages = inputs["advantages"]
        return model(advantages)

    def log(self, logs):
        return dict(logs)


@dataclasses.dataclass
class Output:
    token_ids: list
    extra_fields: dict
'''
STEP = Hook(f"{PKG}.mod", "Trainer.step", params=("model", "inputs"), fragments=('inputs["advantages"]',))
INIT = Hook(f"{PKG}.mod", "Trainer.__init__", attrs=("trainer.top_p", "trainer.use_vllm"))
FEATURE = Feature("step", "the step hook", PKG, hooks=(STEP,), fix=f"pip install -U '{PKG}>=2.0'")


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """The package, importable, at version 2.1 (a release its feature's fix would install)."""
    root = tmp_path / PKG
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (PKG, f"{PKG}.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(f"{PKG}.mod")
    real = capabilities.package_version
    monkeypatch.setattr(capabilities, "package_version", lambda dist: "2.1" if dist == PKG else real(dist))
    return module


def _holds(feature=FEATURE, live=None):
    status = check(feature, live)
    assert status.available, status.warning()
    return status


# ------------------------------------------------------------------------------------------------------ wrappers
def _nested(original):
    return plain(plain(original))


@pytest.mark.parametrize("wrap", [plain, wraps, _nested], ids=lambda f: f.__name__)
def test_checks_read_through_wrappers(pkg, monkeypatch, wrap):
    original = pkg.Trainer.step
    monkeypatch.setattr(pkg.Trainer, "step", wrap(original))
    assert look_through(pkg.Trainer.step, "step") == (original, None)
    assert upstream_source(f"{PKG}.mod", "Trainer.step") == inspect.getsource(original)
    _holds()


def test_a_module_level_wrapper_is_read_through_its_globals(pkg, tmp_path, monkeypatch):
    """A script's ``orig = Trainer.step; def wrapper(...): return orig(...)``: the original is a module global."""
    (tmp_path / "user_patch.py").write_text(textwrap.dedent(f"""
        from {PKG}.mod import Trainer
        orig = Trainer.step
        def wrapper(self, model, inputs):
            return orig(self, model, inputs)
        Trainer.step = wrapper
    """))
    original = pkg.Trainer.step
    monkeypatch.setattr(pkg.Trainer, "step", original)  # undone after the test
    monkeypatch.delitem(sys.modules, "user_patch", raising=False)
    importlib.import_module("user_patch")
    assert pkg.Trainer.step is not original and look_through(pkg.Trainer.step, "step") == (original, None)
    _holds()


def test_an_opaque_wrapper_is_named_with_a_fix_aimed_at_it(pkg, monkeypatch):
    monkeypatch.setattr(pkg.Trainer, "step", opaque(pkg.Trainer.step))
    target, site = look_through(pkg.Trainer.step, "step")
    assert target is pkg.Trainer.step and site.startswith("touched.opaque.<locals>.wrapper (")
    status = check(FEATURE)
    assert not status.available
    # what it saw: the wrapper's signature hides the parameters, and no __wrapped__ leads on
    assert f"{PKG}.mod:Trainer.step(self, *args, **kwargs) takes no model, inputs" in status.reason
    assert "wrapped by" in status.reason and "touched.opaque.<locals>.wrapper" in status.reason
    assert "functools.wraps" in status.fix and "pip install" not in status.fix
    # and the fragment alone (a hook that binds no parameter): the wrapper's source lacks it
    fragment_only = dataclasses.replace(FEATURE, hooks=(Hook(f"{PKG}.mod", "Trainer.step",
                                                             fragments=('inputs["advantages"]',)),))
    status = check(fragment_only)
    assert "no longer contains 'inputs[\"advantages\"]': it is wrapped by" in status.reason
    assert "functools.wraps" in status.fix


# ------------------------------------------------------------------------------------------------ rebuilt classes
def _rebuilt(edit, tmp_path=None, name="rebuilt_mod"):
    text = edit(SOURCE)
    module = types.ModuleType(name)
    if tmp_path is None:
        exec(compile(text, f"<{name}>", "exec", dont_inherit=True), module.__dict__)
    else:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        exec(compile(text, str(path), "exec", dont_inherit=True), module.__dict__)
    return module


def test_a_class_rebuilt_from_a_string_reads_its_unchanged_methods_from_the_package(pkg, monkeypatch):
    """Compiled from a string, the rebuilt methods have no readable source; those whose code is the package's own
    are read from the package's file (one unrelated line changed elsewhere)."""
    rebuilt = _rebuilt(lambda s: s.replace("return dict(logs)", "return {**logs, 'patched': 1}"))
    with pytest.raises(OSError):
        inspect.getsource(rebuilt.Trainer.step)
    own = inspect.getsource(pkg.Trainer.step)
    monkeypatch.setattr(pkg, "Trainer", rebuilt.Trainer)
    assert upstream_source(f"{PKG}.mod", "Trainer.step") == own
    _holds()
    # the changed method: unreadable, and not the package's code
    log = dataclasses.replace(FEATURE, hooks=(Hook(f"{PKG}.mod", "Trainer.log", fragments=("dict(logs)",)),))
    status = check(log)
    assert not status.available
    assert "rebuilt_mod.Trainer.log (<rebuilt_mod>:" in status.reason and "source is unreadable" in status.reason
    assert f"not {PKG}'s own" in status.reason and "from a file" in status.fix and "pip install" not in status.fix


def test_a_fragment_deleted_in_a_rebuilt_class_names_the_statement_and_the_class(pkg, monkeypatch, tmp_path):
    rebuilt = _rebuilt(lambda s: s.replace('inputs["advantages"]', 'inputs.get("advantages")'), tmp_path)
    monkeypatch.setattr(pkg, "Trainer", rebuilt.Trainer)
    status = check(FEATURE)
    assert not status.available
    assert f"{PKG}.mod:Trainer.step no longer contains 'inputs[\"advantages\"]'" in status.reason
    assert f"rebuilt_mod.Trainer.step ({tmp_path / 'rebuilt_mod.py'}:" in status.reason
    assert f"not {PKG}'s own code" in status.reason
    assert "keep the statement 'inputs[\"advantages\"]' where" in status.fix and "pip install" not in status.fix


def test_code_compiled_under_the_package_file_s_name_is_not_read_at_the_wrong_lines(pkg, monkeypatch):
    """A rebuilt class compiled under the original file's name, its lines shifted: getsource would read another
    function's lines there; the check reads the package's own code where it is the same."""
    path = inspect.getsourcefile(pkg)
    module = types.ModuleType("shifted")
    exec(compile("\n" * 4 + SOURCE, path, "exec", dont_inherit=True), module.__dict__)
    # step's first line, 4 lines down, is log's in the file: getsource reads log there
    assert inspect.getsource(module.Trainer.step).lstrip().startswith("def log(")
    monkeypatch.setattr(pkg, "Trainer", module.Trainer)
    assert upstream_source(f"{PKG}.mod", "Trainer.step").lstrip().startswith("def step(")
    _holds()


# ----------------------------------------------------------------------------------------------- a real move
def _moved(pkg, edit):
    path = inspect.getsourcefile(pkg)
    with open(path, "w") as fh:
        fh.write(edit(SOURCE))
    return importlib.reload(pkg)


def test_a_statement_moved_in_the_package_s_own_file(pkg):
    """The package's own file without the statement (a release that moved it): the reason names the statement;
    the fix depends on the installed release, never installing it again."""
    _moved(pkg, lambda s: s.replace('advantages = inputs["advantages"]', 'advantages = inputs.get("advantages")'))
    status = check(FEATURE)
    assert status.reason == f"{PKG}.mod:Trainer.step no longer contains 'inputs[\"advantages\"]'"
    # 2.1 is a release the fix (>= 2.0) would install: reinstall, or report
    assert "pip install -U" not in status.fix and f"--force-reinstall --no-deps '{PKG}==2.1'" in status.fix


@pytest.mark.parametrize("version,expected", [
    ("1.5", f"pip install -U '{PKG}>=2.0'"),  # older than the fix's releases: the upgrade changes something
    ("2.1", f"--force-reinstall --no-deps '{PKG}==2.1'"),  # one of them: reinstall
    ("3.2", f"pip install '{PKG}>=2.0,<3.0' (the tested releases)"),  # newer than the tested range
])
def test_the_fix_for_a_moved_hook_by_installed_release(pkg, monkeypatch, version, expected):
    monkeypatch.setattr(capabilities, "package_version", lambda dist: version if dist == PKG else None)
    monkeypatch.setitem(capabilities.SUPPORTED_RANGES, PKG, ("1.0", "3.0"))
    monkeypatch.delattr(pkg.Trainer, "step")
    status = check(FEATURE)
    assert status.reason == f"{PKG}.mod:Trainer.step is missing: {PKG}.mod.Trainer has no attribute 'step'"
    assert expected in status.fix
    assert f"({PKG} {version})" in status.warning()


def test_a_moved_hook_of_another_package_keeps_the_feature_s_fix(pkg):
    """The feature's fix installs this package (met), but the hook that moved is another package's (the stdlib's
    json here): the installed release of this one is not what moved, so the fix stays the feature's."""
    feature = dataclasses.replace(FEATURE, hooks=(Hook("json.decoder", "JSONDecoder.no_such_method"),))
    assert check(feature).fix == FEATURE.fix


def test_a_module_that_does_not_import_keeps_the_feature_s_fix(pkg, monkeypatch):
    """An import failure is a missing dependency, which the feature's fix installs, whatever the release."""
    feature = dataclasses.replace(FEATURE, hooks=(Hook(f"{PKG}.absent", "thing"),), fix="install the backend")
    status = check(feature)
    assert status.reason.startswith(f"{PKG}.absent:thing is missing: module {PKG}.absent cannot be imported")
    assert status.fix == "install the backend"


@pytest.mark.parametrize("version,since,until,checked", [
    ("2.1", None, "2.2", True), ("2.2.0", None, "2.2", False), ("2.10", None, "2.9", False),  # 10 > 9, not text
    ("2.1", "2.1", None, True), ("2.0.9", "2.1", None, False), ("2.1.0rc1", "2.1", "3", True),
    (None, "2.1", "2.2", True),  # an unknown release: checked
])
def test_a_hook_is_checked_only_in_the_releases_it_is_needed_in(pkg, monkeypatch, version, since, until, checked):
    """A hook with ``since`` / ``until`` (a symbol the package added, or a code path it removed) is checked only in
    [since, until) of the installed release: outside, a missing symbol leaves the feature on."""
    monkeypatch.setattr(capabilities, "package_version", lambda dist: version if dist == PKG else None)
    moved = Hook(f"{PKG}.mod", "Trainer.removed_path", since=since, until=until)
    feature = dataclasses.replace(FEATURE, hooks=(STEP, moved))
    assert moved.needed_in(version) is checked
    status = check(feature)
    assert status.available is not checked
    if checked:
        assert "Trainer.removed_path is missing" in status.reason


def test_registered_hooks_take_since_and_until_from_the_registry_s_tables():
    registry = {("m", "A"): "", ("m", "B"): "", ("m", "C"): ""}
    hook = capabilities.registered_hooks(registry, "REG", since={("m", "B"): "0.31"}, until={("m", "C"): "0.34"})
    assert (hook("m", "A").since, hook("m", "A").until) == (None, None)
    assert hook("m", "B").since == "0.31" and hook("m", "C").until == "0.34"
    with pytest.raises(KeyError, match="m:D is not in REG"):
        hook("m", "D")


# --------------------------------------------------------------------------------------------- live objects
def test_attributes_are_read_on_the_live_object(pkg, monkeypatch):
    feature = dataclasses.replace(FEATURE, hooks=(INIT,))
    # __init__ wrapped so that no check could read its source: the live object decides
    monkeypatch.setattr(pkg.Trainer, "__init__", opaque(pkg.Trainer.__init__))
    trainer = pkg.Trainer({"top_p": 0.9, "use_vllm": False})
    doctor = _holds(feature)
    assert doctor.deferred == ("trainer.top_p", "trainer.use_vllm")
    assert "checked when attaching: trainer.top_p, trainer.use_vllm" in doctor.line()
    assert _holds(feature, {"trainer": trainer}).deferred == ()
    del trainer.top_p
    status = check(feature, {"trainer": trainer})
    assert status.reason == f"trainer.top_p is missing on the live Trainer ({PKG}.mod:Trainer.__init__ sets it)"
    # 2.1 should set it: the fix is about what removed it, not an install
    assert status.fix.startswith(f"keep trainer.top_p as {PKG}.mod:Trainer.__init__ sets it")
    assert "[off] the step hook: trainer.top_p is missing" in status.line() and status.fix in status.line()


def test_an_unreadable_live_attribute_is_reported(pkg):
    class Raises:
        @property
        def use_vllm(self):
            raise RuntimeError("not yet")

        top_p = 1.0

    status = check(dataclasses.replace(FEATURE, hooks=(INIT,)), {"trainer": Raises()})
    assert status.reason == "trainer.use_vllm cannot be read on the live object (RuntimeError: not yet)"


def test_fields_are_read_on_the_class(pkg, monkeypatch):
    feature = dataclasses.replace(FEATURE, hooks=(Hook(f"{PKG}.mod", "Output", fields=("token_ids", "extra_fields")),))
    _holds(feature)

    @dataclasses.dataclass
    class Output:  # a release without extra_fields
        token_ids: list

    monkeypatch.setattr(pkg, "Output", Output)
    assert check(feature).reason == f"{PKG}.mod:Output declares no field extra_fields"
