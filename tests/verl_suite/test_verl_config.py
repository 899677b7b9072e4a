"""The recipe's overrides compose with verl's own Hydra ``ppo_trainer`` config, pass verl's validation and ours;
a known-bad set fails with each expected message."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")

import harness  # noqa: E402,F401  (CPU platform before verl)

from tim_plugins.safe_vocab import DEFAULT_MIN_P  # noqa: E402  (the recipe's default MIN_P)

RECIPE = Path(__file__).resolve().parents[2] / "integrations" / "verl" / "recipes" / "run_grpo_tim.sh"


def recipe_overrides(model_path: str) -> list[str]:
    env = dict(os.environ, MODEL_PATH=str(model_path), TRAIN_FILE="/tmp/train.parquet", TIM_PRINT_OVERRIDES="1",
               N_GPUS="1")
    out = subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True, check=True).stdout
    return [o.replace('"', "") for o in out.split()]


def compose(overrides: list[str], config_name: str = "ppo_trainer"):
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = str(Path(main_ppo.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name=config_name, overrides=overrides)


def test_recipe_overrides_compose_and_validate(toy_model_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from tim_plugins.integrations.verl.composed import check_composed_config

    cfg = compose(recipe_overrides(toy_model_path))
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    tim, problems, notes = check_composed_config(cfg)
    assert problems == []
    assert tim.monitor.enable and tim.safe_vocab.min_p == DEFAULT_MIN_P and tim.lr_decay.enable
    assert tim.parity.strict and tim.probe.thresholds == {"tim/token/kl_k3": 1e-2} and tim.probe.action == "stop"
    assert notes == []  # the rollout prunes with the same min_p (checked in detail below)
    # the tim trainer mode the recipe selects exists once the plugin is loaded
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls(cfg.trainer.v1.trainer_mode).__name__ == "TIMPPOTrainerSync"



def test_the_recipes_audit_line_audits_the_recipe(toy_model_path, tmp_path):
    """The recipe's header says how to check its overrides without GPUs (`tim-plugins audit --verl "$(...)"`). Run as
    printed, with a model and a data file where it writes `...`, from the recipe's folder: the audit must see the
    recipe's overrides (the same findings as the audit of them through the Python API), not verl's bare defaults
    after a recipe that stopped on an unset MODEL_PATH."""
    import sys

    from tim_plugins.integrations.verl.parity_spec import specs_from_overrides
    from tim_plugins.parity import audit

    line = next(x for x in RECIPE.read_text().splitlines() if "tim-plugins audit --verl" in x)
    command = line[line.index("tim-plugins audit"):]
    command = command.replace("MODEL_PATH=...", f"MODEL_PATH={toy_model_path}").replace(
        "TRAIN_FILE=...", f"TRAIN_FILE={tmp_path / 'train.parquet'}")
    cli = f"{sys.executable} -c 'import sys; from tim_plugins.apps.cli import main; sys.exit(main(sys.argv[1:]))'"
    # a user's shell: no recipe variables, and not this suite's CPU platform (its shims load in main_ppo runs only)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MODEL_PATH", "TRAIN_FILE", "VAL_FILE") and not k.startswith("VERL_")}
    proc = subprocess.run(["bash", "-c", f'tim-plugins() {{ {cli} "$@"; }}; {command}'], cwd=RECIPE.parent,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "MODEL_PATH" not in proc.stderr and " is off: " not in proc.stderr, \
        (command, proc.stderr[-2000:])
    printed = set(re.findall(r"^(?:error|warning|info)\s+([a-z0-9-]+)", proc.stdout, flags=re.M))
    expected = {f.code for f in audit(*specs_from_overrides(recipe_overrides(toy_model_path)))}
    assert printed == expected, (command, printed, expected)

def test_known_bad_config_reports_each_problem(toy_model_path):
    from tim_plugins.integrations.verl.composed import check_composed_config

    bad = [o for o in recipe_overrides(toy_model_path) if not o.startswith(("trainer.v1.trainer_mode",
                                                                            "actor_rollout_ref.actor.optim.optimizer",
                                                                            "actor_rollout_ref.model.use_fused"))]
    bad += ["actor_rollout_ref.rollout.calculate_log_probs=false",
            "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"]
    _, problems, _ = check_composed_config(compose(bad))
    text = "\n".join(problems)
    for expected in ("trainer.v1.trainer_mode='sync'", "optimizer_impl='torch.optim'",
                     "logprobs_mode='raw_logprobs'", "calculate_log_probs=False"):
        assert expected in text, expected
    assert len(problems) == 4


def test_rollout_min_p_reaches_vllm_engine_kwargs(toy_model_path):
    """The recipe's rollout node through verl's own config conversion (``vLLMHttpServer._init_config`` =
    ``omega_conf_to_dataclass``) and the engine-kwargs read of ``launch_server``: exactly the engine args that
    load tim-plugins' min-p processor with the trainer's min_p. The rest of the chain (verl's CLI builder ->
    vLLM's parser -> VllmConfig -> processor) runs next to vLLM in tests/test_vllm_min_p_processor.py, from the
    same ``vllm_engine_kwargs`` dict; launching vLLM inside verl needs a GPU."""
    from verl.utils.config import omega_conf_to_dataclass

    from tim_plugins.rollout.vllm_min_p_config import vllm_engine_kwargs

    cfg = compose(recipe_overrides(toy_model_path))
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    engine_kwargs = rollout.get("engine_kwargs", {}).get("vllm", {}) or {}
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    assert engine_kwargs == vllm_engine_kwargs(cfg.tim.safe_vocab.min_p) == vllm_engine_kwargs(DEFAULT_MIN_P)
    # verl's CLI builder expands only real lists and JSON-dumps only real dicts (not OmegaConf containers)
    assert type(engine_kwargs["logits_processors"]) is list and type(engine_kwargs["additional_config"]) is dict


@pytest.mark.parametrize("drop, add, quoted, fixes", [
    ("engine_kwargs.vllm.logits_processors", [], "engine_kwargs.vllm.logits_processors=[]", ["logits_processors"]),
    ("engine_kwargs.vllm.logits_processors", ["+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[]"],
     "engine_kwargs.vllm.logits_processors=[]", ["logits_processors"]),
    ("engine_kwargs.vllm", ["+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.tim_min_p=0.01"],
     "engine_kwargs.vllm.logits_processors=[]", ["logits_processors", "tim_min_p"]),
    ("engine_kwargs.vllm.additional_config", [], "additional_config.tim_min_p=None", ["tim_min_p"]),
    ("engine_kwargs.vllm.additional_config",
     ["+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.tim_min_p=0.01"], "tim_min_p=0.01",
     ["tim_min_p"]),
])
def test_rollout_without_the_same_min_p_is_refused(toy_model_path, drop, add, quoted, fixes):
    """The message quotes the value and, as its fix, the overrides of the keys that differ only; pasted after the
    user's own overrides (which may have added those keys with `+` already), they compose and the check passes."""
    import shlex

    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.config import rollout_min_p_overrides

    overrides = [o for o in recipe_overrides(toy_model_path) if drop not in o] + add
    _, problems, _ = check_composed_config(compose(overrides))
    assert len(problems) == 1 and quoted in problems[0], problems
    fix = shlex.split(problems[0].split("Fix: ")[1])
    expected = {"logits_processors": rollout_min_p_overrides(DEFAULT_MIN_P)[0],
                "tim_min_p": rollout_min_p_overrides(DEFAULT_MIN_P)[1]}
    assert fix == [expected[k] for k in fixes]
    assert check_composed_config(compose(overrides + fix))[1] == []


def test_bypass_mode_is_accepted_and_says_what_the_monitor_measures_there(toy_model_path):
    """verl's bypass mode copies the rollout's log-probs into old_log_probs and runs no old-log-prob pass
    (``PPOTrainer._compute_old_log_prob``): the monitor measures the update's first mini-batch instead
    (test_verl_bypass_mode.py runs it). Accepted, with a note that says so and, with several mini-batches a step,
    which share of the batch that is."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    recipe = recipe_overrides(toy_model_path) + ["algorithm.rollout_correction.bypass_mode=true"]
    _, problems, notes = check_composed_config(compose(recipe))
    assert problems == []
    (note,) = [n for n in notes if n.startswith("algorithm.rollout_correction.bypass_mode=True")]
    assert "the update's first mini-batch (ppo_mini_batch_size=64 of data.train_batch_size=256: that share" in note
    assert "every training pass is keyed by its policy lag against the rollout (tim/by_lag/*" in note
    assert "with no exact split (tim/staleness/*, tim/split/*: π_old is the rollout)" in note
    config = compose(recipe + ["actor_rollout_ref.actor.ppo_mini_batch_size=256"])
    (note,) = [n for n in check_composed_config(config)[2] if "bypass_mode=True" in n]
    assert "the update's first mini-batch, in its training forward" in note


@pytest.mark.parametrize("override, quoted", [
    ("+tim.safe_vocab.min_p=1.5", "tim.safe_vocab.min_p=1.5"),
    ("+tim.monitor.ratio_band=[2.0,0.5]", "tim.monitor.ratio_band=[2.0, 0.5]"),
    ("+tim.probe.action=explode", "tim.probe.action='explode'"),
    ("+tim.lr_decay.options.decay=0.5", "unknown option(s) 'decay' (did you mean 'decay_steps'?)"),
    ("+tim.monitr.enable=true", "unknown section(s) 'monitr' (did you mean 'monitor'?)"),
])
def test_bad_tim_values_are_quoted(override, quoted):
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    cfg = compose([override])
    with pytest.raises(ValueError) as err:
        TIMVerlConfig.from_node(cfg.tim)
    assert quoted in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize("override, quoted", [
    ("+tim.monitor.enable=flase", "tim.monitor.enable='flase'"),
    ("+tim.safe_vocab.mask_boundary=yes please", "tim.safe_vocab.mask_boundary='yes please'"),
    ("+tim.parity.strict=1", "tim.parity.strict=1"),
    ("+tim.lr_decay.enable=on", "tim.lr_decay.enable='on'"),
    ("+tim.dump.sample_rate=lots", "tim.dump.sample_rate='lots'"),
    ("+tim.probe.every_n_steps=1.5", "tim.probe.every_n_steps=1.5"),
])
def test_a_bad_setting_stops_the_run_at_start_up(toy_model_path, override, quoted):
    """Through the composed config and the trainer class main_ppo's TaskRunner builds for the run's mode
    (``get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)``, before any worker starts): a value of the
    wrong type is an error with the value and the fix (``+tim.monitor.enable=flase`` used to switch the monitor
    ON: the string 'flase' is truthy)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    key = override.split("=", 1)[0]
    cfg = compose([o for o in recipe_overrides(toy_model_path) if o.split("=", 1)[0] != key] + [override])
    with pytest.raises(ValueError) as err:
        get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
    assert quoted in str(err.value) and "Fix: ++" in str(err.value), str(err.value)


@pytest.mark.parametrize("mode, section", [("sync", "monitor.enable=true"), ("sync", "parity.strict=true"),
                                           ("colocate_async", "dump.dir=/tmp/d")])
def test_a_tim_node_under_verls_own_trainer_mode_stops_the_run(toy_model_path, section, mode):
    """A ``tim`` node, whatever section it holds, with a trainer mode that is verl's own: verl never reads it, so
    the run stops before any worker starts, naming the tim mode to use."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    overrides = [o for o in recipe_overrides(toy_model_path) if not o.startswith(("trainer.v1.trainer_mode", "+tim."))]
    cfg = compose(overrides + [f"trainer.v1.trainer_mode={mode}", f"+tim.{section}"])
    with pytest.raises(ValueError) as err:
        get_trainer_cls(mode)(config=cfg)
    assert f"trainer.v1.trainer_mode={mode!r}" in str(err.value)
    assert f"Fix: trainer.v1.trainer_mode=tim_{mode}" in str(err.value)
    if section != "monitor.enable=true":
        return
    # without the tim node verl's own class gets past the guard (it fails later, on what this CPU test lacks)
    cfg = compose(overrides + [f"trainer.v1.trainer_mode={mode}"])
    try:
        get_trainer_cls(mode)(config=cfg)
    except ValueError as other:
        assert "tim" not in str(other), other
    except Exception:  # noqa: BLE001 - verl's own start-up beyond the guard: not this test's subject
        pass


def test_no_tim_node_means_everything_off():
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    tim = TIMVerlConfig.from_node(compose([]).get("tim"))
    assert not tim.worker_side_active and not tim.probe.enabled and not tim.safe_vocab.enabled



def test_a_dump_folder_that_cannot_be_written_stops_the_run_at_start_up(toy_model_path, tmp_path):
    """``+tim.dump.dir`` where no folder can be made (here: under a file) used to stop the TaskRunner with a bare
    ``NotADirectoryError`` from the summary's write. It is a config mistake: the value, why, and a fix (a folder
    beside verl's checkpoints) that, pasted after the user's overrides, composes and takes the run's summary."""
    import shlex

    from verl.trainer.ppo.v1 import get_trainer_cls

    from tim_plugins.dump import SUMMARY
    from tim_plugins.integrations.verl import composed
    from tim_plugins.integrations.verl.config import TIMVerlConfig
    from tim_plugins.integrations.verl.trainer import write_run_summary

    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "tim_dump"
    user = recipe_overrides(toy_model_path) + [f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                                               f"+tim.dump.dir={bad}"]
    cfg = compose(user)
    with pytest.raises(ValueError) as err:
        get_trainer_cls(cfg.trainer.v1.trainer_mode)(config=cfg)
    text = str(err.value)
    assert f"tim.dump.dir='{bad}': the dump folder cannot be created or written here (NotADirectoryError" in text
    fix = shlex.split(text.split("Fix: ")[1].split(" (beside")[0])
    assert fix == [f"++tim.dump.dir={tmp_path / 'ckpt' / 'tim_dump'}"], text
    fixed = compose(user + fix)
    tim = TIMVerlConfig.from_node(fixed.tim)
    assert composed.dump_dir_problems(tim, fixed) == []
    assert write_run_summary(fixed, tim, None) == tmp_path / "ckpt" / "tim_dump" / SUMMARY

def test_startup_audit_on_recipe_and_on_a_known_bad_set(toy_model_path):
    """The driver-side audit (what a tim trainer mode runs before any worker) on the recipe's composed config,
    and on a set with known mismatches: each expected code is in the findings; strict stops."""
    import io

    from tim_plugins.integrations.verl.config import TIMVerlConfig
    from tim_plugins.integrations.verl.trainer import run_startup_audit
    from tim_plugins.parity.findings import ParityError

    cfg = compose(recipe_overrides(toy_model_path))
    buf = io.StringIO()
    findings = run_startup_audit(cfg, TIMVerlConfig.from_node({"parity": {"strict": False}}), out=buf)
    assert findings is not None and buf.getvalue().strip()
    # the recipe runs with tim.parity.strict=true: it must have no error-level finding
    assert [f.code for f in findings if f.severity == "error"] == []

    bad = compose(["actor_rollout_ref.rollout.dtype=float16", "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs",
                   "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.enable_prefix_caching=true"])
    buf = io.StringIO()
    findings = run_startup_audit(bad, TIMVerlConfig.from_node({}), out=buf)
    codes = {f.code for f in findings}
    for code in ("dtype-mismatch", "logprobs-mode-not-processed", "sampler-truncation-unmatched",
                 "prefix-caching-on"):
        assert code in codes, (code, codes)
        assert code in buf.getvalue()
    with pytest.raises(ParityError):
        run_startup_audit(bad, TIMVerlConfig.from_node({"parity": {"strict": True}}), out=io.StringIO())


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_tim_trainer_mode_runs_its_worker_behind_the_actor(toy_model_path, use_kl_loss):
    """A tim trainer mode's resource mapping (what verl's V1 ``_setup`` spawns the worker groups from) puts
    ``TIMActorRolloutRefWorker`` behind the actor role, whatever verl names it (``actor_rollout``, or
    ``actor_rollout_ref`` with a reference policy); without it every tim_sync run died at its first step
    ("'RayWorkerGroup' object has no attribute 'tim_pop_metrics'"). Needs no Ray cluster."""
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker

    cfg = compose(recipe_overrides(toy_model_path) + [f"actor_rollout_ref.actor.use_kl_loss={use_kl_loss}"])
    stock = object.__new__(get_trainer_cls("sync"))
    ours = object.__new__(get_trainer_cls(cfg.trainer.v1.trainer_mode))
    for trainer in (stock, ours):
        trainer.config = cfg
        trainer._init_resource_pool_mgr()
    assert set(ours.role_worker_mapping) == set(stock.role_worker_mapping)
    actor_role = Role.ActorRolloutRef if use_kl_loss else Role.ActorRollout
    assert actor_role in ours.role_worker_mapping
    for role, remote in ours.role_worker_mapping.items():
        want = TIMActorRolloutRefWorker if role == actor_role else stock.role_worker_mapping[role].__ray_actor_class__
        assert remote.__ray_actor_class__ is want, role
    assert stock.role_worker_mapping[actor_role].__ray_actor_class__ is ActorRolloutRefWorker
    assert "tim_pop_metrics" in dir(TIMActorRolloutRefWorker)


@pytest.mark.parametrize("step, planned_total, save_freq, saved", [
    (5, 8, 4, True),    # cut short, save_freq does not divide 5: verl would not save it -> we do
    (4, 8, 4, False),   # verl saves it anyway (4 % 4 == 0)
    (8, 8, 4, False),   # already the last step: verl saves it
    (5, 8, -1, False),  # checkpoints switched off: respected
])
def test_probe_stop_checkpoints_the_step_it_cut_short(step, planned_total, save_freq, saved):
    """verl decides to save before ``on_step_end``, from an ``is_last_step`` computed before the step: the tim
    trainer writes the checkpoint of a step the probe made the last one exactly when verl would not."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = object.__new__(get_trainer_cls("tim_sync"))
    trainer.config = OmegaConf.create({"trainer": {"save_freq": save_freq}})
    trainer.global_steps, trainer._tim_stop = step, (step, planned_total)
    calls = []
    trainer._save_checkpoint = lambda: calls.append(trainer.global_steps)
    trainer._tim_checkpoint_on_stop()
    assert calls == ([step] if saved else [])
    trainer._tim_stop = None  # no stop asked: never
    trainer._tim_checkpoint_on_stop()
    assert len(calls) == int(saved)


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_a_resumed_run_moves_the_crashed_attempts_later_steps_aside_before_its_first_step(mode, tmp_path):
    """A two-rank attempt crashed after step 4 (checkpoint 2), its broken sync after step 2 named in step 3's window;
    verl resumes on one rank: fit sets global_steps to 3 and calls on_train_begin, where the driver moves every rank's
    files, log rows and causes of steps >= 3 aside before any worker writes (the mode's own on_train_begin still
    runs). The report then reads steps 1-2 of both ranks and the resumed step 3 alone, and names no cause. The
    crashed attempt's summary.json goes aside with its steps; the folder's is then this attempt's (its settings,
    the findings of its own start-up audit)."""
    import json

    from omegaconf import OmegaConf
    from test_dump_resume import check_resumed_folder, crashed_attempt, resumed_attempt
    from verl.trainer.ppo.v1 import get_trainer_cls

    from tim_plugins.dump import write_summary
    from tim_plugins.integrations.verl.config import TIMVerlConfig
    from tim_plugins.parity.findings import make_finding

    crashed_attempt(tmp_path)
    write_summary(tmp_path, framework="verl", title="the crashed attempt", settings={"model": "/old"})
    trainer = object.__new__(get_trainer_cls(f"tim_{mode}"))
    trainer.tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "dump": {"dir": str(tmp_path)}})
    trainer.config = OmegaConf.create({
        "trainer": {"v1": {mode: {"num_warmup_batches": 1}, "trainer_mode": f"tim_{mode}"}},
        "actor_rollout_ref": {"model": {"path": "/new"}, "actor": {"strategy": "fsdp2"},
                              "rollout": {"name": "vllm", "dtype": "bfloat16", "top_p": 1.0}}})
    finding = make_finding("dtype-mismatch", "error", "rollout bfloat16, trainer float32")
    trainer._tim_findings = [finding]  # what __init__'s start-up audit found
    calls = []
    trainer._add_async_warmup_batches = calls.append
    trainer.global_steps = 3  # _load_checkpoint's 2, + 1 in fit
    trainer.on_train_begin()
    assert calls == ([1] if mode == "colocate_async" else [])
    resumed_attempt(tmp_path, steps=(3,))
    moved = check_resumed_folder(tmp_path, 3, kept_steps=(1, 2), resumed_steps=(3,))
    old, new = (json.loads((d / "summary.json").read_text()) for d in (moved, tmp_path))
    assert (old["title"], old["settings"]["model"], "findings" in old) == ("the crashed attempt", "/old", False)
    assert (new["framework"], new["settings"]["model"], new["settings"]["rollout"]) == ("verl", "/new",
                                                                                        "vllm (bfloat16)")
    assert new["findings"] == [finding.to_dict()]


def test_a_probe_stop_says_the_run_ends_without_verls_final_validation(caplog):
    """The probe's stop makes the current step the last one after verl computed ``is_last_step`` (False) for it, so
    verl's final validation (``is_last_step or global_steps % test_freq == 0``) does not run: on purpose (it samples
    from the rollout engine the probe found faulty), and the stop line says so, with how to validate the checkpoint
    once fixed."""
    import inspect
    import logging

    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from tim_plugins.integrations.verl.config import TIMVerlConfig
    from tim_plugins.parity.probe import ProbeDecision

    fit = " ".join(inspect.getsource(PPOTrainer.fit).split())
    assert ("if self.config.trainer.test_freq > 0 and ( is_last_step or self.global_steps % "
            "self.config.trainer.test_freq == 0 ):") in fit
    trainer = object.__new__(get_trainer_cls("tim_sync"))
    trainer.tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": {"enable": True, "action": "stop"}})
    decision = ProbeDecision(step=5, checked=True, tripped=True, action="stop", stop=True,
                             message="tim parity probe tripped at step 5: cause sync-noop")

    class Workers:
        def tim_pop_metrics(self):
            return [{"holds": True, "metrics": {"tim/probe/tripped": 1.0}, "decision": decision}]

    trainer.actor_rollout_wg, trainer.global_steps, trainer.total_training_steps = Workers(), 5, 8
    trainer._tim_stop = None
    metrics = {}
    with caplog.at_level(logging.WARNING, logger="tim_plugins.integrations.verl.trainer"):
        trainer._tim_collect(metrics)
    assert trainer._tim_stop == (5, 8) and trainer.total_training_steps == 5 and metrics["tim/probe/tripped"] == 1.0
    [line] = [r.getMessage() for r in caplog.records if "parity probe asked to stop" in r.getMessage()]
    assert line.startswith("tim-plugins: parity probe asked to stop at step 5 (tim parity probe tripped at step 5")
    assert "without verl's final validation" in line and "trainer.resume_mode=auto trainer.val_only=true" in line


class _RolloutCalls:
    """The driver's handle on the rollout replicas (``checkpoint_manager``), recording what verl's ``on_step_end``
    asks of it into ``calls``."""

    def __init__(self, calls: list):
        self.calls = calls

    def update_weights(self, global_steps=None):
        self.calls.append("wake rollout + sync weights")

    def resume_generation_replicas(self):
        self.calls.append("resume generation")


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_probe_stop_checkpoint_is_written_before_verl_wakes_the_rollout(mode):
    """verl's own fit writes a step's checkpoint after the step and before ``on_step_end``, where its colocated modes
    wake the rollout replicas (their weights and KV cache back on the GPUs) and colocate_async resumes generation: the
    checkpoint of a step the probe cut short is written at the same point, not with the rollout awake beside it."""
    import inspect

    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    # the reference: verl's own order in fit (save, then on_step_end)
    fit = inspect.getsource(PPOTrainer.fit)
    assert fit.index("self._save_checkpoint()") < fit.index("self.on_step_end()")
    trainer = object.__new__(get_trainer_cls(f"tim_{mode}"))
    trainer.config = OmegaConf.create({"trainer": {"save_freq": 4}})
    trainer.global_steps, trainer._tim_stop, trainer.timing_raw = 5, (5, 8), {}
    trainer.prev_step_profile = trainer.curr_step_profile = False
    calls: list = []
    trainer.checkpoint_manager = _RolloutCalls(calls)
    trainer._save_checkpoint = lambda: calls.append("checkpoint")
    trainer.on_step_end()
    assert calls[0] == "checkpoint" and calls.count("checkpoint") == 1, calls
    assert "wake rollout + sync weights" in calls  # verl's own on_step_end still ran, after it


def test_a_probe_stop_that_no_checkpoint_follows_is_said_at_start_up(toy_model_path):
    """``+tim.probe.action=stop`` ends the run after the step the probe trips on, whose checkpoint verl writes only
    with ``trainer.save_freq > 0`` (verl's own default is -1): without one, the start-up says so, with the fix."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    recipe = recipe_overrides(toy_model_path)
    assert "trainer.save_freq=20" in recipe and "+tim.probe.action=stop" in recipe
    assert check_composed_config(compose(recipe))[1:] == ([], [])
    verl_default = [o for o in recipe if not o.startswith("trainer.save_freq=")]
    cfg = compose(verl_default)
    assert cfg.trainer.save_freq <= 0  # verl's own default: no checkpoints
    _, problems, notes = check_composed_config(cfg)
    assert problems == [] and len(notes) == 1, notes
    assert notes[0].startswith(f"tim.probe.action='stop' with trainer.save_freq={cfg.trainer.save_freq}: ")
    assert notes[0].endswith("Fix: trainer.save_freq=<N > 0> (or ++tim.probe.action=raise)")
    for other in ("warn", "raise"):  # nothing to checkpoint
        cfg = compose([o for o in verl_default if o != "+tim.probe.action=stop"] + [f"+tim.probe.action={other}"])
        assert check_composed_config(cfg)[1:] == ([], [])


def test_probe_options_that_leave_the_probe_off_are_said_at_start_up(toy_model_path):
    """The probe is switched on by ``tim.probe.enable=true`` or by a limit (``TIMVerlConfig``'s rule): the recipe's
    ``+tim.probe.action=stop`` without its ``kl_k3`` leaves it off, so nothing would ever stop the run; the start-up
    says so, with the fix. With a limit, or ``enable`` written either way, nothing is said."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    recipe = recipe_overrides(toy_model_path)
    no_limit = [o for o in recipe if not o.startswith("+tim.probe.kl_k3=")]
    assert "+tim.probe.action=stop" in no_limit and not any(o.startswith("+tim.probe.kl_k3") for o in no_limit)
    tim, problems, notes = check_composed_config(compose(no_limit))
    assert not tim.probe.enabled and problems == [] and len(notes) == 1, notes
    assert notes[0].startswith("tim.probe.action='stop' with no limit and tim.probe.enable unset: the probe is off")
    assert notes[0].endswith(
        "Fix: ++tim.probe.enable=true (its default limit kl_k3=0.001) or ++tim.probe.kl_k3=<limit>")
    for written in ("+tim.probe.enable=true", "+tim.probe.enable=false", "+tim.probe.abs_diff_max=5"):
        tim, problems, notes = check_composed_config(compose(no_limit + [written]))
        assert problems == [] and notes == [], (written, notes)
        assert tim.probe.enabled == (written != "+tim.probe.enable=false")


def test_truncation_fix_names_the_overrides_the_adapter_checks():
    """The audit's verl fix for a truncating sampler quotes the rollout overrides the adapter itself requires."""
    from tim_plugins.integrations.verl.config import rollout_min_p_overrides
    from tim_plugins.parity.findings import CODES

    fix = CODES["sampler-truncation-unmatched"].fix["verl"]
    processors, min_p = rollout_min_p_overrides(DEFAULT_MIN_P)
    assert processors in fix  # the processor list, verbatim
    key, value = min_p.split("=")
    assert f"{key}={DEFAULT_MIN_P:g}" in fix and float(value) == DEFAULT_MIN_P


def test_dump_settings_share_the_core_dump_config_and_fail_with_the_fix():
    import dataclasses

    from tim_plugins.dump import DumpConfig
    from tim_plugins.integrations.verl.config import DumpSettings, TIMVerlConfig

    core = {f.name: f for f in dataclasses.fields(DumpConfig)}
    for f in dataclasses.fields(DumpSettings):
        if f.name != "dir":  # one default and one help per option, the core's
            assert (f.default, f.metadata["help"]) == (core[f.name].default, core[f.name].metadata["help"]), f.name
    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "dump": {"dir": "/tmp/d", "sample_rate": 1.0}})
    assert tim.dump.config() == DumpConfig(out_dir="/tmp/d", sample_rate=1.0)
    assert not TIMVerlConfig.from_node({}).dump.enabled
    with pytest.raises(ValueError, match=r"tim.dump.dir='/tmp/d' is invalid: .*Fix: \+\+tim.monitor.enable=true"):
        TIMVerlConfig.from_node({"dump": {"dir": "/tmp/d"}})
    with pytest.raises(ValueError, match=r"tim.dump: sample_rate=0 is invalid.*Fix: \+\+tim.dump"):
        TIMVerlConfig.from_node({"monitor": {"enable": True}, "dump": {"dir": "/tmp/d", "sample_rate": 0}})
    with pytest.raises(ValueError, match=r"tim.dump.dir='' is invalid"):
        TIMVerlConfig.from_node({"monitor": {"enable": True}, "dump": {"dir": ""}})


@pytest.mark.parametrize("tim_min_p, flagged", [(True, False), (False, True)])
def test_top_p_top_k_are_kept_with_the_safe_vocabulary(toy_model_path, tim_min_p, flagged):
    """The user's rollout.top_p / top_k stay as set: with the safe vocabulary the actor applies them (the audit's
    trainer spec says so and the truncation finding is gone); without it the finding stands, and its fix in verl's
    words keeps the sampling (no top_p=1.0, no fused kernels off)."""
    from tim_plugins.integrations.verl.fixes import FINDING_FIXES
    from tim_plugins.integrations.verl.parity_spec import specs_from_config
    from tim_plugins.parity.audit import audit

    overrides = recipe_overrides(toy_model_path) + ["actor_rollout_ref.rollout.top_p=0.8",
                                                    "actor_rollout_ref.rollout.top_k=20",
                                                    "actor_rollout_ref.model.use_fused_kernels=true"]
    if not tim_min_p:
        overrides = [o for o in overrides if not o.startswith("+tim.safe_vocab")]
    rollout, trainer = specs_from_config(compose(overrides))
    codes = {f.code for f in audit(rollout, trainer)}
    assert ("sampler-truncation-unmatched" in codes) == flagged, codes
    if tim_min_p:
        assert (trainer.top_p, trainer.top_k, trainer.min_p) == (0.8, 20, DEFAULT_MIN_P)
    fix = FINDING_FIXES["sampler-truncation-unmatched"]
    assert "top_p=1.0" not in fix and "use_fused_kernels=false" not in fix


def test_megatron_recipe_composes_with_and_without_fused_kernels(toy_model_path):
    """``STRATEGY=megatron`` prints the Megatron overrides: they pass the driver's checks on verl's own
    ``ppo_megatron_trainer`` config (the LR decay needs no optimizer_impl there: the Megatron engine applies it to
    Megatron's optimizer; the safe vocabulary runs in its logits processor, or with fused kernels in its fused head);
    a top-k distillation loss with the safe vocabulary stops the driver with the fix."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    env = dict(os.environ, TIM_PRINT_OVERRIDES="tim", STRATEGY="megatron")
    tim_overrides = subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True,
                                   check=True).stdout.split()
    base = [f"actor_rollout_ref.model.path={toy_model_path}", "actor_rollout_ref.rollout.name=vllm"]
    cfg = compose(base + tim_overrides, config_name="ppo_megatron_trainer")
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    tim, problems, _ = check_composed_config(cfg)
    assert problems == [] and tim.monitor.enable and tim.lr_decay.enable and tim.safe_vocab.min_p == DEFAULT_MIN_P
    fused = ["actor_rollout_ref.model.use_fused_kernels=true"]
    tim, problems, _ = check_composed_config(compose(base + tim_overrides + fused,
                                                     config_name="ppo_megatron_trainer"))
    assert problems == [] and tim.safe_vocab.min_p == DEFAULT_MIN_P
    # A top-k distillation loss (verl's registry says which) with the safe vocabulary stops the driver too; an
    # estimator loss (k3) reads only the sampled tokens' log-probs and passes.
    found = {}
    for mode in ("forward_kl_topk", "k3"):
        distill = ["distillation.enabled=true", f"distillation.distillation_loss.loss_mode={mode}"]
        found[mode] = check_composed_config(compose(base + tim_overrides + distill,
                                                    config_name="ppo_megatron_trainer"))[1]
    assert found["k3"] == [], found["k3"]
    problems = found["forward_kl_topk"]
    assert len(problems) == 1 and "loss_mode='forward_kl_topk' (a top-k distillation) on a Megatron actor" in \
        problems[0], problems
    assert "Fix: drop +tim.safe_vocab.min_p / +tim.safe_vocab.enable, or distillation.enabled=false" in problems[0]



def test_megatron_dynamic_context_parallelism_stops_the_driver(toy_model_path):
    """The tim Megatron engine refuses Megatron's dynamic context parallelism (``_tim_check_config`` reads the engine
    config verl builds from ``actor.megatron``), but only in the workers, once they hold the model: the driver
    refuses it first, before any worker starts, with a fix that composes and turns it off in that engine config."""
    from verl.utils.config import omega_conf_to_dataclass

    from tim_plugins.integrations.verl.composed import check_composed_config

    env = dict(os.environ, TIM_PRINT_OVERRIDES="tim", STRATEGY="megatron")
    tim_overrides = subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True,
                                   check=True).stdout.split()
    base = [f"actor_rollout_ref.model.path={toy_model_path}", "actor_rollout_ref.rollout.name=vllm", *tim_overrides]
    dynamic = ["actor_rollout_ref.actor.megatron.dynamic_context_parallel=true",
               "actor_rollout_ref.actor.megatron.max_seqlen_per_dp_cp_rank=1024"]
    cfg = compose(base + dynamic, config_name="ppo_megatron_trainer")
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron).dynamic_context_parallel  # what it reads
    problems = check_composed_config(cfg)[1]
    assert len(problems) == 1 and problems[0].startswith(
        "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True with the tim settings"), problems
    fixed = compose(base + dynamic + problems[0].split("Fix: ")[1].split(), config_name="ppo_megatron_trainer")
    assert not omega_conf_to_dataclass(fixed.actor_rollout_ref.actor.megatron).dynamic_context_parallel
    assert check_composed_config(fixed)[1] == []
    # verl's own mode without tim settings is verl's business
    plain = [o for o in base if not o.startswith(("+tim.", "trainer.v1."))]
    assert check_composed_config(compose(plain + dynamic, config_name="ppo_megatron_trainer"))[1] == []

def _without_min_p(model_path) -> list[str]:
    """The recipe's overrides without its min-p pruning (the trainer's min_p and the vLLM processor)."""
    return [o for o in recipe_overrides(model_path)
            if not o.startswith("+tim.safe_vocab.min_p") and "engine_kwargs.vllm" not in o]


def test_safe_vocabulary_over_the_sampler_cut_alone(toy_model_path):
    """``+tim.safe_vocab.enable=true`` at min_p 0: the actor applies the rollout's own top-k / top-p as set (vLLM
    applies them itself: no logits processor); refused with the fix when the sampler keeps the whole vocabulary,
    or when the rollout still prunes a min-p tail the actor would keep."""
    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.config import ActorContext
    from tim_plugins.integrations.verl.parity_spec import trainer_spec_from_config
    from tim_plugins.truncation import Truncation

    sampler = ["actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.top_k=20"]
    cfg = compose(_without_min_p(toy_model_path) + ["+tim.safe_vocab.enable=true"] + sampler)
    tim, problems, notes = check_composed_config(cfg)
    assert (problems, notes) == ([], [])
    assert tim.safe_vocab.enabled and tim.safe_vocab.min_p == 0.0
    context = ActorContext.from_config(cfg, asynchronous=False)
    assert context.truncation(tim.safe_vocab.min_p) == Truncation(min_p=0.0, top_p=0.8, top_k=20, temperature=1.0,
                                                                 order="vllm")
    spec = trainer_spec_from_config(cfg)  # the audit sees the actor truncate as the sampler does
    assert (spec.top_p, spec.top_k, spec.min_p) == (0.8, 20, 0.0)
    assert _tim_of(compose(_without_min_p(toy_model_path) + sampler)).safe_vocab.enabled is False

    _, problems, _ = check_composed_config(compose(_without_min_p(toy_model_path) + ["+tim.safe_vocab.enable=true"]))
    assert len(problems) == 1 and "rollout.top_p=1" in problems[0] and "top_k=-1:" in problems[0], problems
    assert "no cut to renormalise" in problems[0]
    from tim_plugins.options import SAFE_VOCAB_NEEDS_A_CUT  # the rule TRL's safe vocabulary states too

    assert SAFE_VOCAB_NEEDS_A_CUT in problems[0]
    assert "Fix: your sampler's actor_rollout_ref.rollout.top_p=<p < 1>" in problems[0]

    prunes = ["+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors="
              "[tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor]",
              "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.tim_min_p=0.001"]
    _, problems, _ = check_composed_config(
        compose(_without_min_p(toy_model_path) + ["+tim.safe_vocab.enable=true"] + sampler + prunes))
    assert len(problems) == 1 and "tim_min_p=0.001 with tim.safe_vocab.min_p=0" in problems[0], problems
    assert "Fix: ++tim.safe_vocab.min_p=0.001" in problems[0]


def test_the_start_up_audit_reaches_the_actors_causes(toy_model_path):
    """The driver's audit runs on the composed config; its error codes travel in ``actor_rollout_ref.tim_context``
    (the workers get that node only), so the causes' rules that read the audit (truncation, a constrained sampler)
    see in the actor what the driver printed: a rollout that truncates with no safe vocabulary in the actor."""
    import io

    from omegaconf import OmegaConf

    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.config import ActorContext
    from tim_plugins.integrations.verl.trainer import run_startup_audit
    from tim_plugins.pipeline import StepPipeline

    # strict off: the recipe's strict audit would stop at the truncation finding this test needs
    cfg = compose(_without_min_p(toy_model_path) + ["actor_rollout_ref.rollout.top_p=0.8", "++tim.parity.strict=false"])
    tim, problems, _ = check_composed_config(cfg)
    assert problems == []
    findings = run_startup_audit(cfg, tim, out=io.StringIO())
    errors = tuple(f.code for f in findings if f.severity == "error")
    assert "sampler-truncation-unmatched" in errors
    sent = ActorContext.from_config(cfg, asynchronous=False, audit_errors=errors)
    received = ActorContext.from_node(OmegaConf.create({ActorContext.NODE: sent.to_dict()})[ActorContext.NODE])
    assert received == sent and received.audit_errors == errors
    pipe = StepPipeline(tim.pipeline_config(received), framework="verl")
    pipe.audited(received.audit_errors)
    assert pipe.causes.audit_codes == set(errors)


def test_the_rollouts_tensor_parallel_size_reaches_the_actor(toy_model_path):
    """``actor_rollout_ref.rollout.tensor_model_parallel_size`` travels in ``actor_rollout_ref.tim_context``, which
    the actor's sync check is sized from (test_verl_sync_check.py); 1 where the rollout is not sharded."""
    from omegaconf import OmegaConf

    from tim_plugins.integrations.verl.config import ActorContext

    for overrides, tp in (([], 1), (["actor_rollout_ref.rollout.tensor_model_parallel_size=8"], 8)):
        sent = ActorContext.from_config(compose(recipe_overrides(toy_model_path) + overrides), asynchronous=False)
        received = ActorContext.from_node(OmegaConf.create({ActorContext.NODE: sent.to_dict()})[ActorContext.NODE])
        assert sent.rollout_tp == tp and received == sent


def _tim_of(cfg):
    from tim_plugins.integrations.verl.config import TIMVerlConfig

    return TIMVerlConfig.from_node(cfg.get("tim"))


# vLLM's own rules beside return_sampling_mask (the checks below restate them in verl's names)
VLLM_REPLAY_RULES = {
    "vllm.config.vllm:VllmConfig._verify_sampling_replay_config": (
        "does not support custom logits processors", "logprobs_mode='processed_logprobs'"),
    "vllm.v1.engine.input_processor:InputProcessor": (
        "sampling distribution replay requires temperature > 0", "sampling distribution replay requires top_k > 0"),
}


def test_vllm_still_has_the_replay_rules_the_adapter_checks():
    import importlib
    import inspect

    for where, phrases in VLLM_REPLAY_RULES.items():
        module, _, qualname = where.partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        source = inspect.getsource(obj)
        for phrase in phrases:
            assert phrase in source, (where, phrase)


REPLAY = ["+tim.safe_vocab.enable=true", "actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.top_k=20",
          "+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true",
          "trainer.val_before_train=false", "trainer.test_freq=-1"]


@pytest.mark.parametrize("change, quoted", [
    (["actor_rollout_ref.rollout.top_k=-1"], "actor_rollout_ref.rollout.top_k=-1"),
    (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature=0"),
    (["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"], "logprobs_mode='raw_logprobs': pruning needs"),
    (["trainer.val_before_train=true"], "actor_rollout_ref.rollout.val_kwargs.top_k=-1"),
    (["trainer.test_freq=5"], "val_kwargs.temperature=0"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[my.pkg:Proc]"],
     "refuses custom logits processors"),
])
def test_what_vllm_refuses_beside_its_kept_sets_stops_the_run_at_start_up(toy_model_path, change, quoted):
    """``engine_kwargs.vllm.return_sampling_mask=true`` (the actor replays vLLM's kept sets): what vLLM refuses
    with it (at start-up, or per request: top_k > 0, temperature > 0; a validation request takes val_kwargs,
    greedy by verl's default) is a problem before any worker starts, quoting the value and the fix."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    base = _without_min_p(toy_model_path) + REPLAY
    tim, problems, _ = check_composed_config(compose(base))
    assert problems == [] and tim.safe_vocab.enabled
    _, problems, _ = check_composed_config(compose(base + change))
    assert len(problems) == 1 and quoted in problems[0], problems
    assert "Fix: " in problems[0]
    if "logprobs_mode" not in change[0]:  # (a raw logprobs_mode is the safe vocabulary's own problem already)
        assert "return_sampling_mask=true" in problems[0]
    if change == ["trainer.val_before_train=true"]:  # the fix it quotes
        fixed = base + change + ["actor_rollout_ref.rollout.val_kwargs.top_k=20",
                                 "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
        assert check_composed_config(compose(fixed))[1] == []


def test_min_p_pruning_with_vllm_kept_sets_is_refused_with_the_way_out(toy_model_path):
    """The recipe's min-p pruning loads tim-plugins' logits processor, which vLLM refuses beside
    return_sampling_mask: the fix names the safe vocabulary over the sampler's own cut."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    cfg = compose(recipe_overrides(toy_model_path) + REPLAY[1:])
    _, problems, _ = check_composed_config(cfg)
    assert len(problems) == 1 and "refuses custom logits processors" in problems[0], problems
    assert "++tim.safe_vocab.enable=true ++tim.safe_vocab.min_p=0" in problems[0]
    # the fix on top of the recipe's own +tim.safe_vocab.min_p, without the logits processor it says to drop
    fixed = [o for o in recipe_overrides(toy_model_path) if "engine_kwargs.vllm" not in o] + REPLAY[1:] + [
        "++tim.safe_vocab.enable=true", "++tim.safe_vocab.min_p=0"]
    assert check_composed_config(compose(fixed))[1] == []


def _legacy(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("trainer.v1.trainer_mode")] + ["trainer.use_v1=false"]


def test_a_tim_node_under_the_legacy_trainer_stops_at_validation(toy_model_path):
    """``trainer.use_v1=false`` runs verl's legacy trainer, which never reads a tim node: the validate_config that
    main_ppo calls on the composed config (the plugin's wrapper, bound by main_ppo's own import) stops with the fix;
    without the tim node verl's validation runs as before."""
    import verl.trainer.main_ppo as main_ppo
    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    assert main_ppo.validate_config is verl_config.validate_config  # the wrapper is what main_ppo calls
    original = main_ppo.validate_config.__wrapped__
    cfg = compose(_legacy(recipe_overrides(toy_model_path)))
    args = dict(use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    with pytest.raises(ValueError) as err:
        main_ppo.validate_config(config=cfg, **args)
    message = str(err.value)
    assert message.startswith("tim-plugins: the config has a tim node (tim.[") and "trainer.use_v1=false" in message
    assert message.endswith("Fix: trainer.use_v1=true trainer.v1.trainer_mode=tim_sync (or drop the +tim.* overrides)")
    # a tim mode already chosen: the fix is only the switch back to the V1 trainer
    kept_mode = compose(recipe_overrides(toy_model_path) + ["trainer.use_v1=false"])
    with pytest.raises(ValueError, match=r"Fix: trainer\.use_v1=true \(or drop the \+tim\.\* overrides\)$"):
        main_ppo.validate_config(config=kept_mode, **args)
    plain = compose(_legacy([o for o in recipe_overrides(toy_model_path) if not o.startswith("+tim.")]))
    assert main_ppo.validate_config(config=plain, **args) is None
    assert original(config=plain, **args) is None  # verl's own validation, unchanged underneath
    # the V1 trainer with a tim mode (the recipe) passes
    assert main_ppo.validate_config(config=compose(recipe_overrides(toy_model_path)), **args) is None


@pytest.mark.slow
def test_main_ppo_with_the_legacy_trainer_and_tim_settings_fails_before_ray(toy_model_path, tmp_path):
    """verl's own entry point, ``python -m verl.trainer.main_ppo ... trainer.use_v1=false +tim.*``: it stops with the
    fix before Ray starts (it ran the legacy trainer with every tim setting ignored)."""
    import main_ppo_run as M

    files = M.prepare(tmp_path, toy_model_path)
    overrides = _legacy(M.base_overrides(files, tmp_path, steps=1) + M.CPU_OVERRIDES + M.recipe_tim_overrides())
    run = M.run_main_ppo(overrides, cwd=tmp_path, timeout=300, log_path=tmp_path / "run.log")
    assert run.returncode != 0
    assert "Fix: trainer.use_v1=true trainer.v1.trainer_mode=tim_sync" in run.output, run.output[-3000:]
    assert "ray init kwargs" not in run.output and not run.steps  # stopped before Ray and before any step


def _docs_minimal_overrides() -> list[str]:
    """The overrides of docs/verl.md's monitor-only block (its ``+`` lines)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "verl.md").read_text()
    block = text.split("<!-- section:verl-minimal -->", 1)[1].split("<!-- /section:verl-minimal -->", 1)[0]
    return [line[1:].strip().rstrip("\\").strip() for line in block.splitlines() if line.startswith("+ ")]


def test_the_docs_monitor_only_block_composes_and_validates_and_each_line_is_needed(toy_model_path):
    """docs/verl.md's first block over verl's defaults: verl's validation and the tim checks pass, the monitor is on
    and nothing else of tim-plugins is; without either line the run is refused or monitors nothing."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    import verl.trainer.main_ppo as main_ppo
    from tim_plugins.integrations.verl.composed import check_composed_config

    block = _docs_minimal_overrides()
    assert block == ["trainer.v1.trainer_mode=tim_sync", "+tim.monitor.enable=true"]
    from main_ppo_run import recipe_tim_overrides

    tim_keys = {o.split("=", 1)[0] for o in recipe_tim_overrides()}
    # the recipe's run without tim-plugins
    base = [o for o in recipe_overrides(toy_model_path) if o.split("=", 1)[0] not in tim_keys]
    assert not any(o.startswith(("+tim.", "trainer.v1.trainer_mode")) for o in base)
    cfg = compose(base + block)
    main_ppo.validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    tim, problems, notes = check_composed_config(cfg)
    assert problems == [] and notes == []
    assert tim.monitor.enable and tim.safe_vocab.min_p == 0 and not tim.lr_decay.enable and not tim.parity.strict
    for dropped in block:
        rest = [o for o in block if o != dropped]
        tim, problems, _ = check_composed_config(compose(base + rest))
        assert problems or not tim.monitor.enable, dropped
    # the rollout's log-probs are verl's default; switched off, the start-up says so with the fix
    _, problems, _ = check_composed_config(compose(base + block + ["actor_rollout_ref.rollout.calculate_log_probs=false"]))
    assert problems == [problems[0]] and problems[0].endswith("Fix: actor_rollout_ref.rollout.calculate_log_probs=true")


@pytest.mark.parametrize("name", ["AdamW8bit", "adamw", "TIMLRDecayMixin"])
def test_an_lr_decay_optimizer_name_the_tim_module_lacks_is_refused_at_start_up(toy_model_path, name):
    """verl takes ``getattr(import_module(optimizer_impl), optimizer)`` in each worker (``build_optimizer``): a name
    the tim module lacks, or one of its helpers, failed there, after start-up. The driver refuses it first, with the
    value and the fix, which composes and builds the optimizer with verl's own ``build_optimizer``."""
    import torch
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.optimizer import build_optimizer

    from tim_plugins.integrations.verl.composed import check_composed_config

    overrides = [o for o in recipe_overrides(toy_model_path)
                 if not o.startswith("actor_rollout_ref.actor.optim.optimizer=")]
    _, problems, _ = check_composed_config(compose([*overrides, f"actor_rollout_ref.actor.optim.optimizer={name}"]))
    assert len(problems) == 1 and problems[0].startswith(f"actor_rollout_ref.actor.optim.optimizer={name!r}")
    fix = problems[0].split("Fix: ")[1].split()
    cfg = compose([*overrides, f"actor_rollout_ref.actor.optim.optimizer={name}", *fix])
    assert check_composed_config(cfg)[1] == []
    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    built = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim)
    assert type(built).__module__ == "tim_plugins.integrations.verl.optim" and type(built).__name__ == "AdamW"


@pytest.mark.parametrize("written, why", [
    (["+tim.lr_decay.options.window=10"], ["tim.lr_decay.enable is false"]),
    (["+tim.monitor.ratio_band=[0.8,1.25]", "+tim.monitor.log_detail=true"], ["tim.monitor.enable is false"]),
    (["+tim.safe_vocab.mask_boundary=false"], ["tim.safe_vocab.min_p is 0"]),
    (["+tim.causes.confident_p=0.6"], ["tim.monitor.enable is false"]),
    (["+tim.sync_check.every_n_syncs=2", "+tim.monitor.enable=true", "+tim.causes.enable=false"],
     ["tim.causes.enable is false"]),
    (["+tim.sync_check.every_n_syncs=2", "+tim.monitor.enable=false", "+tim.sync_check.enable=false"],
     ["tim.monitor.enable is false", "tim.sync_check.enable is false"]),
])
def test_options_a_switch_leaves_off_are_said_at_start_up_with_a_fix_that_composes(written, why):
    """Options whose section is off do nothing: one start-up line names them, the switch, and overrides that, pasted
    after the user's own (which may have written the switch), compose on verl's config and switch it on."""
    from tim_plugins.integrations.verl.composed import check_composed_config

    base = ["trainer.v1.trainer_mode=tim_sync"]
    _, _, notes = check_composed_config(compose([*base, *written]))
    section = written[0].split(".")[1]
    mine = [n for n in notes if n.startswith(f"tim.{section}.") and "nothing. Fix: " in n]
    assert len(mine) == 1, notes
    note = mine[0]
    option = written[0].split("=")[0].lstrip("+")
    assert note.startswith(option) and f" while {' and '.join(why)}: " in note
    fix = note.split("Fix: ")[1].split(" (or ")[0].split()
    tim, _, notes = check_composed_config(compose([*base, *written, *fix]))
    assert not [n for n in notes if "nothing. Fix: " in n], notes


def test_no_left_off_line_when_the_switch_is_on_or_nothing_is_written(toy_model_path):
    from tim_plugins.integrations.verl.composed import check_composed_config

    for overrides in (["trainer.v1.trainer_mode=tim_sync"], recipe_overrides(toy_model_path),
                      ["trainer.v1.trainer_mode=tim_sync", "+tim.monitor.enable=true", "+tim.causes.confident_p=0.6",
                       "+tim.sync_check.every_n_syncs=2"]):
        _, _, notes = check_composed_config(compose(overrides))
        assert not [n for n in notes if "nothing. Fix: " in n], notes


def _startup_refusals(cfg) -> list[str]:
    """What the tim trainer mode's start-up says about ``cfg`` before any worker starts: the error a bad tim value
    raises, else each problem and note of the composed config, else the strict audit's stop (nothing: [])."""
    import io

    from tim_plugins.integrations.verl.composed import check_composed_config
    from tim_plugins.integrations.verl.trainer import run_startup_audit
    from tim_plugins.parity.findings import ParityError

    try:
        tim, problems, notes = check_composed_config(cfg)
    except ValueError as err:
        return [str(err)]
    if problems or notes:
        return problems + notes
    try:
        run_startup_audit(cfg, tim, out=io.StringIO())
    except ParityError as err:
        return [str(err)]
    return []


FP32_ACTOR = ["actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
              "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,"
              "buffer_dtype:fp32}"]


@pytest.mark.parametrize("mistake, fixes", [
    (["+tim.parity.audit=false"], [["++tim.parity.audit=true"], ["++tim.parity.strict=false"]]),
    (FP32_ACTOR, [["++tim.parity.strict=false"]]),  # the strict audit's stop (bf16 rollout, fp32 actor)
    (["++tim.monitor.enable=false"], [["++tim.monitor.enable=true"]]),
    (["++tim.monitor.enable=flase"], [["++tim.monitor.enable=true"]]),
    (["++tim.safe_vocab.min_p=1.5"], [["++tim.safe_vocab.min_p=1e-05"]]),
    (["++tim.safe_vocab.min_p=abc"], [["++tim.safe_vocab.min_p=1e-05"]]),
    (["++tim.probe.kl_k3=-1"], [["++tim.probe.kl_k3=1e-2"]]),
    (["++tim.probe.kl_k3=abc"], [["++tim.probe.kl_k3=0.01"]]),
    (["++tim.probe.action=halt"], [["++tim.probe.action=warn"]]),
    (["+tim.monitor.ratio_band=[2,3]"], [["++tim.monitor.ratio_band=[0.5,2.0]"]]),
    (["trainer.save_freq=-1"], [["++tim.probe.action=raise"]]),
    (["++tim.safe_vocab.min_p=0", "+tim.safe_vocab.enable=true"], [["++tim.safe_vocab.min_p=1e-05"]]),
])
def test_each_start_up_fix_works_pasted_after_the_users_own_overrides(toy_model_path, mistake, fixes):
    """A start-up refusal is about a value the user has set, with `+key=` (the README's spelling) or `++key=`: its fix
    pasted after the user's overrides, as printed, must compose on verl's config (Hydra refuses `+key=` for a key
    that is set already: 'Could not append to config') and leave nothing to say. Every alternative of the fix."""
    recipe = recipe_overrides(toy_model_path)
    written = {o.split("=", 1)[0].lstrip("+") for o in mistake}
    user = [o for o in recipe if o.split("=", 1)[0].lstrip("+") not in written] + mistake
    said = _startup_refusals(compose(user))
    assert said, mistake
    text = "\n".join(said)
    assert not re.search(r"(?<![\w+])\+tim\.", text), text  # `+tim.` after the user's own `+tim.` never composes
    for fix in fixes:
        assert all(o in text for o in fix), (fix, text)
        assert _startup_refusals(compose(user + fix)) == [], (mistake, fix)
