"""The report reads a dump by streaming queries (``tim_plugins.report.query``, DuckDB): every number equals the
in-memory computation it replaced (``report_reference``, kept here as the reference), its memory cap is the
engine's and a dump larger than the cap still reads, it reads a snapshot of complete files, and several runs
compare on one page."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("duckdb")
pytest.importorskip("matplotlib")

import report_reference as ref  # noqa: E402
from tim_plugins.dump import TokenDumper  # noqa: E402
from tim_plugins.report.query import Engine, engine, open_dump  # noqa: E402
from tim_plugins.report.sql_stats import order_statistics  # noqa: E402


def _dump(folder, *, steps=(1, 2, 3), ranks=(0, 1), B=6, T=40, noise=0.05, seed=0, entropy_on=(2,)):
    """A dump with what real ones hold: several steps and ranks, exact zeros, tied |d|, placeholders, NaN and
    -inf rows, a fully invalid sequence, masked tails, files with and without the entropy column."""
    g = torch.Generator().manual_seed(seed)
    dumper = TokenDumper(out_dir=str(folder), sample_rate=1.0, max_sequences_per_step=64)
    for step in steps:
        for rank in ranks:
            rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) ** 3 * 12  # many confident tokens
            train = rollout + noise * torch.randn(B, T, generator=g, dtype=torch.float64) * (1 - rollout.exp())
            train[0, :6] = rollout[0, :6]                        # exact zeros
            train[1, 2], train[1, 5] = rollout[1, 2] + 0.25, rollout[1, 5] - 0.25  # a tie in |d|
            rollout[1, 7] = -9999.0                              # placeholder
            train[2, 3] = float("nan")
            rollout[2, 4] = float("-inf")
            rollout[3] = -1e4                                    # a sequence with no valid token
            mask = torch.ones(B, T, dtype=torch.bool)
            mask[4, T // 2:] = False
            ent = torch.rand(B, T, generator=g) if step in entropy_on else None
            dumper.write(step, rollout, train, mask, torch.randint(0, 500, (B, T), generator=g), rank=rank,
                         entropy=ent)
    return folder


def test_every_number_equals_the_in_memory_report(tmp_path):
    ref.assert_same_numbers(_dump(tmp_path / "a"))
    # one step, one rank, the tail of heavy noise (the ratio figure splits into zoom and full range)
    ref.assert_same_numbers(_dump(tmp_path / "b", steps=(7,), ranks=(3,), noise=2.0, seed=1))


@pytest.mark.parametrize("bins,fetch", [(4, 8), (2048, 1 << 16)])
def test_order_statistics_are_exact(bins, fetch):
    """Against a sort, with ties and heavy tails, per group; tiny bins and fetches force several narrowing
    rounds."""
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_cauchy(3000) * 1e-3, np.zeros(500), np.full(200, 0.125), [1e6, -1e6]])
    g = rng.integers(0, 3, v.size)
    with Engine() as eng:
        eng.con.register("vals", pa.table({"g": g, "v": v}))
        wanted = {k: [0, 1, 17, (g == k).sum() // 2, (g == k).sum() - 1] for k in range(3)}
        got = order_statistics(eng.con, "SELECT g, v FROM vals", wanted, bins=bins, fetch=fetch)
    for k, ranks in wanted.items():
        srt = np.sort(v[g == k])
        assert [got[(k, r)] for r in ranks] == [srt[r] for r in ranks]


def test_the_memory_limit_is_the_engine_s_and_a_dump_larger_than_it_reads(tmp_path):
    """1 M rows (56 MB of columns as the engine decodes them) under a 32 MB cap: every query completes, and
    what it returns equals numpy on the same rows."""
    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(0)
    n_files, rows = 4, 250_000
    d_all, r_all = [], []
    for f in range(n_files):
        r = -rng.exponential(1.0, rows).astype(np.float32)
        t = (r + rng.normal(0, 0.02, rows)).astype(np.float32)
        d_all.append(t.astype(np.float64) - r.astype(np.float64))
        r_all.append(r)
        pq.write_table(pa.table({
            "step": np.full(rows, f, dtype=np.int64), "rank": np.zeros(rows, dtype=np.int32),
            "sequence": np.arange(rows) // 500, "position": (np.arange(rows) % 500).astype(np.int32),
            "token_id": np.arange(rows, dtype=np.int64), "rollout_logprob": r, "train_logprob": t}),
            folder / f"step_{f:08d}-rank_0000.parquet")
    d = np.concatenate(d_all)
    with engine(memory_limit="32MB", threads=2) as eng:
        assert eng.setting("memory_limit") == "30.5 MiB"  # DuckDB spells 32 MB in MiB
        assert eng.setting("threads") == 2
        dump = open_dump(folder)
        assert dump.size == d.size
        from tim_plugins.report.tokens import overall_metrics, rho_source

        k3 = overall_metrics(dump)["tim/token/kl_k3"]
        assert k3 == pytest.approx(float(np.mean(np.expm1(d) - d)), rel=1e-9)
        src = rho_source({"x": dump})
        assert (src.qlo, src.qhi) == tuple(np.quantile(d, (0.005, 0.995)))
        top = dump.largest_disagreements(3, 2)
        assert [r["diff"] for r in top] == sorted(d, key=lambda x: -abs(x))[:3]


def test_memory_limit_errors_name_the_value_and_the_fix(tmp_path, capsys):
    from tim_plugins.apps.cli import main

    with pytest.raises(ValueError, match=r"memory_limit='lots' is invalid.*'1GB'"):
        Engine(memory_limit="lots")
    _dump(tmp_path, steps=(1,), ranks=(0,))
    assert main(["report", str(tmp_path), "--memory-limit", "2 parsecs"]) == 2
    assert "--memory-limit '2 parsecs'" in capsys.readouterr().err


def test_the_report_reads_a_snapshot_of_complete_files(tmp_path):
    """A file being written (the writer's temporary name) is not read; one completed after the snapshot is not
    either, so every query of one report describes the same rows."""
    _dump(tmp_path, steps=(1, 2), ranks=(0,))
    (tmp_path / "step_00000003-rank_0000.parquet.tmp4242").write_bytes(b"PAR1 half a file")
    with engine():
        dump = open_dump(tmp_path)
        assert [p.rsplit("/", 1)[-1] for p in dump.files] == ["step_00000001-rank_0000.parquet",
                                                              "step_00000002-rank_0000.parquet"]
        before = dump.size
        _dump(tmp_path, steps=(3,), ranks=(0,), seed=9)  # completes during the report
        from tim_plugins.report.tokens import metrics_by_step

        steps, metrics = metrics_by_step(dump)
        assert steps.tolist() == [1, 2] and sum(m["tim/tokens"] for m in metrics) == before
        assert {r["step"] for r in dump.largest_disagreements(50, 1)} <= {1, 2}


def test_two_runs_compare_on_one_page(tmp_path, capsys):
    """``tim-plugins report A B --label``: one verdict per run (each the verdict of its own dump), the per-step
    series and per-token figures overlaid with a legend per run, each run's largest disagreements."""
    from tim_plugins.apps.cli import main
    from tim_plugins.report.health import RULES

    a, b = _dump(tmp_path / "bf16", noise=0.05), _dump(tmp_path / "fp32", noise=1e-4, seed=1)
    out = tmp_path / "cmp.html"
    assert main(["report", str(a), str(b), "--label", "bf16 rollouts", "--label", "fp32 rollouts",
                 "--out", str(out)]) == 0
    assert f"report written to {out}" in capsys.readouterr().out
    html = out.read_text()
    assert html.count("class='verdict") == 2
    for label, folder in (("bf16 rollouts", a), ("fp32 rollouts", b)):
        k3 = ref.overall_metrics(ref.load_tokens(folder))["tim/token/kl_k3"]
        block = html.split(f"<b>{label}</b>", 1)[1].split("</ul></div>", 1)[0]
        assert f"{RULES['tim/token/kl_k3'].label} = {k3:.3g}" in block
        assert f"<summary><b>{label}</b></summary>" in html
    assert html.count("<img src='data:image/png;base64,") == 6  # per-step series + 5 per-token figures
    assert "Mismatch per optimizer step" in html and "Largest disagreements" in html
    # default labels: the folder names (more of the path where they repeat); a wrong number of labels is refused
    from tim_plugins.report import run_labels

    assert run_labels([a, b]) == ["bf16", "fp32"]
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert main(["report", str(a), str(b), "--label", "only one"]) == 2
    assert "one distinct --label per folder" in capsys.readouterr().err


def test_comparison_overlays_each_run_in_the_step_panels(tmp_path, monkeypatch):
    import tim_plugins.report.figures as figures
    from tim_plugins.report import build_comparison

    kept = []
    save = figures.png_bytes
    monkeypatch.setattr(figures, "png_bytes", lambda fig: (kept.append(fig), save(fig))[1])
    a, b = _dump(tmp_path / "a", steps=(1, 2, 3)), _dump(tmp_path / "b", steps=(2, 3, 4, 5), noise=1e-3, seed=3)
    build_comparison([a, b], tmp_path / "c.html", labels=["A", "B"])
    k3_panel = kept[0].axes[0]
    lines = {line.get_label(): line for line in k3_panel.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"A", "B"}
    for label, folder in (("A", a), ("B", b)):
        steps, metrics = ref.metrics_by_step(ref.load_tokens(folder))
        assert lines[label].get_xdata().tolist() == steps.tolist()
        np.testing.assert_allclose(lines[label].get_ydata(), [m["tim/token/kl_k3"] for m in metrics], rtol=1e-9)
    prob = kept[1].axes[0]  # per-probability markers: one series per run, named
    assert {line.get_label() for line in prob.get_lines()} >= {"A", "B"}
    assert re.search(r"Training-inference mismatch: A vs B", (tmp_path / "c.html").read_text())


def test_doctor_lists_the_query_engine():
    import duckdb

    from tim_plugins.apps.doctor import _versions

    assert ("duckdb", duckdb.__version__, None) in _versions()
