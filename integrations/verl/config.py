"""Typed settings of the verl adapter, read from the top-level ``tim`` node of verl's Hydra config.

Users add them as Hydra overrides (``+tim.monitor.enable=true``); see README section ``verl`` for every string.
Every field defaults to "off", so a config without a ``tim`` node changes nothing. Validation runs on the driver
(before any worker starts) and again in each worker; a bad value fails with the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from tim_plugins._config import coerce_options, core_field, field_help, unknown_names
from tim_plugins.causes import CauseConfig
from tim_plugins.dump import DumpConfig
from tim_plugins.lr_control import LRDecayConfig
from tim_plugins.metrics import DEFAULT_RATIO_BAND, check_ratio_band
from tim_plugins.options import (DEPENDENCY_RULES, DUMP_DIR_RULE, check_min_p,
                                 dependency_problems, dump_dir_accepted, probe_config, type_problem)
from tim_plugins.pipeline import PipelineConfig, TrainingSetup, pipeline_config
from tim_plugins.parity.probe import DEFAULT_METRIC_KEYS, ParityProbeConfig, check_probe_values
from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY as _VLLM_MIN_P_KEY
from tim_plugins.rollout.vllm_min_p_config import PROCESSOR_FQCN as _VLLM_MIN_P_PROCESSOR
from tim_plugins.truncation import DEFAULT_MIN_P
from tim_plugins.weight_sync import SyncCheckConfig

__all__ = [
    "ActorContext",
    "MonitorSettings",
    "SafeVocabSettings",
    "LRDecaySettings",
    "ParitySettings",
    "ProbeSettings",
    "DumpSettings",
    "CauseSettings",
    "SyncCheckSettings",
    "TIMVerlConfig",
    "OPTIMIZER_IMPL",
    "TRAINER_MODE_PREFIX",
    "LAG_FIELD",
    "KEPT_SETS_KEY",
    "EXTRA_FIELDS",
    "VLLM_ENGINE_KWARGS",
    "rollout_min_p_overrides",
]

# What ``actor_rollout_ref.actor.optim.optimizer_impl`` must name for the LR decay to reach verl's optimizer.
OPTIMIZER_IMPL = "tim_plugins.integrations.verl.optim"
# Our trainer modes are verl's registered modes with this prefix (``trainer.v1.trainer_mode=tim_sync``).
TRAINER_MODE_PREFIX = "tim_"
# The per-sample field the driver writes in an asynchronous mode (each sample's policy lag in optimizer steps, -1
# unknown) and the actor's engine reads from its batch.
LAG_FIELD = "tim_lag"
# Each sample's vLLM kept sets (rollout.py's server writes them into TokenOutput.extra_fields under this key, as a
# {"ids": int32, "offsets": int64} CSR pair); verl carries the dict to the actor as the per-sample field EXTRA_FIELDS.
KEPT_SETS_KEY = "tim_kept_sets"
# VERL_SOURCES verl.workers.rollout.replica:TokenOutput (extra_fields -> the V1 trainer's per-sample field)
EXTRA_FIELDS = "extra_fields"
# verl forwards this node verbatim to ``vllm serve``:
# VERL_SOURCES verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.launch_server
VLLM_ENGINE_KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm"


def rollout_min_p_overrides(min_p: float) -> list[str]:
    """Hydra overrides that make vLLM inside verl sample from the safe vocabulary with ``min_p``.

    verl 0.9.1's agent loop sends temperature/top_p/top_k only (agent_loop_tq.py ``generate_sequences``, turned
    into SamplingParams in vllm_async_server.py), so min_p cannot ride on the request; tim-plugins' logits processor
    applies it to every request instead, loaded and configured through the engine args verl forwards
    (``tim_plugins.integrations.vllm.min_p``).
    """
    # VERL_SOURCES verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ.generate_sequences
    # `++`: engine_kwargs.vllm is empty in verl's config, and `+` fails where the user has added the key already
    return [f"++{VLLM_ENGINE_KWARGS}.logits_processors=[{_VLLM_MIN_P_PROCESSOR}]",
            f"++{VLLM_ENGINE_KWARGS}.additional_config.{_VLLM_MIN_P_KEY}={min_p!r}"]


def _bad(path: str, value: Any, rule: str, fix: str) -> ValueError:
    return ValueError(f"tim-plugins: {path}={value!r} is invalid: {rule}. Fix: {fix}")


def _check_types(section: Any, name: str, examples: Mapping[str, Any] | None = None) -> None:
    """Each field of the settings dataclass ``section`` (the ``tim.<name>`` node) against its annotation
    (``tim_plugins.options.type_problem``, the rule TIMConfig's option groups have too): Hydra hands values over as
    typed by YAML, so ``+tim.monitor.enable=flase`` arrives as the string 'flase', which is truthy. The fix is an
    override that works pasted after the user's own (``++``: the user has set the key) with a value the rule
    takes: ``examples``' for the field, else the field's default."""
    problem = type_problem(section)
    if problem is None:
        return
    field_name, value, base, rule = problem
    path = f"tim.{name}.{field_name}"
    if base == "bool":
        raise _bad(path, value, rule, f"++{path}=true or ++{path}=false")
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    example = _hydra_value((examples or {}).get(field_name, defaults.get(field_name)))
    raise _bad(path, value, rule, f"++{path}={example}" if example is not None else f"++{path}=<{base}>")


def _hydra_value(value: Any) -> str | None:
    """``value`` as a Hydra override writes it (None where it has no plain spelling: no example)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, str) and re.fullmatch(r"[\w./-]+", value):
        return value
    if isinstance(value, (list, tuple)) and value:
        items = [_hydra_value(v) for v in value]
        return None if None in items else f"[{','.join(items)}]"
    return None


@dataclass(frozen=True)
class ActorContext:
    """What the actor's engine needs to know of the rest of the composed config: the driver writes it under
    ``actor_rollout_ref.tim_context`` (the workers get ``actor_rollout_ref`` only), the worker hands it to the
    engine's ``tim_configure``."""

    bypass_mode: bool = False  # algorithm.rollout_correction.bypass_mode: old_log_probs are the rollout's
    multi_turn: bool = False  # rollout.multi_turn.enable: tool / user messages in the response, response_mask 0
    asynchronous: bool = False  # an asynchronous trainer mode: each sample carries its policy lag (LAG_FIELD)
    features_off: tuple = ()  # verl features switched off on the driver (an upstream hook moved)
    top_p: float = 1.0  # rollout.top_p: the sampler's nucleus, which the safe vocabulary applies on the trainer side
    top_k: int = -1  # rollout.top_k (-1 / 0: off), likewise
    audit_errors: tuple = ()  # the start-up parity audit's error codes (the causes' truncation and sampler rules)
    # rollout.tensor_model_parallel_size: the weight-sync check's sample spans every shard of the rollout's tensors
    # (SyncCheckConfig.for_tensor_parallel)
    rollout_tp: int = 1

    NODE = "tim_context"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "features_off": list(self.features_off),
                "audit_errors": list(self.audit_errors)}

    @classmethod
    def from_node(cls, node: Any) -> "ActorContext":
        data = _to_plain(node) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) - names:
            raise ValueError(f"tim-plugins: actor_rollout_ref.{cls.NODE}={data!r} is not what the driver writes "
                             f"(keys {sorted(names)}): the driver and the workers run different tim-plugins releases. "
                             "Fix: install the same tim-plugins everywhere the run's processes start")
        flags = {k: data[k] for k in ("bypass_mode", "multi_turn", "asynchronous") if k in data}
        bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
        if bad:
            raise ValueError(f"tim-plugins: actor_rollout_ref.{cls.NODE} has non-boolean flags {bad}")
        sampler = {k: data[k] for k in ("top_p", "top_k", "rollout_tp") if k in data}
        return cls(**flags, **sampler, features_off=tuple(str(x) for x in data.get("features_off") or ()),
                   audit_errors=tuple(str(x) for x in data.get("audit_errors") or ()))

    @classmethod
    def from_config(cls, config, *, asynchronous: bool, features_off: tuple = (),
                    audit_errors: tuple = ()) -> "ActorContext":
        """The driver's reading of a composed ``ppo_trainer`` config (``audit_errors``: its start-up audit's)."""
        arr = config.actor_rollout_ref
        rollout = arr.rollout
        return cls(
            bypass_mode=bool((config.get("algorithm", {}).get("rollout_correction") or {}).get("bypass_mode", False)),
            # verl's multi-turn agent loop writes tool/user messages into the response with response_mask 0
            multi_turn=bool((rollout.get("multi_turn") or {}).get("enable", False)),
            asynchronous=asynchronous, features_off=tuple(features_off), audit_errors=tuple(audit_errors),
            # what the agent loop sends vLLM with every request (temperature, top_p, top_k):
            # VERL_SOURCES verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ.generate_sequences
            top_p=float(rollout.get("top_p", 1.0) if rollout.get("top_p") is not None else 1.0),
            top_k=int(rollout.get("top_k", -1) if rollout.get("top_k") is not None else -1),
            rollout_tp=max(1, int(rollout.get("tensor_model_parallel_size") or 1)))

    def truncation(self, min_p: float):
        """The sampler's whole rule (``tim_plugins.truncation.Truncation``, vLLM's order: min_p, top_k, top_p) on
        logits the engine has already divided by the temperature."""
        from tim_plugins.truncation import Truncation

        return Truncation(min_p=float(min_p), top_p=self.top_p, top_k=self.top_k, temperature=1.0, order="vllm")

    @property
    def setup(self) -> TrainingSetup:
        """The trainer's mechanics in the core's words (``tim_plugins.pipeline.TrainingSetup``): verl's loss takes
        the boundary mask (``response_mask``); its own IS correction (``algorithm.rollout_correction``) stays; in
        bypass mode π_old is the rollout."""
        return TrainingSetup(asynchronous=self.asynchronous, multi_turn=self.multi_turn, loss_factor=True,
                             old_is_rollout=self.bypass_mode)


@dataclass
class MonitorSettings:
    enable: bool = field(default=False, metadata=field_help(
        "Per step, tim/* mismatch metrics of rollout_log_probs vs the actor's recomputed old_log_probs, "
        "merged exactly over data-parallel ranks inside the worker."))
    ratio_band: tuple = core_field(PipelineConfig, "ratio_band")
    log_detail: bool = field(default=False, metadata=field_help(
        "Also log the detail metrics (by probability, position, lag and turn, the staleness split, the other token "
        "statistics) through verl's tracker; false: the few read each step (tim_plugins.log_keys.STEP_KEYS). The "
        "dump's log_history.jsonl and the report always have them all. TRL: TIMConfig(log_detail=True)"))

    def __post_init__(self) -> None:
        _check_types(self, "monitor")
        lo, hi = DEFAULT_RATIO_BAND
        self.ratio_band = check_ratio_band(list(self.ratio_band), "tim-plugins: tim.monitor.ratio_band",
                                           f"++tim.monitor.ratio_band=[{lo},{hi}]")


@dataclass
class SafeVocabSettings:
    min_p: float = field(default=0.0, metadata=field_help(
        "Safe vocabulary S = {a : p_T(a) >= min_p * max_b p_T(b)}, then the rollout's own top_k / top_p, for the "
        "actor's log-probs (old-log-prob and training passes), a number in [0, 1); 0 = no min-p pruning (the safe "
        "vocabulary is then off unless tim.safe_vocab.enable=true). The vLLM rollout must sample with the same "
        "min_p (tim-plugins' logits processor, see rollout_min_p_overrides) and report processed log-probs."))
    enable: bool = field(default=False, metadata=field_help(
        "The safe vocabulary without min-p pruning: the actor renormalises over the rollout's own top_k / top_p "
        "cut as set (actor_rollout_ref.rollout.top_p < 1 or top_k > 0), which vLLM applies by itself, so no "
        "logits processor is loaded and vLLM can also hand out its kept sets "
        "(engine_kwargs.vllm.return_sampling_mask=true: replayed instead of recomputed). With min_p > 0 the "
        "safe vocabulary is on anyway."))
    mask_boundary: bool = field(default=True, metadata=field_help(
        "Drop sampled tokens outside the trainer's S (boundary disagreements) from the loss."))

    def __post_init__(self) -> None:
        _check_types(self, "safe_vocab", examples={"min_p": DEFAULT_MIN_P})
        # the rule TIMConfig.safe_vocab_min_p has too
        self.min_p = check_min_p(self.min_p, "tim-plugins: tim.safe_vocab.min_p",
                                 f"++tim.safe_vocab.min_p={DEFAULT_MIN_P:g} (the tim-plugins default for extreme-tail "
                                 "pruning)")

    @property
    def enabled(self) -> bool:
        return self.min_p > 0.0 or self.enable

    @property
    def setting(self) -> str:
        """The override that switched the safe vocabulary on, for messages."""
        return f"tim.safe_vocab.min_p={self.min_p!r}" if self.min_p > 0.0 else "tim.safe_vocab.enable=True"


@dataclass
class LRDecaySettings:
    enable: bool = field(default=False, metadata=field_help(
        "Length-triggered LR decay inside the actor's optimizer (needs optim.optimizer_impl="
        f"{OPTIMIZER_IMPL})."))
    options: LRDecayConfig = field(default_factory=LRDecayConfig, metadata=field_help(
        "The decay's options, tim_plugins.lr_control.LRDecayConfig's fields (warmup_steps, window, margin, "
        "patience, decay_factor, min_lr_ratio, cooldown, mode, signals, ...), e.g. "
        "+tim.lr_decay.options.decay_factor=0.5; the same as TIMConfig.lr_decay_options.", options=LRDecayConfig))

    def __post_init__(self) -> None:
        _check_types(self, "lr_decay")
        self.options = coerce_options(LRDecayConfig, self.options, "tim-plugins: tim.lr_decay.options",
                                      fix="++tim.lr_decay.options.<field>=<value>")


# verl's spelling -> ParityProbeConfig's field (the documented overrides keep their names), and the limits among them
_PROBE_FIELDS = {"kl_k3": "kl_k3_max", "abs_diff_max": "abs_diff_max", "seq_log_ratio_abs_max": "seq_log_ratio_abs_max",
                 "action": "action", "every_n_steps": "every_n_steps", "patience": "patience"}
_PROBE_LIMITS = {name: core for name, core in _PROBE_FIELDS.items() if core in DEFAULT_METRIC_KEYS}
# a value each rule allows, for the fix a refused one is given
_PROBE_FIX = {"action": "warn", "every_n_steps": "1", "patience": "1"}


@dataclass
class ProbeSettings:
    """The live parity probe (``tim_plugins.parity.probe``): the actor's pipeline decides at each step's merge
    (``StepPipeline.compute``), the driver acts on the decision (warn, raise, stop after a checkpoint). Options and
    rules are ``ParityProbeConfig``'s; ``kl_k3`` is its ``kl_k3_max``. On and off as TRL's ``parity_probe``
    (``tim_plugins.options.probe_config``): ``enable=true`` takes the core's limits for those not given (kl_k3
    1e-3), ``enable=false`` is off whatever limits are set, and a limit set without ``enable`` switches the probe on
    with only the limits set. After construction ``enable`` says whether it is on."""

    enable: bool | None = field(default=None, metadata=field_help(
        "Switch the probe on (true: TIMConfig(parity_probe=True), with ParityProbeConfig's limits for those not "
        "set) or off (false, whatever limits are set); unset: on when a limit is set, with only the limits set."))
    action: str = core_field(ParityProbeConfig, "action")
    kl_k3: float | None = core_field(ParityProbeConfig, "kl_k3_max", default=None)
    abs_diff_max: float | None = core_field(ParityProbeConfig, "abs_diff_max")
    seq_log_ratio_abs_max: float | None = core_field(ParityProbeConfig, "seq_log_ratio_abs_max")
    every_n_steps: int = core_field(ParityProbeConfig, "every_n_steps")
    patience: int = core_field(ParityProbeConfig, "patience")

    def __post_init__(self) -> None:
        _check_types(self, "probe", examples=dict.fromkeys(_PROBE_LIMITS, 1e-2))
        for name, core in _PROBE_FIELDS.items():  # ParityProbeConfig's rules, with verl's names in the message
            try:
                check_probe_values({core: getattr(self, name)}, where=lambda _: f"tim-plugins: tim.probe.{name}")
            except ValueError as err:
                raise ValueError(f"{err}. Fix: ++tim.probe.{name}={_PROBE_FIX.get(name, '1e-2')}") from None
        limits = {name: getattr(self, name) for name in _PROBE_LIMITS}
        if self.enable is None:
            self.enable = any(v is not None for v in limits.values())
        elif self.enable and all(v is None for v in limits.values()):  # the core's limits
            self._set_core(probe_config(True, {}))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ProbeSettings":
        """From the ``tim.probe`` node: with ``enable=true`` the limits not written take the core's defaults (a
        limit written null stays off), as ``parity_probe_options`` does in TRL."""
        settings = cls(**options)
        if options.get("enable") is not True:
            return settings
        written = {core: options[name] for name, core in _PROBE_FIELDS.items() if name in options}
        try:
            settings._set_core(probe_config(True, written))
        except ValueError as err:
            raise _bad("tim.probe", dict(options), str(err).replace("ParityProbeConfig: ", ""),
                       "++tim.probe.kl_k3=1e-3 (or drop the null limits)") from None
        return settings

    def _set_core(self, core: ParityProbeConfig) -> None:
        for name, core_name in _PROBE_FIELDS.items():
            setattr(self, name, getattr(core, core_name))

    @property
    def thresholds(self) -> dict[str, float]:
        if not self.enable:
            return {}
        return {DEFAULT_METRIC_KEYS[core]: float(getattr(self, name)) for name, core in _PROBE_LIMITS.items()
                if getattr(self, name) is not None}

    @property
    def enabled(self) -> bool:
        return bool(self.enable)

    def config(self):
        """The core ``ParityProbeConfig`` (None when the probe is off)."""
        if not self.enabled:
            return None
        return ParityProbeConfig(**{core: getattr(self, name) for name, core in _PROBE_FIELDS.items()})


@dataclass
class ParitySettings:
    audit: bool = field(default=True, metadata=field_help(
        "Audit rollout vs trainer numerics on the composed config at start-up (driver) and print the table."))
    strict: bool = field(default=False, metadata=field_help(
        "Stop before any worker starts when the audit finds an error-level mismatch."))

    def __post_init__(self) -> None:
        _check_types(self, "parity")


class _DumpMethods:
    """The per-token Parquet dump (``tim_plugins.dump``) of the actor's measurement pass: the same files as
    ``TIMConfig(dump_dir=...)`` writes for TRL, read by ``tim-plugins report DIR``. Its options are ``DumpConfig``'s
    own fields (generated from it: a new dump option reaches verl as ``+tim.dump.<option>``), defaults and rules
    included; ``dir`` is its ``out_dir``."""

    def __post_init__(self) -> None:
        # TIMConfig.dump_dir's rule; YAML holds no path objects
        if not isinstance(self.dir, (str, type(None))) or not dump_dir_accepted(self.dir):
            raise _bad("tim.dump.dir", self.dir, DUMP_DIR_RULE, "++tim.dump.dir=/path/to/tim_dump")
        _check_types(self, "dump")
        try:
            self.config()
        except ValueError as err:
            raise ValueError(f"tim-plugins: tim.dump: {err} Fix: ++tim.dump.<option>=<value>") from None

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def config(self) -> DumpConfig:
        """The core ``DumpConfig`` (``out_dir`` = ``dir``; a placeholder when off, never written)."""
        return DumpConfig(out_dir=self.dir or ".", **{name: getattr(self, name) for name in _DUMP_OPTIONS})


_DUMP_OPTIONS = tuple(f.name for f in dataclasses.fields(DumpConfig) if f.name != "out_dir")
DumpSettings = dataclasses.make_dataclass("DumpSettings", [
    ("dir", "str | None", field(default=None, metadata=field_help(
        "Folder for the dump (step_<verl global step>-rank_<DP rank>.parquet, -part_<k> files for separate_async's "
        "later updates of a step, plus the run's summary.json with the "
        "start-up audit and the model path, for the report); null = off. Needs tim.monitor.enable=true."))),
    *[(f.name, f.type, core_field(DumpConfig, f.name)) for f in dataclasses.fields(DumpConfig) if f.name != "out_dir"],
], bases=(_DumpMethods,), namespace={"__module__": __name__, "__doc__": _DumpMethods.__doc__})


class _SwitchedOptions:
    """A section that is one core option group behind a switch: ``enable`` and the core class's own fields (generated
    from it: a new option reaches verl as ``+tim.<section>.<option>``), its defaults and rules. ``config()`` is the
    core instance."""

    CORE: type
    SECTION: str

    def __post_init__(self) -> None:
        _check_types(self, self.SECTION)
        try:
            self.config()
        except ValueError as err:
            raise ValueError(f"tim-plugins: tim.{self.SECTION}: {err}. Fix: ++tim.{self.SECTION}.<option>=<value> "
                             f"({', '.join(f.name for f in dataclasses.fields(self.CORE))})") from None

    def config(self):
        return self.CORE(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self.CORE)})


def _switched_options(name: str, core: type, section: str, enable_help: str) -> type:
    return dataclasses.make_dataclass(name, [
        ("enable", "bool", field(default=True, metadata=field_help(enable_help))),
        *[(f.name, f.type, core_field(core, f.name)) for f in dataclasses.fields(core)],
    ], bases=(_SwitchedOptions,), namespace={"__module__": __name__, "__doc__": _SwitchedOptions.__doc__,
                                             "CORE": core, "SECTION": section})


CauseSettings = _switched_options("CauseSettings", CauseConfig, "causes", (
    "Name what causes a mismatch (a broken weight sync, an engine sampling from other weights, a jump of the lag-0 "
    "floor, staleness, truncation): tim/cause/*, one console line per cause, the probe trips on one. Runs with the "
    "monitor (off without it); the same as TIMConfig.causes."))
SyncCheckSettings = _switched_options("SyncCheckSettings", SyncCheckConfig, "sync_check", (
    "After each checked weight sync of the colocated vLLM rollout (ActorRolloutRefWorker.update_weights), compare "
    "the engine's weights with what the actor engine streamed (a fixed sample of elements per tensor, exact in the "
    "engine's dtype) and name tensors not updated, in another precision, or missing. Needs tim.causes.enable; the "
    "same as TIMConfig.sync_check."))


@dataclass
class TIMVerlConfig:
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    safe_vocab: SafeVocabSettings = field(default_factory=SafeVocabSettings)
    lr_decay: LRDecaySettings = field(default_factory=LRDecaySettings)
    parity: ParitySettings = field(default_factory=ParitySettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    dump: DumpSettings = field(default_factory=DumpSettings)
    causes: CauseSettings = field(default_factory=CauseSettings)
    sync_check: SyncCheckSettings = field(default_factory=SyncCheckSettings)

    _SECTIONS = {"monitor": MonitorSettings, "safe_vocab": SafeVocabSettings, "lr_decay": LRDecaySettings,
                 "parity": ParitySettings, "probe": ProbeSettings, "dump": DumpSettings, "causes": CauseSettings,
                 "sync_check": SyncCheckSettings}

    def __post_init__(self) -> None:
        # the combinations TIMConfig refuses too (tim_plugins.options), in verl's names
        signals = self.lr_decay.options.signals if self.lr_decay.enable else ()
        problems = dependency_problems(monitor=self.monitor.enable, probe=self.probe.enabled, lr_decay_signals=signals,
                                       audit=self.parity.audit, strict=self.parity.strict)
        spelling = {
            "k3_needs_monitor": ("tim.lr_decay.options.signals", list(signals), "++tim.monitor.enable=true"),
            "probe_needs_monitor": ("tim.probe", self.probe.thresholds, "++tim.monitor.enable=true"),
            "strict_needs_audit": ("tim.parity.strict", self.parity.strict,
                                   "++tim.parity.audit=true (or ++tim.parity.strict=false)"),
        }
        if problems:
            path, value, fix = spelling[problems[0]]
            raise _bad(path, value, DEPENDENCY_RULES[problems[0]] + (
                " (tim.parity.audit=false)" if problems[0] == "strict_needs_audit" else " (tim.monitor.enable=false)"),
                fix)
        if self.dump.enabled and not self.monitor.enable:
            raise _bad("tim.dump.dir", self.dump.dir, "the dump writes the monitor's measurement pass, and "
                       "tim.monitor.enable=false", "++tim.monitor.enable=true")

    def pipeline_config(self, context: "ActorContext | None" = None) -> PipelineConfig:
        """These settings, for an actor in ``context``, as the core pipeline's configuration (the core's builder,
        ``tim_plugins.pipeline.pipeline_config``: the rules both adapters share)."""
        context = context if context is not None else ActorContext()
        return pipeline_config(
            monitor=self.monitor.enable, ratio_band=self.monitor.ratio_band, safe_vocab=self.safe_vocab.enabled,
            mask_boundary=self.safe_vocab.mask_boundary,
            lr_decay=self.lr_decay.options if self.lr_decay.enable else None,
            probe=self.probe.config(), dump=self.dump.config() if self.dump.enabled else None,
            causes=self.causes.config() if self.causes.enable else None, setup=context.setup)

    @property
    def worker_side_active(self) -> bool:
        """Whether the actor workers have anything to do."""
        return self.monitor.enable or self.safe_vocab.enabled or self.lr_decay.enable or self.probe.enabled

    @classmethod
    def from_node(cls, node: Any) -> "TIMVerlConfig":
        """Build from the ``tim`` node (OmegaConf DictConfig, dict, or None = all defaults)."""
        if node is None:
            return cls()
        data = _to_plain(node)
        if not isinstance(data, Mapping):
            raise _bad("tim", data, "must be a mapping of sections", "++tim.monitor.enable=true")
        if set(data) - set(cls._SECTIONS):
            raise _bad("tim", sorted(data), f"unknown section(s) {unknown_names(data, cls._SECTIONS)}",
                       f"use {sorted(cls._SECTIONS)}")
        kwargs = {}
        for name, section_cls in cls._SECTIONS.items():
            sub = data.get(name) or {}
            if not isinstance(sub, Mapping):
                raise _bad(f"tim.{name}", sub, "must be a mapping", f"++tim.{name}.<option>=<value>")
            names = {f.name for f in dataclasses.fields(section_cls)}
            if set(sub) - names:
                raise _bad(f"tim.{name}", dict(sub), f"unknown option(s) {unknown_names(sub, sorted(names))}",
                           f"use {sorted(names)}")
            kwargs[name] = section_cls.from_options(sub) if section_cls is ProbeSettings else section_cls(**sub)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in self._SECTIONS}


def _to_plain(node: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # plain dicts only
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node
