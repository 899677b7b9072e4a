"""One config schema: each capability's options are one core dataclass, which TIMConfig (TRL) and verl's ``tim.*``
settings both hold or mirror, so an option has one name, default, help text and rule in both adapters; no untyped
``*_options: dict`` field is left, and the LR-decay signal spellings live in one table."""

from __future__ import annotations

import dataclasses
import typing

import pytest

# Neither adapter's settings module imports its framework: these checks run without TRL and without verl.
from tim_plugins.corrections import CorrectionConfig
from tim_plugins.dump import DumpConfig
from tim_plugins.integrations.trl.config import TIMConfig
from tim_plugins.integrations.verl.config import DumpSettings, ProbeSettings, TIMVerlConfig
from tim_plugins.lr_control import SIGNAL_ALIASES, LRDecayConfig
from tim_plugins.parity.probe import ParityProbeConfig
from tim_plugins.pipeline import PipelineConfig
from tim_plugins.rollout.inject import InjectorConfig

OPTION_GROUPS = {"dump_options": DumpConfig, "inject_options": InjectorConfig, "lr_decay_options": LRDecayConfig,
                 "parity_probe_options": ParityProbeConfig, "is_correction_options": CorrectionConfig}


def _settings_classes():
    return [TIMConfig, TIMVerlConfig, *TIMVerlConfig._SECTIONS.values(), PipelineConfig]


def test_no_config_field_is_an_untyped_dict():
    for cls in _settings_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert hints[f.name] not in (dict, typing.Any), (cls.__name__, f.name, hints[f.name])


def test_the_pipeline_s_compile_takes_what_the_monitor_takes():
    """PipelineConfig.compile is MismatchMonitor(compile=...): its type lists exactly the values the monitor
    accepts, and the pipeline's monitors run with it."""
    from tim_plugins.metrics import MismatchMonitor
    from tim_plugins.pipeline import StepPipeline

    hint = typing.get_type_hints(PipelineConfig)["compile"]
    allowed = {a for arg in typing.get_args(hint) for a in (typing.get_args(arg) or (True, False))}
    assert allowed == {True, False, "auto"}
    for value in allowed:
        assert MismatchMonitor(compile=value).compile == value
        assert StepPipeline(PipelineConfig(monitor=True, compile=value)).monitor.compile == value
    with pytest.raises(ValueError, match=r"compile='yes' is invalid"):
        MismatchMonitor(compile="yes")


def test_each_trl_option_group_is_the_core_dataclass_from_a_dict_or_itself():
    values = {"dump_options": {"sample_rate": 0.5}, "inject_options": {"scale": 0.2, "tau": 0.3},
              "lr_decay_options": {"window": 3, "signals": "k3"}, "parity_probe_options": {"kl_k3_max": 0.1},
              "is_correction_options": {"token_clip": 3.0}}
    cfg = TIMConfig(dump_dir="/tmp/d", rollout="inject", is_correction="token_mis", **values)
    for name, core in OPTION_GROUPS.items():
        got = getattr(cfg, name)
        assert type(got) is core, name
        for key, value in values[name].items():
            expected = getattr(core(**({"out_dir": "x"} if core is DumpConfig else {}),
                                    **({"mode": "token_mis"} if core is CorrectionConfig else {}),
                                    **{key: value}), key)
            assert getattr(got, key) == expected, (name, key)
    assert cfg.dump_options.out_dir == "/tmp/d" and cfg.is_correction_options.mode == "token_mis"
    assert cfg.lr_decay_options.signals == ("kl_k3",)  # the one alias table: k3 -> kl_k3
    again = TIMConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})  # instances pass through
    assert again == cfg
    defaults = TIMConfig()
    assert defaults.lr_decay_options == LRDecayConfig() and defaults.parity_probe_options == ParityProbeConfig()
    assert defaults.inject_options == InjectorConfig() and defaults.is_correction_options is None


def test_lr_decay_options_are_one_class_with_one_rule_in_both_adapters():
    verl = TIMVerlConfig.from_node({"lr_decay": {"enable": True, "options": {"window": 3, "signals": ["grad_norm"]}}})
    trl = TIMConfig(lr_decay=True, lr_decay_options={"window": 3, "signals": ["grad_norm"]})
    assert verl.lr_decay.options == trl.lr_decay_options == LRDecayConfig(window=3, signals=("grad_norm",))
    with pytest.raises(ValueError) as core:
        LRDecayConfig(decay_factor=1.5)
    for build in (lambda: TIMConfig(lr_decay_options={"decay_factor": 1.5}),
                  lambda: TIMVerlConfig.from_node({"lr_decay": {"options": {"decay_factor": 1.5}}})):
        with pytest.raises(ValueError) as err:
            build()
        assert str(core.value) in str(err.value) and "1.5" in str(err.value) and "Fix:" in str(err.value)
    for build in (lambda: TIMConfig(lr_decay_options={"windw": 3}),
                  lambda: TIMVerlConfig.from_node({"lr_decay": {"options": {"windw": 3}}})):
        with pytest.raises(ValueError, match=r"unknown option\(s\) 'windw' \(did you mean 'window'\?\)"):
            build()


def test_probe_and_dump_settings_in_verl_share_the_core_help_default_and_rule():
    core_probe = {f.name: f for f in dataclasses.fields(ParityProbeConfig)}
    names = {"kl_k3": "kl_k3_max", "abs_diff_max": "abs_diff_max", "seq_log_ratio_abs_max": "seq_log_ratio_abs_max",
             "action": "action", "every_n_steps": "every_n_steps", "patience": "patience"}
    for f in dataclasses.fields(ProbeSettings):
        if f.name == "enable":  # the switch, TIMConfig.parity_probe (tests/test_shared_schema.py)
            continue
        core = core_probe[names[f.name]]
        assert f.metadata["help"] == core.metadata["help"], f.name
        assert f.default == (None if f.name == "kl_k3" else core.default), f.name  # verl: no limit = probe off
    for bad in ({"patience": 0}, {"action": "explode"}, {"kl_k3_max": float("inf")}):
        with pytest.raises(ValueError) as core_err:
            ParityProbeConfig(**bad)
        rule = str(core_err.value).split(" is invalid: ")[1]
        verl_name = {v: k for k, v in names.items()}[next(iter(bad))]
        with pytest.raises(ValueError) as err:
            ProbeSettings(**{verl_name: next(iter(bad.values()))})
        assert f"tim.probe.{verl_name}=" in str(err.value) and rule in str(err.value)
    core_dump = {f.name: f for f in dataclasses.fields(DumpConfig)}
    for f in dataclasses.fields(DumpSettings):
        if f.name != "dir":
            assert (f.default, f.metadata["help"]) == (core_dump[f.name].default, core_dump[f.name].metadata["help"])
    assert DumpSettings(dir="/tmp/d", sample_rate=0.5).config() == TIMConfig(
        dump_dir="/tmp/d", dump_options={"sample_rate": 0.5}).dump_options


def test_signal_spellings_live_in_one_table():
    from tim_plugins.apps import lr_replay
    from tim_plugins.integrations.trl.config import LR_DECAY_SIGNALS

    assert set(LR_DECAY_SIGNALS) == set(SIGNAL_ALIASES)
    for spelling, name in SIGNAL_ALIASES.items():
        assert LRDecayConfig(signals=(spelling,)).signals == (name,)
        assert TIMConfig(lr_decay_signals=(spelling,)).lr_decay_options.signals == (name,)
    assert set(lr_replay.K3_COLUMNS) == {a for a, n in SIGNAL_ALIASES.items() if n == "kl_k3"}
    assert set(lr_replay.GRAD_NORM_COLUMNS) == {a for a, n in SIGNAL_ALIASES.items() if n == "grad_norm"}
    with pytest.raises(ValueError, match="disagree"):
        TIMConfig(lr_decay_signals=("k3",), lr_decay_options={"signals": ("grad_norm",)})


def test_options_given_to_a_capability_that_is_off_fail_early():
    with pytest.raises(ValueError, match=r"inject_options=.* is invalid with rollout='auto'.* Fix: rollout='inject', or drop inject_options"):
        TIMConfig(inject_options={"scale": 0.1})
    with pytest.raises(ValueError, match=r"is_correction_options=.* is invalid with is_correction=None.* Fix: is_correction='token_tis'"):
        TIMConfig(is_correction_options={"token_clip": 3.0})


@pytest.mark.parametrize("group, value", [("causes_options", {"confident_p": 0.6}),
                                          ("sync_check_options", {"every_n_syncs": 3}),
                                          ("sync_probe_options", {"every_n_syncs": 2}),
                                          ("parity_probe_options", {"kl_k3_max": 0.1})])
@pytest.mark.parametrize("switch", ["monitor", "causes", "sync_check", "parity_probe"])
def test_options_of_a_feature_a_switch_leaves_off_are_warned_about(group, value, switch, caplog):
    """causes_options need monitor and causes; the sync check's and the server probe's options sync_check too; the
    live probe's options parity_probe (which needs the monitor: refused without). Options given with a switch they
    need off do nothing: one warning names them, the switch and the fix (verl's driver notes the same of its
    sections), and the config is built as given. The switches alone stay quiet (sync_check is on by default and
    needs causes, which may be off)."""
    import logging

    needs = {"causes_options": ("monitor", "causes"), "parity_probe_options": ("parity_probe",)}.get(
        group, ("monitor", "causes", "sync_check"))
    on = {"parity_probe": True} if switch != "parity_probe" and "parity_probe" in needs else {}
    if on and switch == "monitor":  # the probe without the monitor is refused outright
        with pytest.raises(ValueError, match="parity_probe=True with monitor=False is invalid"):
            TIMConfig(**on, **{switch: False, group: value})
        return
    with caplog.at_level(logging.WARNING, logger="tim_plugins.trl"):
        cfg = TIMConfig(**on, **{switch: False, group: value})
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert getattr(cfg, group) == dataclasses.replace(getattr(TIMConfig(), group), **value)
        TIMConfig(**on, **{switch: True, group: value})  # the fix
        TIMConfig(**on, **{switch: False})  # the switch alone
        TIMConfig(causes=False, sync_check=True)
        assert caplog.records == []
    if switch not in needs:
        assert warned == []
        return
    (line,) = warned
    assert line == (f"TIMConfig.{group}={value!r} while {switch}=False: this setting does nothing. "
                    f"Fix: {switch}=True")


def test_to_dict_is_plain_and_builds_the_same_config():
    import json

    cfg = TIMConfig(dump_dir="/tmp/d", dump_options={"seed": 3}, is_correction="icepop",
                    is_correction_options={"icepop_band": (0.4, 4.0)}, lr_decay=True, lr_decay_signals=("k3",))
    plain = json.loads(json.dumps(cfg.to_dict()))
    assert TIMConfig(**plain) == cfg
    assert "out_dir" not in plain["dump_options"] and "mode" not in plain["is_correction_options"]


def test_ratio_band_has_one_default_and_help_in_both_adapters():
    core = {f.name: f for f in dataclasses.fields(PipelineConfig)}["ratio_band"]
    trl = {f.name: f for f in dataclasses.fields(TIMConfig)}["ratio_band"]
    verl = {f.name: f for f in dataclasses.fields(TIMVerlConfig._SECTIONS["monitor"])}["ratio_band"]
    assert trl.default == verl.default == core.default
    assert trl.metadata["help"] == verl.metadata["help"] == core.metadata["help"]


def test_every_dump_option_reaches_verl():
    """verl's ``tim.dump.*`` options are generated from DumpConfig: a new dump option is a verl setting too."""
    core = {f.name: f for f in dataclasses.fields(DumpConfig) if f.name != "out_dir"}
    verl = {f.name: f for f in dataclasses.fields(DumpSettings) if f.name != "dir"}
    assert verl.keys() == core.keys()
    assert all(verl[k].default == core[k].default and verl[k].metadata["help"] == core[k].metadata["help"]
               for k in core)


def _wrong_value(kind: str):
    return {"bool": "flase", "float": "lots", "int": 1.5, "str": 3, "tuple": "0.5,2"}.get(kind.split("|")[0].strip())


def test_every_verl_setting_refuses_a_value_of_the_wrong_type():
    """Hydra hands values over as YAML typed them (``+tim.monitor.enable=flase`` is the truthy string 'flase'): every
    plain field of every ``tim.<section>`` is checked against its annotation, with the value and the fix."""
    checked, skipped, groups = 0, set(), set()
    for section, cls in TIMVerlConfig._SECTIONS.items():
        hints = typing.get_type_hints(cls)
        groups |= {(section, f.name) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
        for f in dataclasses.fields(cls):
            bad = _wrong_value(str(f.type))
            if bad is None:  # an option group (a core dataclass): its own checks
                skipped.add((section, f.name))
                continue
            with pytest.raises(ValueError) as err:
                TIMVerlConfig.from_node({section: {f.name: bad}})
            assert f"tim.{section}.{f.name}={bad!r}" in str(err.value) and "Fix:" in str(err.value), (section, f.name)
            checked += 1
    # only the option groups were left out: every plain field (none of an annotation _wrong_value lacks) was checked
    assert skipped == groups and groups
    assert checked == sum(len(dataclasses.fields(c)) for c in TIMVerlConfig._SECTIONS.values()) - len(groups)


def test_unknown_names_quote_each_refused_key_with_the_nearest_valid_one():
    from tim_plugins._config import unknown_names

    assert unknown_names({"min_pp": 1, "zzz": 2, "top_k": 3}, ["min_p", "top_k"]) == \
        "'min_pp' (did you mean 'min_p'?), 'zzz'"  # sorted; a valid key is not named; no near name, no guess
    assert unknown_names(["top_k"], ["top_k"]) == ""
