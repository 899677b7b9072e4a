"""A report of dump files no adapter of ours writes but the report says it reads (another writer's Parquet, a damaged
copy), and of what a user names it with: it is written, its numbers are a naive recomputation's, and what it cannot
show is shown as such (the standard: a report never ends on one bad cell)."""

from __future__ import annotations

import re
from html import escape as html_escape

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tim_plugins.dump import dump_file_name
from tim_plugins.report import build_comparison, build_report
from tim_plugins.report.disagreements import NO_ID
from tim_plugins.report.query import engine, open_dump
from tim_plugins.report.tokens import overall_metrics


def _write(folder, step=1, *, position=None, sequence=None, token_id=None, d=None, n=10, rank=0):
    """One dump file of ``n`` rows of one sequence: rollout log-probs in (-3, 0), the trainer's ``d`` above them
    (default: a small ramp, so the last row disagrees most); key columns as given (lists may hold None)."""
    folder.mkdir(parents=True, exist_ok=True)
    r = -np.linspace(0.1, 2.9, n)
    d = np.linspace(0.001, 0.01, n) if d is None else np.asarray(d, dtype=np.float64)
    cols = {
        "step": pa.array([step] * n, pa.int64()), "rank": pa.array([rank] * n, pa.int32()),
        "sequence": pa.array([0] * n if sequence is None else sequence, pa.int64()),
        "position": pa.array(list(range(n)) if position is None else position, pa.int32()),
        "token_id": pa.array(list(range(100, 100 + n)) if token_id is None else token_id, pa.int64()),
        "rollout_logprob": pa.array(r.astype(np.float32)), "train_logprob": pa.array((r + d).astype(np.float32)),
    }
    pq.write_table(pa.table(cols), folder / dump_file_name(step, rank))
    return (r.astype(np.float32).astype(np.float64), (r + d).astype(np.float32).astype(np.float64))


def _naive_abs_mean(r, t, keep):
    return float(np.abs(t[keep] - r[keep]).mean())


def test_positions_outside_the_dense_range_are_counted_and_reported(tmp_path):
    """Positions below 0 (a writer's -1 for "unknown") and at 2^24 and beyond take the position profile's sparse
    path: the report is written and every row is in its numbers."""
    pos = [-1, 0, 1, 2, 3, 1 << 24, (1 << 24) + 7, 5, 6, 7]
    r, t = _write(tmp_path, position=pos)
    with engine(threads=1):
        dump = open_dump(tmp_path)
        m = overall_metrics(dump)
        assert dump.size == 10 and dump.invalid == 0
    assert m["tim/token/abs_diff_mean"] == pytest.approx(_naive_abs_mean(r, t, np.ones(10, bool)), rel=1e-9)
    html = build_report(tmp_path, threads=1).read_text()
    assert "10 tokens from 1 sequences" in html


def test_a_row_without_a_key_is_an_invalid_row_not_the_largest_disagreement(tmp_path):
    """A null sequence or position (no sequence to show the row in) makes the row invalid, counted as such; the
    largest disagreement is the largest of the rows that have their keys."""
    seq = [0] * 9 + [None]  # the last row, with the largest d, has no sequence
    pos = [0, 1, None] + list(range(3, 10))
    r, t = _write(tmp_path, sequence=seq, position=pos)
    keyed = np.array([s is not None and p is not None for s, p in zip(seq, pos)])
    with engine(threads=1):
        dump = open_dump(tmp_path)
        assert dump.size == keyed.sum() and dump.invalid == (~keyed).sum()
        assert overall_metrics(dump)["tim/token/abs_diff_mean"] == pytest.approx(_naive_abs_mean(r, t, keyed),
                                                                                 rel=1e-9)
        top = dump.largest_disagreements(3, 2)
    want = np.argsort(-np.abs(t - r) * keyed, kind="stable")[:3]
    assert [row["position"] for row in top] == [pos[i] for i in want]
    assert build_report(tmp_path, threads=1).exists()


def test_a_top_row_without_a_token_id_shows_a_question_mark(tmp_path):
    tok = list(range(100, 109)) + [None]
    _write(tmp_path, token_id=tok)
    with engine(threads=1):
        top = open_dump(tmp_path).largest_disagreements(2, 2)
    assert top[0]["position"] == 9 and top[0]["token_id"] is None and top[0]["before"] == [107, 108]
    assert top[1]["token_id"] == 108 and top[1]["after"] == []  # the row without an id is no context either
    html = build_report(tmp_path, threads=1, decode=lambda ids: "".join(f"<{i}>" for i in ids)).read_text()
    assert f"<mark>{NO_ID}</mark>" in html


def test_a_token_id_the_tokenizer_rejects_costs_its_text_not_the_report(tmp_path, toy_model_path):
    """The run's own tokenizer (the toy model's) given ids it cannot decode (negative: a damaged file; past its
    vocabulary: a model whose embedding is padded beyond it): the report is written, each such id shown as such and
    its neighbours decoded as the tokenizer decodes them alone."""
    from tim_plugins.apps.report import token_decoder

    decode = token_decoder(str(toy_model_path))
    tok = [5, 6, 7, 8, 9, 10, 11, 12, -1, 13]
    _write(tmp_path, token_id=tok, d=[0.001] * 8 + [0.5, 0.002])  # the rejected id disagrees most
    with pytest.raises(Exception):  # the premise: the tokenizer rejects it
        decode([-1])
    html = build_report(tmp_path, threads=1, decode=decode).read_text()
    assert "<mark>⟨id -1⟩</mark>" in html
    rows = re.findall(r"<td class='ctx'>(.*?)</td>", html)
    assert rows and decode([12]) in rows[0] and decode([13]) in rows[0]


def test_a_lone_surrogate_in_the_run_s_settings_does_not_end_the_page(tmp_path):
    """A model path that is not UTF-8 (``json.dumps`` of a surrogate-escaped file name) in summary.json: the page
    is written, the surrogate shown escaped."""
    import json

    _write(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"framework": "trl", "title": "t",
                                                       "settings": {"model": "/m/caf\udce9"}}))
    html = build_report(tmp_path, threads=1).read_text(encoding="utf-8")
    assert "/m/caf\\udce9" in html


def test_run_labels_with_dollar_signs_are_shown_as_written(tmp_path):
    """matplotlib reads text between two ``$`` as math markup; a run named so (a folder, ``--label``) is drawn
    literally, and the comparison is written."""
    a, b = tmp_path / "a", tmp_path / "b"
    for step in (1, 2):
        _write(a, step)
        _write(b, step, d=np.linspace(0.01, 0.1, 10))
    labels = ["fp32 $x_$", "bf16 $\\rho$"]
    html = build_comparison([a, b], tmp_path / "c.html", labels=labels, threads=1).read_text()
    for label in labels:
        assert html_escape(label, quote=False) in html
    assert html.count("<img") >= 5  # every figure drawn


def test_a_file_whose_data_pages_are_damaged_is_skipped_and_named(tmp_path):
    """A copy damaged in its middle (its footer intact, so it opens): the full pass meets it and the report is made
    without it, its numbers those of the other files (a naive recomputation), the page naming the file."""
    r, t = _write(tmp_path, step=1)
    _write(tmp_path, step=2, n=4000, d=np.full(4000, 0.3))
    path = tmp_path / dump_file_name(2, 0)
    data = bytearray(path.read_bytes())
    data[200:2200] = b"\xab" * 2000
    path.write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows == 4000  # the premise: the footer reads, the pages do not
    with pytest.raises(OSError):
        pq.read_table(path)
    with engine(threads=1):
        dump = open_dump(tmp_path)
        m = overall_metrics(dump)
        assert [name for name, _ in dump.skipped] == [path.name] and dump.size == 10
    assert m["tim/token/abs_diff_mean"] == pytest.approx(_naive_abs_mean(r, t, np.ones(10, bool)), rel=1e-9)
    html = build_report(tmp_path, threads=1).read_text()
    assert path.name in html and "10 tokens from 1 sequences" in html


def test_read_dump_widens_another_writers_float64_and_int32_columns_beside_ours(tmp_path):
    """``read_dump`` (the whole dump as one Table) of our float32 file beside another writer's float64 log-probs and
    int32 steps: every row, the values exactly as written, in the wider type (pyarrow's own cast as reference)."""
    from tim_plugins.dump import read_dump

    r, t = _write(tmp_path, step=1, n=4)
    wide = {"step": pa.array([2] * 3, pa.int32()), "rank": pa.array([0] * 3, pa.int32()),
            "sequence": pa.array([0] * 3, pa.int64()), "position": pa.array([0, 1, 2], pa.int32()),
            "token_id": pa.array([7, 8, 9], pa.int64()),
            "rollout_logprob": pa.array([-0.1, -0.2, -0.3], pa.float64()),
            "train_logprob": pa.array([-0.11, -0.21, -0.31], pa.float64())}
    pq.write_table(pa.table(wide), tmp_path / dump_file_name(2, 0))
    table = read_dump(tmp_path)
    assert table.schema.field("rollout_logprob").type == pa.float64()
    assert table.schema.field("step").type == pa.int64()
    assert table.column("step").to_pylist() == [1] * 4 + [2] * 3
    assert table.column("rollout_logprob").to_pylist() == [*r.tolist(), -0.1, -0.2, -0.3]
    assert table.column("train_logprob").to_pylist() == [*t.tolist(), -0.11, -0.21, -0.31]


def _keyless_dump(folder, write_statistics=True):
    """One file of 200 rows (5 sequences of 40), every other row without its position; log-prob differences wide
    enough that the |Δ| histogram's edges and the p99's bins cut fine bins (the narrow passes read rows again).
    Returns (rollout, train) of the rows that have their keys, in float64 as the report reads them."""
    rng = np.random.default_rng(7)
    n = 200
    r = np.log(rng.uniform(0.01, 1.0, n)).astype(np.float32)
    t = (r + rng.normal(0, 0.3, n)).astype(np.float32)
    pos = [None if i % 2 == 0 else i % 40 for i in range(n)]
    cols = {"step": pa.array([1] * n, pa.int64()), "rank": pa.array([0] * n, pa.int32()),
            "sequence": pa.array(np.repeat(np.arange(5), 40), pa.int64()), "position": pa.array(pos, pa.int32()),
            "token_id": pa.array(rng.integers(0, 1000, n), pa.int64()),
            "rollout_logprob": pa.array(r), "train_logprob": pa.array(t)}
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), folder / dump_file_name(1, 0), write_statistics=write_statistics)
    keyed = np.array([p is not None for p in pos])
    return r[keyed].astype(np.float64), t[keyed].astype(np.float64)


@pytest.mark.parametrize("write_statistics", [True, False])
def test_rows_without_a_key_are_left_out_of_every_pass_alike(tmp_path, write_statistics):
    """Rows with valid log-probs but no position are invalid in the full pass and in the narrow passes alike (with
    or without the footer's null counts): the report is written, and the |Δ| histogram (every bin), the token
    counts and the p99 of |d| per probability bin are those of a naive computation over the rows with their keys."""
    from tim_plugins.report.figures import PROB_EDGES, PROB_MIN_COUNT
    from tim_plugins.report.tokens import abs_histograms, prob_curves

    r, t = _keyless_dump(tmp_path, write_statistics)
    a = np.abs(t - r)
    with engine(threads=1):
        dump = open_dump(tmp_path)
        assert (dump.size, dump.invalid) == (100, 100)
        curve = prob_curves({"d": dump}, quantile=True)["d"]
        (hists, bins) = abs_histograms({"d": dump})
    want_bins = np.geomspace(a[a > 0].min(), a.max() * 1.01, 50)
    want_bins[0] = a[a > 0].min()
    assert np.allclose(bins, want_bins, rtol=1e-12)
    assert hists["d"][0].tolist() == np.histogram(a[a > 0], bins=bins)[0].tolist()
    assert hists["d"][1] == int((a == 0).sum())
    # the p99 of |d| per bin of 1 − p, naive: np.digitize then clip, np.quantile
    idx = np.clip(np.digitize(np.clip(-np.expm1(r), 1e-7, 1.0), PROB_EDGES) - 1, 0, len(PROB_EDGES) - 2)
    assert curve["count"].tolist() == np.bincount(idx, minlength=len(PROB_EDGES) - 1).tolist()
    big = [g for g in range(len(PROB_EDGES) - 1) if (idx == g).sum() >= PROB_MIN_COUNT]
    assert big  # the premise: a bin with a p99 (read by a narrow pass)
    for g in range(len(PROB_EDGES) - 1):
        if g in big:
            assert curve["quantile"][g] == pytest.approx(np.quantile(a[idx == g], 0.99), rel=1e-12)
        else:
            assert np.isnan(curve["quantile"][g])
    html = build_report(tmp_path, threads=1).read_text()
    assert "100 tokens from 5 sequences in the dump (100 invalid rows skipped)" in html


def test_a_narrow_pass_reads_the_keys_only_of_a_file_that_may_lack_one(tmp_path, monkeypatch):
    """The narrow passes stay narrow: a file whose footer says no key is null is read for its two log-prob columns
    alone; one with a null key for its keys as well."""
    from tim_plugins.report import scan

    _write(tmp_path / "whole", n=10)
    _keyless_dump(tmp_path / "keyless")
    asked = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, columns=None, **kwargs):
        asked.append(tuple(columns))
        return real(self, *args, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    for name in ("whole", "keyless"):
        list(scan._read(str(tmp_path / name / dump_file_name(1, 0)), scan.NARROW_COLUMNS, 1000))
    assert asked == [("rollout_logprob", "train_logprob"),
                     ("rollout_logprob", "train_logprob", "step", "rank", "sequence", "position")]
