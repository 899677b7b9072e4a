"""Every subcommand answers a typical wrong input with one line (the bad value, the rule, the fix), exit status 2
and no traceback; ``--debug`` keeps the traceback. Run as a user would: the installed entry point's module in a
subprocess (its own process group, killed on timeout)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bounded import run_bounded

TIMEOUT_S = 180


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    proc, timed_out = run_bounded([sys.executable, "-m", "tim_plugins.apps.cli", *args], TIMEOUT_S, merge_stderr=False,
                                  cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline"})
    if timed_out:
        pytest.fail(f"tim-plugins {' '.join(args)} ran past {TIMEOUT_S} s")
    return proc

CASES = [
    # (argv, text the single error line must contain)
    (["measure", "--model", "/nonexistent"], ["'/nonexistent'", "no such local folder or file", "pass a local"]),
    (["measure", "--min-p", "1.5"], ["--min-p 1.5", "[0, 1)", "e.g. 0.001"]),
    (["measure", "--compare", "hf-bf16,sglang"], ["--compare item 'sglang'", "unknown rollout 'sglang'", "e.g. --compare"]),
    (["measure", "--min-new-tokens", "80", "--max-new-tokens", "64"], ["--min-new-tokens 80", "--max-new-tokens"]),
    (["measure", "--rollout", "sglang"], ["invalid choice: 'sglang'", "--help"]),
    (["measure", "--num-prompts", "x"], ["--num-prompts", "invalid int value: 'x'"]),
    (["demo", "--steps", "0"], ["--steps 0", ">= 1"]),
    (["demo", "--model", "/nonexistent"], ["'/nonexistent'", "no such local folder or file"]),
    (["report", "EMPTY"], ["neither summary.json nor dump files", "point at"]),
    (["report", "/nonexistent"], ["'/nonexistent'", "no such folder"]),
    (["audit"], ["one of the arguments --verl --trl-config --vllm-args is required"]),
    (["audit", "--vllm-args", "--dtype bfloat16", "--sampling", "{bad"], ["--sampling '{bad'", "is not JSON"]),
    (["check-batch-invariance", "--model", "/nonexistent"], ["'/nonexistent'", "does not exist"]),
    (["lr-replay", "/nonexistent.jsonl"], ["'/nonexistent.jsonl': no such file", "pass a per-step metrics file"]),
    (["lr-replay", "EMPTY"], ["'EMPTY': a folder, not a file", ".jsonl", "trainer_state.json"]),
]


@pytest.mark.parametrize("argv,needles", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_exit_2_no_traceback(argv, needles, tmp_path):
    (tmp_path / "EMPTY").mkdir()
    res = _run(argv, tmp_path)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert len(lines) == 1, res.stderr
    assert "[Errno" not in lines[0]  # the raw OS error is no explanation: the line names the file and the fix
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_missing_local_model_is_named_as_such_and_debug_keeps_the_traceback(tmp_path):
    res = _run(["measure", "--model", str(tmp_path / "no-model"), "--debug"], tmp_path)
    assert res.returncode != 0
    assert "Traceback" in res.stderr and "UsageError" in res.stderr
    assert "no such local folder or file" in res.stderr
    # A folder that exists but holds no checkpoint is told apart from a missing one.
    (tmp_path / "empty-model").mkdir()
    res = _run(["measure", "--model", str(tmp_path / "empty-model")], tmp_path)
    assert res.returncode == 2 and "no config.json" in res.stderr and "Traceback" not in res.stderr


def test_the_command_line_imports_no_framework_before_a_command_runs():
    """What every invocation does first (``tim-plugins --help``, an argument error) imports no torch and no
    framework: the subcommand modules keep their heavy imports inside the commands, so ``--help``, ``report`` and
    ``lr-replay`` start in well under a second, and a wrong argument is one line at once."""
    code = ("import sys; from tim_plugins.apps.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'trl', 'verl', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("command", ["demo", "measure"])
def test_help_states_each_default_once_and_never_none(command, capsys):
    """``tim-plugins demo|measure --help``: an option with a default says it once, the dataclass value appended or
    in the help's own words where it depends on other options (the field is None then); nothing reads "None"."""
    import dataclasses
    import importlib
    import re

    from tim_plugins.apps import cli

    module, name = {"demo": ("tim_plugins.apps.demo", "DemoConfig"),
                    "measure": ("tim_plugins.apps.measure", "MeasureConfig")}[command]
    fields = dataclasses.fields(getattr(importlib.import_module(module), name))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "None" not in text
    # a switch's block starts "--x, --no-x"
    blocks = {b.split()[0].rstrip(","): " ".join(b.split())
              for b in re.split(r"\n  (?=--)", text.split("options:", 1)[1])}
    for f in fields:
        block = blocks["--" + f.name.replace("_", "-")]
        said = "default:" in f.metadata.get("help", "").lower()
        if f.default is not None and not said:
            assert block.endswith(f"(default: {f.default})") and block.count("default") == 1, block
        else:
            assert "(default: " not in block, block  # its own words (said) or no default at all (None: off)


def test_the_download_command_a_missing_model_suggests_parses_with_the_installed_hf_cli(tmp_path):
    """huggingface_hub 1.x's `huggingface-cli` no longer works; the suggested command must be one the installed
    CLI accepts (click parses every option before it acts on --help: an unknown one exits 2)."""
    import re
    import shlex
    from pathlib import Path

    from tim_plugins.apps.cli import UsageError
    from tim_plugins.apps.models import check_model_path

    with pytest.raises(UsageError) as err:
        check_model_path(str(tmp_path / "missing"))
    command = shlex.split(re.search(r"e\.g\. (.+?), then pass DIR", str(err.value))[1])
    exe = Path(sys.executable).parent / command[0]
    if not exe.exists():
        pytest.skip(f"{command[0]} is not installed next to this Python")
    res = subprocess.run([str(exe), *command[1:], "--help"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, (command, res.stdout[-500:], res.stderr[-500:])


_WITHOUT = """
import sys
gone = sys.argv.pop(1)
class Uninstalled:  # the package as pip uninstall leaves it: its import fails as a missing module
    def find_spec(self, name, path=None, target=None):
        if name == gone or name.startswith(gone + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Uninstalled())
from tim_plugins.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("module", ["matplotlib", "pyarrow"])
def test_a_missing_report_package_names_the_extra_that_installs_it(module, tmp_path):
    """The report of a dump imports matplotlib (the figures) and pyarrow (the files) where it uses them: with one of
    them uninstalled, the one error line says which package is missing and the pip command of the extra that brings
    it (it said only "No module named 'matplotlib'"), as the report's duckdb check does."""
    import torch

    from tim_plugins.dump import TokenDumper

    dumper = TokenDumper(out_dir=str(tmp_path / "dump"), sample_rate=1.0, max_sequences_per_step=8)
    rollout = -torch.rand(2, 6, dtype=torch.float64)
    dumper.write(1, rollout, rollout + 0.01, torch.ones(2, 6, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.long))
    proc, timed_out = run_bounded([sys.executable, "-c", _WITHOUT, module, "report", str(tmp_path / "dump")],
                                  TIMEOUT_S, merge_stderr=False, cwd=tmp_path)
    if timed_out:
        pytest.fail(f"tim-plugins report ran past {TIMEOUT_S} s")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert f"No module named '{module}'" in lines[0], lines[0]
    assert "Install it with: pip install 'tim-plugins[report]'" in lines[0], lines[0]
