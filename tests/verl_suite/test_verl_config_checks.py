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
