"""The test matrix's machinery: the stacks' definitions and locks, the fixed subset the stacks run, the suite runner
that keeps `make test` going past a failing suite, the generated compatibility table, the user-stack check. Fast:
nothing here installs anything."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import os
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
                dist = dist.split("[")[0]  # extras: the distribution's own name
                assert locked[stack._norm(dist)] == version, (name, req, locked.get(stack._norm(dist)))
        for dist in spec["no_deps"]:
            assert stack._norm(dist.split("==")[0]) in locked, (name, dist)


def test_stacks_run_without_verl_and_main_has_it():
    assert "verl" in stack.parse_in("main")["extras"].split(",")
    for name in ("newest", "oldest", "vllm-gpu"):
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
    assert _make_var("STACKS") == ["newest", "oldest", "vllm-gpu"]
    assert _make_var("SUITES") == ["main", "verl", "wheel", "megatron", "latest", "stack-newest", "stack-oldest",
                                   "stack-vllm-gpu"]
    for node in _make_var("STACK_TESTS_vllm-gpu"):  # the vllm-gpu stack's own list: vLLM tests that start no engine
        path, _, func = node.partition("::")
        assert path.startswith("tests/test_vllm_") and (ROOT / path).is_file(), node
        if func:
            assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), node


def _dry(target: str) -> str:
    dry = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    return dry.stdout


def _pytest_args(dry: str) -> list[str]:
    line = next(x for x in dry.replace("\\\n", " ").splitlines() if " -m pytest " in x)
    return [a for a in line.split(" -m pytest ")[1].split() if not a.startswith("-")]


def _marked_vllm(path: Path) -> bool:
    """Whether the test module ``path`` carries pyproject's ``vllm`` marker in its module-level ``pytestmark``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "vllm" and isinstance(n.value, ast.Attribute)
                       and n.value.attr == "mark" for n in ast.walk(node.value))
    return False


def _imports_or_skips_vllm(path: Path) -> bool:
    """Whether the test module ``path`` skips itself without vLLM (a module-level ``pytest.importorskip("vllm")``)."""
    for node in ast.parse(path.read_text()).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "importorskip"
                and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == "vllm"):
            return True
    return False


def test_a_main_suite_module_that_needs_vllm_carries_the_vllm_marker():
    """The lane split below reads the marker: a module that skips itself without vLLM but is not marked would land
    in the `latest` lane, where vLLM is not installed, and be skipped there (and not run on the newest stack)."""
    modules = sorted((ROOT / "tests").glob("test_*.py"))
    needs = {p.name for p in modules if _imports_or_skips_vllm(p)}
    marked = {p.name for p in modules if _marked_vllm(p)}
    assert {"test_trl_vllm.py", "test_vllm_sources.py", "test_trl_real_model.py"} <= needs
    assert needs == marked, (needs ^ marked)


def test_the_latest_lane_and_the_newest_stack_share_stack_tests_without_overlap():
    """The `latest` lane runs a user's commands, the report's tests and STACK_TESTS without vLLM; the newest locked
    stack runs the vLLM part only; together they run all of STACK_TESTS once."""
    stack_tests = _make_var("STACK_TESTS")
    latest = _pytest_args(_dry("test-latest"))
    newest = _pytest_args(_dry("test-stack-newest"))
    assert latest[0] == "tests/test_user_commands.py"
    assert set(_make_var("REPORT_TESTS")) <= set(latest)
    assert {"tests/test_report_query.py", "tests/test_dump_report.py"} <= set(_make_var("REPORT_TESTS"))
    for node in _make_var("REPORT_TESTS"):
        assert (ROOT / node).is_file(), node
    vllm = [t for t in stack_tests if _marked_vllm(ROOT / t.partition("::")[0])]
    assert vllm and newest == vllm
    assert [t for t in latest if t in stack_tests] == [t for t in stack_tests if t not in vllm]
    assert not set(latest) & set(newest)
    assert "scripts/stack latest" in _dry("test-latest")


def test_the_latest_stack_takes_the_torch_pip_installs_and_names_the_newest_listed(tmp_path, monkeypatch):
    """scripts/stack latest's torch: ``torch`` unpinned (pip's own choice under the machine's configuration: the
    newest release it installs), its reason naming the newest release pip lists (a machine that caps torch says
    so, by release order: 2.10 > 2.9); LATEST_TORCH overrides."""
    pip = tmp_path / "bin" / "pip"
    pip.parent.mkdir()

    def pip_lists(versions: list[str]) -> None:
        listing = json.dumps({"name": "torch", "versions": versions, "latest": versions[0]})
        pip.write_text(f"#!/bin/sh\necho '{listing}'\n")
        pip.chmod(0o755)

    monkeypatch.delenv("LATEST_TORCH", raising=False)
    pip_lists(["2.9.1", "2.15.0", "2.14.1", "2.13.0+cpu"])
    requirement, why = stack.latest_torch(tmp_path)
    assert requirement == "torch" and why.endswith("the newest it lists: 2.15.0")
    pip_lists(["2.9.1", "2.10.0"])
    assert stack.latest_torch(tmp_path)[1].endswith("2.10.0")
    monkeypatch.setenv("LATEST_TORCH", "torch==2.12.0+cpu")
    assert stack.latest_torch(tmp_path) == ("torch==2.12.0+cpu", "LATEST_TORCH")
    # the install pins the torch pip chose for the rest of the environment (uv keeps it)
    src = (ROOT / "scripts" / "stack").read_text()
    body = src[src.index("def latest() -> int:"):src.index("_VERSIONS = ")]
    assert "torch = f\"torch=={_freeze(venv)['torch']}\"" in body


def _wheel(folder: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel (metadata only): enough for pip to resolve and install it."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def test_the_latest_stacks_pip_ignores_a_machine_cap_but_keeps_its_find_links(tmp_path):
    """A CI machine's pip configuration may cap a package (``global.constraint``: this machine caps torch at the
    release on its disk); a user's pip has no such cap, so the latest lane's pip runs with USER_PIP_ENV. Real pip,
    a package offered in two releases through the configuration's find-links: capped at 1.0 by the configuration,
    2.0 with USER_PIP_ENV (and find-links, also from the configuration, still read)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        _wheel(wheels, "timcapprobe", version)
    cap = tmp_path / "cap.txt"
    cap.write_text("timcapprobe<=1.0\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nconstraint = {cap}\nfind-links = {wheels}\nno-index = true\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}

    def would_install(extra: dict) -> str:
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "timcapprobe"],
                             capture_output=True, text=True, env={**base, "PIP_CONFIG_FILE": str(conf), **extra})
        assert out.returncode == 0, out.stderr
        return re.search(r"Would install (\S+)", out.stdout).group(1)

    assert would_install({}) == "timcapprobe-1.0"
    assert would_install(stack.USER_PIP_ENV) == "timcapprobe-2.0"
    # every pip call that builds .venv-latest runs with it (pip itself, torch, the extras)
    src = (ROOT / "scripts" / "stack").read_text()
    body = src[src.index("def latest() -> int:"):src.index("_VERSIONS = ")]
    calls = re.findall(r"_run\(\[PIP_INSTALL.*?\)\n", body, re.S)
    assert len(calls) == 3 and all("USER_PIP_ENV" in call for call in calls)


def _test_recipe() -> str:
    return re.split(r"\ntest:[^\n]*\n", MAKEFILE)[1].split("\n\n")[0]


def test_make_test_goes_on_after_a_failing_suite_and_ends_with_the_summary():
    recipe = _test_recipe()
    # every suite of SUITES, SUITE_JOBS at a time, each one's failure absorbed until the summary
    assert "printf '%s\\n' $(SUITES) |" in recipe and "xargs -P $(SUITE_JOBS)" in recipe
    assert "test-SUITE || true'" in recipe and "$(SUITE) summary $(SUITES)" in recipe
    assert re.search(r"^test: \$\(VENV\)/\$\(STAMP\)$", MAKEFILE, re.M)  # built once, before suites share it
    dry = subprocess.run(["make", "-n", "--no-print-directory", "test-stack-newest"], cwd=ROOT, capture_output=True,
                         text=True)
    assert dry.returncode == 0, dry.stderr
    assert "scripts/stack install newest" in dry.stdout and ".venv-newest/bin/python -m pytest" in dry.stdout


def test_make_test_builds_the_stack_environments_in_the_background_and_waits_for_them():
    recipe = _test_recipe()
    assert ("$(BACKGROUND) scripts/stack install $$stack; done; $(BACKGROUND) scripts/megatron_env install) "
            ">$(MATRIX)/stack-installs.log 2>&1 &" in recipe)
    # at the lowest priority: they must not slow the suites beside them
    assert re.search(r"^BACKGROUND := nice -n 19 ", MAKEFILE, re.M)
    assert recipe.index("&") < recipe.index("xargs") < recipe.index("wait") < recipe.index("summary")


def test_the_megatron_suite_runs_in_its_own_python_312_environment():
    dry = subprocess.run(["make", "-n", "--no-print-directory", "test-megatron", "test-main"], cwd=ROOT,
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "scripts/megatron_env install" in dry.stdout
    assert ".venv-megatron/bin/python -m pytest -q tests/megatron_suite" in dry.stdout
    assert "--ignore=tests/verl_suite --ignore=tests/megatron_suite" in dry.stdout  # never in the main process
    script = (ROOT / "scripts" / "megatron_env").read_text()
    assert 'PY="$py" exec scripts/stack install megatron' in script and "3.12" in script
    locked = stack.read_lock(CONSTRAINTS / "megatron.txt")
    assert locked["megatron-core"] == "0.19.2" and locked["mbridge"] == "0.15.1" and locked["verl"] == "0.9.1"
    assert "Python 3.12" in (CONSTRAINTS / "megatron.txt").read_text().splitlines()[1]


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
    clone = MAKEFILE.split("\nUSER_STACKS_CLONE := ")[1].split("\n")[0]
    assert '"trl==1.16.0 transformers==5.24.0"' in users and clone == "stack:oldest"
    assert "scripts/user_stack_check . $(USER_STACKS_CLONE)" in MAKEFILE
    check = _script("user_stack_check")
    assert set(check._pins("stack:oldest")) == {r for r in stack.parse_in("oldest")["requirements"]
                                                 if r.startswith(("trl==", "transformers=="))}
    assert check.KEPT == ("torch", "trl", "transformers", "tokenizers", "huggingface-hub", "accelerate")


def test_the_install_from_a_clone_is_the_command_the_docs_give():
    """USER_STACKS_CLONE installs this folder with the README's and docs/install.md's own command, in the folder."""
    check = _script("user_stack_check")
    assert check.install_command("pip", ROOT) == (["pip", "install", "-q", ".[trl]"], ROOT)
    wheel = ROOT / "dist" / "tim_plugins-0.1.0-py3-none-any.whl"
    assert check.install_command("pip", wheel) == (["pip", "install", "-q", f"{wheel}[trl]"], None)
    readme = (ROOT / "README.md").read_text().split("\n## Install\n")[1].split("\n## ")[0]
    install = (ROOT / "docs" / "install.md").read_text()
    for text in (readme, install):
        assert "pip install '.[trl]'" in text
        assert "pip install 'tim-plugins[trl] @ git+<repository URL>'" in text
        assert "https://download.pytorch.org/whl/cpu" in text  # torch's CPU build first on a CPU machine


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


def test_junit_testcases_are_named_by_their_pytest_ids():
    assert suite._test_id("tests.test_matrix_infra", "test_x[a b]") == "tests/test_matrix_infra.py::test_x[a b]"
    assert suite._test_id("tests.test_matrix_infra.TestK", "test_y") == "tests/test_matrix_infra.py::TestK::test_y"
    assert suite._test_id("", "tests.verl_suite.test_verl_async") == "tests/verl_suite/test_verl_async.py"


def test_each_expected_skip_names_a_test_file_and_says_why():
    """Every suite's list (scripts/expected_skips) parses, each entry with a reason, and names a test file that
    exists: an entry left behind by a renamed file would expect a skip that can no longer happen."""
    lists = sorted((ROOT / "scripts" / "expected_skips").glob("*.txt"))
    assert {p.stem for p in lists} >= {"main", "verl", "stack-newest", "stack-oldest"}
    suites = set(_make_var("SUITES"))
    for path in lists:
        assert path.stem in suites, f"{path.name}: no such suite in the Makefile's SUITES"
        for pattern, reason in suite.expected_skips(path.stem):
            assert (ROOT / pattern.split("::")[0]).is_file(), (path.name, pattern)
            assert len(reason.split()) >= 3, (path.name, pattern, reason)


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
    entries = {"main": {"date": "2026-11-27", "versions": {"transformers": "5.10.4", "trl": "1.16.0",
                                                           "verl": "0.9.1", "vllm": "0.31.0"}}}
    (tmp_path / "oldest.json").write_text(json.dumps({
        "stack": "oldest", "versions": {"torch": "2.13.0+cpu", "transformers": "5.5.3", "trl": "1.9.0",
                                        "vllm": "0.27.1", "verl": None},
        "suites": {"stack-oldest": {"what": "STACK_TESTS (Makefile)", "rc": 1, "wall_s": 321.0,
                                    "counts": {"passed": 90, "failed": 5, "skipped": 2, "errors": 0},
                                    "started": "2026-11-27T13:00:00+00:00"}}}))
    (tmp_path / "user-trl1.16.0-transformers5.24.0.json").write_text(json.dumps({
        "pins": ["trl==1.16.0", "transformers==5.24.0"], "checks": {"install": True, "grpo": False},
        "versions": {"trl": "1.16.0", "transformers": "5.24.0"}, "changed": {}, "date": "2026-11-27T13:00:00"}))
    text = compat.render(tmp_path, entries)
    row = next(x for x in text.splitlines() if x.startswith("| **oldest**"))
    assert "| 5.5.3 | 1.9.0 | 0.27.1 | – | – | – | – |" in row  # verl, numpy, duckdb, pyarrow: not recorded
    assert "| 90 | **5** | 2 | 5 min 21 s | 2026-11-27 |" in row
    user = next(x for x in text.splitlines() if "trl==1.16.0 transformers==5.24.0" in x)
    assert "| yes | **no** |" in user
    assert "](install.md)" in text and "Generated by `make compat`" in text


def _matrix_stack(path: Path, name: str, rc: int, **versions) -> None:
    path.mkdir(exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps({
        "stack": name, "versions": {"torch": "2.13.0+cpu", "numpy": "2.4.6", **versions},
        "suites": {f"stack-{name}": {"rc": rc, "started": "2026-12-04T01:00:00+00:00"}}}))


def test_tested_ranges_follow_the_stacks_that_passed(tmp_path):
    """`make compat` writes tim_plugins/_tested.py: each stack of the run that passed every suite replaces its entry
    (the ranged frameworks only), one that failed loses it, one the run did not record keeps it; a stack that
    passed on a new release moves the range's end past it."""
    before = {"main": {"date": "2026-11-27", "versions": {"transformers": "5.10.4", "trl": "1.16.0", "verl": "0.9.1",
                                                          "vllm": "0.31.0"}},
              "oldest": {"date": "2026-11-27", "versions": {"transformers": "5.5.3", "trl": "1.9.0", "vllm": "0.27.1"}},
              "latest": {"date": "2026-11-27", "versions": {"transformers": "5.24.0", "trl": "1.16.0"}}}
    matrix = tmp_path / "m"
    _matrix_stack(matrix, "latest", 0, transformers="5.25.0", trl="1.17.1", vllm=None, duckdb="2.0.1")
    _matrix_stack(matrix, "oldest", 1, transformers="5.5.3", trl="1.9.0", vllm="0.27.1")
    entries = compat.passed_entries(compat.read_stacks(matrix), before)
    assert entries == {"main": before["main"],
                       "latest": {"date": "2026-12-04", "versions": {"transformers": "5.25.0", "trl": "1.17.1"}}}
    from tim_plugins._optional import passed_releases, tested_range

    releases = passed_releases(entries)
    assert tested_range(releases["transformers"]) == ("5.10", "5.26")  # oldest failed: its 5.5.3 is no longer in
    assert tested_range(releases["trl"]) == ("1.16", "1.18") and tested_range(["0.9.1"]) == ("0.9", "0.10")
    module = tmp_path / "_tested.py"
    module.write_text(compat.render_tested(entries))
    import runpy

    assert runpy.run_path(str(module))["PASSED"] == entries
    # a stack that reads vLLM at the source level only (SOURCES_ONLY) does not widen vLLM's range
    _matrix_stack(matrix, "vllm-gpu", 0, transformers="5.22.2", trl="1.16.0", vllm="0.34.0")
    gpu = compat.passed_entries(compat.read_stacks(matrix), before)["vllm-gpu"]
    assert gpu["versions"] == {"transformers": "5.22.2", "trl": "1.16.0"}
    with pytest.raises(SystemExit, match="no stack passed with \\['verl'\\]"):
        compat.render_tested({"latest": entries["latest"], "oldest": before["oldest"]})


def test_compat_writes_the_page_and_the_tested_ranges_together(tmp_path):
    """The script's own command line (`make compat`): both files from one run, the page's range table from the
    module's data."""
    matrix = tmp_path / "m"
    _matrix_stack(matrix, "latest", 0, transformers="5.25.0", trl="1.16.0")
    module, page = tmp_path / "_tested.py", tmp_path / "compat.md"
    module.write_text((ROOT / "tim_plugins" / "_tested.py").read_text())
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compat_table.py"), str(matrix), str(page),
                          str(module)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import runpy

    entries = runpy.run_path(str(module))["PASSED"]
    assert entries["latest"] == {"date": "2026-12-04", "versions": {"transformers": "5.25.0", "trl": "1.16.0"}}
    assert "\n".join(compat.ranges_section(entries)) in page.read_text()


def test_docs_compatibility_page_is_the_generated_one():
    """docs/compatibility.md is written by scripts/compat_table.py (it carries the generator's header), and its
    tested ranges are those the version warning uses: both from tim_plugins/_tested.py."""
    from tim_plugins import _tested
    from tim_plugins._optional import RANGED, SUPPORTED_RANGES, passed_releases, tested_range

    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page.startswith("[← README](../README.md) · [Install](install.md)\n\n# Compatibility")
    assert "Generated by `make compat`" in page
    assert "\n".join(compat.ranges_section(_tested.PASSED)) in page
    releases = passed_releases(_tested.PASSED)
    assert set(SUPPORTED_RANGES) == set(RANGED)
    for dist in RANGED:
        assert SUPPORTED_RANGES[dist] == tested_range(releases[dist])
        assert f"| {dist} | " in page and f"`>={SUPPORTED_RANGES[dist][0]},<{SUPPORTED_RANGES[dist][1]}`" in page
    # the page's stack rows name the releases the module lists for the stacks that passed
    for name, entry in _tested.PASSED.items():
        rows = [x for x in page.splitlines() if x.startswith(f"| **{name}**")]
        assert rows and all(all(f"| {v} |" in x for v in entry["versions"].values()) for x in rows), name


SKIPPING = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_cuda():
    pass

@pytest.mark.parametrize("v", [1, 2])
def test_moved(v):
    pytest.skip("trl.some.module moved")
"""


def test_suite_counts_skips_and_fails_on_one_its_list_does_not_expect(tmp_path, monkeypatch):
    """A real pytest run through ``suite run``: its junit XML's skips are checked against the suite's list; a skip
    the list does not name fails the suite (with pytest's reason), one it names does not."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_skipping.py").write_text(SKIPPING)
    (tests / "test_gone.py").write_text('import pytest\npytest.skip("no module", allow_module_level=True)\n')
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "s.txt").write_text("# comment\ntest_skipping.py::test_cuda needs a CUDA device here\n")
    env = {"MATRIX_DIR": str(tmp_path / "m"), "PATH": "/usr/bin:/bin", "EXPECTED_SKIPS_DIR": str(lists)}

    def run(name):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "suite"), "run", name, "--", sys.executable, "-m",
                               "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tests), str(tests)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)

    failed = run("s")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "suite s: 4 skipped, 1 of them expected" in failed.stdout and "3 unexpected" in failed.stdout
    unexpected = sorted(x for x in failed.stdout.splitlines() if "UNEXPECTED SKIP" in x)
    assert unexpected == ["suite s: UNEXPECTED SKIP test_gone.py: no module",
                          "suite s: UNEXPECTED SKIP test_skipping.py::test_moved[1]: trl.some.module moved",
                          "suite s: UNEXPECTED SKIP test_skipping.py::test_moved[2]: trl.some.module moved"]
    rec = json.loads((tmp_path / "m" / "suites" / "s.json").read_text())
    assert rec["rc"] == 1 and rec["counts"]["skipped"] == 4 and len(rec["unexpected_skips"]) == 3
    summary = subprocess.run([sys.executable, str(ROOT / "scripts" / "suite"), "summary", "s"], capture_output=True,
                             text=True, cwd=ROOT, env=env, timeout=60)
    assert summary.returncode == 1 and "4 skipped, 0 errors (3 unexpected)" in summary.stdout

    (lists / "s.txt").write_text("test_skipping.py::test_cuda needs a CUDA device here\n"
                                 "test_skipping.py::test_moved[[]*] the fixture's own skip\n"
                                 "test_gone.py skipped whole on purpose\n")
    passed = run("s")
    assert passed.returncode == 0, passed.stdout
    assert "suite s: 4 skipped, 4 of them expected" in passed.stdout and "UNEXPECTED" not in passed.stdout

    (lists / "s.txt").write_text("test_skipping.py::test_cuda\n")  # no reason
    monkeypatch.setattr(suite, "EXPECTED_SKIPS", lists)
    with pytest.raises(ValueError, match="has no reason"):
        suite.expected_skips("s")



@pytest.mark.parametrize("echo", ["1", "0"])
def test_suite_side_by_side_prints_each_suites_end_once(tmp_path, echo):
    """``make test`` runs suites side by side with SUITE_ECHO=0: a suite's output then goes to its log only, and
    its last SUITE_ECHO_LINES lines to the terminal at its end, each prefixed with the suite's name (two suites'
    output never interleave line by line); SUITE_ECHO=1 echoes it as it comes. The log holds everything either way."""
    env = {"MATRIX_DIR": str(tmp_path / "m"), "PATH": "/usr/bin:/bin", "SUITE_ECHO": echo, "SUITE_ECHO_LINES": "3"}
    cmd = [sys.executable, str(ROOT / "scripts" / "suite"), "run", "s", "--", sys.executable, "-c",
           "print('\\n'.join(f'line {i}' for i in range(10))); print('check: 1 passed, 0 failed')"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    log = (tmp_path / "m" / "logs" / "s.log").read_text().splitlines()
    assert log == [f"line {i}" for i in range(10)] + ["check: 1 passed, 0 failed"]
    shown = [x for x in out.stdout.splitlines() if x.startswith(("line ", "check:", "s | "))]
    if echo == "1":
        assert shown == log
    else:
        assert shown == ["s | line 8", "s | line 9", "s | check: 1 passed, 0 failed"]
