"""Start-up checks of the composed verl config (``integrations/verl/composed.py``) for ``tim.*`` values that are
accepted but would do nothing: each is said at start-up with a fix that composes on verl's own ``ppo_trainer``
config (the composition main_ppo does) and then takes effect."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import harness  # noqa: E402,F401  (CPU platform before verl)
from test_verl_config import compose  # noqa: E402

BASE = ["trainer.v1.trainer_mode=tim_sync"]


def _left_off(notes: list[str], section: str) -> list[str]:
    return [n for n in notes if n.startswith(f"tim.{section}.") and "nothing. Fix: " in n]


@pytest.mark.parametrize("monitor, why", [
    (["+tim.monitor.enable=true"], "tim.dump.dir is null"),
    ([], "tim.monitor.enable is false and tim.dump.dir is null"),
])
def test_dump_options_without_a_dump_folder_are_said_at_start_up(monitor, why):
    """``+tim.dump.sample_rate=0.5`` without ``tim.dump.dir``: the dump is off (its folder is its switch), so the
    option does nothing, and the start-up said nothing about it. Reference: the core pipeline the actor builds from
    these settings gets no dump at all. The note's fix, pasted after the user's overrides, composes on verl's config
    and turns the dump on with the user's option."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    written = [*monitor, "+tim.dump.sample_rate=0.5"]
    tim, problems, notes = check_composed_config(compose([*BASE, *written]))
    assert problems == [] and tim.pipeline_config().dump is None  # the option reaches nothing
    mine = _left_off(notes, "dump")
    assert len(mine) == 1, notes
    assert mine[0].startswith("tim.dump.sample_rate=0.5 while ") and f" while {why}: " in mine[0], mine[0]
    fix = mine[0].split("Fix: ")[1].split()
    assert all(o.startswith("++tim.") for o in fix), fix
    tim, problems, notes = check_composed_config(compose([*BASE, *written, *fix]))
    assert problems == [] and not _left_off(notes, "dump"), notes
    assert tim.dump.enabled and tim.pipeline_config().dump.sample_rate == 0.5


def test_no_dump_note_with_a_folder_or_an_explicit_null_alone():
    from tim_plugins.integrations.verl.composed import check_composed_config

    for written in (["+tim.monitor.enable=true", "+tim.dump.dir=/tmp/tim_dump", "+tim.dump.sample_rate=0.5"],
                    ["+tim.monitor.enable=true", "+tim.dump.dir=null"]):
        _, problems, notes = check_composed_config(compose([*BASE, *written]))
        assert problems == [] and not _left_off(notes, "dump"), (written, notes)


# ---------------------------------------------------------------------------------------- the actor's engine backend
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]  # what verl's actor dataclass needs to build


def _verl_builds_the_tim_engine(cfg) -> bool:
    """Reference: the engine verl's worker builds for this actor (``EngineRegistry.new(backend=<the actor config's
    engine>.strategy)``, engine_workers.py), looked up in verl's registry after the plugin registered: whether it is
    the tim engine. A backend not registered in this process (veomni, torchtitan: not installed) has none either."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (the registrations)
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    backend = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine.strategy
    if backend not in EngineRegistry._engines["language_model"]:
        return False
    return hasattr(EngineRegistry.get_engine_cls("language_model", backend), "tim_configure")


@pytest.mark.parametrize("written, quoted", [
    (["actor_rollout_ref.actor.strategy=fsdp_turbo"], "actor_rollout_ref.actor.strategy='fsdp_turbo'"),
    (["actor_rollout_ref.actor.strategy=automodel"], "actor_rollout_ref.actor.strategy='automodel'"),
    (["model_engine=veomni"], "model_engine='veomni'"),
    (["model_engine=torchtitan"], "model_engine='torchtitan'"),
    (["model_engine=veomni", "actor_rollout_ref.actor.strategy=fsdp2"], "model_engine='veomni'"),
])
def test_an_actor_backend_without_a_tim_engine_stops_the_driver(written, quoted):
    """An actor strategy / model engine the tim engine is not registered for used to pass the driver: Ray started, the
    workers loaded the model, then init_model said the engine was not the tim engine and to check that the plugin
    loads in the Ray workers (wrong advice). Reference: the engine verl builds for that actor is not the tim engine;
    the problem quotes the value, and its fix, pasted after the user's overrides, gives the tim engine."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    user = [*BASE, "+tim.monitor.enable=true", *MICRO, *written]
    cfg = compose(user)
    assert not _verl_builds_the_tim_engine(cfg)
    problems = check_composed_config(cfg)[1]
    mine = [p for p in problems if p.startswith(quoted)]
    assert len(mine) == 1 and "the tim engine is registered for the actor backends fsdp, fsdp2, megatron" in mine[0], \
        problems
    fix = mine[0].split("Fix: ")[1].split(" (or ")[0].split()
    fixed = compose(user + fix)
    assert _verl_builds_the_tim_engine(fixed)
    assert check_composed_config(fixed)[1] == []
    # verl's own mode without tim settings is verl's business
    plain = compose(["trainer.v1.trainer_mode=sync", *MICRO, *written])
    assert check_composed_config(plain)[1] == []


def test_the_worker_says_a_strategy_has_no_tim_engine(monkeypatch):
    """The worker's refusal (a config that did not pass the driver's check): for a backend the tim engine is not
    registered for it says so with the fix, not 'check that the plugin loads in the Ray workers'. Reference: the
    engine class verl's registry gives for the backend of verl's own actor config."""
    from types import SimpleNamespace

    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker

    import tim_plugins.integrations.verl.plugin  # noqa: F401  (the registrations)
    from tim_plugins.integrations.verl.config import TIMVerlConfig
    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker

    def refusal(cfg) -> str:
        engine_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine
        engine_cls = EngineRegistry.get_engine_cls("language_model", engine_config.strategy)
        worker = object.__new__(TIMActorRolloutRefWorker)
        worker.config = cfg.actor_rollout_ref
        with open_dict(worker.config):
            worker.config.tim = TIMVerlConfig.from_node({"monitor": {"enable": True}}).to_dict()

        def built(self):  # what verl's init_model leaves: the actor's TrainingWorker and its engine
            self.actor = SimpleNamespace(engine=object.__new__(engine_cls), engine_config=engine_config)

        monkeypatch.setattr(ActorRolloutRefWorker, "init_model", built)
        with pytest.raises(RuntimeError) as err:
            TIMActorRolloutRefWorker.init_model(worker)
        return str(err.value)

    text = refusal(compose([*BASE, *MICRO, "actor_rollout_ref.actor.strategy=fsdp_turbo"]))
    assert "FSDPTurboEngineWithLMHead, for the actor backend 'fsdp_turbo'" in text, text
    assert "this strategy has no tim engine" in text and "check that it loads" not in text, text
    fix = text.split("Fix: ")[1].split(" (")[0].split()
    assert _verl_builds_the_tim_engine(compose([*BASE, *MICRO, "actor_rollout_ref.actor.strategy=fsdp_turbo", *fix]))


# ------------------------------------------------------------------------------- tim state in verl's checkpoint
LR_DECAY = ["+tim.lr_decay.enable=true",
            "actor_rollout_ref.actor.optim.optimizer_impl=tim_plugins.integrations.verl.optim"]
CKPT = "actor_rollout_ref.actor.checkpoint"


def _verl_carries_the_optimizer(cfg, monkeypatch) -> tuple[bool, bool]:
    """Reference: verl's checkpoint manager built from verl's own actor config (what the engine passes it): whether it
    saves and loads the optimizer (its first param group holds tim's state)."""
    import torch
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
    from verl.utils.config import omega_conf_to_dataclass

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    manager = BaseCheckpointManager(None, None, checkpoint_config=omega_conf_to_dataclass(
        cfg.actor_rollout_ref.actor).checkpoint)
    return manager.should_save_optimizer, manager.should_load_optimizer


@pytest.mark.parametrize("config_name", ["ppo_trainer", "ppo_megatron_trainer"])
@pytest.mark.parametrize("written, quoted", [
    ([f"{CKPT}.save_contents=[model,extra]"], f"{CKPT}.save_contents=[model,extra]"),
    ([f"{CKPT}.load_contents=[model,extra]"], f"{CKPT}.load_contents=[model,extra]"),
    ([f"{CKPT}.save_contents=[model,extra,hf_model]", f"{CKPT}.load_contents=[model]"],
     f"{CKPT}.save_contents=[model,extra,hf_model] and {CKPT}.load_contents=[model]"),
])
def test_lr_decay_with_a_checkpoint_without_the_optimizer_stops_the_driver(written, quoted, config_name, monkeypatch):
    """The LR controller's state (and the grad norm it is fed) rides in the optimizer's first param group: with
    "optimizer" left out of save_contents / load_contents a resumed run silently restarted the decay at the full LR.
    Reference: verl's checkpoint manager from verl's own actor config does not carry the optimizer; the fix, pasted
    after the user's overrides, makes it carry it (Megatron's config has the same keys)."""
    import shlex

    from tim_plugins.integrations.verl.composed import check_composed_config

    lr_decay = LR_DECAY[:1] if config_name == "ppo_megatron_trainer" else LR_DECAY  # Megatron: no optimizer_impl
    user = [*BASE, *lr_decay, *MICRO, *written]
    cfg = compose(user, config_name=config_name)
    assert _verl_carries_the_optimizer(cfg, monkeypatch) != (True, True)
    tim, problems, _ = check_composed_config(cfg)
    assert tim.lr_decay.enable
    mine = [p for p in problems if p.startswith(quoted + ": ")]
    assert len(mine) == 1 and "restart the decay from scale 1.0" in mine[0], problems
    fixed = compose(user + shlex.split(mine[0].split("Fix: ")[1]), config_name=config_name)
    assert _verl_carries_the_optimizer(fixed, monkeypatch) == (True, True)
    assert check_composed_config(fixed)[1] == []


def test_causes_with_a_checkpoint_without_the_optimizer_are_a_note(monkeypatch):
    """The cause tracker's state rides there too (on by default with the monitor): without the LR decay, a note
    (the causes start afresh)."""
    import shlex

    from tim_plugins.integrations.verl.composed import check_composed_config

    user = [*BASE, "+tim.monitor.enable=true", "+tim.causes.enable=true", *MICRO, f"{CKPT}.save_contents=[model,extra]"]
    cfg = compose(user)
    assert _verl_carries_the_optimizer(cfg, monkeypatch) == (False, False)
    _, problems, notes = check_composed_config(cfg)
    mine = [n for n in notes if n.startswith(f"{CKPT}.save_contents=[model,extra]")]
    assert problems == [] and len(mine) == 1 and "tim.causes.enable=True" in mine[0], (problems, notes)
    fixed = compose(user + shlex.split(mine[0].split("Fix: ")[1]))
    assert _verl_carries_the_optimizer(fixed, monkeypatch) == (True, True)
    assert not [n for n in check_composed_config(fixed)[2] if n.startswith(CKPT)]
    # nothing of tim's rides there (the causes are on by default with the monitor): verl's business
    _, problems, notes = check_composed_config(compose([*BASE, "+tim.monitor.enable=true", "+tim.causes.enable=false",
                                                        *MICRO, f"{CKPT}.save_contents=[model,extra]"]))
    assert problems == [] and not [n for n in notes if n.startswith(CKPT)]


# ------------------------------------------------------------------------- verl's lookups of trainer.v1.<mode>
SEPARATE = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.nnodes=1", "+tim.parity.audit=false",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "skip.rollout_tq.enable=true"]


def _skip_sync_step(cfg, monkeypatch) -> int:
    """Reference: verl's own reader of ``trainer.v1.<configured mode>`` (``SkipManager.init``, called by fit with the
    trainer's config, builds ``RolloutTqSkip``): the parameter_sync_step it reads."""
    from verl.utils.skip import SkipManager

    for attr in ("skip_instances", "config", "step"):  # class state: put back after the test
        monkeypatch.setattr(SkipManager, attr, getattr(SkipManager, attr, None), raising=False)
    SkipManager.init(cfg)
    return SkipManager.skip_instances["rollout_tq"].parameter_sync_step


@pytest.mark.parametrize("mode, steps", [("separate_async", 2), ("colocate_async", None), ("sync", None)])
def test_verls_lookups_of_the_configured_modes_node_find_the_base_modes(mode, steps, monkeypatch):
    """The config says ``trainer.v1.trainer_mode=tim_<mode>``; verl's trainer reads its mode's node under the base
    name (``trainer_mode``), but verl code that reads ``trainer.v1.<configured mode>`` from the config
    (``RolloutTqSkip``: parameter_sync_step, default 1) missed it and ran separate_async's skip with 1 update a step.
    Reference: the same lookup on verl's own mode."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    # (verl: train_batch_size = parameter_sync_step x ppo_mini_batch_size, 1024 by default)
    user = [*SEPARATE, *([f"trainer.v1.{mode}.parameter_sync_step={steps}",
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={1024 // steps}"] if steps else [])]
    verls = compose([f"trainer.v1.trainer_mode={mode}", *user])
    reference = _skip_sync_step(verls, monkeypatch)
    cfg = compose([f"trainer.v1.trainer_mode=tim_{mode}", "+tim.monitor.enable=true", *user])
    trainer = get_trainer_cls(f"tim_{mode}")(config=cfg)
    assert _skip_sync_step(trainer.config, monkeypatch) == reference == trainer.parameter_sync_step
    # the lookup RolloutTqSkip makes, for any key of the mode's node
    node = OmegaConf.select(trainer.config, f"trainer.v1.{trainer.config.trainer.v1.trainer_mode}")
    assert node is not None and OmegaConf.to_container(node) == OmegaConf.to_container(verls.trainer.v1[mode])
    assert reference == (steps or 1)
    assert trainer.config.trainer.v1.trainer_mode == f"tim_{mode}"  # the run's mode as configured


def test_settings_under_the_tim_modes_own_name_are_refused_with_the_base_modes_keys(monkeypatch):
    """``+trainer.v1.tim_separate_async.parameter_sync_step=2`` is never read by verl's trainer (it reads the base
    mode's node): refused with the fix, which (the user's tim-named override dropped) verl's lookup then reads."""
    import shlex

    from tim_plugins.integrations.verl.composed import check_composed_config

    user = ["trainer.v1.trainer_mode=tim_separate_async", "+tim.monitor.enable=true", *SEPARATE]
    written = "+trainer.v1.tim_separate_async.parameter_sync_step=2"
    problems = check_composed_config(compose([*user, written]))[1]
    mine = [p for p in problems if p.startswith("trainer.v1.tim_separate_async={'parameter_sync_step': 2}")]
    assert len(mine) == 1, problems
    fix = [o for o in shlex.split(mine[0].split("Fix: ")[1]) if o.startswith("++")]
    fixed = compose([*user, *fix])
    assert check_composed_config(fixed)[1] == []
    assert _skip_sync_step(compose([o.replace("tim_separate_async", "separate_async") for o in user] + fix),
                           monkeypatch) == 2
