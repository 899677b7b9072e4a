"""TIMConfig: what the TRL callback does. Every capability is switched on and off on its own.

With the defaults only the monitor runs (rollout log-probs vs the trainer's recomputation of the same tokens);
the mitigations (safe vocabulary, LR decay, IS correction) are opt-in. Each ``*_options`` field is the core's own
dataclass of that capability (``DumpConfig``, ``InjectorConfig``, ``LRDecayConfig``, ``ParityProbeConfig``,
``CorrectionConfig``): one definition of every option, its default, help and checks, shared with verl's ``tim.*``
settings. A dict of its fields is accepted and turned into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from tim_plugins._config import (coerce_options, core_field, field_default, field_help, help_table, help_texts,
                                 unknown_names)
from tim_plugins.causes import CauseConfig
from tim_plugins.corrections import CORRECTION_MODES, CorrectionConfig
from tim_plugins.dump import DumpConfig
from tim_plugins.lr_control import SIGNAL_ALIASES, LRDecayConfig
from tim_plugins.metrics import DEFAULT_RATIO_BAND, check_ratio_band
from tim_plugins.options import (DEPENDENCY_RULES, DUMP_DIR_RULE, check_min_p,
                                 dependency_problems, dump_dir_accepted, type_problem)
from tim_plugins.parity.probe import ParityProbeConfig
from tim_plugins.pipeline import PipelineConfig
from tim_plugins.rollout.inject import InjectorConfig
from tim_plugins.truncation import DEFAULT_MIN_P
from tim_plugins.lag0_probe import Lag0ProbeConfig
from tim_plugins.weight_sync import SyncCheckConfig

__all__ = ["TIMConfig", "ROLLOUT_CHOICES", "IS_CORRECTION_CHOICES", "LR_DECAY_SIGNALS"]

logger = logging.getLogger("tim_plugins.trl")

# Where the rollout log-probs come from.
#   auto  vLLM when the trainer uses vLLM, else TRL's own `generate` with the processed log-probs recorded
#   hf    TRL's own `generate` with the processed log-probs recorded (use_vllm=False)
#   exact the bitwise-exact sampler of tim_plugins.rollout.exact (diagnostic runs: mismatch must read 0)
#   inject TRL's generation, then a controlled mismatch added by tim_plugins.rollout.inject (diagnostic runs)
ROLLOUT_CHOICES = ("auto", "hf", "exact", "inject")
# Names of the corrections in tim_plugins.corrections (token TIS/MIS, IcePop, sequence TIS/MIS, geometric RS).
# The correction modes are defined once, in the core (combinations such as "geo_rs+token_tis" are valid too).
IS_CORRECTION_CHOICES = tuple(m for m in CORRECTION_MODES if m != "none")
# Any spelling lr_control knows of an extra signal (k3, kl_k3, tim/token/kl_k3, grad_norm, ...).
LR_DECAY_SIGNALS = tuple(SIGNAL_ALIASES)


@dataclass
class TIMConfig:
    """Configuration of `TIMCallback` (see each field's ``help``)."""

    enabled: bool = field(
        default=True,
        metadata=field_help("Master switch. False: the callback attaches nothing and the run is numerically identical "
                       "to a run without it."),
    )
    # ------------------------------------------------------------------------------------------ monitor
    monitor: bool = field(
        default=True,
        metadata=field_help("Log tim/... mismatch metrics (rollout log-probs vs the trainer's recomputation of the same "
                       "tokens) through the trainer's own logging."),
    )
    ratio_band: tuple = core_field(PipelineConfig, "ratio_band")
    log_detail: bool = field(
        default=False, metadata=field_help(
            "Also log the detail metrics (by probability, position, lag and turn, the staleness split, the other "
            "token statistics) in TRL's log; False: the few read each step (tim_plugins.log_keys.STEP_KEYS). The "
            "per-token dump's log_history.jsonl and the report always have them all. verl: tim.monitor.log_detail"),
    )
    log_histograms: bool = field(
        default=True, metadata=field_help("Log wandb histograms of |d| and rho at each logging step (when wandb is active)"),
    )
    dump_dir: Optional[str] = field(
        default=None, metadata=field_help("Directory for a per-token Parquet dump (tim_plugins.dump); None = off"),
    )
    dump_options: DumpConfig = field(
        default=None, metadata=field_help("Options of the dump: a tim_plugins.dump.DumpConfig, or a dict of its "
                                          "fields (sample_rate, max_sequences_per_step, every_n_steps, seed); its "
                                          "out_dir is dump_dir", options=DumpConfig),
    )
    rollout: str = field(
        default="auto",
        metadata=field_help("Source of rollout log-probs: auto (vLLM if the trainer uses it, else HF generate with "
                       "processed log-probs recorded), hf, exact (exact sampler), inject (controlled mismatch)"),
    )
    inject_options: InjectorConfig = field(
        default=None,
        metadata=field_help("rollout='inject': a tim_plugins.rollout.inject.InjectorConfig, or a dict of its fields "
                            "(scale, tau, mode, seed, bias_sign, profile); it perturbs the tail of the distribution "
                            "TRL's generate samples", options=InjectorConfig),
    )
    # -------------------------------------------------------------------------------------- safe vocab
    safe_vocab: bool = field(
        default=False,
        metadata=field_help("Compute the policy log-probs over the safe vocabulary (the sampler's kept set: its "
                            "min_p, top_k and top_p as set in GRPOConfig, generation_kwargs' overrides included) and "
                            "mask boundary tokens (sampled but outside the trainer's safe set) out of the loss. Not "
                            "with rollout='exact' (it samples the full softmax: no kept set)"),
    )
    safe_vocab_min_p: Optional[float] = field(
        default=None,
        metadata=field_help("min_p of the safe set, a number in [0, 1) (0 = no min-p pruning: the safe set is then "
                            "the sampler's top_k / top_p cut alone); None = the sampler's own min_p (GRPOConfig.min_p, "
                            "or generation_kwargs' min_p when given), so both sides prune the same tail; verl: "
                            "tim.safe_vocab.min_p"),
    )
    mask_boundary_tokens: bool = field(
        default=True, metadata=field_help("With safe_vocab: drop sampled tokens outside the trainer's safe set from the loss"),
    )
    # ---------------------------------------------------------------------------------------- LR decay
    lr_decay: bool = field(
        default=False,
        metadata=field_help("Scale the LR (through the scheduler, so TRL's logged learning_rate shows it) when the "
                       "mean completion length surges (tim_plugins.lr_control.LengthTriggeredLRDecay)"),
    )
    lr_decay_options: LRDecayConfig = field(
        default=None, metadata=field_help("Options of the decay: a tim_plugins.lr_control.LRDecayConfig, or a dict of "
                                          "its fields (warmup_steps, window, margin, patience, decay_factor, ...)", options=LRDecayConfig),
    )
    lr_decay_signals: tuple = field(
        default=(), metadata=field_help("Extra signals the decay also watches: k3 (the monitor's tim/token/kl_k3) "
                                        "and/or grad_norm, as a list or one comma-separated string; the same as "
                                        "lr_decay_options' signals"),
    )
    # ------------------------------------------------------------------------------------------ parity
    parity_audit: bool = field(
        default=True,
        metadata=field_help("At train begin, compare the rollout side (vLLM engine or HF generate) with the trainer "
                       "side and log the findings as a table"),
    )
    parity_strict: bool = field(
        default=False, metadata=field_help("Raise at train begin when the audit reports an error-level finding"),
    )
    parity_probe: bool = field(
        default=False,
        metadata=field_help("Live probe: stop training gracefully (control.should_training_stop) when the measured "
                            "mismatch crosses the probe's limits (parity_probe_options); needs monitor=True. verl: "
                            "tim.probe.enable"),
    )
    parity_probe_options: ParityProbeConfig = field(
        default=None, metadata=field_help("The probe's limits and action: a tim_plugins.parity.ParityProbeConfig, or "
                                          "a dict of its fields (kl_k3_max, abs_diff_max, action, patience, ...)", options=ParityProbeConfig),
    )
    # ------------------------------------------------------------------------------------------- causes
    causes: bool = field(
        default=True,
        metadata=field_help("Name what causes a mismatch (a broken weight sync, an engine sampling from other weights, "
                            "a jump of the lag-0 floor, staleness, truncation): tim/cause/*, one console line per "
                            "cause, the report's verdict; with parity_probe, a named cause trips it. Needs "
                            "monitor=True (off without it). docs/causes.md"),
    )
    causes_options: CauseConfig = field(
        default=None, metadata=field_help("The causes' thresholds: a tim_plugins.causes.CauseConfig, or a dict of its "
                                          "fields (confident_p, confident_gap, floor_jump_factor, ...)",
                                          options=CauseConfig),
    )
    sync_check: bool = field(
        default=True,
        metadata=field_help("With vLLM colocate: after each checked weight sync, compare the engine's weights with "
                            "what TRL sent (a fixed sample of elements per tensor, exact in the engine's dtype) and "
                            "name tensors not updated, in another precision, or missing, and a prefix cache the sync "
                            "left holding blocks. In server mode, where the weights cannot be read: a lag-0 probe "
                            "after each sync (a fixed batch scored by the server and the trainer). Needs causes=True"),
    )
    sync_check_options: SyncCheckConfig = field(
        default=None, metadata=field_help("The sync check's options: a tim_plugins.weight_sync.SyncCheckConfig, or a "
                                          "dict of its fields (every_n_syncs, elements_per_tensor, ...)",
                                          options=SyncCheckConfig),
    )
    sync_probe_options: Lag0ProbeConfig = field(
        default=None, metadata=field_help("The server-mode probe's options: a tim_plugins.lag0_probe.Lag0ProbeConfig, "
                                          "or a dict of its fields (every_n_syncs, sequences, max_tokens, ...)",
                                          options=Lag0ProbeConfig),
    )
    # --------------------------------------------------------------------------------------- correction
    is_correction: Optional[str] = field(
        default=None,
        metadata=field_help(f"Importance-sampling correction applied to the loss, one of {IS_CORRECTION_CHOICES} "
                            "(or several joined with '+'), None = no correction; for rollouts that do not come from "
                            "vLLM (with vLLM, TRL's own correction applies). Needs rollout log-probs: refused where "
                            "TRL's generation yields none (continuous batching, beam search, assisted decoding)"),
    )
    is_correction_options: Optional[CorrectionConfig] = field(
        default=None, metadata=field_help("The correction's thresholds: a tim_plugins.corrections.CorrectionConfig, "
                                          "or a dict of its fields (token_clip, seq_clip, icepop_band, ...); its "
                                          "mode is is_correction (a CorrectionConfig given holds the same mode); "
                                          "None when is_correction is None", options=CorrectionConfig),
    )
    # -------------------------------------------------------------------------------------------- misc
    strict: bool = field(
        default=False,
        metadata=field_help("Raise on diagnostic problems (unavailable rollout log-probs, shape mismatches) instead of "
                       "counting them under tim/diag/..."),
    )

    def __post_init__(self) -> None:
        problem = type_problem(self, _SWITCHES)  # the rule verl's settings are checked with
        if problem is not None:
            name, value, _, rule = problem
            raise ValueError(f"TIMConfig.{name}={value!r} is invalid: {rule}. Fix: {name}=True or {name}=False")
        self.ratio_band = check_ratio_band(self.ratio_band, "TIMConfig.ratio_band",
                                           f"TIMConfig(ratio_band={DEFAULT_RATIO_BAND})")
        if self.rollout not in ROLLOUT_CHOICES:
            raise ValueError(f"TIMConfig.rollout={self.rollout!r} is invalid: must be one of {ROLLOUT_CHOICES}. Fix: "
                             "rollout='auto' (the default)")
        if self.rollout == "exact" and self.safe_vocab:
            raise ValueError(
                "TIMConfig.rollout='exact' with safe_vocab=True is invalid: the exact sampler samples the full "
                "softmax(logits/T), so there is no kept set for the safe vocabulary to renormalise over (and the exact "
                "scorer never calls the head it swaps in). Fix: safe_vocab=False for the exact run, or rollout='auto' "
                "to keep the safe vocabulary with TRL's sampler")
        if self.safe_vocab_min_p is not None:  # the rule verl's tim.safe_vocab.min_p has too
            self.safe_vocab_min_p = check_min_p(
                self.safe_vocab_min_p, "TIMConfig.safe_vocab_min_p",
                f"safe_vocab_min_p={DEFAULT_MIN_P:g}, or None to use GRPOConfig.min_p")
        if self.dump_dir != "" and not dump_dir_accepted(self.dump_dir):  # "": no dump, as it always was
            raise ValueError(f"TIMConfig.dump_dir={self.dump_dir!r} is invalid: {DUMP_DIR_RULE}. Fix: "
                             "dump_dir='/path/to/tim_dump' or dump_dir=None")
        self.dump_options = _options(DumpConfig, self.dump_options, "dump_options",
                                     out_dir=str(self.dump_dir) if self.dump_dir else "")
        inject = _options(InjectorConfig, self.inject_options, "inject_options")
        if self.rollout != "inject" and inject != InjectorConfig():
            raise ValueError(f"TIMConfig.inject_options={self.inject_options!r} is invalid with rollout="
                             f"{self.rollout!r}: the injector perturbs rollout='inject' only. Fix: rollout='inject', "
                             "or drop inject_options")
        self.inject_options = inject
        self.parity_probe_options = _options(ParityProbeConfig, self.parity_probe_options, "parity_probe_options")
        self.causes_options = _options(CauseConfig, self.causes_options, "causes_options")
        self.sync_check_options = _options(SyncCheckConfig, self.sync_check_options, "sync_check_options")
        self.sync_probe_options = _options(Lag0ProbeConfig, self.sync_probe_options, "sync_probe_options")
        # typed as verl checks tim.*
        for group in ("dump_options", "causes_options", "sync_check_options", "sync_probe_options"):
            problem = type_problem(getattr(self, group))
            if problem is not None:
                name, value, kind, rule = problem
                raise ValueError(f"TIMConfig.{group}.{name}={value!r} is invalid: {rule}. Fix: "
                                 f"{group}={{{name!r}: <{kind}>}}")
        self._check_correction()
        self._merge_lr_decay_signals()
        self._check_dependencies()
        self._note_unused_options()

    def _check_correction(self) -> None:
        """is_correction names the mode, is_correction_options holds its thresholds (a CorrectionConfig or a dict of
        its fields): one mode, named once."""
        mode, options = self.is_correction, self.is_correction_options
        if mode is not None:  # the core's own checks: modes, '+' combinations and thresholds
            try:
                parsed = CorrectionConfig(mode=mode).mode
            except ValueError as err:
                raise ValueError(
                    f"TIMConfig.is_correction={mode!r} is invalid: {err} Fix: is_correction='token_tis' "
                    f"(one of {IS_CORRECTION_CHOICES}, or several joined with '+', e.g. 'geo_rs+token_tis'), or "
                    "None for no correction") from None
            if parsed == "none":
                # None is this field's "no correction", as it is every TIMConfig switch's off value; the core's
                # mode 'none' would still run the correction pass (weights 1, tim/correction/* logged) and turn
                # batches without rollout log-probs into errors, so the string is refused rather than guessed at
                raise ValueError(
                    f"TIMConfig.is_correction={mode!r} is invalid: no correction is written None, not the string "
                    f"'none' (the choices are {IS_CORRECTION_CHOICES}, or several joined with '+'). Fix: "
                    "is_correction=None")
            if isinstance(options, CorrectionConfig) and options.mode != parsed:
                raise ValueError(
                    f"TIMConfig.is_correction={mode!r} and is_correction_options.mode={options.mode!r} disagree: "
                    "they are one setting (the options' mode is is_correction). Fix: name the mode once, "
                    f"is_correction={options.mode!r}, or is_correction_options=CorrectionConfig(mode={parsed!r}, "
                    "...) (or a dict of its thresholds)")
            self.is_correction_options = _options(CorrectionConfig, options, "is_correction_options", mode=mode)
        elif isinstance(options, CorrectionConfig) or options:
            named = isinstance(options, CorrectionConfig) and options.mode != "none"
            fix = (f"is_correction={options.mode!r} (the mode of the CorrectionConfig given)" if named else
                   "is_correction='token_tis' (or another mode)")
            raise ValueError(f"TIMConfig.is_correction_options={options!r} is invalid with is_correction=None: they "
                             "are the thresholds of a correction, and none is named (is_correction switches it on). "
                             f"Fix: {fix}, or drop is_correction_options")
        else:
            self.is_correction_options = None

    def _note_unused_options(self) -> None:
        """Options given for a feature a switch leaves off do nothing: one warning per option group (or option
        field), naming the options, the switch and the fix, as verl's driver notes options under a section whose
        switch is off (``integrations/verl/composed.py``). A warning, not an error: switching a feature off for a
        run while its options stay written is common."""
        # each switch: (off, as the warning says it, the fix)
        switch = {name: (not getattr(self, name), f"{name}=False", f"{name}=True")
                  for name in ("monitor", "causes", "sync_check", "parity_probe", "lr_decay", "safe_vocab")}
        switch["dump_dir"] = (not self.dump_dir, f"dump_dir={self.dump_dir!r}", "dump_dir='/path/to/tim_dump'")
        needs = {"causes_options": ("monitor", "causes"),
                 "sync_check_options": ("monitor", "causes", "sync_check"),
                 "sync_probe_options": ("monitor", "causes", "sync_check"),
                 "parity_probe_options": ("parity_probe",),  # with monitor=False the probe is refused
                 "lr_decay_options": ("lr_decay",), "lr_decay_signals": ("lr_decay",),
                 "dump_options": ("dump_dir",),
                 "safe_vocab_min_p": ("safe_vocab",), "mask_boundary_tokens": ("safe_vocab",)}
        for name, switches in needs.items():
            value, off = getattr(self, name), [switch[s] for s in switches if switch[s][0]]
            if not off:
                continue
            if dataclasses.is_dataclass(value):
                # out_dir is dump_dir's; the signals lr_decay_signals named are reported under that field
                fixed = {"out_dir"} | ({"signals"} if name == "lr_decay_options" and self.lr_decay_signals else set())
                given = {f.name: getattr(value, f.name) for f in fields(value)
                         if f.name not in fixed and getattr(value, f.name) != field_default(type(value), f.name)}
                count = len(given)
            else:
                given, count = value, int(value != field_default(type(self), name))
            if count:
                logger.warning("TIMConfig.%s=%r while %s: %s nothing. Fix: %s", name, given,
                               " and ".join(said for _, said, _ in off),
                               "this setting does" if count == 1 else "these settings do",
                               ", ".join(fix for _, _, fix in off))

    def _check_dependencies(self) -> None:
        """The combinations both adapters refuse (``tim_plugins.options.dependency_problems``), in TIMConfig's
        names."""
        problems = dependency_problems(
            monitor=self.monitor, probe=self.parity_probe, audit=self.parity_audit, strict=self.parity_strict,
            lr_decay_signals=self.lr_decay_options.signals if self.lr_decay else ())
        spelling = {
            "probe_needs_monitor": ("parity_probe=True with monitor=False", "monitor=True, or parity_probe=False"),
            "k3_needs_monitor": (f"lr_decay_signals={list(self.lr_decay_options.signals)!r} with monitor=False",
                                 "monitor=True, or drop 'kl_k3' from the signals"),
            "strict_needs_audit": ("parity_strict=True with parity_audit=False",
                                   "parity_audit=True, or parity_strict=False"),
        }
        if problems:
            what, fix = spelling[problems[0]]
            raise ValueError(f"TIMConfig.{what} is invalid: {DEPENDENCY_RULES[problems[0]]}. Fix: {fix}")

    def _merge_lr_decay_signals(self) -> None:
        """lr_decay_signals and lr_decay_options.signals are one setting: either may name the signals (in any
        spelling SIGNAL_ALIASES knows), both only alike."""
        given = self.lr_decay_signals
        fix = f"lr_decay_signals=('kl_k3',) (any of {LR_DECAY_SIGNALS}), or () for the length alone"
        if isinstance(given, str):  # a comma-separated list, as LRDecayConfig.signals takes it
            self.lr_decay_signals = tuple(s.strip() for s in given.split(",") if s.strip())
        elif isinstance(given, (list, tuple)) and all(isinstance(s, str) for s in given):
            self.lr_decay_signals = tuple(given)
        else:
            raise ValueError(f"TIMConfig.lr_decay_signals={given!r} is invalid: must be a list of signal names "
                             "(e.g. ('kl_k3', 'grad_norm')) or one comma-separated string of them ('k3,grad_norm'). "
                             f"Fix: {fix}")
        options = _options(LRDecayConfig, self.lr_decay_options, "lr_decay_options")
        try:  # the spellings and their rule are lr_control's
            named = tuple(dict.fromkeys(LRDecayConfig(signals=self.lr_decay_signals).signals))
        except ValueError as err:
            raise ValueError(f"TIMConfig.lr_decay_signals={given!r} is invalid: {err} Fix: {fix}") from None
        if named and options.signals and set(options.signals) != set(named):
            raise ValueError(
                f"TIMConfig.lr_decay_signals={self.lr_decay_signals!r} and lr_decay_options.signals="
                f"{options.signals!r} disagree: they are one setting. Fix: name the signals once, "
                f"lr_decay_signals={named!r}")
        self.lr_decay_options = dataclasses.replace(options, signals=named) if named and not options.signals \
            else options

    def to_dict(self) -> dict[str, Any]:
        """Plain values (option groups as dicts), accepted back by ``TIMConfig(**d)``: the fields other fields
        set (dump_options.out_dir is dump_dir, is_correction_options.mode is is_correction) are left out."""
        out = asdict(self)
        out["ratio_band"] = list(self.ratio_band)
        out["lr_decay_signals"] = list(self.lr_decay_signals)
        out["dump_options"].pop("out_dir")
        if out["is_correction_options"] is not None:
            out["is_correction_options"].pop("mode")
        return out

    @classmethod
    def help(cls) -> None:
        """Print every field with its default and what it does (``TIMConfig.help()``, as the README says);
        `help_texts` returns the same as a dict."""
        print(help_table(cls))

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        """{field name: help text} (for command lines and docs)."""
        return help_texts(cls)


# TIMConfig's switches: checked with the shared type rule (``options.type_problem``), as verl's settings are.
_SWITCHES = tuple(f.name for f in fields(TIMConfig) if f.type == "bool")


def _options(cls, value, name: str, **fixed):
    """``coerce_options`` for the option group ``TIMConfig.<name>``: a refused option's fix is that option at its
    default, in this field's spelling (``dump_options={'sample_rate': 0.05}``)."""
    return coerce_options(cls, value, f"TIMConfig.{name}", **fixed,
                          option_fix=lambda key, default: f"{name}={{{key!r}: {default!r}}} (its default)")


def _checked_init(init):
    """The dataclass's own ``__init__``, behind a check of the keyword names: a misspelt field gets a TypeError
    that names it and the nearest field (Python's own says only "unexpected keyword argument")."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        names = [f.name for f in fields(TIMConfig)]
        if set(kwargs) - set(names):
            raise TypeError(f"TIMConfig has no field {unknown_names(kwargs, names)}. Fields: {', '.join(names)} "
                            "(TIMConfig.help() says what each does).")
        init(self, *args, **kwargs)

    return __init__


TIMConfig.__init__ = _checked_init(TIMConfig.__init__)
