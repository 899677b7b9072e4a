"""A misspelt TIMConfig field: a TypeError that names it and the field meant (not Python's bare "unexpected keyword
argument"), while every valid construction, dataclasses.replace and the signature stay the dataclass's own. A bad value of
any field: a ValueError that names the field the user set, its rule or valid values, and a fix in that field's own
spelling."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from tim_plugins.integrations.trl import TIMConfig
from tim_plugins.lag0_probe import Lag0ProbeConfig

FIELDS = [f.name for f in dataclasses.fields(TIMConfig)]


@pytest.mark.parametrize("typo,meant", [
    ("safe_vocb", "safe_vocab"),
    ("is_corection", "is_correction"),
    ("paritystrict", "parity_strict"),
    ("lr_decay_option", "lr_decay_options"),
    ("Monitor", "monitor"),
])
def test_a_misspelt_field_names_itself_and_the_field_meant(typo, meant):
    with pytest.raises(TypeError) as err:
        TIMConfig(**{typo: True})
    msg = str(err.value)
    assert f"'{typo}'" in msg and f"did you mean '{meant}'?" in msg
    assert "TIMConfig.help()" in msg


def test_every_field_is_found_from_a_one_letter_slip():
    """For each field, the name with one letter dropped (at every position) suggests that field."""
    for name in FIELDS:
        for i in range(1, len(name)):
            typo = name[:i] + name[i + 1:]
            if typo in FIELDS or typo.strip("_") != typo:
                continue
            with pytest.raises(TypeError, match=rf"'{typo}' \(did you mean '{name}'\?\)"):
                TIMConfig(**{typo: 1})


def test_a_name_like_no_field_lists_the_fields():
    with pytest.raises(TypeError) as err:
        TIMConfig(temperature=0.7)
    msg = str(err.value)
    assert "'temperature'" in msg and "did you mean" not in msg
    assert all(name in msg for name in FIELDS)


def test_valid_constructions_are_the_dataclasses_own():
    cfg = TIMConfig(safe_vocab=True, is_correction="token_tis")
    assert (cfg.safe_vocab, cfg.is_correction) == (True, "token_tis")
    assert dataclasses.replace(cfg, monitor=False).monitor is False
    assert list(inspect.signature(TIMConfig).parameters) == FIELDS
    assert TIMConfig(True).enabled is True  # positional arguments still reach the dataclass
    with pytest.raises(ValueError, match="must be true or false"):  # its own value checks still run
        TIMConfig(monitor="yes")


def _default(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _bad_values():
    """{field: (the TIMConfig keywords, what the message must say of the rule or the valid values, the fix)} for every
    field: the fix names the field set (for an option group: the option, at the core class's own default)."""
    from tim_plugins.causes import CauseConfig
    from tim_plugins.corrections import CorrectionConfig
    from tim_plugins.dump import DumpConfig
    from tim_plugins.integrations.trl.config import IS_CORRECTION_CHOICES, ROLLOUT_CHOICES
    from tim_plugins.lr_control import LRDecayConfig
    from tim_plugins.parity.probe import ParityProbeConfig
    from tim_plugins.rollout.inject import MAX_SCALE, InjectorConfig
    from tim_plugins.weight_sync import SyncCheckConfig

    switches = {f.name: ({f.name: "yes"}, "must be true or false", f"{f.name}=True or {f.name}=False")
                for f in dataclasses.fields(TIMConfig) if f.type == "bool"}
    return {**switches,
            "ratio_band": ({"ratio_band": (2.0, 3.0)}, "0 < lo < 1 < hi", "ratio_band=(0.5, 2.0)"),
            "dump_dir": ({"dump_dir": 3}, "must be a folder path", "dump_dir='/path/to/tim_dump'"),
            "dump_options": ({"dump_options": {"sample_rate": 2}}, "it must be in (0, 1]",
                             f"dump_options={{'sample_rate': {_default(DumpConfig, 'sample_rate')!r}}}"),
            "rollout": ({"rollout": "vllm"}, f"must be one of {ROLLOUT_CHOICES}", "rollout='auto'"),
            "inject_options": ({"rollout": "inject", "inject_options": {"scale": -1.0}},
                               f"must be a number in [0, {MAX_SCALE:g}]",
                               f"inject_options={{'scale': {_default(InjectorConfig, 'scale')!r}}}"),
            "safe_vocab_min_p": ({"safe_vocab_min_p": 1.5}, "must be a number in [0, 1)", "safe_vocab_min_p=1e-05"),
            "lr_decay_options": ({"lr_decay_options": {"window": 0}}, "must be an integer >= 1",
                                 f"lr_decay_options={{'window': {_default(LRDecayConfig, 'window')!r}}}"),
            "lr_decay_signals": ({"lr_decay_signals": ("loss",)}, "extra signals are ('kl_k3', 'grad_norm')",
                                 "lr_decay_signals=('kl_k3',)"),
            "parity_probe_options": ({"parity_probe": True, "parity_probe_options": {"action": "halt"}}, "action",
                                     f"parity_probe_options={{'action': {_default(ParityProbeConfig, 'action')!r}}}"),
            "is_correction": ({"is_correction": "tis"}, "unknown part(s) ['tis']",
                              f"is_correction='token_tis' (one of {IS_CORRECTION_CHOICES}"),
            "causes_options": ({"causes_options": {"confident_p": 1.5}}, "must be in (0, 1)",
                               f"causes_options={{'confident_p': {_default(CauseConfig, 'confident_p')!r}}}"),
            "sync_check_options": ({"sync_check_options": {"every_n_syncs": 0}}, "must be an integer >= 1",
                                   "sync_check_options={'every_n_syncs': "
                                   f"{_default(SyncCheckConfig, 'every_n_syncs')!r}}}"),
            "sync_probe_options": ({"sync_probe_options": {"unchanged_ratio": 1.5}}, "must be in (0, 1)",
                                   "sync_probe_options={'unchanged_ratio': "
                                   f"{_default(Lag0ProbeConfig, 'unchanged_ratio')!r}}}"),
            "is_correction_options": ({"is_correction": "seq_tis", "is_correction_options": {"seq_clip": 0}},
                                      "seq_clip=0",
                                      f"is_correction_options={{'seq_clip': {_default(CorrectionConfig, 'seq_clip')!r}}}"),
            }


def test_every_field_has_a_bad_value_below():
    assert sorted(_bad_values()) == sorted(FIELDS)


@pytest.mark.parametrize("name", FIELDS)
def test_a_bad_value_names_the_field_set_its_rule_and_a_fix_in_its_spelling(name):
    kwargs, rule, fix = _bad_values()[name]
    with pytest.raises(ValueError) as err:
        TIMConfig(**kwargs)
    msg = str(err.value)
    assert msg.startswith(f"TIMConfig.{name}={kwargs[name]!r} is invalid"), msg
    said, _, fixed = msg.partition(" Fix: ")
    assert rule in said, msg
    assert fix in fixed, msg
    # the fix is about this field, never another one's options (is_correction='tis' once pointed at
    # CorrectionConfig's fields)
    other = [f for f in FIELDS if f != name and re.search(rf"(?<![\w.]){f}=", fixed)
             and not (name == "inject_options" and f == "rollout")]
    assert not other, msg
