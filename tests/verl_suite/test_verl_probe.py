"""The live parity probe in verl decides where the TRL callback's does, in the per-step pipeline
(``StepPipeline.compute`` on the merged metrics, inside the actor engine), and the driver only acts on the decision:
warn, raise ``ParityError`` in the driver (raising inside a Ray worker would not stop the run cleanly), or stop after
this step's checkpoint. The stop through ``main_ppo`` is ``test_verl_main_ppo.py::test_probe_stop_...``."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.config import TIMVerlConfig  # noqa: E402

VOCAB = 383


def _naive_k3(old, raw) -> float:
    m = raw["response_mask"].bool()
    d = (old.double() - raw["rollout_log_probs"].double())[m]
    return float((torch.expm1(d) - d).mean())


def _decide(engine, step: int, seed: int):
    """One measurement pass at verl's global ``step``: (the engine's decision, the batch's naive k3)."""
    engine.tim_begin_step(step)
    td, raw = H.make_batch(VOCAB, response=6, seed=seed)
    old = H.old_log_probs_padded(H.infer(engine, td), td)
    metrics = engine.tim_pop_metrics()
    return engine.tim_pop_decision(), _naive_k3(old, raw), metrics


class _WorkerGroup:
    """What the driver calls: verl's ONE_TO_ALL answer, one result per rank, here of one real engine."""

    def __init__(self, engine):
        self.engine = engine

    def tim_pop_metrics(self):
        return [self.engine.tim_report()]


def _driver(engine, tim: TIMVerlConfig, step: int):
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = object.__new__(get_trainer_cls("tim_sync"))
    trainer.tim, trainer._tim_stop = tim, None
    trainer.global_steps, trainer.total_training_steps = step, 10
    trainer.actor_rollout_wg = _WorkerGroup(engine)
    return trainer


@pytest.mark.parametrize("action", ["warn", "raise", "stop"])
def test_the_engine_decides_on_the_merged_k3_and_the_driver_acts(toy_model_path, action, tmp_path, monkeypatch):
    from tim_plugins.parity.findings import ParityError

    H.init_dist(port={"warn": 29591, "raise": 29592, "stop": 29593}[action])
    engine = H.build_engine(toy_model_path)
    # a threshold between the two batches' k3: the random rollout log-probs of make_batch sit ~1.5 nats from the
    # toy model's; rollout_noise shifts them, so one batch is below and the other above
    # the causes off: make_batch's random rollout log-probs put confident tokens the toy model scores far lower, which
    # the stream rule names engine-stale (a named cause trips the probe at any k3); this test is the k3 limit's
    no_causes = {"causes": {"enable": False}}
    engine.tim_configure(TIMVerlConfig.from_node({"monitor": {"enable": True}, **no_causes,
                                                  "probe": {"kl_k3": 1e9, "action": action}}))
    _, k3_a, _ = _decide(engine, 1, seed=30)
    td, raw = H.make_batch(VOCAB, response=6, seed=31, rollout_noise=-6.0)
    k3_b = _naive_k3(H.old_log_probs_padded(H.infer(engine, td), td), raw)
    engine.tim_pop_metrics(), engine.tim_pop_decision()
    # the threshold below (their geometric mean) needs them apart by far more than float error; how far depends on
    # the toy model, which is trained on the machine that runs the tests (1.76x on an AVX2-only CPU)
    assert k3_b > 1.2 * k3_a
    threshold = (k3_a * k3_b) ** 0.5
    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, **no_causes,
                                   "probe": {"kl_k3": threshold, "action": action}})
    engine.tim_deconfigure()
    engine.tim_configure(tim)

    decision, k3, metrics = _decide(engine, 3, seed=30)  # below the threshold
    assert k3 == pytest.approx(k3_a, rel=1e-12)
    assert decision.checked and not decision.tripped and decision.action is None and decision.step == 3
    assert metrics["tim/probe/checked"] == 1.0 and metrics["tim/probe/tripped"] == 0.0

    engine.tim_begin_step(4)  # above it: the engine decides, never raises
    H.infer(engine, td)
    trainer = _driver(engine, tim, 4)
    logged: dict = {}
    if action == "raise":
        # the raise ends the step before verl logs it: the tripped step's row still reaches verl's tracker (its own
        # file backend here) and the dump's log history, as verl's row and _compute_metrics would have written them
        import dataclasses
        import json

        from verl.utils.tracking import Tracking

        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "tracker.jsonl"))
        trainer.logger = Tracking("p", "e", default_backend=["file"])
        trainer.tim = dataclasses.replace(tim, dump=dataclasses.replace(tim.dump, dir=str(tmp_path)))
        with pytest.raises(ParityError, match=r"tripped at step 4: tim/token/kl_k3=.* > "):
            trainer._tim_collect(logged)
        trainer.logger.logger["file"].finish()
        (tracked,) = [json.loads(line) for line in (tmp_path / "tracker.jsonl").read_text().splitlines()]
        (history,) = [json.loads(line) for line in (tmp_path / "log_history.jsonl").read_text().splitlines()]
        assert tracked["step"] == history["step"] == 4
        assert tracked["data"]["tim/token/kl_k3"] == history["tim/token/kl_k3"] == logged["tim/token/kl_k3"]
        assert tracked["data"]["tim/probe/tripped"] == 1.0 and all(k.startswith("tim/") for k in tracked["data"])
    else:
        trainer._tim_collect(logged)
    assert logged["tim/probe/tripped"] == 1.0 and logged["tim/token/kl_k3"] == pytest.approx(k3_b, rel=1e-6)
    if action == "stop":  # this step becomes the last one
        assert trainer._tim_stop == (4, 10) and trainer.total_training_steps == 4
    else:
        assert trainer._tim_stop is None and trainer.total_training_steps == 10


def test_probe_settings_are_the_core_probe_config():
    import dataclasses

    from tim_plugins.parity.probe import ParityProbeConfig

    tim = TIMVerlConfig.from_node({"monitor": {"enable": True},
                                   "probe": {"kl_k3": 1e-2, "action": "stop", "patience": 2}})
    assert tim.probe.config() == ParityProbeConfig(kl_k3_max=1e-2, abs_diff_max=None, seq_log_ratio_abs_max=None,
                                                   action="stop", every_n_steps=1, patience=2)
    core = {f.name: f.metadata["help"] for f in dataclasses.fields(ParityProbeConfig)}
    from tim_plugins.integrations.verl.config import ProbeSettings

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(ProbeSettings)}
    assert helps["kl_k3"] == core["kl_k3_max"] and helps["patience"] == core["patience"]
    assert TIMVerlConfig.from_node({}).probe.config() is None
    with pytest.raises(ValueError, match=r"tim.probe=.* is invalid: the probe checks the monitor's metrics.*"
                                         r"Fix: \+\+tim.monitor.enable=true"):
        TIMVerlConfig.from_node({"probe": {"kl_k3": 1e-2}})
    with pytest.raises(ValueError, match=r"tim.probe.patience=0 is invalid: must be an integer >= 1"):
        TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": {"kl_k3": 1e-2, "patience": 0}})
