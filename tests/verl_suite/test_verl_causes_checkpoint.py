"""The cause tracker's state through verl's own FSDP checkpoint (``FSDPEngine.save_checkpoint`` /
``load_checkpoint``, the actor optimizer's param groups, a plain ``torch.optim`` AdamW): a resumed actor judges its
first floor against the windows before the checkpoint, and its tally (the run's closing lines) holds the causes
named before it; the parity audit's codes stay the resumed attempt's own."""

from __future__ import annotations

import math
import statistics

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402

from tim_plugins.integrations.verl.config import ActorContext, TIMVerlConfig  # noqa: E402

VOCAB = 383
# rollout log-probs -U(0, 3) - noise against the toy actor's on random tokens: a mean |Δ log p| of 1.0-2.3 nats at
# 8, ~21 at 30 (a floor jump: 12x the trailing median, far over the rule's 4x and 0.05 nats)
QUIET, JUMP = 8.0, 30.0
STEPS = {1: QUIET, 2: QUIET, 3: QUIET, 4: JUMP}
CONFIG = {"monitor": {"enable": True}}


def _step(engine, step: int, noise: float) -> dict:
    engine.tim_begin_step(step)
    td, _ = H.make_batch(VOCAB, seed=step, rollout_noise=noise)
    H.train_step(engine, td, H.old_log_probs_padded(H.infer(engine, td), td))
    return engine.tim_pop_metrics()


def _configured(model_path: str, audit_errors: tuple = ()):
    engine = H.build_engine(model_path)
    engine.tim_configure(TIMVerlConfig.from_node(CONFIG), context=ActorContext(audit_errors=audit_errors))
    return engine


def test_a_resumed_actor_continues_the_floor_and_the_causes_named_before_its_checkpoint(toy_model_path, tmp_path):
    H.init_dist(port=29595)
    run = _configured(toy_model_path, audit_errors=("dtype-mismatch",))
    floors = {}
    for step, noise in STEPS.items():
        m = _step(run, step, noise)
        floors[step] = m["tim/token/abs_diff_mean"]
        assert m["tim/cause/named"] == (1.0 if step == 4 else 0.0), (step, m["tim/cause/named"])
    assert run.tim_report()["causes"]["floor-jump"]["first"] == 4
    ckpt = str(tmp_path / "ckpt")
    run.save_checkpoint(ckpt, global_step=4)
    saved = run._tim_pipeline.causes.state_dict()

    # verl loads the checkpoint after the worker configured the engine (the worker's init, then the trainer's
    # _load_checkpoint), or a later configure finds it loaded: both continue from it
    after_configure = _configured(toy_model_path)
    after_configure.load_checkpoint(ckpt)
    before_configure = H.build_engine(toy_model_path)
    before_configure.load_checkpoint(ckpt)
    before_configure.tim_configure(TIMVerlConfig.from_node(CONFIG))
    assert before_configure._tim_pipeline.causes.state_dict() == saved

    # step 5 on the run that went on and on both resumed actors: the same window, judged against steps 1-3 (the
    # jumped step 4 is not kept in the trailing windows)
    went_on = _step(run, 5, QUIET)
    want = went_on["tim/token/abs_diff_mean"] / statistics.median([floors[1], floors[2], floors[3]])
    assert went_on["tim/cause/floor_jump"] == pytest.approx(want, rel=1e-9)
    for resumed in (after_configure, before_configure):
        m = _step(resumed, 5, QUIET)
        assert m["tim/token/abs_diff_mean"] == pytest.approx(went_on["tim/token/abs_diff_mean"], rel=1e-6)
        assert m["tim/cause/floor_jump"] == pytest.approx(want, rel=1e-6)
        causes = resumed._tim_pipeline.causes
        assert causes.tally == run._tim_pipeline.causes.tally
        assert causes.summary_lines() == run._tim_pipeline.causes.summary_lines()
        assert len(causes.summary_lines()) == 1 and "[floor-jump] at step 4" in causes.summary_lines()[0]
        assert causes.audit_codes == set()  # this attempt's audit, not the saved run's
    assert run._tim_pipeline.causes.audit_codes == {"dtype-mismatch"}


def test_a_sync_cause_found_after_the_last_window_is_named_by_the_resumed_runs_first_window(toy_model_path, tmp_path,
                                                                                          caplog):
    """verl syncs after the step's actor update and saves its checkpoint after that sync, before the next window: a
    cause the sync check found there is in the checkpoint, and the resumed run's first window names it (its
    ``tim/cause/*``, the tally that closes the run) as the run that went on does, without logging it again. Reference:
    the run that went on, and the skipped layer's tensor names."""
    H.init_dist(port=29597)
    skipped_prefix = "model.layers.1."
    run = _configured(toy_model_path)
    rollout = H.Rollout(toy_model_path)
    m = _step(run, 1, QUIET)
    assert m["tim/cause/named"] == 0.0
    with caplog.at_level("WARNING"):
        report = H.checked_sync(run, rollout, 1, skip=skipped_prefix)
    skipped = sorted(n for n in rollout.streamed if n.startswith(skipped_prefix))
    assert [c.code for c in report.causes] == ["sync-tensors-differ"] and sorted(report.causes[0].tensors) == skipped
    assert sum("sync-tensors-differ" in r.getMessage() for r in caplog.records) == 1
    ckpt = str(tmp_path / "ckpt")
    run.save_checkpoint(ckpt, global_step=1)

    after_configure = _configured(toy_model_path)
    after_configure.load_checkpoint(ckpt)
    before_configure = H.build_engine(toy_model_path)
    before_configure.load_checkpoint(ckpt)
    before_configure.tim_configure(TIMVerlConfig.from_node(CONFIG))

    went_on = _step(run, 2, QUIET)
    assert went_on["tim/cause/named"] == 1.0 and went_on["tim/cause/sync_bad_tensors"] == len(skipped)
    assert run.tim_report()["causes"]["sync-tensors-differ"]["first"] == 1  # the sync after optimizer step 1
    for resumed in (after_configure, before_configure):
        caplog.clear()
        with caplog.at_level("WARNING"):
            m = _step(resumed, 2, QUIET)
        for key in ("tim/cause/named", "tim/cause/sync_bad_tensors", "tim/cause/sync_checked_tensors"):
            assert m[key] == went_on[key], key
        causes = resumed._tim_pipeline.causes
        assert causes.tally == run._tim_pipeline.causes.tally
        assert sorted(causes.named[-1].tensors) == skipped
        assert causes.summary_lines() == run._tim_pipeline.causes.summary_lines()
        assert not any("sync-tensors-differ" in r.getMessage() for r in caplog.records)  # the first attempt logged it


def test_switching_the_engine_off_drops_the_window_in_progress_and_keeps_the_tally(toy_model_path):
    """``tim_deconfigure`` drops what was not popped yet, a faulty sync's causes waiting for their window included;
    the tally (the causes named in closed windows) stays for a later ``tim_configure``."""
    H.init_dist(port=29599)
    engine = _configured(toy_model_path)
    rollout = H.Rollout(toy_model_path)
    for step in (1, 2):
        H.checked_sync(engine, rollout, step - 1, skip="model.layers.1.")
        assert _step(engine, step, QUIET)["tim/cause/named"] == 1.0
    tally = {k: dict(v) for k, v in engine._tim_pipeline.causes.tally.items()}
    assert tally["sync-tensors-differ"]["windows"] == 1 and tally["sync-tensors-stale"]["windows"] == 1
    H.checked_sync(engine, rollout, 2, skip="model.layers.1.")  # found, its window not closed
    engine.tim_deconfigure()
    engine.tim_configure(TIMVerlConfig.from_node(CONFIG))
    m = _step(engine, 3, QUIET)
    assert m["tim/cause/named"] == 0.0 and math.isnan(m["tim/cause/sync_checked_tensors"])
    assert engine._tim_pipeline.causes.tally == tally
