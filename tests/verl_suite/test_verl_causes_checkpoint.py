"""The cause tracker's state through verl's own FSDP checkpoint (``FSDPEngine.save_checkpoint`` /
``load_checkpoint``, the actor optimizer's param groups, a plain ``torch.optim`` AdamW): a resumed actor judges its
first floor against the windows before the checkpoint, and its tally (the run's closing lines) holds the causes
named before it; the parity audit's codes stay the resumed attempt's own."""

from __future__ import annotations

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
