"""The report's truncation section (``tim_plugins.report.truncation``) on a run written by the project's own
writers: the core ``StepPipeline`` with the safe vocabulary measures three steps of a synthetic rollout (the rollout
samples from its own min-p + top-k cut of slightly different logits, so some sampled tokens fall outside the
trainer's kept set), logs through ``append_log_history`` and dumps every sequence; ``write_summary`` records the
settings as the verl driver does. Every number the section shows is checked against a naive recomputation from the
step's tensors in this file (softmax, sort, masks). Without the safe vocabulary the section is absent."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("duckdb")

from tim_plugins.dump import DumpConfig, append_log_history, write_summary  # noqa: E402
from tim_plugins.kept_set import kept_set  # noqa: E402
from tim_plugins.pipeline import StepPipeline, pipeline_config  # noqa: E402
from tim_plugins.report import build_report, read_summary  # noqa: E402
from tim_plugins.report.query import engine  # noqa: E402
from tim_plugins.report.tokens import load_tokens  # noqa: E402
from tim_plugins.report.training_page import step_table  # noqa: E402
from tim_plugins.report.truncation import settings_line, truncation_rows  # noqa: E402
from tim_plugins.safe_vocab import safe_logprobs_from_logits  # noqa: E402

MIN_P, TOP_K, V, B, T = 0.02, 12, 64, 6, 20
STEPS = (1, 2, 3)


def _naive_kept(z: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: vLLM's order, min-p then top-k, written out: p >= min_p · max p, then the TOP_K largest logits
    among those (no ties in random float64 logits)."""
    p = torch.softmax(z.double(), -1)
    keep = p >= MIN_P * p.max(-1, keepdim=True).values
    masked = z.double().masked_fill(~keep, -math.inf)
    kth = masked.sort(-1, descending=True).values[:, TOP_K - 1:TOP_K]
    return keep & (masked >= kth)


def _step_batch(seed: int):
    """(trainer logits [B·T, V], rollout log-probs [B, T] over the rollout's own kept set, sampled ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B * T, V, generator=g, dtype=torch.float64) * 1.5
    z_roll = z + 0.4 * torch.randn(B * T, V, generator=g, dtype=torch.float64)  # the engine's slightly other logits
    keep_roll = _naive_kept(z_roll)
    q = torch.softmax(z_roll.masked_fill(~keep_roll, -math.inf), -1)
    ids = torch.multinomial(q, 1, generator=g).squeeze(-1)
    rollout = q.gather(-1, ids[:, None]).squeeze(-1).log().view(B, T)
    mask = torch.arange(T)[None, :] < (T - torch.arange(B)[:, None] % 5)  # ragged ends
    return z, rollout.float(), ids.view(B, T), mask


def _write_run(folder, *, safe: bool) -> list[dict]:
    """Run the pipeline over STEPS, log each step and dump it; returns the naive per-step reference."""
    pipe = StepPipeline(pipeline_config(safe_vocab=safe, dump=DumpConfig(out_dir=str(folder), sample_rate=1.0)))
    truth = []
    for step in STEPS:
        z, rollout, ids, mask = _step_batch(step)
        res = safe_logprobs_from_logits(z.float(), ids.reshape(-1), min_p=MIN_P, top_k=TOP_K,
                                        order="vllm") if safe else None
        if safe:
            train = res.logprobs.view(B, T)
            fields = type(res)(logprobs=None, in_safe=res.in_safe.view(B, T), pruned_mass=res.pruned_mass.view(B, T),
                               size=res.size.view(B, T), entropy=None)
        else:
            train = torch.log_softmax(z.float(), -1).gather(-1, ids.reshape(-1, 1)).view(B, T)
            fields = None
        pipe.measure(rollout, train, mask, safe=fields, token_ids=ids, step=step)
        pipe.end_step(step)
        metrics, _, _ = pipe.compute(step, sync=False)
        append_log_history(folder, step, metrics)
        # the naive reference, from the tensors alone
        keep = _naive_kept(z)
        p = torch.softmax(z, -1)
        kept_mass = (p * keep).sum(-1).view(B, T)[mask]
        size = keep.sum(-1).view(B, T)[mask].double()
        in_s = keep.gather(-1, ids.reshape(-1, 1)).view(B, T)
        safe_lp = (z - z.masked_fill(~keep, -math.inf).logsumexp(-1, keepdim=True)).gather(
            -1, ids.reshape(-1, 1)).view(B, T)
        measured = mask & in_s
        rho = torch.exp(safe_lp - rollout.double())[measured]
        rho_full = torch.exp(torch.log_softmax(z, -1).gather(-1, ids.reshape(-1, 1)).view(B, T)
                             - rollout.double())[measured]
        truth.append({"step": step, "tokens": int(mask.sum()), "kept_mass": float(kept_mass.mean()),
                      "kept_mass_min": float(kept_mass.min()), "size_mean": float(size.mean()),
                      "boundary_frac": float((mask & ~in_s).sum()) / int(mask.sum()), "ratio": float(rho.mean()),
                      "ratio_full_exact": float(rho_full.mean())})
    write_summary(folder, framework="verl", title="synthetic verl run", settings={
        "model": "/nowhere", "tim": json.dumps({"safe_vocab": {"min_p": MIN_P if safe else 0.0, "mask_boundary": True}}),
        "rollout sampling": json.dumps({"temperature": 1.0, "top_p": 1.0, "top_k": TOP_K})})
    return truth


@pytest.fixture(scope="module")
def safe_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("safe_run")
    return folder, _write_run(folder, safe=True)


def _rows(folder):
    summary = read_summary(folder)
    with engine():
        tokens = load_tokens(folder)
        table = step_table(summary, tokens)
    return summary, truncation_rows(summary, table)


def test_rows_equal_a_naive_recomputation(safe_run):
    folder, truth = safe_run
    _, rows = _rows(folder)
    assert [r["step"] for r in rows] == list(STEPS)
    assert any(t["boundary_frac"] > 0 for t in truth)  # the run has boundary tokens to report
    for row, want in zip(rows, truth):
        assert row["tokens"] == want["tokens"]
        for key in ("kept_mass", "kept_mass_min", "size_mean", "boundary_frac"):
            assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert row["ratio_source"] == "logged"
        assert row["ratio"] == pytest.approx(want["ratio"], rel=1e-5)
        # the full-vocabulary ρ the section estimates (ρ × kept mass) against the one measured here; the kept mass
        # is far from 1, so an estimate that ignored it would miss by more than this
        assert row["ratio_full"] == pytest.approx(want["ratio_full_exact"], rel=0.01)
        assert abs(want["ratio_full_exact"] - want["ratio"]) > 0.05


def test_ratio_falls_back_to_the_dump(safe_run, tmp_path):
    """A run that logged no tim/token/ratio_mean: ρ per step from the dump's rows (the measured tokens)."""
    folder, truth = safe_run
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    lines = (tmp_path / "log_history.jsonl").read_text().splitlines()
    kept = [{k: v for k, v in json.loads(line).items() if k != "tim/token/ratio_mean"} for line in lines]
    (tmp_path / "log_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in kept))
    _, rows = _rows(tmp_path)
    for row, want in zip(rows, truth):
        assert row["ratio_source"] == "dump"
        assert row["ratio"] == pytest.approx(want["ratio"], rel=1e-5)


def test_the_page_shows_the_section_in_verl_words(safe_run):
    folder, truth = safe_run
    html = build_report(folder).read_text()
    assert html.count("<h2>Truncation (safe vocabulary)</h2>") == 1
    assert f"+tim.safe_vocab.min_p={MIN_P:g} actor_rollout_ref.rollout.top_p=1 actor_rollout_ref.rollout.top_k={TOP_K}" \
        in html
    assert "<b>Kept set: recompute.</b>" in html and kept_set("verl").mode == "recompute"
    for want in truth:  # each step's row as the page prints it
        cells = [f"{want['kept_mass']:.6g}", f"{want['size_mean']:.4g}", f"{want['boundary_frac']:.3%}",
                 f"{want['ratio']:.6g}"]
        row = next(r for r in html.split("<tr>") if r.startswith(f"<td class='num'>{want['step']}</td>"
                                                                  f"<td class='num'>{want['tokens']}</td>"))
        for cell in cells:
            assert f"<td class='num'>{cell}</td>" in row, (cell, row)
    n = sum(t["tokens"] for t in truth)
    pooled = sum(t["tokens"] * t["kept_mass"] for t in truth) / n
    assert f"{pooled:.4g} of the probability mass kept on average" in html  # the verdict's line


def test_trl_settings_in_trl_words():
    summary = {"framework": "trl", "settings": {
        "GRPOConfig sampling": {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "min_p": 1e-05},
        "TIMConfig safe vocabulary": {"safe_vocab": True, "safe_vocab_min_p": None}}}
    assert settings_line(summary) == ("GRPOConfig(top_p=0.8, top_k=20, min_p=1e-05, temperature=0.9), "
                                      "TIMConfig(safe_vocab=True)")


def test_no_section_without_the_safe_vocabulary(tmp_path):
    _write_run(tmp_path, safe=False)
    summary, rows = _rows(tmp_path)
    assert rows == [] and "tim/token/ratio_mean" in summary["log_history"][0]
    html = build_report(tmp_path).read_text()
    assert "Truncation (safe vocabulary)" not in html and "Kept set" not in html


def test_the_comparison_page_sets_the_runs_side_by_side(safe_run, tmp_path):
    """Before / after: a run without the safe vocabulary (its trainer over the full vocabulary) against the safe run;
    one row each, the numbers token-weighted over the run and checked against the naive per-step values."""
    from tim_plugins.report import build_comparison

    folder, truth = safe_run
    plain = tmp_path / "plain"
    _write_run(plain, safe=False)
    html = build_comparison([plain, folder], tmp_path / "cmp.html", labels=["full", "safe"]).read_text()
    assert html.count("<h2>Truncation (safe vocabulary)</h2>") == 1
    rows = {r.split("</td>")[0].removeprefix("<td>"): r for r in html.split("<tr>")[1:] if r.startswith("<td>")}
    n = sum(t["tokens"] for t in truth)
    safe_row = rows["safe"]
    assert "yes (recompute)" in safe_row and f"+tim.safe_vocab.min_p={MIN_P:g}" in safe_row
    kept, size = (sum(t["tokens"] * t[k] for t in truth) / n for k in ("kept_mass", "size_mean"))
    for cell in (f"{kept:.6g}", f"{size:.4g}", f"{sum(t['tokens'] * t['boundary_frac'] for t in truth) / n:.3%}"):
        assert f"<td class='num'>{cell}</td>" in safe_row, (cell, safe_row)
    # the full-vocabulary run: ρ over every response token of the run (no boundary tokens to leave out)
    num = den = 0.0
    for step in STEPS:
        z, rollout, ids, mask = _step_batch(step)
        full = torch.log_softmax(z.float(), -1).gather(-1, ids.reshape(-1, 1)).view(B, T).double()
        num += float(torch.exp(full - rollout.double())[mask].sum())
        den += int(mask.sum())
    assert "no (full vocabulary)" in rows["full"] and f"<td class='num'>{num / den:.6g}</td>" in rows["full"]
    # the fix shows: the full-vocabulary run's ρ is far below the safe run's
    safe_rho = sum(t["tokens"] * t["ratio"] for t in truth) / n
    assert num / den < safe_rho - 0.05
