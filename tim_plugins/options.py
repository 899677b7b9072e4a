"""The settings TRL's ``TIMConfig`` and verl's ``tim.*`` overrides share: one table of their spellings, and the rules
both adapters call, so a setting has one default, one range and one "off" in both.

The options of each capability are the core's own dataclasses (``DumpConfig``, ``LRDecayConfig``,
``ParityProbeConfig``, ...: their defaults and checks); what lives here is what those classes do not hold:

* ``check_min_p``: a min-p of ours (the safe vocabulary's, the trainer's truncation, ``measure``'s), a number in
  [0, 1) (``MIN_P_RULE``); 0 = no min-p pruning. verl's
  ``tim.safe_vocab.min_p`` > 0 switches the safe vocabulary on (at 0, ``tim.safe_vocab.enable`` does); TRL's switch is
  ``safe_vocab=True`` and its ``safe_vocab_min_p`` accepts 0 too. Either way at min-p 0 the kept set is the sampler's
  top-k / top-p cut alone, refused at start-up where the sampler cuts nothing (``SAFE_VOCAB_NEEDS_A_CUT``).
* ``probe_config``: when the live probe is on and with which limits. On: ``ParityProbeConfig`` with its defaults
  for the limits not given (``kl_k3_max=1e-3``). Off: None, whatever limits are given. Not said (verl's older
  spelling, a limit without ``tim.probe.enable``): on with only the limits given.
* ``dependency_problems``: combinations both refuse (the probe, or the LR decay's k3 signal, with the monitor off;
  the strict audit with the audit off).
* ``type_problem``: a setting's value against its annotation (a bool a bool, a number not a bool, ...), for verl's
  sections and the option groups whose fields verl generates (the dump's).
* ``dump_dir_accepted``: the dump folder (None = no dump).

``SHARED_SETTINGS`` lists each shared setting's spelling in both adapters, ``ADAPTER_DEFAULTS`` the settings whose
default differs on purpose and ``ADAPTER_VALUES`` the values one adapter keeps taking (and why), ``TRL_ONLY`` /
``VERL_ONLY`` what exists in one adapter only: ``tests/test_shared_schema.py`` walks them against both adapters'
classes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .min_p import MIN_P_RULE, min_p_accepted

if TYPE_CHECKING:
    from .parity.probe import ParityProbeConfig

# The min-p and dump-folder rules need no torch (the vLLM processor's settings, ``rollout.vllm_min_p_config``, check
# min-p with them); the probe's rule and the table import the core classes, so they load on first use
# (``PROBE_THRESHOLDS`` and ``SHARED_SETTINGS`` are module attributes computed then).

__all__ = [
    "MIN_P_RULE",
    "SAFE_VOCAB_NEEDS_A_CUT",
    "check_min_p",
    "min_p_accepted",
    "probe_config",
    "type_problem",
    "DUMP_DIR_RULE",
    "dump_dir_accepted",
    "PROBE_THRESHOLDS",
    "DEPENDENCY_RULES",
    "dependency_problems",
    "SharedSetting",
    "SHARED_SETTINGS",
    "ADAPTER_DEFAULTS",
    "ADAPTER_VALUES",
    "TRL_ONLY",
    "VERL_ONLY",
]

SAFE_VOCAB_NEEDS_A_CUT = ("the safe vocabulary renormalises over the sampler's kept set, which needs a cut: a "
                          "min-p > 0, a top_p < 1 or a top_k > 0")


def check_min_p(value: Any, where: str, fix: str) -> float:
    """``value`` as a float under ``MIN_P_RULE``, else a ValueError quoting ``where``, the value, the rule and
    ``fix``."""
    if not min_p_accepted(value):
        raise ValueError(f"{where}={value!r} is invalid: {MIN_P_RULE}. Fix: {fix}")
    return float(value)


def probe_config(enable: bool | None, options: Mapping[str, Any] | ParityProbeConfig | None
                 ) -> ParityProbeConfig | None:
    """The probe a setting asks for (``options``: ParityProbeConfig or a mapping of its field names).

    ``enable=True``: ``ParityProbeConfig(**options)``, the core's defaults for what is not given (TRL's
    ``parity_probe=True``, verl's ``tim.probe.enable=true``). ``False``: None, the options still checked. ``None``
    (verl's spelling without ``enable``): on when a limit is given (not None), with only the limits given. Raises
    the core's ValueError (its field names) on a bad option."""
    from .parity.probe import DEFAULT_METRIC_KEYS, ParityProbeConfig, check_probe_values

    if isinstance(options, ParityProbeConfig):
        options = {f.name: getattr(options, f.name) for f in fields(options)}
    options = dict(options or {})
    if enable is True:
        return ParityProbeConfig(**options)
    check_probe_values(options)
    if enable is False or all(options.get(name) is None for name in DEFAULT_METRIC_KEYS):
        return None
    return ParityProbeConfig(**{**{name: None for name in DEFAULT_METRIC_KEYS}, **options})


def type_problem(obj: Any, names: Iterable[str] | None = None) -> tuple[str, Any, str, str] | None:
    """The first field of the dataclass instance ``obj`` (of those in ``names``, default every field) whose value
    does not fit its annotation, as (field, value, annotated type, rule), or None. A bool must be a bool; a number a
    real number, not a bool (an int: a whole one); a str a str; a tuple a list or tuple; None only where the
    annotation allows it. Annotations of other kinds (option groups, unions of several types) are left to the
    class's own checks. Settings read from YAML arrive as YAML typed them (``enable=flase`` is the truthy string
    'flase'): both adapters check their settings and option groups with this (TRL's ``TIMConfig`` its switches)."""
    wanted = None if names is None else set(names)
    for f in fields(obj):
        if wanted is not None and f.name not in wanted:
            continue
        value, kind = getattr(obj, f.name), str(f.type)
        optional = kind.startswith("Optional[")
        base = kind[len("Optional["):-1] if optional else kind.split("|")[0].strip()
        if value is None:
            if not optional and "None" not in kind:
                return f.name, value, base, f"must be set ({kind})"
            continue
        if base == "bool" and not isinstance(value, bool):
            return f.name, value, base, "must be true or false"
        if base in ("float", "int") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                         or (base == "int" and not float(value).is_integer())):
            return f.name, value, base, f"must be a number ({base})"
        if base == "str" and not isinstance(value, str):
            return f.name, value, base, "must be a string"
        if base == "tuple" and not isinstance(value, (list, tuple)):
            return f.name, value, base, "must be a list"
    return None


DUMP_DIR_RULE = "must be a folder path (not blank), or None / null for no dump"


def dump_dir_accepted(value: Any) -> bool:
    """Whether ``value`` is a dump folder both adapters accept (``DUMP_DIR_RULE``; ``os.PathLike`` too, which only
    Python code can pass). TRL also takes ``dump_dir=""`` as no dump (``ADAPTER_VALUES``)."""
    if value is None:
        return True
    return isinstance(value, (str, os.PathLike)) and bool(str(os.fspath(value)).strip())


# Rule of each combination both adapters refuse (the adapter names its own spellings and the fix).
DEPENDENCY_RULES = {
    "probe_needs_monitor": "the probe checks the monitor's metrics, and the monitor is off",
    "k3_needs_monitor": "the LR decay's kl_k3 signal is the monitor's k3 of each step, and the monitor is off",
    "strict_needs_audit": "the strict audit stops on the audit's findings, and the audit is off",
}


def dependency_problems(*, monitor: bool, probe: bool, lr_decay_signals: tuple, audit: bool,
                        strict: bool) -> list[str]:
    """Keys of ``DEPENDENCY_RULES`` the settings break (``lr_decay_signals``: the signals of an LR decay that is on,
    () when it is off)."""
    out = []
    if probe and not monitor:
        out.append("probe_needs_monitor")
    if "kl_k3" in lr_decay_signals and not monitor:
        out.append("k3_needs_monitor")
    if strict and not audit:
        out.append("strict_needs_audit")
    return out


@dataclass(frozen=True)
class SharedSetting:
    """One setting both adapters have: ``trl`` is its ``TIMConfig`` field (``group.field`` for a field of an option
    group), ``verl`` its path under verl's ``tim`` node; ``core`` the core dataclass and field holding its default
    and rule, when one does (``None``: a switch whose default is ``default``)."""

    name: str
    trl: str
    verl: str
    core: tuple[type, str] | None = None
    default: Any = None


@cache
def _settings() -> tuple[SharedSetting, ...]:
    from .causes import CauseConfig
    from .dump import DumpConfig
    from .lr_control import LRDecayConfig
    from .parity.probe import ParityProbeConfig
    from .pipeline import PipelineConfig
    from .weight_sync import SyncCheckConfig

    verl_probe = {"kl_k3_max": "kl_k3"}
    out = [
        SharedSetting("monitor", "monitor", "monitor.enable", (PipelineConfig, "monitor")),
        SharedSetting("ratio band", "ratio_band", "monitor.ratio_band", (PipelineConfig, "ratio_band")),
        SharedSetting("log detail", "log_detail", "monitor.log_detail", default=False),
        SharedSetting("safe vocabulary min-p", "safe_vocab_min_p", "safe_vocab.min_p"),
        SharedSetting("boundary mask", "mask_boundary_tokens", "safe_vocab.mask_boundary",
                      (PipelineConfig, "mask_boundary")),
        SharedSetting("LR decay", "lr_decay", "lr_decay.enable", default=False),
        *[SharedSetting(f"LR decay {f.name}", f"lr_decay_options.{f.name}", f"lr_decay.options.{f.name}",
                        (LRDecayConfig, f.name)) for f in fields(LRDecayConfig)],
        SharedSetting("parity audit", "parity_audit", "parity.audit", default=True),
        SharedSetting("strict audit", "parity_strict", "parity.strict", default=False),
        SharedSetting("probe", "parity_probe", "probe.enable", default=False),
        *[SharedSetting(f"probe {f.name}", f"parity_probe_options.{f.name}",
                        f"probe.{verl_probe.get(f.name, f.name)}", (ParityProbeConfig, f.name))
          for f in fields(ParityProbeConfig)],
        SharedSetting("dump", "dump_dir", "dump.dir", default=None),
        *[SharedSetting(f"dump {f.name}", f"dump_options.{f.name}", f"dump.{f.name}", (DumpConfig, f.name))
          for f in fields(DumpConfig) if f.name != "out_dir"],
        SharedSetting("causes", "causes", "causes.enable", default=True),
        *[SharedSetting(f"causes {f.name}", f"causes_options.{f.name}", f"causes.{f.name}", (CauseConfig, f.name))
          for f in fields(CauseConfig)],
        SharedSetting("sync check", "sync_check", "sync_check.enable", default=True),
        *[SharedSetting(f"sync check {f.name}", f"sync_check_options.{f.name}", f"sync_check.{f.name}",
                        (SyncCheckConfig, f.name)) for f in fields(SyncCheckConfig)],
    ]
    return tuple(out)


def __getattr__(name: str):
    if name == "SHARED_SETTINGS":  # every shared setting (SharedSetting), in the adapters' order
        return _settings()
    if name == "PROBE_THRESHOLDS":  # the limits among ParityProbeConfig's fields (None = not checked)
        from .parity.probe import DEFAULT_METRIC_KEYS

        return tuple(DEFAULT_METRIC_KEYS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Settings whose default differs on purpose: {name: ({adapter: default}, why)}.
ADAPTER_DEFAULTS = {
    "monitor": ({"trl": True, "verl": False},
                "TRL: attaching TIMCallback is the opt-in, and the monitor is what it does; verl: a tim trainer mode "
                "without a tim node changes nothing"),
    "safe vocabulary min-p": ({"trl": None, "verl": 0.0},
                              "TRL: None = GRPOConfig.min_p, the sampler's own (safe_vocab switches it on); verl: "
                              "the min-p is the switch (0 = off), and the vLLM rollout is given the same one"),
}

# Values one adapter takes and the other refuses, kept for the spellings users already write: {name: {value: (
# {adapter: accepted}, why)}}.
ADAPTER_VALUES = {
    "dump": {"": ({"trl": True, "verl": False},
                  "TRL has always read dump_dir='' as no dump; verl refuses +tim.dump.dir= (an empty shell variable) "
                  "instead of running without the dump asked for")},
}

# Settings of one adapter only: {spelling: why}.
TRL_ONLY = {
    "enabled": "master switch of the callback (verl: the tim trainer mode)",
    "log_histograms": "wandb histograms through TRL's logging",
    "rollout": "where TRL's rollout log-probs come from (verl: its rollout worker)",
    "inject_options": "the controlled-mismatch rollout of rollout='inject'",
    "is_correction": "an IS correction for rollouts not from vLLM (verl: its own algorithm.rollout_correction)",
    "is_correction_options": "the options of is_correction",
    "lr_decay_signals": "a second spelling of lr_decay_options.signals",
    "strict": "raise on diagnostic problems instead of counting them (verl's workers count them)",
    "safe_vocab": "the safe vocabulary's switch (verl: tim.safe_vocab.min_p > 0, or tim.safe_vocab.enable)",
    "sync_probe_options": "the lag-0 probe of TRL's vLLM server (server mode; verl's colocated sync is read by the "
                          "sync check itself)",
}
VERL_ONLY: dict[str, str] = {
    "safe_vocab.enable": "the safe vocabulary's switch at min-p 0 (over the sampler's own top-k / top-p): verl's "
                         "tim.safe_vocab.min_p > 0 is its switch otherwise; TRL's switch is safe_vocab=True at any "
                         "min-p",
}
