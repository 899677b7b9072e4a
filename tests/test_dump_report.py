"""Per-token Parquet dump round trip and the HTML report built from it."""

from __future__ import annotations

import os

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from tim_plugins.dump import DumpConfig, TokenDumper, read_dump  # noqa: E402
from tim_plugins.report import build_report  # noqa: E402


def _batch(B=6, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    train = rollout + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[2] = False  # a fully masked row writes no row
    tokens = torch.randint(0, 383, (B, T), generator=g)
    entropy = torch.rand(B, T, generator=g)
    return rollout.to(torch.bfloat16), train, mask, tokens, entropy


def test_round_trip_every_masked_in_token(tmp_path):
    rollout, train, mask, tokens, entropy = _batch()
    dumper = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0, max_sequences_per_step=100)
    path = dumper.write(3, rollout, train, mask, tokens, rank=1, entropy=entropy)
    assert path.name == "step_00000003-rank_0001.parquet"
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves no temporary behind
    table = read_dump(tmp_path)
    rows = table.to_pylist()
    want = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    assert [(r["sequence"], r["position"]) for r in rows] == want
    for r in rows:
        b, t = r["sequence"], r["position"]
        assert r["step"] == 3 and r["rank"] == 1
        assert r["token_id"] == tokens[b, t].item()
        assert r["rollout_logprob"] == rollout[b, t].float().item()  # bf16 → fp32 exactly
        assert r["train_logprob"] == pytest.approx(train[b, t].item(), abs=0)
        assert r["entropy"] == pytest.approx(entropy[b, t].item(), abs=0)


def test_sampling_rate_and_cap_bound_disk_use(tmp_path):
    rollout, train, mask, tokens, _ = _batch(B=400, T=5)
    mask[:] = True
    dumper = TokenDumper(DumpConfig(out_dir=str(tmp_path), sample_rate=0.1, max_sequences_per_step=1000))
    dumper.write(0, rollout, train, mask, tokens)
    n_seq = len(set(read_dump(tmp_path).column("sequence").to_pylist()))
    assert 20 <= n_seq <= 65  # Binomial(400, 0.1): mean 40, sd 6
    # the rate itself, pooled over 50 steps x 2 ranks (Binomial(40000, 0.1): sd 0.0015, the bound 6 sd), each step's
    # draw its own (no two steps keep the same sequences)
    pooled = tmp_path / "pooled"
    d = TokenDumper(out_dir=str(pooled), sample_rate=0.1, max_sequences_per_step=1000)
    one = (rollout[:, :1], train[:, :1], mask[:, :1], tokens[:, :1])
    for step in range(50):
        for rank in (0, 1):
            d.write(step, *one, rank=rank)
    picked = {}
    for r in read_dump(pooled).to_pylist():
        picked.setdefault((r["step"], r["rank"]), set()).add(r["sequence"])
    assert sum(map(len, picked.values())) / (50 * 2 * 400) == pytest.approx(0.1, abs=0.009)
    assert len({frozenset(s) for s in picked.values()}) == len(picked) == 100
    capped = tmp_path / "capped"
    TokenDumper(out_dir=str(capped), sample_rate=1.0, max_sequences_per_step=7).write(0, rollout, train, mask, tokens)
    assert len(set(read_dump(capped).column("sequence").to_pylist())) == 7
    # Same seed, step and rank → the same sequences (reproducible sampling).
    again = tmp_path / "again"
    TokenDumper(out_dir=str(again), sample_rate=0.1, max_sequences_per_step=1000).write(0, rollout, train, mask, tokens)
    assert read_dump(again).column("sequence").to_pylist() == read_dump(tmp_path).column("sequence").to_pylist()


def test_a_step_measured_in_several_batches_keeps_every_batch(tmp_path):
    """verl's separate_async with parameter_sync_step=2 measures one global step in two batches (one old-log-prob
    pass per actor update): both are kept, in two files, the second batch's sequences numbered after the first's,
    and the cap counts the step's sequences over both. A resumed run's new attempt at the step replaces the earlier
    attempt's files (all parts). Reference: the batches' own tensors, row by row."""
    from tim_plugins.report import query

    batches = [_batch(B=6, T=9, seed=1), _batch(B=5, T=9, seed=2)]
    dumper = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0, max_sequences_per_step=100)
    paths = [dumper.write(5, r, t, m, tok, rank=1) for r, t, m, tok, _ in batches]
    assert [p.name for p in paths] == ["step_00000005-rank_0001.parquet", "step_00000005-rank_0001-part_0001.parquet"]
    rows = read_dump(tmp_path).to_pylist()
    want = [(b + first, t, r[b, t].float().item(), tok[b, t].item())
            for first, (r, _, m, tok, _) in ((0, batches[0]), (6, batches[1]))
            for b in range(m.shape[0]) for t in range(m.shape[1]) if m[b, t]]
    assert [(r["sequence"], r["position"], r["rollout_logprob"], r["token_id"]) for r in rows] == want
    with query.engine() as eng:  # the report's reader sees both files' tokens, each sequence once
        dump = query.Dump(tmp_path, eng)
        assert dump.size == len(want)
        assert dump.sequences().sequence.tolist() == sorted({w[0] for w in want})
    dumper.write(6, *batches[0][:4], rank=1)  # the next step starts at part 0 and sequence 0 again
    assert sorted({r["sequence"] for r in read_dump(tmp_path).to_pylist() if r["step"] == 6}) == [0, 1, 3, 4, 5]

    capped = TokenDumper(out_dir=str(tmp_path / "capped"), sample_rate=1.0, max_sequences_per_step=8)
    for r, t, m, tok, _ in batches:
        capped.write(0, r, t, m, tok)
    # 6 rows of the first batch (row 2 fully masked: picked, no tokens) and the first 2 of the second
    assert sorted({r["sequence"] for r in read_dump(tmp_path / "capped").to_pylist()}) == [0, 1, 3, 4, 5, 6, 7]

    resumed = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0, max_sequences_per_step=100)
    resumed.write(5, *batches[1][:4], rank=1)  # the redone step, measured in one batch this time
    assert sorted(p.name for p in tmp_path.glob("step_00000005-*")) == ["step_00000005-rank_0001.parquet"]
    assert {r["sequence"] for r in read_dump(tmp_path).to_pylist() if r["step"] == 5} == {0, 1, 3, 4}


def test_every_n_steps_and_config_errors(tmp_path):
    rollout, train, mask, tokens, _ = _batch()
    d = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0, every_n_steps=2)
    assert d.write(1, rollout, train, mask, tokens) is None
    assert d.write(2, rollout, train, mask, tokens) is not None
    with pytest.raises(ValueError, match=r"sample_rate=1\.5"):
        DumpConfig(out_dir=str(tmp_path), sample_rate=1.5)
    with pytest.raises(FileNotFoundError, match="no dump files"):
        read_dump(tmp_path / "empty")


def test_report_from_multi_step_dump(tmp_path):
    d = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0)
    for step in range(3):
        rollout, train, mask, tokens, _ = _batch(B=8, T=30, seed=step)
        d.write(step, rollout, train, mask, tokens)
    out = build_report(tmp_path, summary={"settings": {"rollout": "test"}})
    html = out.read_text()
    assert html.count("<img src='data:image/png;base64,") == 6  # per-step series + 5 per-token figures
    assert html.count("How to read it") == 6 and "Drift by response position" in html
    assert "class='verdict" in html and "Sources of the healthy ranges" in html
    assert os.path.getsize(out) > 20_000


def test_report_cli(tmp_path, capsys):
    from tim_plugins.apps.cli import main

    rollout, train, mask, tokens, _ = _batch(B=8, T=30)
    TokenDumper(out_dir=str(tmp_path), sample_rate=1.0).write(0, rollout, train, mask, tokens)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    assert "report written to" in capsys.readouterr().out
    html = (tmp_path / "r.html").read_text()
    assert html.count("data:image/png;base64,") == 5  # one step: no per-step series


def test_report_cli_decodes_the_largest_disagreements_with_a_tokenizer(tmp_path, toy_model_path, capsys):
    """A bare dump has no tokenizer: token ids, and the hint; --tokenizer PATH decodes them with it."""
    from transformers import AutoTokenizer

    from tim_plugins.apps.cli import main

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    ids = torch.tensor([tok("A: 42.\nsort 3 1 2 -> 1 2 3.")["input_ids"][:14]] * 4)
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 14, generator=g) * 3
    TokenDumper(out_dir=str(tmp_path), sample_rate=1.0).write(
        0, rollout, rollout + 0.1 * torch.randn(4, 14, generator=g), torch.ones(4, 14, dtype=torch.bool), ids)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "ids.html")]) == 0
    assert "Token ids only: pass the tokenizer" in (tmp_path / "ids.html").read_text()
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "text.html"), "--tokenizer",
                 str(toy_model_path)]) == 0
    html = (tmp_path / "text.html").read_text()
    from tim_plugins.report.disagreements import dump_disagreements, visible

    top = dump_disagreements(tmp_path)[0]
    import html as html_mod

    assert f"<mark>{html_mod.escape(visible(tok.decode([top['token_id']])))}</mark>" in html
    assert "Token ids only" not in html and "⏎" in html  # the dumped completion holds a line break
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_log_history_beside_a_dump_feeds_the_per_step_series_and_a_verl_summary_names_verl(tmp_path):
    """What the verl driver leaves beside the dump (summary.json without a ``kind``, log_history.jsonl): the LR
    panel draws the logged scale, the fix column and the step axis speak verl, and one audit reads as one."""
    import json

    from tim_plugins.dump import LOG_HISTORY, append_log_history, read_log_history
    from tim_plugins.parity.findings import make_finding

    dumper = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0)
    for step in (1, 2, 3):
        rollout, train, mask, tokens, _ = _batch(seed=step)
        dumper.write(step, rollout, train, mask, tokens)
        append_log_history(tmp_path, step, {"tim/tokens": 10.0, "tim/lr/scale": 1.0 if step < 3 else 0.5,
                                            "actor/lr": 1e-3, "actor/pg_loss": 0.3, "tim/probe/tripped": True,
                                            "note": "x"})
    with open(tmp_path / LOG_HISTORY, "a") as f:
        f.write('{"step": 4, "tim/to')  # a run killed mid-write
    rows = read_log_history(tmp_path / LOG_HISTORY)
    # numeric tim/* and actor/lr only (a bool is not a metric value), the torn line skipped
    assert rows == [{"step": s, "tim/tokens": 10.0, "tim/lr/scale": 1.0 if s < 3 else 0.5, "actor/lr": 1e-3}
                    for s in (1, 2, 3)]
    finding = make_finding("prefix-caching-on", "warning", "prefix caching reuses KV", "yes", "no")
    (tmp_path / "summary.json").write_text(json.dumps({"framework": "verl", "findings": [finding.to_dict()],
                                                       "settings": {"model": "/nowhere"}}))
    html = build_report(tmp_path).read_text()
    assert "TIM LR scale (" not in html  # drawn from the log: neither "not logged" nor "stays 1"
    assert "fix (verl)" in html and "actor_rollout_ref.rollout.enable_prefix_caching=False" in html
    assert "verl" in html and "TRL&#x27;s global_step" not in html and "TRL's global_step" not in html
    assert "By table" not in html  # one audit: no "callback's view" against "the rollout model actually used"


def test_a_run_folder_before_its_first_dump_file_reports_its_logged_steps_and_causes(tmp_path):
    """summary.json and log_history.jsonl written, a cause named, and no dump file yet (the run stopped before a
    step wrote one, or a low sample_rate picked no sequence): the report renders the verdict with the cause and the
    per-step series from the log, says why there is no per-token part, and draws none."""
    from tim_plugins.causes import Cause
    from tim_plugins.dump import append_causes, append_log_history, write_summary

    write_summary(tmp_path, framework="verl", title="a run", settings={})
    for step in (1, 2):
        append_log_history(tmp_path, step, {"tim/tokens": 40.0, "tim/token/kl_k3": 1e-4 * step,
                                            "tim/token/abs_diff_p99": 0.01})
    append_causes(tmp_path, [Cause("floor-jump", 2, "the lag-0 floor jumped")])
    html = build_report(tmp_path).read_text()
    assert "No per-token rows in the dump yet" in html
    assert "floor-jump" in html and "Per optimizer step" in html
    assert ">Per token</h2>" not in html


def test_a_run_resumed_after_a_torn_log_line_keeps_its_first_logged_step(tmp_path):
    """A run killed mid-append leaves a torn last line in log_history.jsonl / causes.jsonl; the resumed run appends
    after it. Its first row (the step it redid) and its first cause are read, not glued to the torn line and lost,
    and the report's per-step series and verdict show them. A log written that way before (the row glued to the
    torn line) is recovered too."""
    import json

    from tim_plugins.causes import Cause
    from tim_plugins.dump import (CAUSES_LOG, LOG_HISTORY, append_causes, append_log_history, last_row_per_step,
                                  read_log_history)
    from tim_plugins.report.causes import read_causes

    for step in (1, 2, 3):
        append_log_history(tmp_path, step, {"tim/tokens": 10.0, "tim/token/kl_k3": 1e-4})
    with open(tmp_path / LOG_HISTORY, "a") as f:
        f.write('{"step": 4, "tim/tokens": 10.0, "tim/tok')  # killed mid-write
    with open(tmp_path / CAUSES_LOG, "a") as f:
        f.write('{"code": "floor-jump", "step": 4, "mess')
    for step in (3, 4, 5):  # resumed from the checkpoint of step 2
        append_log_history(tmp_path, step, {"tim/tokens": 20.0, "tim/token/kl_k3": 5e-2})
    append_causes(tmp_path, [Cause("floor-jump", 3, "the lag-0 floor jumped")])
    rows = last_row_per_step(read_log_history(tmp_path / LOG_HISTORY))
    assert [(r["step"], r["tim/tokens"], r["tim/token/kl_k3"]) for r in rows] == [
        (1, 10.0, 1e-4), (2, 10.0, 1e-4), (3, 20.0, 5e-2), (4, 20.0, 5e-2), (5, 20.0, 5e-2)]
    assert [(c["code"], c["step"]) for c in read_causes(tmp_path)] == [("floor-jump", 3)]
    html = build_report(tmp_path, summary={"framework": "verl", "settings": {}}).read_text()
    assert "floor-jump at step 3" in html
    assert "3 optimizer steps" not in html and "5 optimizer steps, 80 monitored tokens" in html

    glued = tmp_path / "glued"
    glued.mkdir()
    (glued / LOG_HISTORY).write_text(
        json.dumps({"step": 1, "tim/tokens": 1.0}) + "\n" + '{"step": 2, "tim/tok' + json.dumps(
            {"step": 2, "tim/tokens": 2.0}) + "\n" + json.dumps({"step": 3, "tim/tokens": 3.0}) + "\n")
    assert read_log_history(glued / LOG_HISTORY) == [{"step": s, "tim/tokens": float(s)} for s in (1, 2, 3)]


def test_report_out_that_is_a_folder_fails_before_reading_the_dump(tmp_path, capsys, monkeypatch):
    """``--out`` naming an existing folder (or a path under a file) is a usage mistake: it fails at once with the
    value and the fix, before the passes over the dump (minutes on a large one), not with IsADirectoryError after
    them."""
    from tim_plugins.apps.cli import main
    import tim_plugins.report.scan as scan

    rollout, train, mask, tokens, _ = _batch(B=8, T=30)
    TokenDumper(out_dir=str(tmp_path / "dump"), sample_rate=1.0).write(0, rollout, train, mask, tokens)
    (tmp_path / "a_file").write_text("x")

    def no_pass(*args, **kwargs):
        raise AssertionError("the dump was read before --out was checked")

    monkeypatch.setattr(scan, "full_pass", no_pass)
    for out in (tmp_path, tmp_path / "a_file" / "r.html"):
        assert main(["report", str(tmp_path / "dump"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {str(out)!r}" in err and "report.html" in err
    assert main(["report", str(tmp_path / "dump"), str(tmp_path / "dump"), "--label", "a", "--label", "b",
                 "--out", str(tmp_path)]) == 2
    assert f"--out {str(tmp_path)!r}" in capsys.readouterr().err


def test_a_run_whose_model_folder_has_no_loadable_tokenizer_reports_token_ids(tmp_path, capsys):
    """summary.json names the run's model folder, and it exists, but no tokenizer loads from it here (weights only,
    or a sentencepiece tokenizer in a report environment without sentencepiece): the report is written with token
    ids, the hint on the page, and a line saying why; the same folder passed as --tokenizer is a usage error that
    names it."""
    pytest.importorskip("transformers")
    import json

    from tim_plugins.apps.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "run"
    rollout, train, mask, tokens, _ = _batch(B=8, T=30)
    TokenDumper(out_dir=str(run), sample_rate=1.0).write(0, rollout, train, mask, tokens)
    (run / "summary.json").write_text(json.dumps({"framework": "verl", "settings": {"model": str(model)}}))
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert str(model) in err and "token ids" in err
    assert "Token ids only: pass the tokenizer" in (run / "report.html").read_text()
    assert main(["report", str(run), "--tokenizer", str(model), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {str(model)!r}" in err and not (tmp_path / "r.html").exists()


def test_without_dump_rows_the_verdict_is_that_of_the_logged_steps(tmp_path):
    """No per-token dump rows (the run stopped before its first dump file, or its sampling picked none): the page
    says the verdict comes from the logged metrics, so it is theirs, not 'No metric with a healthy range was
    measured' beside a k3 panel far above its range: k3 and the fraction of ρ outside [0.5, 2] pooled over the
    logged steps by their tokens, the largest sequence log-ratio of any step (a naive recomputation here)."""
    import re

    from tim_plugins.dump import append_log_history, write_summary
    from tim_plugins.report.health import RULES, STATUSES

    write_summary(tmp_path, framework="verl", title="a run", settings={})
    logged = [(1, 100.0, 0.01, 0.0, 0.2), (2, 300.0, 0.05, 0.004, 0.9), (3, 0.0, None, None, None)]
    for step, n, k3, outside, seq in logged:
        append_log_history(tmp_path, step, {"tim/tokens": n, **({"tim/token/kl_k3": k3,
                           "tim/token/ratio_outside_frac": outside, "tim/seq/log_ratio_abs_max": seq} if n else {})})
    html = build_report(tmp_path).read_text()
    assert "No per-token rows in the dump yet" in html and "No metric with a healthy range was measured" not in html
    k3 = (100 * 0.01 + 300 * 0.05) / 400
    outside = (100 * 0.0 + 300 * 0.004) / 400
    assert f"k3 per sampled token = {k3:.3g} nats" in html
    assert f"tokens with ρ outside [0.5, 2] = {100 * outside:.3g} %" in html
    assert "max |sequence log-ratio| = 0.9 nats" in html
    statuses = [RULES[k].status(v) for k, v in (("tim/token/kl_k3", k3), ("tim/token/ratio_outside_frac", outside),
                                                ("tim/seq/log_ratio_abs_max", 0.9))]
    want = max(statuses, key=STATUSES.index)
    assert re.search(rf"class='verdict {want}'", html), want


def test_numpy_scalars_are_logged_and_a_folder_of_logged_rows_alone_is_reported(tmp_path):
    """A framework's reduced metrics may be NumPy scalars (np.float32, np.int64): logged as the numbers they are,
    not dropped. A folder holding the run's log_history.jsonl and causes.jsonl alone (no summary.json, no token
    file) is reported by the command line as the library reports it."""
    import subprocess
    import sys

    import numpy as np

    from tim_plugins.causes import Cause
    from tim_plugins.dump import LOG_HISTORY, append_causes, append_log_history, read_log_history

    for step in (1, 2):
        append_log_history(tmp_path, step, {"tim/tokens": np.int64(40), "tim/token/kl_k3": np.float32(2.5e-4 * step),
                                            "tim/flag": np.bool_(True), "tim/ok": True})
    rows = read_log_history(tmp_path / LOG_HISTORY)
    assert [(r["step"], r["tim/tokens"]) for r in rows] == [(1, 40.0), (2, 40.0)]
    assert rows[1]["tim/token/kl_k3"] == pytest.approx(5e-4) and "tim/flag" not in rows[0] and "tim/ok" not in rows[0]
    append_causes(tmp_path, [Cause("sync-noop", 1, "at the weight sync after optimizer step 1, nothing moved")],
                  window=2)
    res = subprocess.run([sys.executable, "-m", "tim_plugins.apps.cli", "report", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"report written to {tmp_path / 'report.html'}" in res.stdout + res.stderr
    html = (tmp_path / "report.html").read_text()
    assert "sync-noop" in html and "Per optimizer step" in html
