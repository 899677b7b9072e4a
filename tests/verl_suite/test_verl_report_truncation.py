"""The verl driver's ``summary.json`` names the sampler's truncation as the run set it, and the report's truncation
section speaks it as verl overrides: the recipe's overrides plus a user's ``top_p`` / ``top_k`` and a dump folder,
composed with verl's own Hydra config (the expected values read back from that composed config)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")

import harness  # noqa: E402,F401  (CPU platform before verl)
from test_verl_config import compose, recipe_overrides  # noqa: E402


def test_summary_records_the_truncation_and_the_report_names_the_overrides(toy_model_path, tmp_path):
    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.trainer import write_run_summary
    from tim_plugins.report import read_summary
    from tim_plugins.report.truncation import settings_line

    cfg = compose(recipe_overrides(toy_model_path) + ["actor_rollout_ref.rollout.top_p=0.8",
                                                      "actor_rollout_ref.rollout.top_k=20",
                                                      f"+tim.dump.dir={tmp_path}"])
    tim, problems, _ = check_composed_config(cfg)
    assert not problems and tim.safe_vocab.enabled and tim.dump.enabled
    write_run_summary(cfg, tim, None)
    summary = read_summary(tmp_path)
    rollout = cfg.actor_rollout_ref.rollout
    assert json.loads(summary["settings"]["rollout sampling"]) == {
        "top_p": 0.8, "top_k": 20, "temperature": rollout.temperature}
    assert settings_line(summary) == (f"+tim.safe_vocab.min_p={tim.safe_vocab.min_p:g} "
                                      "actor_rollout_ref.rollout.top_p=0.8 actor_rollout_ref.rollout.top_k=20 "
                                      f"actor_rollout_ref.rollout.temperature={rollout.temperature:g}")


def test_the_report_names_the_enable_override_when_the_cut_alone_is_replayed_or_recomputed(toy_model_path, tmp_path):
    """``+tim.safe_vocab.enable=true`` at min_p 0 (no min-p pruning, no logits processor): the settings line names
    that override, not a ``min_p=0`` the user never wrote; with vLLM asked for its kept sets the summary says so."""
    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.trainer import write_run_summary
    from tim_plugins.report import read_summary
    from tim_plugins.report.truncation import settings_line

    overrides = [o for o in recipe_overrides(toy_model_path)
                 if not o.startswith("+tim.safe_vocab.min_p") and "engine_kwargs.vllm" not in o]
    for mask in (False, True):
        dump = tmp_path / str(mask)
        cfg = compose(overrides + ["+tim.safe_vocab.enable=true", "actor_rollout_ref.rollout.top_p=0.8",
                                   "actor_rollout_ref.rollout.top_k=20", f"+tim.dump.dir={dump}"]
                      # vLLM refuses greedy or untruncated requests beside its kept sets: validation samples too
                      + ["+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true",
                         "actor_rollout_ref.rollout.val_kwargs.top_k=20",
                         "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"] * mask)
        tim, problems, _ = check_composed_config(cfg)
        assert not problems and tim.safe_vocab.enabled and tim.safe_vocab.min_p == 0.0, problems
        write_run_summary(cfg, tim, None)
        summary = read_summary(dump)
        assert summary["settings"]["sampling mask"] == ("true" if mask else "false")
        temperature = cfg.actor_rollout_ref.rollout.temperature
        assert settings_line(summary) == ("+tim.safe_vocab.enable=true actor_rollout_ref.rollout.top_p=0.8 "
                                          "actor_rollout_ref.rollout.top_k=20 "
                                          f"actor_rollout_ref.rollout.temperature={temperature:g}")
