"""The ``tim`` settings checked against the rest of a composed verl ``ppo_trainer`` config, on the driver before any
worker starts (``trainer.py``): the trainer mode that carries them to the workers, the optimizer the LR decay acts
in, the rollout settings the safe vocabulary and the replay of vLLM's kept sets need. Each problem quotes the value
and the fix; the ``tim`` node itself is read by ``config.TIMVerlConfig``.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

from tim_plugins.options import SAFE_VOCAB_NEEDS_A_CUT
from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY as _VLLM_MIN_P_KEY
from tim_plugins.rollout.vllm_min_p_config import PROCESSOR_FQCN as _VLLM_MIN_P_PROCESSOR
from tim_plugins.truncation import DEFAULT_MIN_P

from .config import (OPTIMIZER_IMPL, TRAINER_MODE_PREFIX, VLLM_ENGINE_KWARGS, TIMVerlConfig, _to_plain,
                     rollout_min_p_overrides)
from .optim import OPTIMIZERS

__all__ = ["BACKEND_FIX", "FSDP_BACKENDS", "MEGATRON_BACKEND", "TIM_ENGINE_BACKENDS", "check_composed_config",
           "asks_sampling_mask", "dump_dir_problems"]

# The actor backends the tim engine is registered for (plugin.register: the FSDP engine; plugin._register_megatron:
# the Megatron engine). verl builds the actor's engine for the backend its actor config names, and any other backend
# (fsdp_turbo, automodel, veomni, torchtitan) gets verl's own engine, which has no tim hooks.
# VERL_SOURCES verl.workers.config.actor:FSDPActorConfig.__post_init__
# VERL_SOURCES verl.workers.engine.base:EngineRegistry.get_engine_cls
FSDP_BACKENDS = ("fsdp", "fsdp2")
MEGATRON_BACKEND = "megatron"
TIM_ENGINE_BACKENDS = (*FSDP_BACKENDS, MEGATRON_BACKEND)
# verl's model_engine config group: the actor configs whose engine is one of the backends above
_TIM_MODEL_ENGINES = ("dp", MEGATRON_BACKEND)
# The overrides that give the actor a tim engine (the driver's check and the worker's refusal print it)
BACKEND_FIX = "model_engine=dp actor_rollout_ref.actor.strategy=fsdp2 (or model_engine=megatron)"


def check_composed_config(config: Any) -> tuple[TIMVerlConfig, list[str], list[str]]:
    """Validate the ``tim`` node against the rest of a composed verl ``ppo_trainer`` config.

    Returns the typed settings, a list of problems (errors; each quotes the value and the fix) and a list of
    notes (warnings); raises on a bad ``tim`` value itself. Used by the driver-side trainer before any worker starts.
    """
    tim = TIMVerlConfig.from_node(config.get("tim") if hasattr(config, "get") else None)
    problems: list[str] = []
    notes: list[str] = []
    arr = config.actor_rollout_ref
    mode = str(config.trainer.get("v1", {}).get("trainer_mode", "sync")) if config.trainer.get("use_v1", True) \
        else None
    if tim.worker_side_active and (mode is None or not mode.startswith(TRAINER_MODE_PREFIX)):
        problems.append(
            f"trainer.v1.trainer_mode={mode!r} (trainer.use_v1={config.trainer.get('use_v1', True)}): the tim "
            f"settings reach the actor workers only through a tim trainer mode. Fix: trainer.use_v1=true "
            f"trainer.v1.trainer_mode={TRAINER_MODE_PREFIX}{mode or 'sync'}")
    if mode is not None and mode.startswith(TRAINER_MODE_PREFIX):
        problems.extend(_mode_node_problems(config.trainer.v1, mode))
    if tim.worker_side_active:
        problems.extend(_backend_problems(config))
    megatron = arr.actor.get("strategy") == MEGATRON_BACKEND
    if megatron and tim.safe_vocab.enabled and _topk_distillation(config.get("distillation")):
        mode = config.distillation.distillation_loss.get("loss_mode")
        problems.append(
            f"{tim.safe_vocab.setting} with distillation.distillation_loss.loss_mode={mode!r} "
            "(a top-k distillation) on a Megatron actor: the distillation loss reads the full-vocabulary student "
            "logits while the policy loss would read safe-vocabulary log-probs (megatron_engine.py refuses the same "
            "on the worker). Fix: drop +tim.safe_vocab.min_p / +tim.safe_vocab.enable, or distillation.enabled=false")
    megatron_node = arr.actor.get("megatron") or {}
    if megatron and tim.worker_side_active and megatron_node.get("dynamic_context_parallel", False):
        # the engine refuses it too (megatron_engine.py _tim_check_config), but only once the workers hold the model
        problems.append(
            f"actor_rollout_ref.actor.megatron.dynamic_context_parallel="
            f"{megatron_node.get('dynamic_context_parallel')!r} with the tim settings on a Megatron actor: the tim "
            "engine does not support Megatron's dynamic context parallelism (one rank of the whole data x context "
            "plane holds the outputs). Fix: actor_rollout_ref.actor.megatron.dynamic_context_parallel=false")
    # the Megatron engine applies the decay through Megatron's own optimizer (megatron_engine.py): no optimizer_impl
    if tim.lr_decay.enable and not megatron and arr.actor.optim.get("optimizer_impl") != OPTIMIZER_IMPL:
        problems.append(
            f"actor_rollout_ref.actor.optim.optimizer_impl={arr.actor.optim.get('optimizer_impl')!r}: the LR decay "
            f"acts inside the optimizer. Fix: actor_rollout_ref.actor.optim.optimizer_impl={OPTIMIZER_IMPL} "
            f"actor_rollout_ref.actor.optim.optimizer=AdamW")
    elif tim.lr_decay.enable and not megatron and arr.actor.optim.get("optimizer") not in OPTIMIZERS:
        # verl resolves the name in optimizer_impl's module (VERL_SOURCES verl.workers.config.optimizer:build_optimizer)
        problems.append(
            f"actor_rollout_ref.actor.optim.optimizer={arr.actor.optim.get('optimizer')!r} with optimizer_impl="
            f"{OPTIMIZER_IMPL}: that module has {', '.join(OPTIMIZERS)}, which apply the LR decay inside step(). "
            f"Fix: actor_rollout_ref.actor.optim.optimizer=AdamW")
    if tim.safe_vocab.enabled:
        rollout = arr.rollout
        if rollout.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            problems.append(
                f"actor_rollout_ref.rollout.logprobs_mode={rollout.get('logprobs_mode')!r}: pruning needs log-probs "
                "renormalised over the kept set. Fix: actor_rollout_ref.rollout.logprobs_mode=processed_logprobs")
    if tim.safe_vocab.enabled and tim.safe_vocab.min_p > 0.0:
        problem = _rollout_min_p_problem(arr.rollout, tim.safe_vocab.min_p)
        if problem is not None:
            (problems if arr.rollout.get("name") == "vllm" else notes).append(problem)
    elif tim.safe_vocab.enabled:
        problems.extend(_rollout_cut_problems(arr.rollout))
    if asks_sampling_mask(config):  # (the safe vocabulary's own check above names a raw logprobs_mode already)
        problems.extend(_sampling_mask_problems(config, logprobs_mode=not tim.safe_vocab.enabled))
    rollout_corr = (config.get("algorithm") or {}).get("rollout_correction") or {}
    if tim.monitor.enable and rollout_corr.get("bypass_mode", False):
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob (bypass: no old-log-prob
        # pass); the engine measures the update's first optimizer step instead (engine_mixin._tim_measuring)
        mini, batch = arr.actor.get("ppo_mini_batch_size"), (config.get("data") or {}).get("train_batch_size")
        part = (f" (ppo_mini_batch_size={mini} of data.train_batch_size={batch}: that share of the batch's tokens; "
                "the whole batch with the two equal)" if isinstance(mini, int) and isinstance(batch, int)
                and mini < batch else "")
        notes.append(
            "algorithm.rollout_correction.bypass_mode=True: verl copies the rollout's log-probs into old_log_probs "
            "and runs no old-log-prob pass, so tim/token/* measures the rollout against the update's first "
            f"mini-batch{part}, in its training forward before any optimizer step of the batch (the weights that "
            "sampled it, in the sync trainer); every training pass is keyed by its policy lag against the rollout "
            "(tim/by_lag/*: lag 0 is that mini-batch, the mismatch floor; the staleness cause reads them), with no "
            "exact split (tim/staleness/*, tim/split/*: π_old is the rollout)")
    probe_node = _to_plain((config.get("tim") or {}).get("probe")) or {}
    unread = {k: probe_node[k] for k in ("action", "every_n_steps", "patience") if k in probe_node}
    if unread and not tim.probe.enabled and "enable" not in probe_node:
        # TIMVerlConfig's rule (ProbeSettings): on with tim.probe.enable=true or a limit, else off
        from tim_plugins.parity.probe import ParityProbeConfig

        written = ", ".join(f"tim.probe.{k}={v!r}" for k, v in unread.items())
        notes.append(
            f"{written} with no limit and tim.probe.enable unset: the probe is off (a limit or tim.probe.enable=true "
            f"switches it on), so these settings do nothing. Fix: ++tim.probe.enable=true (its default limit "
            f"kl_k3={ParityProbeConfig().kl_k3_max:g}) or ++tim.probe.kl_k3=<limit>")
    notes.extend(_options_left_off(config.get("tim") or {}, tim))
    save_freq = _number((config.get("trainer") or {}).get("save_freq"), -1)
    if tim.probe.enabled and tim.probe.action == "stop" and save_freq <= 0:
        # VERL_SOURCES verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit (saves only with save_freq > 0)
        notes.append(
            f"tim.probe.action='stop' with trainer.save_freq={config.trainer.get('save_freq')!r}: a probe stop ends "
            "the run after the step it trips on, and verl writes no checkpoint with save_freq <= 0 (its default), so "
            "there is none of that step to resume from. Fix: trainer.save_freq=<N > 0> (or ++tim.probe.action=raise)")
    problem, note = _checkpoint_contents_lines(arr.actor.get("checkpoint"), tim)
    problems.extend([problem] if problem else [])
    notes.extend([note] if note else [])
    if tim.monitor.enable and not arr.rollout.get("calculate_log_probs", True):
        problems.append(
            "actor_rollout_ref.rollout.calculate_log_probs=False: the monitor compares the engine's log-probs with "
            "the actor's. Fix: actor_rollout_ref.rollout.calculate_log_probs=true")
    return tim, problems, notes


def _mode_node_problems(v1: Any, mode: str) -> list[str]:
    """A node under the tim mode's own name (``+trainer.v1.tim_separate_async.parameter_sync_step=2``): verl's trainer
    reads the mode's settings from the base mode's node (``TIMTrainerMixin.trainer_mode``), and the trainer points
    the tim name at that node for verl's other readers (``TIMTrainerMixin._tim_alias_mode_node``), so these settings
    would be dropped. An alias already in place (a config the trainer has seen) is no setting of the user's."""
    from omegaconf import OmegaConf

    base = mode[len(TRAINER_MODE_PREFIX):]
    if mode not in v1 or (OmegaConf.is_config(v1) and OmegaConf.is_interpolation(v1, mode)):
        return []
    written = _flat(_to_plain(v1.get(mode)) or {})
    settings = " ".join(f"++trainer.v1.{base}.{k}={v}" for k, v in written.items())
    return [f"trainer.v1.{mode}={_to_plain(v1.get(mode))!r}: a tim mode runs as verl's {base!r} and reads its "
            f"settings from trainer.v1.{base}, so settings under the tim mode's name are never read. Fix: drop the "
            f"trainer.v1.{mode} overrides" + (f" and write them under the base mode: {settings}" if settings else "")]


def _backend_problems(config: Any) -> list[str]:
    """Why the actor would get verl's own engine instead of the tim engine (``TIM_ENGINE_BACKENDS``): an actor
    strategy or model engine the tim engine is not registered for. Caught here, before Ray starts and the workers load
    the model (the worker would refuse it only then, worker.TIMActorRolloutRefWorker.init_model)."""
    actor = config.actor_rollout_ref.actor
    strategy, model_engine = actor.get("strategy"), config.get("model_engine")
    rule = (f"the tim engine is registered for the actor backends {', '.join(TIM_ENGINE_BACKENDS)} only (verl's "
            "FSDP/FSDP2 and Megatron engines), so this actor would run verl's own engine, without the tim settings")
    if model_engine is not None and model_engine not in _TIM_MODEL_ENGINES:
        # the veomni / torchtitan actor configs build their engine from their own node, whatever actor.strategy says
        return [f"model_engine={model_engine!r} (actor_rollout_ref.actor.strategy={strategy!r}) with the tim "
                f"settings: {rule}. Fix: {BACKEND_FIX}"]
    if strategy not in TIM_ENGINE_BACKENDS:
        fix = (f"actor_rollout_ref.actor.strategy={MEGATRON_BACKEND}" if model_engine == MEGATRON_BACKEND
               else "actor_rollout_ref.actor.strategy=fsdp2")
        return [f"actor_rollout_ref.actor.strategy={strategy!r} with the tim settings: {rule}. Fix: {fix}"]
    return []


_CHECKPOINT = "actor_rollout_ref.actor.checkpoint"


def _checkpoint_contents_lines(checkpoint: Any, tim: TIMVerlConfig) -> tuple[str | None, str | None]:
    """(problem, note) when verl's actor checkpoint leaves out the optimizer while tim keeps state there: the LR
    controller's (optim.TIMLRDecayMixin), the last grad norm it is fed and the cause tracker's
    (engine_mixin.CAUSES_STATE_KEY, GRAD_NORM_STATE_KEY) ride in the optimizer's first param group, which verl's
    checkpoint managers save and load only with "optimizer" in save_contents / load_contents
    (VERL_SOURCES verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.should_save_optimizer; None means
    verl's default, which has it). Losing the LR decay's state is a problem: the resumed run jumps back to the full LR;
    losing the causes' a note: they start afresh."""
    from omegaconf import OmegaConf

    lr_decay, causes = tim.lr_decay.enable, tim.monitor.enable and tim.causes.enable
    if checkpoint is None or not (lr_decay or causes):
        return None, None
    quoted, fixes = [], []
    for key in ("save_contents", "load_contents"):
        contents = checkpoint.get(key)
        if contents is None or "optimizer" in [str(c) for c in contents]:
            continue
        # load_contents follows save_contents in verl's config (${.save_contents}): quoting and fixing the first
        # covers both
        if key == "load_contents" and OmegaConf.is_config(checkpoint) and \
                OmegaConf.is_interpolation(checkpoint, key):
            continue
        listed = [str(c) for c in contents]
        quoted.append(f"{_CHECKPOINT}.{key}=[{','.join(listed)}]")
        at = listed.index("model") + 1 if "model" in listed else 0
        fixes.append(shlex.quote(f"{_CHECKPOINT}.{key}=[{','.join([*listed[:at], 'optimizer', *listed[at:]])}]"))
    if not quoted:
        return None, None
    why = (f"{' and '.join(quoted)}: verl's actor checkpoint carries the optimizer's first param group only with "
           "'optimizer', and tim keeps its state there")
    if lr_decay:
        return (f"{why} (tim.lr_decay.enable=True: the LR controller's scale and windows, and the last grad norm it "
                "is fed), so a resumed run would silently restart the decay from scale 1.0 (the full LR) at the "
                f"checkpoint's step. Fix: {' '.join(fixes)}"), None
    return None, (f"{why} (tim.causes.enable=True: the lag-0 floor's windows and the causes named so far), so a "
                  "resumed run judges its first floors without the windows before the checkpoint and reports only the "
                  f"causes named after it. Fix: {' '.join(fixes)}")


def dump_dir_problems(tim: TIMVerlConfig, config: Any) -> list[str]:
    """Whether ``tim.dump.dir`` is a folder this process can create and write (the driver, before any worker starts:
    it writes the run's ``summary.json`` there first; an unwritable folder would stop the run with a bare
    ``OSError``). Creates the folder, as the summary's write does. The fix names a folder that can be made:
    ``dump/`` beside verl's checkpoints (``trainer.default_local_dir``) where that is writable."""
    if not tim.dump.enabled:
        return []
    folder = Path(os.path.expanduser(tim.dump.dir))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".tim-write-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return []
    except OSError as err:
        why = f"{type(err).__name__}: {err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
    fix = "++tim.dump.dir=/path/to/a/writable/tim_dump"
    ckpt = (config.get("trainer") or {}).get("default_local_dir")
    if ckpt:
        beside = Path(os.path.abspath(os.path.expanduser(str(ckpt)))) / "tim_dump"
        if _can_create(beside):
            fix = f"++tim.dump.dir={shlex.quote(str(beside))} (beside verl's checkpoints)"
    return [f"tim.dump.dir={tim.dump.dir!r}: the dump folder cannot be created or written here ({why}); the driver "
            f"writes the run's summary.json there and the actor workers their dump files. Fix: {fix}"]


def _can_create(folder: Path) -> bool:
    """Whether ``folder`` exists as a writable folder or its nearest existing ancestor is one (nothing created)."""
    for path in (folder, *folder.parents):
        if path.exists():
            return path.is_dir() and os.access(path, os.W_OK | os.X_OK)
    return False


def _options_left_off(node: Any, tim: TIMVerlConfig) -> list[str]:
    """Options written in a ``tim`` section that a switch leaves off (they would do nothing): one line per section,
    naming the switch and the override that turns it on (``++``: the user may have written the switch). The probe
    has its own line (check_composed_config)."""
    monitor = (not tim.monitor.enable, "tim.monitor.enable is false", "++tim.monitor.enable=true")
    causes = (not tim.causes.enable, "tim.causes.enable is false", "++tim.causes.enable=true")
    sections = {  # section: the keys that switch it, then (off, why, fix) for each switch it needs, in order
        "monitor": (("enable",), [monitor]),
        "safe_vocab": (("enable", "min_p"), [(not tim.safe_vocab.enabled, "tim.safe_vocab.min_p is 0",
                                              f"++tim.safe_vocab.min_p={DEFAULT_MIN_P:g} (or "
                                              "++tim.safe_vocab.enable=true)")]),
        "lr_decay": (("enable",), [(not tim.lr_decay.enable, "tim.lr_decay.enable is false",
                                    "++tim.lr_decay.enable=true")]),
        "causes": (("enable",), [monitor, causes]),
        "sync_check": (("enable",), [monitor, causes, (not tim.sync_check.enable, "tim.sync_check.enable is false",
                                                       "++tim.sync_check.enable=true")]),
        # the dump's switch is its folder (tim.dump.dir; null = off), and it writes the monitor's measurement pass
        "dump": (("dir",), [monitor, (not tim.dump.enabled, "tim.dump.dir is null",
                                      "++tim.dump.dir=/path/to/tim_dump")]),
    }
    out = []
    for section, (switch, needs) in sections.items():
        written = {k: v for k, v in (_to_plain(node.get(section)) or {}).items() if k not in switch}
        off = [(why, fix) for is_off, why, fix in needs if is_off]
        if written and off:
            settings = ", ".join(f"tim.{section}.{k}={v!r}" for k, v in _flat(written).items())
            out.append(f"{settings} while {' and '.join(why for why, _ in off)}: "
                       f"{'this setting does' if len(written) == 1 else 'these settings do'} nothing. "
                       f"Fix: {' '.join(fix for _, fix in off)}")
    return out


def _flat(options: dict, prefix: str = "") -> dict:
    """{"options": {"window": 10}} -> {"options.window": 10}: the names as the user wrote them."""
    out = {}
    for k, v in options.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _topk_distillation(distillation: Any) -> bool:
    """Whether verl's trainer will pass ``distillation_use_topk`` to the actor: distillation enabled with a loss that
    reads the student's top-k logits. The loss's settings come from verl's own registry; a loss it does not know
    counts as top-k (verl itself then fails at start-up)."""
    if distillation is None or not distillation.get("enabled", False):
        return False
    # VERL_SOURCES verl.trainer.distillation.losses:get_distillation_loss_settings
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    try:
        return bool(get_distillation_loss_settings(distillation.distillation_loss.loss_mode).use_topk)
    except ValueError:
        return True


def asks_sampling_mask(config: Any) -> bool:
    """Whether the run asks vLLM for its per-token kept sets: ``rollout.name=vllm`` and
    ``engine_kwargs.vllm.return_sampling_mask`` true (verl forwards the node verbatim to vllm serve)."""
    from omegaconf import OmegaConf

    # VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.launch_server
    rollout = OmegaConf.select(config, "actor_rollout_ref.rollout", default=None)
    if rollout is None or OmegaConf.select(rollout, "name", default=None) != "vllm":
        return False
    value = OmegaConf.select(rollout, "engine_kwargs.vllm.return_sampling_mask", default=False)
    return value is True or str(value).lower() == "true"


def _number(value: Any, default: float) -> float:
    return default if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) else value


def _rollout_cut_problems(rollout: Any) -> list[str]:
    """Why the safe vocabulary without min-p (``tim.safe_vocab.enable``) cannot work with this rollout."""
    top_p, top_k = _number(rollout.get("top_p"), 1.0), _number(rollout.get("top_k"), -1)
    out = []
    if top_p >= 1.0 and top_k <= 0:
        out.append(
            f"tim.safe_vocab.enable=True with tim.safe_vocab.min_p=0 and actor_rollout_ref.rollout.top_p={top_p!r}, "
            f"top_k={top_k!r}: {SAFE_VOCAB_NEEDS_A_CUT}, and the sampler keeps the whole vocabulary, so there is no "
            "cut to renormalise over. Fix: "
            "your sampler's actor_rollout_ref.rollout.top_p=<p < 1> and/or top_k=<k > 0>, or pruning of the "
            f"extreme tail: ++tim.safe_vocab.min_p={DEFAULT_MIN_P:g} "
            + " ".join(shlex.quote(o) for o in rollout_min_p_overrides(DEFAULT_MIN_P)))
    engine = _to_plain((rollout.get("engine_kwargs") or {}).get("vllm")) or {}
    rollout_min_p = (engine.get("additional_config") or {}).get(_VLLM_MIN_P_KEY)
    if _VLLM_MIN_P_PROCESSOR in {str(p) for p in engine.get("logits_processors") or []} \
            and _number(rollout_min_p, 0.0) > 0.0:
        out.append(
            f"{VLLM_ENGINE_KWARGS}.additional_config.{_VLLM_MIN_P_KEY}={rollout_min_p!r} with tim.safe_vocab.min_p=0: "
            "the rollout prunes a min-p tail the actor keeps, so the ratio reads the pruned mass again. Fix: "
            f"++tim.safe_vocab.min_p={rollout_min_p!r}, or drop the tim-plugins logits processor")
    return out


def _sampling_mask_problems(config: Any, *, logprobs_mode: bool = True) -> list[str]:
    """What vLLM refuses beside ``return_sampling_mask`` (``VllmConfig._verify_sampling_replay_config`` at start-up,
    and per request in ``InputProcessor``: temperature > 0, top_k > 0), in verl's names. A validation request
    takes ``rollout.val_kwargs`` (verl's default: greedy, top_k -1), so a run that validates needs them too."""
    # VERL_SOURCES verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ.generate_sequences
    rollout = config.actor_rollout_ref.rollout
    engine = _to_plain((rollout.get("engine_kwargs") or {}).get("vllm")) or {}
    why = f"{VLLM_ENGINE_KWARGS}.return_sampling_mask=true (vLLM's kept sets, replayed by the actor): vLLM"
    out = []
    procs = engine.get("logits_processors") or []
    if procs:
        out.append(f"{VLLM_ENGINE_KWARGS}.logits_processors={procs!r} with {why} refuses custom logits processors. "
                   "Fix: drop the logits processors; for the safe vocabulary over your top-p / top-k alone "
                   "++tim.safe_vocab.enable=true ++tim.safe_vocab.min_p=0")
    if logprobs_mode and rollout.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
        out.append(f"actor_rollout_ref.rollout.logprobs_mode={rollout.get('logprobs_mode')!r} with {why} needs "
                   "processed log-probs. Fix: actor_rollout_ref.rollout.logprobs_mode=processed_logprobs")
    sides = [("actor_rollout_ref.rollout", rollout)]
    trainer = config.get("trainer") or {}
    if _number(trainer.get("test_freq"), -1) > 0 or trainer.get("val_before_train", True):
        sides.append(("actor_rollout_ref.rollout.val_kwargs", rollout.get("val_kwargs") or {}))
    for path, sampling in sides:
        top_k, temperature = _number(sampling.get("top_k"), -1), _number(sampling.get("temperature"), 1.0)
        if top_k <= 0 or temperature <= 0:
            out.append(f"{path}.top_k={sampling.get('top_k')!r}, {path}.temperature={sampling.get('temperature')!r} "
                       f"with {why} refuses every request without top_k > 0 and temperature > 0 (it bounds the "
                       f"sets' size). Fix: {path}.top_k=<k > 0> {path}.temperature=<T > 0>"
                       + (" (or trainer.val_before_train=false trainer.test_freq=-1: no validation)"
                          if path.endswith("val_kwargs") else ""))
    return out


def _rollout_min_p_problem(rollout: Any, min_p: float) -> str | None:
    """Why the rollout does not sample with the trainer's ``min_p`` (None when it does). The fix names only the
    keys that differ, with ``++`` (adds the key or overrides the user's own)."""
    if rollout.get("name") != "vllm":
        return (f"tim.safe_vocab.min_p={min_p!r} with actor_rollout_ref.rollout.name={rollout.get('name')!r}: "
                "only the vLLM rollout can be pruned, so this rollout samples from the full vocabulary; sampled "
                "tokens outside the trainer's safe set are masked out of the loss (tim/safe_vocab/boundary_frac)")
    engine = _to_plain((rollout.get("engine_kwargs") or {}).get("vllm")) or {}
    procs = engine.get("logits_processors") or []
    rollout_min_p = (engine.get("additional_config") or {}).get(_VLLM_MIN_P_KEY)
    processors_fix, min_p_fix = rollout_min_p_overrides(min_p)
    min_p_ok = (isinstance(rollout_min_p, (int, float)) and not isinstance(rollout_min_p, bool)
                and math.isclose(float(rollout_min_p), min_p, rel_tol=1e-9, abs_tol=0.0))
    fix = [] if min_p_ok else [min_p_fix]
    if _VLLM_MIN_P_PROCESSOR not in {str(p) for p in procs}:
        # quoted: the brackets are a glob pattern to the shell
        return (f"{VLLM_ENGINE_KWARGS}.logits_processors={procs!r}: tim.safe_vocab.min_p={min_p!r} prunes the "
                "trainer side, but verl passes no min_p to vLLM, so the rollout would sample from the full "
                "vocabulary; the tim-plugins processor must be loaded. Fix: "
                + " ".join([shlex.quote(processors_fix), *fix]))
    if not min_p_ok:
        return (f"{VLLM_ENGINE_KWARGS}.additional_config.{_VLLM_MIN_P_KEY}={rollout_min_p!r}: the rollout must "
                f"prune with the trainer's tim.safe_vocab.min_p={min_p!r}. Fix: {min_p_fix}")
    return None
