"""A dump's invalid rows (NaN, inf or placeholder log-probs, or a key left null) in the report: each step counts its
own (``tim/invalid_tokens``, as the monitor does), a step whose every row is invalid stays a step (NaN metrics, a
gap in its series, named on the page), and every page that reads a dump says how many rows it skipped. The
reference is a naive recomputation over the files' rows (pyarrow and numpy)."""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tim_plugins.dump import dump_file_name
from tim_plugins.report import build_comparison, build_report
from tim_plugins.report.query import engine, open_dump

THRESHOLD = -1e3  # the monitor's placeholder threshold (``INVALID_LOGPROB_THRESHOLD``)
KEYS = ("step", "rank", "sequence", "position")


def _write_dump(folder):
    """Steps 1-4 of one rank, 3 sequences of 20 tokens each: step 2 all invalid (NaN trainer log-probs), step 3
    mixed (inf, -inf, NaN, a placeholder, a sequence below the threshold), step 4 with rows that lack a position
    (valid log-probs) and one that lacks its step."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True, exist_ok=True)
    for step in (1, 2, 3, 4):
        n = 60
        r = np.log(rng.uniform(0.01, 1.0, n))
        t = r + rng.normal(0, 0.05, n)
        steps, pos = [step] * n, list(np.tile(np.arange(20), 3))
        seq = np.repeat(np.arange(3), 20)
        if step == 2:
            t[:] = np.nan
        if step == 3:
            t[0], r[1], t[2], r[3] = np.inf, -np.inf, -9999.0, np.nan
            r[seq == 1] = -1e4
        if step == 4:
            for i in (5, 6, 30):
                pos[i] = None
            steps[40] = None
        cols = {"step": pa.array(steps, pa.int64()), "rank": pa.array([0] * n, pa.int32()),
                "sequence": pa.array(seq, pa.int64()), "position": pa.array(pos, pa.int32()),
                "token_id": pa.array(rng.integers(0, 500, n), pa.int64()),
                "rollout_logprob": pa.array(r.astype(np.float32)), "train_logprob": pa.array(t.astype(np.float32))}
        pq.write_table(pa.table(cols), folder / dump_file_name(step, 0))
    return folder


def _naive(folder) -> dict:
    """Per step (of the rows that have one): valid rows, invalid rows, k3 of the valid rows; and the dump's invalid
    rows in all (with the row without a step)."""
    table = pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("step_*.parquet"))])
    r = table.column("rollout_logprob").to_numpy(zero_copy_only=False).astype(np.float64)
    t = table.column("train_logprob").to_numpy(zero_copy_only=False).astype(np.float64)
    keyed = np.ones(len(r), dtype=bool)
    for k in KEYS:
        keyed &= ~table.column(k).is_null().to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        d = t - r
        ok = keyed & np.isfinite(d) & (r > THRESHOLD) & (t > THRESHOLD)
    step = np.array([-1 if s is None else s for s in table.column("step").to_pylist()])
    has_step = ~table.column("step").is_null().to_numpy(zero_copy_only=False)
    per = {}
    for s in sorted(set(step[has_step].tolist())):
        here = has_step & (step == s)
        dv = d[here & ok]
        per[s] = {"valid": int(dv.size), "invalid": int((here & ~ok).sum()),
                  "k3": float(np.mean(np.expm1(dv) - dv)) if dv.size else math.nan}
    return {"steps": per, "invalid": int((~ok).sum()), "valid": int(ok.sum())}


def test_each_step_counts_its_invalid_rows_and_a_step_without_a_valid_one_stays(tmp_path):
    from tim_plugins.report.tokens import metrics_by_step, overall_metrics

    folder = _write_dump(tmp_path / "dump")
    want = _naive(folder)
    assert want["steps"][2]["valid"] == 0 and want["invalid"] > sum(s["invalid"] for s in want["steps"].values())
    with engine(threads=1):
        dump = open_dump(folder)
        steps, per_step = metrics_by_step(dump)
        overall = overall_metrics(dump)
        assert (dump.size, dump.invalid) == (want["valid"], want["invalid"])
    assert steps.tolist() == sorted(want["steps"])
    for s, m in zip(steps.tolist(), per_step):
        w = want["steps"][s]
        assert m["tim/invalid_tokens"] == w["invalid"], s
        assert m["tim/tokens"] == w["valid"], s
        if w["valid"]:
            assert m["tim/token/kl_k3"] == pytest.approx(w["k3"], rel=1e-9)
        else:  # no valid token: no value, not 0
            assert math.isnan(m["tim/token/kl_k3"]) and math.isnan(m["tim/token/abs_diff_mean"])
    # over all steps: the invalid rows of every step (the row without a step is in none)
    assert overall["tim/invalid_tokens"] == want["invalid"]  # a row without a step too
    assert overall["tim/tokens"] == want["valid"]


def test_the_series_break_at_a_step_without_a_valid_token(tmp_path, monkeypatch):
    """The step table keeps step 2 with NaN metrics, 0 tokens and ``no_valid``; the k3 panel's line has no value at
    step 2 (matplotlib leaves a gap there) and the naive k3 at the others; a mark names the step on the figure."""
    import tim_plugins.report.figures as figures
    from tim_plugins.report.training_page import step_table

    folder = _write_dump(tmp_path / "dump")
    want = _naive(folder)
    with engine(threads=1):
        table = step_table(None, open_dump(folder))
    assert table["step"].tolist() == [1, 2, 3, 4]
    assert table["no_valid"].tolist() == [False, True, False, False]
    assert table["tokens"].tolist() == [want["steps"][s]["valid"] for s in (1, 2, 3, 4)]
    assert table["invalid"].tolist() == [want["steps"][s]["invalid"] for s in (1, 2, 3, 4)]
    assert np.isnan(table["k3"][1]) and np.isnan(table["ess"][1])

    drawn = []
    real = figures.png_bytes
    monkeypatch.setattr(figures, "png_bytes", lambda fig: drawn.append(fig) or real(fig))
    html = build_report(folder, tmp_path / "r.html", threads=1).read_text()
    k3 = next(ax for fig in drawn for ax in fig.axes if ax.get_title().startswith("k3 per token"))
    (line,) = [ln for ln in k3.lines if ln.get_marker() == "."]
    x, y = np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)
    assert x.tolist() == [1, 2, 3, 4]
    assert np.isnan(y[1])  # a gap: no line drawn from step 1 to step 3
    assert y[[0, 2, 3]] == pytest.approx([want["steps"][s]["k3"] for s in (1, 3, 4)], rel=1e-9)
    assert any(text.get_text().strip() == "no valid token" for text in k3.texts)
    assert "No valid token at step 2 (its 60 dump rows all invalid" in html


def test_every_page_of_a_dump_names_its_invalid_rows(tmp_path):
    """The bare dump's page, a training run's page and the comparison page each say how many rows of the dump were
    skipped as invalid (the naive count) and that step 2 has no valid token."""
    import json
    import shutil

    folder = _write_dump(tmp_path / "dump")
    n = _naive(folder)["invalid"]
    run = tmp_path / "run"
    shutil.copytree(folder, run / "dump")
    (run / "summary.json").write_text(json.dumps({"kind": "training", "framework": "trl", "title": "t",
                                                  "settings": {}}))
    pages = {"dump": build_report(folder, tmp_path / "dump.html", threads=1),
             "training": build_report(run, tmp_path / "train.html", threads=1),
             "comparison": build_comparison([folder, run], tmp_path / "cmp.html", labels=["a", "b"], threads=1)}
    for name, path in pages.items():
        text = re.sub(r"<[^>]+>", "", path.read_text())
        counted = re.findall(rf"\b{n} invalid rows skipped", text)
        assert len(counted) == (2 if name == "comparison" else 1), name  # the comparison: one per run
        assert "No valid token at step 2" in text, name
