"""A misspelt TIMConfig field: a TypeError that names it and the field meant (not Python's bare "unexpected keyword
argument"), while every valid construction, dataclasses.replace and the signature stay the dataclass's own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tim_plugins.integrations.trl import TIMConfig

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
    with pytest.raises(ValueError, match="must be True or False"):  # its own value checks still run
        TIMConfig(monitor="yes")
