"""The fixes in a trainer framework's own terms are its adapter's data (``integrations/<framework>/fixes.py``,
announced through the ``tim_plugins.fixes`` entry points), merged into the core's finding registry and the report's
staleness verdict, and available with no framework installed."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tim_plugins import fixes
from tim_plugins.parity.findings import CODES, fix_for, make_finding
from tim_plugins.report.parity import fix_header

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_announces_each_trainer_adapter_and_the_module_says_its_own_key():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][fixes.ENTRY_POINT_GROUP]
    assert set(eps) == {"trl", "verl"}
    for key, target in eps.items():
        assert target == f"tim_plugins.integrations.{key}.fixes"
        assert (ROOT / "integrations" / key / "fixes.py").is_file()
    # the installed metadata says the same (an editable install that predates the entry points reads {} here)
    assert set(fixes.framework_fixes()) == {"trl", "verl"}


@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_each_adapter_names_known_codes_and_parts_and_the_registry_merges_them(framework):
    adapter = fixes.framework_fixes()[framework]
    assert set(adapter.finding_fixes) <= set(CODES) and set(adapter.part_fixes) == set(fixes.PARTS)
    assert all(isinstance(v, str) and v for v in [*adapter.finding_fixes.values(), *adapter.part_fixes.values()])
    for code, knob in adapter.finding_fixes.items():
        # the core keeps its own vocabulary; the adapter adds its words under its key, nothing else moves
        merged = CODES[code].fix
        assert merged[framework] == knob and {k: merged[k] for k in CODES[code].knobs} == CODES[code].knobs
        assert set(merged) <= {*CODES[code].knobs, *fixes.framework_fixes()}
        assert fix_for(make_finding(code, "error", "m").fix, framework) == knob
    assert fix_header(framework) == f"fix ({adapter.name})"


def test_without_framework_knobs_the_framework_gets_the_knobs_it_runs_on():
    # a code no adapter words (unknown-setting: tim-plugins only) reads as what TRL runs on, each named
    assert "unknown-setting" not in fixes.framework_fixes()["trl"].finding_fixes
    knob = CODES["unknown-setting"].knobs["tim_plugins"]
    assert fix_for(CODES["unknown-setting"].fix, "trl") == f"tim-plugins: {knob}"


def test_part_fix_reads_the_adapters_words_and_falls_back_to_the_core():
    assert fixes.part_fix("staleness_async", "trl") == fixes.framework_fixes()["trl"].part_fixes["staleness_async"]
    assert "max_staleness" in fixes.part_fix("staleness_async", "trl")
    assert "ppo_epochs" in fixes.part_fix("staleness", "verl")
    for framework in (None, "no-such-framework"):
        assert fixes.part_fix("mismatch", framework) == fixes.PARTS["mismatch"]
    with pytest.raises(ValueError, match="part='stale'"):
        fixes.part_fix("stale", "trl")


def test_a_broken_adapter_module_costs_its_fixes_not_the_report(monkeypatch, caplog):
    good = [EntryPoint("trl", "tim_plugins.integrations.trl.fixes", fixes.ENTRY_POINT_GROUP)]
    broken = EntryPoint("zz", "tim_plugins.integrations.no_such_module", fixes.ENTRY_POINT_GROUP)
    monkeypatch.setattr(fixes, "entry_points", lambda group: [broken, *good] if group == fixes.ENTRY_POINT_GROUP else [])
    fixes.framework_fixes.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="tim_plugins.fixes"):
            found = fixes.framework_fixes()
        assert set(found) == {"trl"}
        assert "no_such_module" in caplog.text
        assert "verl" not in CODES["dtype-mismatch"].fix and "trl" in CODES["dtype-mismatch"].fix
    finally:
        fixes.framework_fixes.cache_clear()


def test_the_offline_report_has_every_frameworks_fixes_with_no_framework_importable():
    # A fresh interpreter where importing any framework fails: the adapters' data modules must not need one.
    script = """
import json, sys
for name in ("transformers", "trl", "verl", "vllm", "ray", "accelerate"):
    sys.modules[name] = None
from tim_plugins.parity.findings import make_finding
from tim_plugins.report.parity import finding_fix
from tim_plugins.fixes import part_fix
f = make_finding("dtype-mismatch", "error", "m").to_dict()
print(json.dumps({"trl": finding_fix(f, "trl"), "verl": finding_fix(f, "verl"),
                  "stale": part_fix("staleness", "verl"),
                  "loaded": sorted(m for m in sys.modules if m.startswith("tim_plugins.integrations"))}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    got = json.loads(out.stdout)
    from tim_plugins.integrations.trl.fixes import FINDING_FIXES as TRL
    from tim_plugins.integrations.verl.fixes import FINDING_FIXES as VERL
    from tim_plugins.integrations.verl.fixes import PART_FIXES as VERL_PARTS

    assert got["trl"] == TRL["dtype-mismatch"] and got["verl"] == VERL["dtype-mismatch"]
    assert got["stale"] == VERL_PARTS["staleness"]
    assert got["loaded"] == ["tim_plugins.integrations", "tim_plugins.integrations.trl",
                             "tim_plugins.integrations.trl.fixes", "tim_plugins.integrations.verl",
                             "tim_plugins.integrations.verl.fixes"]
