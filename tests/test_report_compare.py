"""The comparison page (``tim-plugins report A B``) says what differs between the runs: each run's verdict, the
settings whose values differ (nested settings and verl's JSON-text settings compared leaf by leaf, a run's own
folders left out), the package versions that differ (those equal in every run in one line above the table), and
each run's parity audit."""

from __future__ import annotations

import json
import re

from tim_plugins.report import build_comparison
from tim_plugins.report.compare_page import differences, same_versions


def _finding(code: str, severity: str) -> dict:
    return {"code": code, "severity": severity, "message": code, "rollout": "r", "trainer": "t"}


def _summary(safe: bool, trl: str, out: str, findings: list, own: list, deliberate: dict) -> dict:
    return {
        "kind": "training", "framework": "trl", "title": "t",
        "settings": {"steps": 20, "top_p": 0.8, "safe_vocab": safe, "out": out, "model": "/models/toy",
                     "tim": json.dumps({"monitor": {"enable": True, "ratio_band": [0.5, 2.0]},
                                        "dump": {"dir": f"{out}/dump"}})},
        "versions": {"torch": "2.13.0", "trl": trl},
        "findings": findings, "own_audit": own, "deliberate": deliberate,
        "attached": {"config": {"safe_vocab": safe, "dump_dir": f"{out}/dump", "monitor": True}},
        "log_history": [{"step": 1, "loss": 0.0, "tim/tokens": 10.0, "tim/token/kl_k3": 1e-4}],
    }


PROBLEM = _summary(False, "1.16.0", "/runs/a", [_finding("dtype-mismatch", "error")],
                   [_finding("sampler-truncation-unmatched", "error"), _finding("dtype-mismatch", "error"),
                    _finding("lm-head-precision-mismatch", "warning")],
                   {"dtype-mismatch": "on purpose", "sampler-truncation-unmatched": "the problem shown"})
FIX = _summary(True, "1.17.0", "/runs/b", [], [_finding("dtype-mismatch", "error")], {"dtype-mismatch": "on purpose"})


def test_the_table_has_the_verdicts_the_differing_settings_the_versions_and_each_audit():
    rows, same = differences({"problem": PROBLEM, "fix": FIX}, {"problem": {"status": "watch"},
                                                               "fix": {"status": "ok"}})
    assert rows == [
        ["verdict", "WATCH", "OK"],
        ["setting: safe_vocab", "False", "True"],  # TIMConfig.safe_vocab, equal to it in each run: not a twin row
        ["version: trl", "1.16.0", "1.17.0"],  # torch, equal in both runs, is in the paragraph above the table
        ["parity audit", "2 errors: dtype-mismatch (deliberate), sampler-truncation-unmatched (deliberate); "
                         "1 warning: lm-head-precision-mismatch", "1 error: dtype-mismatch (deliberate); 0 warnings"],
    ]
    # equal in both: steps, top_p, model, tim.monitor.enable, tim.monitor.ratio_band, TIMConfig.monitor (the run's
    # own folders, out and the dump folders, are not settings to compare)
    assert same == 6


def test_a_timconfig_field_that_reads_otherwise_than_the_runs_own_setting_keeps_its_row():
    import copy

    other = copy.deepcopy(FIX)
    other["attached"]["config"]["safe_vocab"] = False  # the run asked for it, the callback ran without it
    rows, _ = differences({"problem": PROBLEM, "fix": other})
    assert ["setting: safe_vocab", "False", "True"] in rows
    assert not [r for r in rows if r[0] == "setting: TIMConfig.safe_vocab"]  # equal in both runs now
    other["attached"]["config"]["safe_vocab"] = "on"
    rows, _ = differences({"problem": PROBLEM, "fix": other})
    assert ["setting: TIMConfig.safe_vocab", "False", "on"] in rows and ["setting: safe_vocab", "False", "True"] in rows


def test_versions_equal_in_every_run():
    three = {"a": PROBLEM, "b": FIX, "c": dict(FIX, versions={"torch": "2.13.0", "trl": "1.17.0", "numpy": "2.4.6"})}
    assert same_versions(three) == {"torch": "2.13.0"}
    assert same_versions({"a": FIX, "b": FIX}) == {"torch": "2.13.0", "trl": "1.17.0"}
    rows, _ = differences(three)
    assert [r for r in rows if r[0].startswith("version")] == [["version: numpy", "–", "–", "2.4.6"],
                                                               ["version: trl", "1.16.0", "1.17.0", "1.17.0"]]
    assert same_versions({"a": dict(FIX, versions=None), "b": FIX}) == {}


def test_a_setting_one_run_lacks_and_a_run_without_an_audit():
    other = dict(FIX, settings={**FIX["settings"], "num_iterations": 2})
    del other["findings"], other["own_audit"]
    rows, _ = differences({"a": PROBLEM, "b": other})
    assert ["setting: num_iterations", "–", "2"] in rows
    assert rows[-1] == ["parity audit", rows[-1][1], "no audit recorded"]
    assert not [r for r in rows if r[0] == "verdict"]  # no verdicts given: no row


def test_the_page_opens_with_the_table(tmp_path):
    for name, summary in (("a", PROBLEM), ("b", FIX)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    html = build_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp.html", labels=["problem", "fix"]
                            ).read_text()
    assert html.index("<h2>What differs between the runs</h2>") < html.index("<h2>Verdict per run</h2>")
    flat = html.replace("\n", "")
    assert "<td>setting: safe_vocab</td><td>False</td><td>True</td>" in flat
    assert "<td>version: trl</td><td>1.16.0</td><td>1.17.0</td>" in flat
    assert "the package versions that differ (the same in every run: torch 2.13.0), and each run" in flat
    assert "<td>version: torch" not in flat
    # each run's verdict leaves out its audit line: the table's row stands for it, its tables are not on this page
    assert "Parity audit:" not in html and "By table" not in html


def test_a_run_has_one_colour_in_every_figure(tmp_path, monkeypatch):
    """A comparison of a run with a log and no dump beside two runs with dumps: each run is drawn in the same
    colour in every figure it is in (the per-step series and each per-token figure), the runs in different
    colours."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    import tim_plugins.report.figures as figures
    from tim_plugins.dump import dump_file_name

    logged, b, c = tmp_path / "logged", tmp_path / "b", tmp_path / "c"
    logged.mkdir()
    (logged / "log_history.jsonl").write_text("".join(
        json.dumps({"step": s, "tim/tokens": 100.0, "tim/token/kl_k3": 1e-4 * s}) + "\n" for s in (1, 2, 3)))
    rng = np.random.default_rng(6)
    for folder in (b, c):
        folder.mkdir()
        for step in (1, 2, 3):
            n = 60
            r = np.log(rng.uniform(0.01, 1.0, n))
            cols = {"step": pa.array([step] * n, pa.int64()), "rank": pa.array([0] * n, pa.int32()),
                    "sequence": pa.array(np.repeat(np.arange(3), 20), pa.int64()),
                    "position": pa.array(np.tile(np.arange(20), 3), pa.int32()),
                    "token_id": pa.array(rng.integers(0, 500, n), pa.int64()),
                    "rollout_logprob": pa.array(r.astype(np.float32)),
                    "train_logprob": pa.array((r + rng.normal(0, 0.05, n)).astype(np.float32))}
            pq.write_table(pa.table(cols), folder / dump_file_name(step, 0))
    labels = ["logged", "b", "c"]
    seen: list[dict] = []  # per figure: {run: colour} of its artists labelled with a run's name
    real = figures.png_bytes

    def colour(artist) -> str:  # a line's colour, a step histogram's edge, a scatter's points
        if isinstance(artist, Line2D):
            return to_hex(artist.get_color())
        return to_hex(artist.get_edgecolor() if isinstance(artist, Patch) else artist.get_facecolor()[0])

    def record(fig):
        colours = {}
        for ax in fig.axes:
            for artist in [*ax.lines, *ax.patches, *ax.collections]:
                name = re.split(r" \(|: ", artist.get_label())[0]  # a label may add a note after the name
                if name in labels:
                    colours.setdefault(name, set()).add(colour(artist))
        if colours:
            seen.append(colours)
        return real(fig)

    monkeypatch.setattr(figures, "png_bytes", record)
    build_comparison([logged, b, c], tmp_path / "cmp.html", labels=labels, threads=1)
    assert len(seen) == 6  # the series and the five per-token figures
    assert set(seen[0]) == set(labels)
    assert all(set(s) == {"b", "c"} for s in seen[1:])  # the premise: "logged" has no dump
    each = {}
    for colours in seen:
        for name, found in colours.items():
            each.setdefault(name, set()).update(found)
    assert all(len(found) == 1 for found in each.values()), each
    assert len({found.pop() for found in each.values()}) == 3
