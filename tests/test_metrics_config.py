"""The monitor's settings: the one check of ``ratio_band`` (also meant for the adapters' config fields) and
``compile``; bad values fail early with the value, the rule and the fix."""

from __future__ import annotations

import math

import pytest
import torch

from tim_plugins.metrics import DEFAULT_RATIO_BAND, MismatchMonitor, check_ratio_band


@pytest.mark.parametrize("band", [(0.5, 2.0), [0.9, 1.1], (1e-9, 1e9), (0.5, 2)])
def test_valid_bands_come_back_as_float_pairs(band):
    lo, hi = check_ratio_band(band)
    assert (lo, hi) == (float(band[0]), float(band[1])) and type(lo) is type(hi) is float


@pytest.mark.parametrize("band", [(2.0, 0.5), (1.0, 2.0), (0.5, 1.0), (0.0, 2.0), (0.5, math.inf), (0.5, math.nan),
                                  (0.5,), (0.5, 2.0, 3.0), "ab", None, ("a", 2.0), ("0.5", "2.0"), (False, 2.0),
                                  0.5])
def test_invalid_bands_quote_where_the_value_the_rule_and_the_fix(band):
    with pytest.raises(ValueError) as err:
        check_ratio_band(band, where="tim.monitor.ratio_band", fix="+tim.monitor.ratio_band=[0.5,2.0]")
    text = str(err.value)
    assert text.startswith(f"tim.monitor.ratio_band={band!r} is invalid")
    assert "two numbers (lo, hi) with 0 < lo < 1 < hi < inf" in text and text.endswith("Fix: e.g. +tim.monitor.ratio_band=[0.5,2.0]")


def test_the_monitor_checks_its_settings_with_the_same_rule():
    assert MismatchMonitor().ratio_band == DEFAULT_RATIO_BAND
    mon = MismatchMonitor(ratio_band=[0.8, 1.25])
    assert mon.ratio_band == (0.8, 1.25)
    with pytest.raises(ValueError, match=r"ratio_band=\(1\.5, 3\.0\) is invalid"):
        mon.ratio_band = (1.5, 3.0)
    assert mon.ratio_band == (0.8, 1.25)  # a refused value changes nothing
    with pytest.raises(ValueError, match=r"compile='yes' is invalid: use True, False or 'auto'"):
        MismatchMonitor(compile="yes")


@pytest.mark.parametrize("band", [(0.5, 2.0), ("0.5", "2.0"), (True, 2.0), [0.8, 1.25], (0.5, 2, 3)])
def test_the_adapters_configs_and_the_monitor_accept_the_same_bands(band):
    """TIMConfig (TRL) and the monitor take a band exactly when ``check_ratio_band`` does, with the same value."""
    from integrations.trl.config import TIMConfig

    try:
        want = check_ratio_band(band)
    except ValueError:
        want = None
    for make in (lambda: MismatchMonitor(ratio_band=band).ratio_band, lambda: TIMConfig(ratio_band=band).ratio_band):
        if want is None:
            with pytest.raises(ValueError, match="ratio_band=.* is invalid: it must be two numbers"):
                make()
        else:
            assert make() == want


def test_a_resumed_monitor_keeps_its_configured_band():
    """A run resumed with another ``ratio_band`` counts with the one it was given; the saved statistics carry on."""
    torch.manual_seed(0)
    rollout = -torch.rand(4, 9) * 3
    train = rollout + torch.randn(4, 9) * 0.3
    saved = MismatchMonitor(compile=False)
    saved.update(rollout, train)
    resumed = MismatchMonitor(ratio_band=(0.8, 1.25), compile=False)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.ratio_band == (0.8, 1.25)
    resumed.update(rollout, train)
    rho = torch.exp((train - rollout).double())
    outside = ((rho < 0.5) | (rho > 2.0)).sum() + ((rho < 0.8) | (rho > 1.25)).sum()  # the saved batch, then the new
    got = resumed.compute()
    assert got["tim/seq/count"] == 2 * rollout.shape[0]
    assert got["tim/token/ratio_outside_frac"] == pytest.approx(outside.item() / (2 * rollout.numel()), abs=1e-12)
