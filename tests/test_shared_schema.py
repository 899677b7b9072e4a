"""One schema for the settings TRL and verl share (``tim_plugins.options``): walking its table, each setting has the
same default, takes and refuses the same values (one at each bound of its rule, and values of the wrong type) and is
switched off the same way in TRL's ``TIMConfig`` and in verl's ``tim`` node, the reference being the core class or
rule that defines it. A default or a range that drifts in one adapter fails here; a setting added to one adapter
fails until the table names it (shared, or one adapter's only)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

# Neither adapter's settings module imports its framework: this runs without TRL and without verl.
from tim_plugins.dump import DumpConfig
from tim_plugins.integrations.trl.config import TIMConfig
from tim_plugins.integrations.verl.config import TIMVerlConfig
from tim_plugins.metrics import check_ratio_band
from tim_plugins.options import (ADAPTER_DEFAULTS, ADAPTER_VALUES, DEPENDENCY_RULES, PROBE_THRESHOLDS,
                                 SHARED_SETTINGS, TRL_ONLY, VERL_ONLY, dump_dir_accepted, min_p_accepted,
                                 probe_config, type_problem)
from tim_plugins.parity.probe import ParityProbeConfig

DUMP_DIR = "/tmp/tim_shared_schema_dump"
# What a group's options need to be read at all: the group's switch (TRL) / section switch (verl).
TRL_SWITCH = {"lr_decay_options": {"lr_decay": True}, "parity_probe_options": {"parity_probe": True},
              "dump_options": {"dump_dir": DUMP_DIR}}
VERL_SWITCH = {"lr_decay": {"enable": True}, "probe": {"enable": True}, "dump": {"dir": DUMP_DIR}}
SETTINGS = {s.name: s for s in SHARED_SETTINGS}


def _trl(setting, value=dataclasses.MISSING) -> TIMConfig:
    head, _, sub = setting.trl.partition(".")
    kwargs = dict(TRL_SWITCH.get(head, {})) if sub else {}
    if value is not dataclasses.MISSING:
        kwargs[head] = {sub: value} if sub else value
    return TIMConfig(**kwargs)


def _verl(setting, value=dataclasses.MISSING) -> TIMVerlConfig:
    path = setting.verl.split(".")
    node = {} if setting.verl == "monitor.enable" else {"monitor": {"enable": True}}
    if len(path) > 1 and path[-1] not in ("enable", "dir"):  # an option: its section switched on
        node.setdefault(path[0], {}).update(VERL_SWITCH.get(path[0], {}))
    if value is not dataclasses.MISSING:
        leaf = node
        for key in path[:-1]:
            leaf = leaf.setdefault(key, {})
        leaf[path[-1]] = value
    return TIMVerlConfig.from_node(node)


def _trl_value(setting, cfg: TIMConfig):
    head, _, sub = setting.trl.partition(".")
    value = getattr(cfg, head)
    return getattr(value, sub) if sub else value


def _verl_value(setting, tim: TIMVerlConfig):
    section, *rest = setting.verl.split(".")
    if section == "probe" and rest != ["enable"]:  # what the workers run: the core config
        return getattr(tim.probe.config(), setting.core[1])
    if section == "dump" and rest != ["dir"]:
        return getattr(tim.dump.config(), setting.core[1])
    value = getattr(tim, section)
    for key in rest:
        value = getattr(value, key)
    return value


def _core_default(setting):
    if setting.core is None:
        return setting.default
    f = next(f for f in dataclasses.fields(setting.core[0]) if f.name == setting.core[1])
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize("setting", SHARED_SETTINGS, ids=lambda s: s.name)
def test_the_same_default_in_both_adapters(setting):
    trl, verl = _trl_value(setting, _trl(setting)), _verl_value(setting, _verl(setting))
    if setting.name in ADAPTER_DEFAULTS:
        defaults, why = ADAPTER_DEFAULTS[setting.name]
        assert (trl, verl) == (defaults["trl"], defaults["verl"]) and why
        return
    assert trl == verl == _core_default(setting), (trl, verl)
    if setting.verl.startswith("probe.") and setting.core and setting.core[1] not in PROBE_THRESHOLDS:
        # verl's older spelling (a limit without tim.probe.enable) has the same defaults for the rest
        older = TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": {"kl_k3": 1e-2}})
        assert getattr(older.probe.config(), setting.core[1]) == trl


def test_the_declared_exceptions_are_shared_settings():
    assert set(ADAPTER_DEFAULTS) <= set(SETTINGS) and set(ADAPTER_VALUES) <= set(SETTINGS)
    assert ADAPTER_DEFAULTS["monitor"][0] == {"trl": True, "verl": False}


BOOLS = [True, False, 1, 0, "true", "no"]
NUMBERS = [0, 0.0, 1e-3, 0.5, 1, 1.0, 2, 1.5, 20, -1, -1e-9, math.inf, math.nan, None, True, "0.5", "1"]
WORDS = ["warn", "raise", "stop", "step", "epoch", "any", "all", "explode", "", 1, None]
TUPLES = [(), ("k3",), ("kl_k3", "grad_norm"), ["grad_norm"], ("bogus",), "k3", None, 1]
RATIO_BANDS = [(0.5, 2.0), [0.5, 2.0], (1e-9, 1e9), (0.0, 2.0), (0.5, 1.0), (1.0, 2.0), (0.5, math.inf),
               (0.5, 2.0, 3.0), ("0.5", "2"), (True, 2.0), 0.5, None]
MIN_PS = [0.0, 0, 1e-12, 1e-5, 0.999999, 1.0, 1, -1e-12, math.inf, math.nan, True, "1e-3"]
DUMP_DIRS = [DUMP_DIR, "relative/dir", "", "   ", 3, ["a"]]


def _candidates_and_rule(setting):
    """Values at each bound of the setting's rule and of the wrong type, and the reference: the core's rule."""
    if setting.name == "ratio band":
        return RATIO_BANDS, _accepts(check_ratio_band)
    if setting.name == "safe vocabulary min-p":
        return MIN_PS, min_p_accepted
    if setting.name == "dump":
        return DUMP_DIRS, dump_dir_accepted
    if setting.core is None or typing.get_type_hints(setting.core[0])[setting.core[1]] is bool:
        return BOOLS, lambda v: isinstance(v, bool)  # a switch
    cls, name = setting.core
    kind = str(typing.get_type_hints(cls)[name])
    values = TUPLES if "tuple" in kind else WORDS if "str" in kind else NUMBERS
    fixed = {"out_dir": DUMP_DIR} if cls is DumpConfig else {}

    def build(value):  # the class's own checks, and its annotations (tim_plugins.options.type_problem)
        problem = type_problem(cls(**fixed, **{name: value}))
        if problem is not None:
            raise ValueError(problem)
    return values, _accepts(build)


def _accepts(build):
    def accepted(value) -> bool:
        try:
            build(value)
        except (TypeError, ValueError):
            return False
        return True
    return accepted


def _taken(build) -> bool:
    try:
        build()
    except ValueError as err:
        assert "Fix:" in str(err) or "fix" in str(err).lower(), err  # refused with the fix
        return False
    return True


@pytest.mark.parametrize("setting", SHARED_SETTINGS, ids=lambda s: s.name)
def test_each_bound_is_taken_or_refused_alike(setting):
    values, core_accepts = _candidates_and_rule(setting)
    exceptions = ADAPTER_VALUES.get(setting.name, {})
    disagreements = []
    for value in values:
        trl = _taken(lambda: _trl(setting, value))
        verl = _taken(lambda: _verl(setting, value))
        reference = core_accepts(value)
        if isinstance(value, str) and value in exceptions:
            assert {"trl": trl, "verl": verl} == exceptions[value][0], value
            continue
        if not trl == verl == reference:
            disagreements.append((value, {"core": reference, "trl": trl, "verl": verl}))
    assert disagreements == [], disagreements
    assert any(core_accepts(v) for v in values) and not all(core_accepts(v) for v in values)


def test_every_setting_of_either_adapter_is_in_the_table():
    trl_named = {s.trl.partition(".")[0] for s in SHARED_SETTINGS} | set(TRL_ONLY)
    assert {f.name for f in dataclasses.fields(TIMConfig)} == trl_named
    verl_named = {s.verl.rsplit(".", 1)[0] if s.verl.startswith("lr_decay.options.") else s.verl
                  for s in SHARED_SETTINGS} | set(VERL_ONLY)
    verl_fields = {f"{section}.{f.name}" for section, cls in TIMVerlConfig._SECTIONS.items()
                   for f in dataclasses.fields(cls)}
    assert verl_fields == verl_named
    options = {f"lr_decay_options.{f.name}" for f in dataclasses.fields(TIMConfig().lr_decay_options)}
    assert options <= {s.trl for s in SHARED_SETTINGS}


OFF = [
    # (setting name, TRL's off, verl's off node)
    ("monitor", {"monitor": False}, {}),
    ("safe vocabulary min-p", {"safe_vocab": False}, {"safe_vocab": {"min_p": 0.0}}),
    ("LR decay", {"lr_decay": False}, {"lr_decay": {"enable": False}}),
    ("parity audit", {"parity_audit": False}, {"parity": {"audit": False}}),
    ("probe", {"parity_probe": False}, {"probe": {"enable": False}}),
    ("dump", {"dump_dir": None}, {"dump": {"dir": None}}),
]


@pytest.mark.parametrize("name, trl, verl", OFF, ids=[o[0] for o in OFF])
def test_off_is_spelled_alike_and_is_off(name, trl, verl):
    cfg, tim = TIMConfig(**trl), TIMVerlConfig.from_node(verl)
    on = {"monitor": (cfg.monitor, tim.monitor.enable), "safe vocabulary min-p": (cfg.safe_vocab,
                                                                                    tim.safe_vocab.enabled),
          "LR decay": (cfg.lr_decay, tim.lr_decay.enable), "parity audit": (cfg.parity_audit, tim.parity.audit),
          "probe": (cfg.parity_probe, tim.probe.enabled), "dump": (bool(cfg.dump_dir), tim.dump.enabled)}[name]
    assert on == (False, False)


def test_min_p_zero_is_no_pruning_in_both():
    """``min_p=0`` means "no min-p pruning" in both: verl's safe vocabulary is then off unless ``enable`` switches it
    on, TRL's switch is ``safe_vocab`` itself; on, either renormalises over the sampler's top-k / top-p alone (whether
    the sampler cuts at all is checked against the trainer's settings when the adapter starts)."""
    assert TIMConfig(safe_vocab_min_p=0.0).safe_vocab_min_p == 0.0
    assert TIMConfig(safe_vocab=True, safe_vocab_min_p=0.0).safe_vocab_min_p == 0.0
    assert not TIMVerlConfig.from_node({"safe_vocab": {"min_p": 0}}).safe_vocab.enabled
    assert TIMVerlConfig.from_node({"safe_vocab": {"min_p": 0, "enable": True}}).safe_vocab.enabled


def _verl_probe(**options):
    return TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": options}).probe.config()


@pytest.mark.parametrize("options", [{}, {"abs_diff_max": 0.5}, {"kl_k3_max": None, "abs_diff_max": 0.5},
                                     {"kl_k3_max": 1e-2, "action": "stop", "patience": 2},
                                     {"seq_log_ratio_abs_max": 3.0, "every_n_steps": 4}])
def test_the_probe_switched_on_is_the_same_probe_in_both(options):
    """TRL's ``parity_probe=True`` and verl's ``tim.probe.enable=true`` run the same ParityProbeConfig: the core's
    limits for those not given (kl_k3 1e-3), a limit given null off."""
    verl_options = {("kl_k3" if k == "kl_k3_max" else k): v for k, v in options.items()}
    trl = TIMConfig(parity_probe=True, parity_probe_options=options)
    expected = ParityProbeConfig(**options)  # the core, directly
    # what translate.pipeline_config hands TRL's pipeline
    assert (trl.parity_probe_options if trl.parity_probe else None) == expected
    assert _verl_probe(enable=True, **verl_options) == expected == probe_config(True, options)
    # off: None in both, whatever limits are given
    trl_off = TIMConfig(parity_probe=False, parity_probe_options=options)
    assert (trl_off.parity_probe_options if trl_off.parity_probe else None) is None
    assert _verl_probe(enable=False, **verl_options) is None


def test_a_limit_without_enable_still_switches_the_verl_probe_on_alone():
    """verl's older spelling keeps its meaning: a limit set without ``tim.probe.enable`` runs only that limit."""
    assert _verl_probe(abs_diff_max=0.5) == ParityProbeConfig(kl_k3_max=None, abs_diff_max=0.5)
    assert _verl_probe(kl_k3=1e-2) == ParityProbeConfig(kl_k3_max=1e-2)
    assert _verl_probe() is None and _verl_probe(action="stop") is None
    # the settings the driver hands the workers read back the same probe
    tim = TIMVerlConfig.from_node({"monitor": {"enable": True}, "probe": {"enable": True, "abs_diff_max": 0.5}})
    assert TIMVerlConfig.from_node(tim.to_dict()) == tim


def test_an_enabled_probe_with_every_limit_null_is_refused_in_both():
    with pytest.raises(ValueError, match=r"every threshold is None"):
        TIMConfig(parity_probe=True, parity_probe_options={"kl_k3_max": None})
    with pytest.raises(ValueError, match=r"tim.probe=.* is invalid: every threshold is None.*Fix: \+\+tim.probe"):
        _verl_probe(enable=True, kl_k3=None)


DEPENDENCIES = [
    ("probe_needs_monitor", {"monitor": False, "parity_probe": True},
     {"probe": {"enable": True}}),
    ("k3_needs_monitor", {"monitor": False, "lr_decay": True, "lr_decay_options": {"signals": ["k3"]}},
     {"lr_decay": {"enable": True, "options": {"signals": ["k3"]}}}),
    ("strict_needs_audit", {"parity_audit": False, "parity_strict": True},
     {"parity": {"audit": False, "strict": True}}),
]


@pytest.mark.parametrize("rule, trl, verl", DEPENDENCIES, ids=[d[0] for d in DEPENDENCIES])
def test_a_combination_one_adapter_refuses_the_other_refuses_too(rule, trl, verl):
    text = DEPENDENCY_RULES[rule]
    with pytest.raises(ValueError, match="Fix: ") as trl_err:
        TIMConfig(**trl)
    with pytest.raises(ValueError, match="Fix: ") as verl_err:
        TIMVerlConfig.from_node(verl)
    assert text in str(trl_err.value) and text in str(verl_err.value)
    # the same settings with the dependency met: taken by both
    trl_fixed = {**trl, **({"parity_audit": True} if rule == "strict_needs_audit" else {"monitor": True})}
    verl_fixed = {**verl, **({"parity": {"audit": True, "strict": True}} if rule == "strict_needs_audit"
                             else {"monitor": {"enable": True}})}
    TIMConfig(**trl_fixed)
    TIMVerlConfig.from_node(verl_fixed)
