"""The truncation section on a real TRL run (GRPOTrainer on the toy model, CPU) with the safe vocabulary and a
per-token dump: the callback logs the kept-set line once at start-up, and ``tim-plugins report DUMP_DIR`` shows each
step's kept mass, |S| and boundary fraction as TRL's own ``trainer.state.log_history`` holds them (those values
against a naive per-token recomputation: ``test_trl_mitigations``), in GRPOConfig / TIMConfig words."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

pytest.importorskip("trl")
pytest.importorskip("duckdb")
datasets = pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.report import build_report, read_summary  # noqa: E402
from tim_plugins.report.truncation import truncation_rows  # noqa: E402

pytestmark = pytest.mark.trl

MIN_P, TRAINER_MIN_P = 0.05, 0.3  # the trainer's set above the sampler's: boundary tokens to report


def test_trl_run_report_has_the_truncation_section(toy_model_path, tmp_path, caplog):
    dump = tmp_path / "dump"
    trainer = make_trainer(toy_model_path, tmp_path, min_p=MIN_P, max_steps=2)
    with caplog.at_level(logging.INFO, logger="tim_plugins.trl"):
        trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=True, safe_vocab_min_p=TRAINER_MIN_P,
                                                            dump_dir=str(dump), dump_options={"sample_rate": 1.0})))
        trainer.train()
    version = importlib.metadata.version("trl")
    lines = [r.getMessage() for r in caplog.records if "kept set" in r.getMessage()]
    from tim_plugins.kept_set import kept_set_line

    assert lines == [kept_set_line("trl", version)]  # once, from the one source the doctor and the report share
    assert lines[0].startswith(f"tim-plugins: safe vocabulary: kept set by recompute (TRL {version} does not carry "
                               "vLLM's sampling_mask (the sampler's kept set per token) from the engine into the "
                               "training batch, so the trainer recomputes the sampler's cut on its own logits; to "
                               "replay the engine's own set, build the trainer inside "
                               "tim_plugins.integrations.trl.engine_kept_sets() with vllm_mode='colocate'")
    assert lines[0].endswith("are counted in tim/safe_vocab/boundary_frac).")

    logged = {h["step"]: h for h in trainer.state.log_history if "tim/safe_vocab/tokens" in h}
    assert sorted(logged) == [1, 2]
    rows = truncation_rows(read_summary(dump))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        h = logged[r["step"]]
        assert r["tokens"] == h["tim/safe_vocab/tokens"]
        assert r["kept_mass"] == pytest.approx(1 - h["tim/safe_vocab/pruned_mass_mean"], rel=1e-12)
        assert r["kept_mass_min"] == pytest.approx(1 - h["tim/safe_vocab/pruned_mass_max"], rel=1e-12)
        assert r["size_mean"] == pytest.approx(h["tim/safe_vocab/size_mean"], rel=1e-12)
        assert r["boundary_frac"] == pytest.approx(h["tim/safe_vocab/boundary_frac"], rel=1e-12)
        assert r["ratio"] == pytest.approx(h["tim/token/ratio_mean"], rel=1e-12) and r["ratio_source"] == "logged"
    assert any(r["boundary_frac"] > 0 for r in rows) and all(r["kept_mass"] < 1 for r in rows)

    html = build_report(dump).read_text()
    args = trainer.args
    assert (f"GRPOConfig(top_p={args.top_p:g}, top_k={args.top_k}, min_p={MIN_P:g}, "
            f"temperature={args.temperature:g}), TIMConfig(safe_vocab=True, safe_vocab_min_p={TRAINER_MIN_P:g})"
            in html)
    assert "<b>Kept set: recompute.</b> TRL " + version + " does not carry" in html
