"""The report reads a dump by streaming queries (``tim_plugins.report.query``, DuckDB): every number equals the
in-memory computation it replaced (``report_reference``, kept here as the reference), its memory cap is the
engine's and a dump larger than the cap still reads, it reads a snapshot of complete files, and several runs
compare on one page."""

from __future__ import annotations

import json
import math
import os
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


def test_prob_abs_diff_of_extreme_valid_rows(tmp_path):
    """Rows valid by the monitor's rule whose e^r underflows in float64 while ρ − 1 overflows (d > 709.8), both
    orders, both probabilities tiny, a tiny d: the report's prob_abs_diff mean and max are the naive float64
    |e^t − e^r|, not 0 · inf = NaN."""
    import tim_plugins.report.tokens as tokens

    r = torch.tensor([[-800.0, -720.0, -0.5, -1.0, -200.0]])
    t = torch.tensor([[-0.5, -0.5, -800.0, -1.0 + 2**-20, -100.0]])
    TokenDumper(out_dir=str(tmp_path), sample_rate=1.0).write(1, r, t, torch.ones(1, 5, dtype=torch.bool),
                                                              torch.zeros(1, 5, dtype=torch.long))
    want = [abs(math.exp(tv) - math.exp(rv)) for rv, tv in zip(r[0].tolist(), t[0].tolist())]
    with engine():
        got = tokens.overall_metrics(tokens.load_tokens(tmp_path))
    assert got["tim/token/prob_abs_diff_mean"] == pytest.approx(sum(want) / len(want), rel=1e-12)
    assert got["tim/token/prob_abs_diff_max"] == pytest.approx(max(want), rel=1e-12)


def _values_dump(folder, seed=0):
    """Files whose d = train − rollout has ties, exact zeros, heavy tails, values below the finest bin and both
    signs' extremes, in rows of every probability bin; returns d and the rollout log-probs of the valid rows."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    ds, rs = [], []
    for f in range(3):
        n = 4000
        r = (-rng.exponential(2.0, n)).astype(np.float32)
        d = rng.standard_cauchy(n) * 1e-3
        d[:300] = 0.0  # exact zeros
        d[300:500] = 0.125  # ties (the same r too, so the same float32 pair)
        r[300:500] = -0.5
        d[500:520] = 1e-30  # below the finest bin's decades
        d[520:522] = (500.0, -500.0)
        d[600:2600] = rng.uniform(0.01, 0.01005, 2000)  # distinct values, many in one fine bin
        t = (r.astype(np.float64) + np.clip(d, -900, 900)).astype(np.float32)
        pq.write_table(pa.table({
            "step": np.full(n, f, dtype=np.int64), "rank": np.zeros(n, dtype=np.int32),
            "sequence": np.arange(n) // 100, "position": (np.arange(n) % 100).astype(np.int32),
            "token_id": np.arange(n, dtype=np.int64), "rollout_logprob": r, "train_logprob": t}),
            folder / f"step_{f:08d}-rank_0000.parquet")
        ds.append(t.astype(np.float64) - r.astype(np.float64))
        rs.append(r.astype(np.float64))
    return np.concatenate(ds), np.concatenate(rs)


@pytest.mark.parametrize("fetch", [8, 1 << 16])
def test_order_statistics_are_exact(tmp_path, monkeypatch, fetch):
    """Against a sort, with ties, zeros and heavy tails: any rank of d pooled over two dumps, and quantiles of |d|
    per probability bin; a tiny fetch forces narrowing rounds (more narrow passes), a large one reads the bins
    whole."""
    import tim_plugins.report.query as query
    from tim_plugins.report.figures import PROB_EDGES
    from tim_plugins.report.tokens import order_statistics_of_d

    monkeypatch.setattr(query, "FETCH_ROWS", fetch)
    d1, r1 = _values_dump(tmp_path / "a", seed=0)
    d2, r2 = _values_dump(tmp_path / "b", seed=1)
    pooled = np.sort(np.concatenate([d1, d2]))
    dense = int(np.searchsorted(pooled, 0.010025))  # inside the fine bin of 0.01 .. 0.01005
    ranks = [0, 1, 17, 299, 300, 9000, dense, pooled.size // 2, pooled.size - 2, pooled.size - 1]
    with engine():
        a, b = open_dump(tmp_path / "a"), open_dump(tmp_path / "b")
        got = order_statistics_of_d([a, b], ranks)
        assert [got[k] for k in ranks] == [pooled[k] for k in ranks]
        # one full pass each; one narrow pass reads the bins of every rank whole, a tiny fetch narrows first
        assert a.passes["full"] == b.passes["full"] == 1
        assert a.passes["narrow"] == 1 if fetch > 8 else a.passes["narrow"] >= 2
        q = np.clip(-np.expm1(r1), 1e-7, 1.0)
        idx = np.clip(np.digitize(q, PROB_EDGES) - 1, 0, len(PROB_EDGES) - 2)
        for quantile in (0.5, 0.99, 1.0):
            want = np.array([np.quantile(np.abs(d1[idx == i]), quantile) if (idx == i).sum() >= 20 else np.nan
                             for i in range(len(PROB_EDGES) - 1)])
            np.testing.assert_array_equal(a.prob_curve(quantile, 20)["quantile"], want)


def test_a_report_reads_each_dump_in_one_full_pass_and_two_narrow_ones(tmp_path, monkeypatch):
    """A dump's page, and a comparison of two dumps: every per-token number of a dump from one full pass over its
    files, one narrow pass (the quantiles' and the |Δ| histogram's fine bins), one more for the ρ panels, and the
    largest disagreements' context read from the files that hold them only."""
    import tim_plugins.report.query as query
    from tim_plugins.report import build_comparison, build_report

    opened = []
    init = query.Dump.__init__
    monkeypatch.setattr(query.Dump, "__init__", lambda self, *a, **k: (init(self, *a, **k), opened.append(self))[0])
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b", noise=2.0, seed=1)
    build_report(a, tmp_path / "a.html")
    build_comparison([a, b], tmp_path / "c.html", labels=["A", "B"])
    assert [d.passes for d in opened] == [{"full": 1, "narrow": 2, "context": 1}] * 3
    # the context query reads only the files of the picked rows' (step, rank)
    sql = []
    with engine() as eng:
        dump = open_dump(a)
        top = dump.largest_disagreements(1, 2)[0]
        monkeypatch.setattr(eng, "con", _Recorder(eng.con, sql))
        dump.con = eng.con
        dump.largest_disagreements(1, 2)
    assert len(sql) == 1 and sql[0].count(".parquet'") == 1
    assert f"step_{top['step']:08d}-rank_{top['rank']:04d}.parquet" in sql[0]


class _Recorder:
    """A DuckDB connection that records the SQL it runs."""

    def __init__(self, con, sql: list) -> None:
        self._con, self._sql = con, sql

    def execute(self, q, *args):
        self._sql.append(q)
        return self._con.execute(q, *args)


def test_the_probability_bin_from_p_equals_np_digitize_at_and_next_to_every_edge():
    """The full pass bins 1 − p from p = exp(r) and log10 (``scan.prob_bin_from``); the figure's rule is
    ``np.digitize(-expm1(r))`` then clip (``scan.prob_bin``, the in-memory reference's): equal on a million
    log-probs, on the log-probs at each edge and their float neighbours (two ulps each way), and at 0 and -0."""
    from tim_plugins.report.figures import PROB_EDGES
    from tim_plugins.report.scan import prob_bin, prob_bin_from

    rng = np.random.default_rng(0)
    at = np.log1p(-PROB_EDGES[:-1])
    near = [at]
    for direction in (-np.inf, np.inf):
        x = at
        for _ in range(2):
            x = np.nextafter(x, direction)
            near.append(x)
    r = np.concatenate([-rng.gamma(0.35, 1.5, 1_000_000), -rng.uniform(0, 2e-7, 10_000), [0.0, -0.0, -700.0],
                        *near])
    r = r[np.isfinite(r) & (r <= 0)]
    want = np.clip(np.digitize(np.clip(-np.expm1(r), 1e-7, 1.0), PROB_EDGES) - 1, 0, len(PROB_EDGES) - 2)
    assert (prob_bin(r, PROB_EDGES) == want).all()
    assert (prob_bin_from(np.exp(r), r, PROB_EDGES) == want).all()


def test_the_narrow_pass_prefilter_keeps_every_row_of_a_wanted_bin():
    """``bins.coarse_table`` (a narrow pass's first cut: the float's top 16 bits) is a superset of the wanted fine
    bins' rows: on values spread over 33 decades, both signs, zeros, subnormals and every fine bin's edge and its
    float neighbours, for random sets of wanted bins."""
    from tim_plugins.report import bins as B

    rng = np.random.default_rng(0)
    edges = 10.0 ** (np.arange(-24 * B.PER_DECADE, 4 * B.PER_DECADE) / B.PER_DECADE)
    d = np.concatenate([rng.standard_normal(500_000) * 10.0 ** rng.uniform(-30, 3, 500_000),
                        [0.0, -0.0, 5e-324, -5e-324, 1e-300, 1999.0, -1999.0],
                        edges, -edges, np.nextafter(edges, 0), np.nextafter(edges, 1e9), -np.nextafter(edges, 0)])
    a = np.abs(d)
    with np.errstate(divide="ignore"):
        s = B.signed_bin(d, B.magnitude_bin(a, np.log10(a)))
    for trial in range(10):
        wanted = np.zeros(B.N_SIGNED, dtype=bool)
        wanted[rng.choice(B.N_SIGNED, size=int(rng.integers(1, 300)), replace=False)] = True
        wanted[B.CENTRE] = trial == 0
        kept = B.coarse_table(wanted)[B.coarse_key(d)]
        assert kept[wanted[s]].all()
        assert kept.sum() < 10 * max(wanted[s].sum(), 1000)  # and it does cut


def test_a_narrow_pass_serves_more_requests_than_one_bitmask_word(tmp_path):
    """70 requests (two 64-bit words of the row-to-request masks), each the values of one signed fine bin, equal
    numpy's selection of the same rows."""
    from tim_plugins.report import bins as B
    from tim_plugins.report.scan import narrow_pass

    d_all, _ = _values_dump(tmp_path / "v")
    a = np.abs(d_all)
    with np.errstate(divide="ignore"):
        s = B.signed_bin(d_all, B.magnitude_bin(a, np.log10(a)))
    occupied = np.unique(s)
    picked = occupied[np.linspace(0, occupied.size - 1, 70).astype(int)]
    requests = [B.Collect(B.Rows(signed=(int(k),), value="d")) for k in picked]
    with engine():
        got = narrow_pass(open_dump(tmp_path / "v").files, 2, requests)
    for k, values in zip(picked, got):
        assert np.sort(values).tolist() == np.sort(d_all[s == k]).tolist()


_NO_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("the report imported torch")
sys.meta_path.insert(0, Block())
from tim_plugins.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_report_imports_no_torch(tmp_path):
    """torch costs ~1.5 s to import, a third of a small report: the report reads dumps, derives the monitor's
    metrics and draws without it (a dump's page, a comparison)."""
    import subprocess
    import sys

    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b", seed=1)
    for args in ([str(a), "--out", str(tmp_path / "a.html")], [str(a), str(b), "--out", str(tmp_path / "c.html")]):
        proc = subprocess.run([sys.executable, "-c", _NO_TORCH, "report", *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]


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
    from tim_plugins.report.figures import PROB_MIN_COUNT

    for label, folder in (("A", a), ("B", b)):  # each run's mean |d| per bin of 1 - p, from the in-memory reference
        old = ref.load_tokens(folder)
        want = ref.prob_curve(old.d, old.rollout, False)
        keep = want["count"] >= PROB_MIN_COUNT
        mean = want["sum"][keep] / want["count"][keep]
        (line,) = [x for x in prob.get_lines() if x.get_label() == label]
        np.testing.assert_allclose(line.get_ydata(), mean[mean > 0], rtol=1e-9)
    assert re.search(r"Training-inference mismatch: A vs B", (tmp_path / "c.html").read_text())


def test_doctor_lists_the_query_engine():
    import duckdb

    from tim_plugins.apps.doctor import _versions

    assert ("duckdb", duckdb.__version__, None) in _versions()


def test_a_crashed_run_s_broken_files_are_skipped_and_named(tmp_path):
    """A dump folder with a torn file (a run killed while a non-atomic copy or a full disk cut it), an empty one
    and a Parquet file of another schema: the report reads the complete dump files, its numbers are those of
    those files alone (a naive recomputation), and the page names each file it skipped and why."""
    import shutil

    from tim_plugins.report import build_report
    from tim_plugins.report.tokens import metrics_by_step, overall_metrics

    good = _dump(tmp_path / "good", steps=(1, 2), ranks=(0, 1))
    run = tmp_path / "run"
    shutil.copytree(good, run)
    whole = (run / "step_00000002-rank_0001.parquet").read_bytes()
    (run / "step_00000003-rank_0000.parquet").write_bytes(whole[: len(whole) // 2])
    (run / "step_00000003-rank_0001.parquet").write_bytes(b"")
    pq.write_table(pa.table({"x": [1, 2]}), run / "step_00000004-rank_0000.parquet")
    broken = ["step_00000003-rank_0000.parquet", "step_00000003-rank_0001.parquet", "step_00000004-rank_0000.parquet"]

    valid = ref.load_tokens(good)  # the complete files' valid rows, read whole
    d = valid.d
    with engine():
        dump = open_dump(run)
        assert [name for name, _ in dump.skipped] == broken
        assert dump.size == d.size and dump.invalid == valid.invalid
        steps, per_step = metrics_by_step(dump)
        assert steps.tolist() == [1, 2]
        for s, m in zip(steps, per_step):
            ds = d[valid.step == s]
            assert m["tim/tokens"] == ds.size
            assert m["tim/token/kl_k3"] == pytest.approx(np.mean(np.expm1(ds) - ds), rel=1e-9)
        overall = overall_metrics(dump)
        assert overall["tim/token/abs_diff_mean"] == pytest.approx(np.abs(d).mean(), rel=1e-9)
        assert {r["step"] for r in dump.largest_disagreements(20, 2)} <= {1, 2}
    html = build_report(run, threads=1).read_text()
    assert f"{d.size} tokens from" in html
    for name in broken:
        assert name in html



@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak memory from /proc (Linux)")
def test_one_large_file_is_read_in_chunks_not_whole(tmp_path):
    """A dump file far larger than a chunk (one file per step and rank: a step dumped with a high
    max_sequences_per_step) is read a chunk of row groups at a time: the full pass's peak memory grows by a few
    chunks, not by the file's columns, and its numbers are a naive recomputation's."""
    import subprocess
    import sys

    n = 1 << 22
    rng = np.random.default_rng(0)
    r = (-rng.random(n) * 6).astype(np.float32)
    t = (r + rng.normal(0, 0.05, n)).astype(np.float32)
    r[::1000] = -9999.0  # placeholders
    seq = np.arange(n) // 2048
    pq.write_table(pa.table({"step": np.full(n, 3, np.int64), "rank": np.zeros(n, np.int32), "sequence": seq,
                             "position": (np.arange(n) % 2048).astype(np.int32), "token_id": np.zeros(n, np.int64),
                             "rollout_logprob": r, "train_logprob": t}),
                   tmp_path / "step_00000003-rank_0000.parquet", row_group_size=1 << 14)
    ok = r > -1000
    d = t[ok].astype(np.float64) - r[ok].astype(np.float64)
    columns = n * (8 + 4 + 8 + 4 + 4 + 4)  # the six columns the full pass reads, as stored: what a whole read holds
    code = f"""
import json
import tim_plugins.report.scan as scan
from tim_plugins.report.query import engine, open_dump
scan.CHUNK_ROWS = 1 << 14  # chunks of a row group: the growth is a few of them plus the pass's fixed costs
from tim_plugins.report.tokens import overall_metrics
def peak():  # this process's peak resident memory (VmHWM: its own, not the parent's as ru_maxrss after exec)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
with engine(threads=1):
    dump = open_dump({str(tmp_path)!r})
    base = peak()
    dump.full()
    grew = peak() - base
    m = overall_metrics(dump)
    print(json.dumps({{"grew": grew, "size": dump.size, "invalid": dump.invalid, "k3": m["tim/token/kl_k3"],
                       "abs": m["tim/token/abs_diff_mean"], "seqs": m["tim/seq/count"]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # read whole, the file's columns are in memory at least once (2.2x them, measured, before it was chunked)
    assert got["grew"] < columns, f"grew by {got['grew'] / 1e6:.0f} MB for {columns / 1e6:.0f} MB of columns"
    assert (got["size"], got["invalid"]) == (d.size, n - d.size)
    assert got["k3"] == pytest.approx(np.mean(np.expm1(d) - d), rel=1e-9)
    assert got["abs"] == pytest.approx(np.abs(d).mean(), rel=1e-9)
    assert got["seqs"] == np.unique(seq[ok]).size


@pytest.mark.parametrize("limit", ["0GB", "0", "0.0MB", "100KB", 1000, "15MB"])
def test_a_memory_limit_too_small_for_duckdb_fails_before_the_passes(tmp_path, capsys, limit):
    """A zero or sub-block memory limit (DuckDB allocates 256 KiB blocks) is a usage mistake: it fails at once with
    the value, the rule and the fix, not with DuckDB's out-of-memory traceback after the passes."""
    from tim_plugins.apps.cli import main

    with pytest.raises(ValueError, match=rf"memory_limit={limit!r} is invalid: .*at least 16MB"):
        Engine(memory_limit=limit)
    _dump(tmp_path, steps=(1,), ranks=(0,))
    assert main(["report", str(tmp_path), "--memory-limit", str(limit)]) == 2
    err = capsys.readouterr().err
    assert f"--memory-limit '{limit}'" in err and "at least 16MB" in err and not (tmp_path / "report.html").exists()
    with Engine(memory_limit="16MB") as eng:  # the smallest allowed works
        assert eng.setting("memory_limit")


def test_a_measure_report_names_a_setting_s_skipped_dump_file(tmp_path):
    """The measure page reads each setting's dump like the others: a torn file in one is skipped and named with its
    setting, and the page's per-token numbers are those of the complete files."""
    import json

    from tim_plugins.report import build_report

    _dump(tmp_path / "dump_a", steps=(1,), ranks=(0,))
    (tmp_path / "dump_a" / "step_00000002-rank_0000.parquet").write_bytes(b"PAR1 torn")
    (tmp_path / "summary.json").write_text(json.dumps({"kind": "measure", "comparisons": {"bf16": {
        "tim/token/kl_k3": 1e-4}}, "dumps": {"bf16": "dump_a"}}))
    html = build_report(tmp_path, threads=1).read_text()
    assert re.search(r"bf16.{0,80}1 file of the dump folder skipped.{0,200}step_00000002-rank_0000\.parquet", html)


def test_every_number_is_the_same_when_a_file_is_read_in_chunks_smaller_than_a_sequence(tmp_path, monkeypatch):
    """Files read a few rows at a time (each sequence split over chunks and threads): every number still equals the
    in-memory computation."""
    import tim_plugins.report.scan as scan

    monkeypatch.setattr(scan, "CHUNK_ROWS", 7)
    monkeypatch.setattr(scan, "SLICE_ROWS", 5)
    ref.assert_same_numbers(_dump(tmp_path, steps=(1, 2), ranks=(0, 1), T=20))


@pytest.mark.parametrize("spill_elsewhere", [False, True])
def test_files_a_resumed_run_replaces_or_removes_during_a_report_are_read_as_snapshotted(tmp_path, monkeypatch,
                                                                                          spill_elsewhere):
    """A report on the folder of a live run: the run, resumed, redoes a step (its file replaced under the same name)
    and removes an abandoned attempt's file, between the full pass and the narrow ones. Every figure still reads
    the rows of the snapshot (naive numbers over the files as they were), without a crash, and the report leaves
    nothing in the folder. ``spill_elsewhere``: the engine's temporary folder on another filesystem than the dump."""
    import errno
    import os as os_mod

    import shutil

    import report_reference as reference
    import tim_plugins.report.query as query
    import tim_plugins.report.tokens as tokens

    run = _dump(tmp_path / "run", steps=(1, 2, 3), ranks=(0,))
    before = tmp_path / "before"
    shutil.copytree(run, before)
    want = reference.load_tokens(before)
    if spill_elsewhere:
        link = os_mod.link

        def other_device(src, dst, *a, **k):
            if "/tim-report-" in str(dst):  # the engine's temporary folder, not the dump's hidden one
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return link(src, dst, *a, **k)

        monkeypatch.setattr(query.os, "link", other_device)

    with engine(threads=1):
        dump = open_dump(run)
        dump.full()
        redo = _dump(tmp_path / "redo", steps=(2,), ranks=(0,), seed=7, B=6, T=12)
        os_mod.replace(redo / "step_00000002-rank_0000.parquet", run / "step_00000002-rank_0000.parquet")
        (run / "step_00000003-rank_0000.parquet").unlink()
        d = {"dump": dump}
        curve = tokens.prob_curves(d, quantile=True)["dump"]
        assert curve["count"].tolist() == reference.prob_curve(want.d, want.rollout, True)["count"].tolist()
        hists, _ = tokens.abs_histograms(d)
        assert int(hists["dump"][0].sum()) + hists["dump"][1] == want.size
        src = tokens.rho_source(d)
        assert (src.n, src.dmin, src.dmax) == (want.size, want.d.min(), want.d.max())
        assert src.qlo == pytest.approx(np.quantile(want.d, 0.005), abs=0, rel=1e-12)
        top = dump.largest_disagreements(5, 2)
        assert [r["diff"] for r in top] == sorted(want.d.tolist(), key=lambda x: -abs(x))[:5]
    assert sorted(p.name for p in run.iterdir()) == ["step_00000001-rank_0000.parquet",
                                                     "step_00000002-rank_0000.parquet"]


_KILLED_REPORT = """
import errno, os, signal, sys
from tim_plugins.report import query

link = os.link
with query.engine(threads=1) as eng:
    def other_device(src, dst, *a, **k):  # the engine's temporary folder on another filesystem than the dump
        if str(dst).startswith(eng._spill):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return link(src, dst, *a, **k)
    query.os.link = other_device
    dump = query.open_dump(sys.argv[1])
    print(eng._spill, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_report_killed_mid_read_leaves_nothing_the_next_one_reads_or_keeps(tmp_path, monkeypatch):
    """A report whose temporary folder is on another filesystem links the dump's files in a hidden snapshot folder
    of the dump's own; killed (SIGKILL) it leaves that folder and its temporary folder. The next report reads the
    dump's own files alone (the same numbers as the reference over them, not twice the rows), and removes both
    leftovers of the dead process: their hard links would otherwise keep the disk space of files a resumed run
    replaces or moves aside for good. A folder of a live report (this host, a live process) is kept, as is one of
    another host unless it is a day old; in the system's temporary folder, only this host's dead reports' go."""
    import socket
    import subprocess
    import sys
    import time

    import report_reference as reference
    from tim_plugins.report import build_report
    from tim_plugins.report.tokens import load_tokens

    import tempfile

    run = _dump(tmp_path / "run", steps=(1, 2), ranks=(0, 1))
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(system_tmp))
    killed = subprocess.run([sys.executable, "-c", _KILLED_REPORT, str(run)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert killed.returncode == -9, killed.stderr
    spill = killed.stdout.strip()
    [left] = [p for p in run.iterdir() if p.name.startswith(".tim-report-snapshot-")]
    assert sorted(p.name for p in left.iterdir()) == sorted(p.name for p in run.glob("step_*.parquet"))
    assert os.path.isdir(spill) and spill.startswith(str(system_tmp))
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        kept = [run / f".tim-report-snapshot-{host}-{live.pid}-abc", run / ".tim-report-snapshot-elsewhere-1-abc"]
        old = run / ".tim-report-snapshot-elsewhere-2-abc"
        kept.append(system_tmp / "tim-report-someone-elses")  # a day old, but not of the report's naming
        for folder in (*kept, old):
            folder.mkdir()
        day_ago = time.time() - 2 * 86400
        for folder in (old, kept[-1]):
            os.utime(folder, (day_ago, day_ago))

        want = reference.load_tokens(run)
        with engine(threads=1):
            tokens = load_tokens(run)
            assert tokens.rows == sum(pq.read_metadata(p).num_rows for p in run.glob("step_*.parquet"))
            assert tokens.size == want.size
        build_report(run)
        assert not left.exists() and not os.path.exists(spill) and not old.exists()
        assert all(folder.is_dir() for folder in kept)
    finally:
        live.kill()
        live.wait()


def test_log_probs_far_above_zero_from_a_damaged_file_do_not_end_the_report(tmp_path):
    """A file whose data pages were damaged (its footer intact) reads as garbage log-probs, some far above 0 (e^r
    overflows float64): rows valid by the monitor's rule (finite, above the placeholder threshold), so counted, and
    the largest disagreements show their p as inf instead of ending the report with OverflowError."""
    from tim_plugins.report import build_report

    n = 12
    r = np.full(n, -1.0)
    t = r + 0.01
    r[3], t[3] = 800.0, 803.0  # d = 3, the largest
    pq.write_table(pa.table({"step": np.ones(n, np.int64), "rank": np.zeros(n, np.int32),
                             "sequence": np.zeros(n, np.int64), "position": np.arange(n, dtype=np.int32),
                             "token_id": np.arange(n, dtype=np.int64), "rollout_logprob": r.astype(np.float32),
                             "train_logprob": t.astype(np.float32)}), tmp_path / "step_00000001-rank_0000.parquet")
    with engine(threads=1):
        top = open_dump(tmp_path).largest_disagreements(2, 1)
    assert top[0]["position"] == 3 and top[0]["diff"] == pytest.approx(3.0)
    assert top[0]["p_rollout"] == math.inf and top[0]["p_train"] == math.inf
    assert top[1]["p_rollout"] == pytest.approx(math.exp(-1.0))
    html = build_report(tmp_path, threads=1).read_text()
    assert f"{n} tokens from 1 sequences" in html
    from tim_plugins.report.disagreements import largest_disagreements  # a run's own tensors' columns

    cols = pq.read_table(tmp_path / "step_00000001-rank_0000.parquet").to_pydict()
    rows = largest_disagreements({k: np.asarray(v) for k, v in cols.items()}, 1, 1)
    assert rows[0]["position"] == 3 and rows[0]["p_rollout"] == math.inf


def test_a_file_whose_token_ids_do_not_read_loses_its_context_not_the_report(tmp_path):
    """A file damaged in its token_id column alone (the full pass does not read it, so it gets past the footer check
    and the full pass): the largest disagreements leave that file's rows out of the context (its tokens show as
    unknown) and name it, the other file's rows keep theirs, and the report renders. Reference: the rows as written."""
    from tim_plugins.report import build_report

    n = 64
    for step in (1, 2):
        r = np.full(n, -1.0)
        t = r + 0.01 * np.arange(n) / n
        t[10] = r[10] + (3.0 if step == 1 else 2.0)  # the largest two: step 1's, then step 2's
        pq.write_table(pa.table({"step": np.full(n, step, np.int64), "rank": np.zeros(n, np.int32),
                                 "sequence": np.zeros(n, np.int64), "position": np.arange(n, dtype=np.int32),
                                 "token_id": np.arange(1000, 1000 + n, dtype=np.int64) * step,
                                 "rollout_logprob": r.astype(np.float32), "train_logprob": t.astype(np.float32)}),
                       tmp_path / f"step_{step:08d}-rank_0000.parquet", compression="snappy", use_dictionary=False)
    path = tmp_path / "step_00000001-rank_0000.parquet"
    meta = pq.ParquetFile(path).metadata.row_group(0)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "token_id")
    data = bytearray(path.read_bytes())
    start = col.dictionary_page_offset or col.data_page_offset
    for i in range(start + 24, start + col.total_compressed_size - 4):  # the page's data, its header intact
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with engine(threads=1):
        dump = open_dump(tmp_path)
        top = dump.largest_disagreements(2, 2)
        assert [(x["step"], x["position"]) for x in top] == [(1, 10), (2, 10)]
        assert top[0]["token_id"] is None and top[0]["before"] == top[0]["after"] == []
        assert top[1]["token_id"] == 2 * 1010 and top[1]["before"] == [2 * 1008, 2 * 1009]
        assert [name for name, _ in dump.context_unread] == [path.name] and dump.skipped == []
    assert "Largest disagreements" in build_report(tmp_path, threads=1).read_text()
