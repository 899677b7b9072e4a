"""The test matrix's machinery: the stacks' definitions and locks, the fixed subset the stacks run, the suite runner
that keeps `make test` going past a failing suite, the generated compatibility table, the user-stack check. Fast:
nothing here installs anything."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()
CONSTRAINTS = ROOT / "constraints"


def _script(name: str):
    loader = importlib.machinery.SourceFileLoader(f"_test_{name.replace('.', '_')}", str(ROOT / "scripts" / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _make_var(name: str) -> list[str]:
    """A Makefile variable's words (continuation lines joined), as `make` would expand a plain list."""
    m = re.search(rf"^{name} :=((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    assert m, name
    return m.group(1).replace("\\\n", " ").split()


stack = _script("stack")
suite = _script("suite")
compat = _script("compat_table.py")


def test_every_stack_has_a_lock_that_pins_every_package_exactly():
    stacks = sorted(p.stem for p in CONSTRAINTS.glob("*.in"))
    assert {"main", "newest", "oldest"} <= set(stacks)
    for name in stacks:
        spec = stack.parse_in(name)
        lock = CONSTRAINTS / f"{name}.txt"
        lines = [x for x in lock.read_text().splitlines() if x and not x.startswith("#")]
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", x) for x in lines), name
        locked = stack.read_lock(lock)
        assert not {"tim-plugins", "torchvision", "torchaudio", "torchcodec", "pip"} & set(locked), name
        assert "torch" in locked and spec["extras"], name
        for req in spec["requirements"]:  # the stack's defining versions are what its lock holds
            if "==" in req:
                dist, version = req.split("==")
                assert locked[stack._norm(dist)] == version, (name, req, locked.get(stack._norm(dist)))
        for dist in spec["no_deps"]:
            assert stack._norm(dist) in locked, (name, dist)


def test_stacks_run_without_verl_and_main_has_it():
    assert "verl" in stack.parse_in("main")["extras"].split(",")
    for name in ("newest", "oldest"):
        assert "verl" not in stack.parse_in(name)["extras"].split(",")
        assert "verl" not in stack.read_lock(CONSTRAINTS / f"{name}.txt")


def test_the_stack_subset_is_named_once_and_exists():
    tests = _make_var("STACK_TESTS")
    assert len(tests) == len(set(tests))
    for node in tests:
        path, _, func = node.partition("::")
        assert (ROOT / path).is_file(), node
        if func:
            assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), node
    assert _make_var("STACKS") == ["newest", "oldest"]
    assert _make_var("SUITES") == ["main", "verl", "wheel", "stack-newest", "stack-oldest"]
    assert "$(filter-out tests/test_trl_vllm.py tests/test_vllm_sources.py tests/test_vllm_min_p_processor.py" \
           in MAKEFILE


def test_make_test_goes_on_after_a_failing_suite_and_ends_with_the_summary():
    recipe = MAKEFILE.split("\ntest:\n")[1].split("\n\n")[0]
    assert "|| true; done" in recipe and "$(SUITE) summary $(SUITES)" in recipe
    dry = subprocess.run(["make", "-n", "--no-print-directory", "test-stack-newest"], cwd=ROOT, capture_output=True,
                         text=True)
    assert dry.returncode == 0, dry.stderr
    assert "scripts/stack install newest" in dry.stdout and ".venv-newest/bin/python -m pytest" in dry.stdout


def test_make_test_builds_the_stack_environments_in_the_background_and_waits_for_them():
    recipe = MAKEFILE.split("\ntest:\n")[1].split("\n\n")[0]
    assert "scripts/stack install $$stack; done) >$(MATRIX)/stack-installs.log 2>&1 &" in recipe
    assert recipe.index("&") < recipe.index("for suite in") < recipe.index("wait") < recipe.index("summary")


def test_a_second_install_of_a_stack_waits_for_the_first_then_finds_its_stamp(tmp_path, monkeypatch):
    import fcntl
    import threading

    for name in ("x.txt", "x.in", "pyproject.toml"):  # a stack "x" and its lock
        (tmp_path / name).write_text("")
    monkeypatch.setattr(stack, "ROOT", tmp_path)
    monkeypatch.setattr(stack, "CONSTRAINTS", tmp_path)
    monkeypatch.setattr(stack, "_install", lambda *a: pytest.fail("the stamp was there: nothing to install"))
    done = []
    with open(tmp_path / ".venv-x.lock", "w") as first:  # the first install, still running
        fcntl.flock(first, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: done.append(stack.install("x")))
        second.start()
        second.join(0.5)
        assert second.is_alive() and not done  # waits on the lock
        (tmp_path / ".venv-x").mkdir()
        (tmp_path / ".venv-x" / stack._stamp_name("x")).touch()  # the first one finishes
    second.join(10)
    assert done == [0]


def test_user_stacks_cover_the_newest_releases_and_the_oldest_stack():
    users = MAKEFILE.split("\nUSER_STACKS := ")[1].split("\n")[0]
    assert '"trl==1.16.0 transformers==5.24.0"' in users and "stack:oldest" in users
    check = _script("user_stack_check")
    assert set(check._pins("stack:oldest")) == {r for r in stack.parse_in("oldest")["requirements"]
                                                 if r.startswith(("trl==", "transformers=="))}
    assert check.KEPT == ("torch", "trl", "transformers", "tokenizers", "huggingface-hub", "accelerate")


def test_counts_from_pytest_output_and_from_check_lines():
    assert suite.log_counts("...\n3 failed, 40 passed, 1 skipped, 2 errors in 12.30s\n") == {
        "passed": 40, "failed": 3, "skipped": 1, "errors": 2}
    text = ("wheel: 1 passed, 0 failed\nuser-stack trl==1.16.0 transformers==5.24.0 install: 1 passed, 0 failed (x)\n"
            "user-stack trl==1.16.0 transformers==5.24.0 grpo: 0 passed, 1 failed (RuntimeError: no)\n")
    assert suite.log_counts(text) == {"passed": 2, "failed": 1, "skipped": 0, "errors": 0}
    assert suite.log_counts("nothing\n") is None


def test_junit_counts(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite tests="10" failures="2" errors="1" skipped="3"/></testsuites>')
    assert suite.junit_counts(xml) == {"passed": 4, "failed": 2, "skipped": 3, "errors": 1}
    assert suite.junit_counts(tmp_path / "missing.xml") is None


def _suite(tmp_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "suite"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={"MATRIX_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_suite_records_each_suite_and_the_summary_fails_on_any(tmp_path):
    ok = _suite(tmp_path, "run", "good", "--", "sh", "-c", "echo 'x: 2 passed, 0 failed'")
    assert ok.returncode == 0, ok.stderr
    assert "x: 2 passed, 0 failed" in ok.stdout and "peak_mem good: process tree PSS" in ok.stdout
    bad = _suite(tmp_path, "run", "bad", "--setup", "exit 3", "--", "true")
    assert bad.returncode == 3
    rec = json.loads((tmp_path / "suites" / "good.json").read_text())
    assert rec["rc"] == 0 and rec["counts"]["passed"] == 2 and rec["wall_s"] >= 0
    summary = _suite(tmp_path, "summary", "good", "bad", "never")
    assert summary.returncode == 1
    lines = summary.stdout.splitlines()
    assert any(re.match(r"\s+good\s+ok\s+rc 0: 2 passed, 0 failed, 0 skipped, 0 errors", x) for x in lines)
    assert any("bad" in x and "FAILED" in x and "rc 3" in x for x in lines)
    assert any("never" in x and "did not run" in x for x in lines)
    assert "2 of 3 suites failed: bad, never" in summary.stdout
    assert _suite(tmp_path, "summary", "good").returncode == 0


def test_compatibility_table_is_generated_from_the_results(tmp_path):
    (tmp_path / "oldest.json").write_text(json.dumps({
        "stack": "oldest", "versions": {"torch": "2.13.0+cpu", "transformers": "5.5.3", "trl": "1.9.0",
                                        "vllm": "0.27.1", "verl": None},
        "suites": {"stack-oldest": {"what": "STACK_TESTS (Makefile)", "rc": 1, "wall_s": 321.0,
                                    "counts": {"passed": 90, "failed": 5, "skipped": 2, "errors": 0},
                                    "started": "2026-11-27T13:00:00+00:00"}}}))
    (tmp_path / "user-trl1.16.0-transformers5.24.0.json").write_text(json.dumps({
        "pins": ["trl==1.16.0", "transformers==5.24.0"], "checks": {"install": True, "grpo": False},
        "versions": {"trl": "1.16.0", "transformers": "5.24.0"}, "changed": {}, "date": "2026-11-27T13:00:00"}))
    text = compat.render(tmp_path)
    row = next(x for x in text.splitlines() if x.startswith("| **oldest**"))
    assert "| 5.5.3 | 1.9.0 | 0.27.1 | – |" in row and "| 90 | **5** | 2 | 5 min 21 s | 2026-11-27 |" in row
    user = next(x for x in text.splitlines() if "trl==1.16.0 transformers==5.24.0" in x)
    assert "| yes | **no** |" in user
    assert "](install.md)" in text and "Generated by `make compat`" in text


def test_docs_compatibility_page_is_the_generated_one():
    """docs/compatibility.md is written by scripts/compat_table.py (it carries the generator's header)."""
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page.startswith("[← README](../README.md) · [Install](install.md)\n\n# Compatibility")
    assert "Generated by `make compat`" in page
