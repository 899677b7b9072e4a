"""Packaging: the hand-written package list covers the tree, pins agree with the version checks, and the core
imports no framework."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tim_plugins._optional import SUPPORTED_RANGES, check_version_range

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_list_covers_every_package_folder():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set()
    for top, prefix in (("tim_plugins", "tim_plugins"), ("integrations", "tim_plugins.integrations")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    assert listed == found


@pytest.mark.parametrize("dist", sorted(SUPPORTED_RANGES))
def test_extra_pins_match_supported_ranges(dist):
    low, high = SUPPORTED_RANGES[dist]
    extra = PYPROJECT["project"]["optional-dependencies"][dist]
    assert f"{dist}>={low},<{high}" in extra


def test_untested_major_version_fails_with_the_fix():
    with pytest.raises(RuntimeError, match=r"trl 2\.0\.0 is not supported.*pip install 'trl>=1\.16,<1\.17'"):
        check_version_range("trl", "2.0.0")
    assert check_version_range("trl", "1.16.3") == "1.16.3"
    with pytest.raises(RuntimeError, match="verl 0.10.0rc1"):
        check_version_range("verl", "0.10.0rc1")


def test_core_import_pulls_in_no_framework():
    code = (
        "import sys, tim_plugins, tim_plugins.metrics, tim_plugins.safe_vocab, tim_plugins.lr_control, "
        "tim_plugins.corrections, tim_plugins.parity, tim_plugins.dump, tim_plugins.cli, tim_plugins.measure, "
        "tim_plugins.rollout.vllm_min_p_config, tim_plugins.rollout.inject, tim_plugins.rollout.exact; "
        "bad = [m for m in ('trl', 'verl', 'vllm', 'ray', 'wandb', 'flash_attn', 'transformers') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_lists_every_subcommand():
    from tim_plugins.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"measure", "report", "audit", "check-batch-invariance", "lr-replay"} <= set(sub.choices)
