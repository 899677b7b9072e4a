"""The report's figures do not mislead: what an axis leaves out is said on the figure with naive counts, printed
values stay inside their panel (measured on the drawn figure), per-step axes do not zoom into noise, a series at
exactly 0 stays visible, log-prob axes carry their unit, and the run's timings add up.

Each figure function returns PNG bytes; the tests keep the matplotlib Figure it saved (``png_bytes`` wrapped)
and read the drawn artists: limits, texts and their pixel extents, histogram heights."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

import report_reference as ref  # noqa: E402
import tim_plugins.report.figures as figures  # noqa: E402
from tim_plugins.dump import TokenDumper  # noqa: E402
from tim_plugins.report import build_report  # noqa: E402
from tim_plugins.report.health import K3_HEALTHY_MAX, LOG2, RULES  # noqa: E402


@pytest.fixture
def drawn(monkeypatch):
    """The Figures the figure functions save, in order."""
    kept = []
    save = figures.png_bytes

    def keep(fig):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        png = save(fig)  # closes it: a fresh canvas keeps it drawable for the test, with the saved layout
        FigureCanvasAgg(fig).draw()
        kept.append(fig)
        return png

    monkeypatch.setattr(figures, "png_bytes", keep)
    return kept


def _step_counts(ax, k: int = 0) -> np.ndarray:
    """Bin heights of the k-th step histogram (vertices: (x0, 0), (x0, n0), (x1, n0), (x1, n1), ...)."""
    xy = ax.patches[k].get_xy()
    return xy[1:-1:2, 1]


def test_ratio_histogram_zooms_on_the_bulk_says_what_lies_beyond_and_shows_every_token_beside(drawn):
    rng = np.random.default_rng(0)
    d = np.concatenate([rng.normal(0, 0.01, 20000), [-5.0, -4.0, 3.0]])
    figures.ratio_distribution(ref.rho_source({"a": d}))
    zoom, full = drawn[0].axes
    qlo, qhi = np.quantile(d, figures.RHO_QUANTILES)
    half = (qhi - qlo) / 2
    lo, hi = math.exp(qlo - half), math.exp(qhi + half)  # the bulk's window, widened by half its width
    assert zoom.get_xlim() == pytest.approx((lo, hi))
    rho = np.exp(d)
    below, above = int((rho < lo).sum()), int((rho > hi).sum())
    assert below >= 2 and above >= 1
    note = " ".join(zoom.get_title(loc="left").split())
    assert f"{below} of the 20003 tokens lie left of it (ρ < {lo:.3g}), {above} right (ρ > {hi:.3g})" in note
    inside = (rho >= lo) & (rho <= hi)
    naive, _ = np.histogram(rho[inside], bins=np.linspace(lo, hi, 80))
    np.testing.assert_array_equal(_step_counts(zoom), naive)  # nothing piled into the end bins
    # Every token on the full-range log axis beside it, with the true extremes named.
    assert full.get_xscale() == "log" and full.get_xlim() == pytest.approx((math.exp(-5.0), math.exp(3.0)))
    assert _step_counts(full).sum() == d.size
    title = " ".join(full.get_title(loc="left").split())
    assert f"ρ from {math.exp(-5.0):.3g} to {math.exp(3.0):.3g}" in title


@pytest.mark.parametrize("extremes", [(-40.0,), (-18.0, 18.0), (-60.0, 45.0)])
def test_the_full_range_axis_of_tens_of_decades_gets_a_few_ticks(drawn, extremes):
    """A token the trainer scores 40 nats below the rollout spans 17 decades of ρ (the tick thinning once looped
    forever there: decades alone were more than 7 and kept them all): at most 7 ticks, inside the axis, ascending,
    every token still drawn."""
    rng = np.random.default_rng(3)
    d = np.concatenate([rng.normal(0, 0.01, 2000), extremes])
    figures.ratio_distribution(ref.rho_source({"a": d}))
    full = drawn[0].axes[-1]
    lo, hi = full.get_xlim()
    assert (lo, hi) == pytest.approx((math.exp(d.min()), math.exp(d.max())))
    ticks = list(full.get_xticks())
    assert 2 <= len(ticks) <= 7 and ticks == sorted(ticks) and all(lo <= t <= hi for t in ticks), ticks
    assert _step_counts(full).sum() == d.size


def test_ratio_histogram_draws_every_token_when_the_full_range_is_not_much_wider(drawn):
    rng = np.random.default_rng(1)
    d = np.concatenate([rng.normal(0, 0.01, 5000), [0.05, -0.045]])  # beyond the quantiles, but close
    figures.ratio_distribution(ref.rho_source({"a": d, "b": d * 0.5}))
    assert len(drawn[0].axes) == 1
    ax = drawn[0].axes[0]
    assert ax.get_xlim() == pytest.approx((math.exp(d.min()), math.exp(d.max())))
    assert sum(_step_counts(ax, k).sum() for k in range(2)) == 2 * d.size
    assert f"Every one of the {2 * d.size} tokens drawn: ρ from {math.exp(d.min()):.4g} to {math.exp(d.max()):.4g}" \
        in " ".join(ax.get_title(loc="left").split())


def test_abs_diff_histogram_counts_the_exact_zeros_a_log_axis_cannot_show(drawn):
    rng = np.random.default_rng(2)
    d = rng.normal(0, 1e-3, 500)
    d[:37] = 0.0
    figures.abs_diff_histogram(*ref.abs_histograms({"bf16": d, "exact": np.zeros(20)}))
    ax = drawn[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["bf16 (+37 tokens at exactly 0)", "exact: all 20 tokens at exactly 0"]
    assert "(nats)" in ax.get_xlabel() and "no place on a log axis" in ax.get_xlabel()
    assert _step_counts(ax).sum() == 500 - 37


def test_comparison_bar_values_are_printed_inside_their_panel_frames(drawn):
    names = ["hf-bf16", "hf-fp16", "hf-fp32", "hf-bf16+fp32-head", "hf-bf16+min-p=0.001", "vllm", "exact"]
    panels = [
        ("k3", [7.857e-5, 1.291e-6, 1.734e-13, 5.325e-5, 7.987e-5, 6.554e-5, 0.0], (None, K3_HEALTHY_MAX), True),
        ("KL", [7.8e-5, 1.3e-6, 1.5e-13, 5.4e-5, 1.417e-4, 6.9e-5, 0.0], (None, K3_HEALTHY_MAX), True),
        ("p99", [0.0487, 0.0065, 1.9e-6, 0.045, 0.0487, 0.042, 0.0], (None, LOG2), True),
        ("tokens / s", [85.0, 88.9, 178.9, 191.7, 368.1, 406.2, 1044.0], None, False),
    ]
    figures.comparison_bars(names, panels)
    fig = drawn[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    checked = 0
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        for text in ax.texts:
            box = text.get_window_extent(renderer)
            assert frame.x0 - 0.5 <= box.x0 and box.x1 <= frame.x1 + 0.5, (ax.get_title(), text.get_text())
            checked += 1
    assert checked == 4 * len(names)  # 6 values and "exactly 0" on the log panels, 7 values on the last


def test_drift_by_position_keeps_a_setting_at_exactly_zero_visible(drawn):
    pos = np.tile(np.arange(40), 10)
    rng = np.random.default_rng(3)
    small = np.abs(rng.normal(0, 1e-2, pos.size))
    # Linear axis (one setting, plus one at exactly 0): the zero line lies strictly inside the frame.
    figures.drift_by_position({"bf16": ref.position_profile(small, pos),
                               "exact": ref.position_profile(np.zeros(pos.size), pos)})
    ax = drawn[0].axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] < 0 < ax.get_ylim()[1]
    zero = next(line for line in ax.get_lines() if line.get_label().startswith("exact"))
    assert zero.get_label() == "exact (exactly 0 at every position)" and not np.any(zero.get_ydata())
    assert "(nats)" in ax.get_ylabel()
    # Settings four decades apart: a log axis (a linear one would flatten fp32 onto 0), the zero setting drawn
    # along the bottom edge and named so.
    figures.drift_by_position({"bf16": ref.position_profile(small, pos), "fp32": ref.position_profile(small * 1e-4, pos),
                               "exact": ref.position_profile(np.zeros(pos.size), pos)})
    ax = drawn[1].axes[0]
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    fp32 = lines["fp32"].get_ydata()
    assert np.nanmax(fp32) < 1e-5 and ax.get_ylim()[0] < np.nanmin(fp32)
    zero = lines["exact: exactly 0 (drawn on the bottom edge)"]
    ys = zero.get_transform().transform(np.column_stack([zero.get_xdata(), zero.get_ydata()]))[:, 1]
    frame = ax.get_window_extent()
    assert np.all((ys > frame.y0) & (ys < frame.y1))


def test_step_panels_do_not_zoom_into_noise():
    steps = np.arange(1, 11, dtype=float)
    ess = 0.9999 + 2e-5 * np.sin(steps)  # a healthy ESS whose step-to-step noise is 1e-5
    k3 = 5e-5 * (1 + 0.3 * np.cos(steps))
    assert figures._series_limits(ess, (0.5, None), False, (0.0, 1.05)) == (0.0, 1.05)
    lo, hi = figures._series_limits(k3, (None, K3_HEALTHY_MAX), True, None)
    assert lo <= k3.min() / 2 and hi >= K3_HEALTHY_MAX  # reaches the healthy limit
    lo, hi = figures._series_limits(np.full(10, 0.1), (None, LOG2), False, None)
    assert lo == 0.0 and hi > LOG2
    lo, hi = figures._series_limits(np.full(10, 3e-4), None, True, None)
    assert hi / lo >= 10 * (1 - 1e-12)  # at least a decade


def _synthetic_run(tmp_path, scale: float = 1e-3):
    """A training run folder: per-step dump with a small mismatch, logged k3, a timing block."""
    g = torch.Generator().manual_seed(4)
    run = tmp_path / "run"
    dumper = TokenDumper(out_dir=str(run / "dump"), sample_rate=1.0)
    history = []
    for step in range(1, 9):
        rollout = -torch.rand(16, 24, generator=g) * 4
        train = rollout + scale * torch.randn(16, 24, generator=g)
        dumper.write(step, rollout, train, torch.ones(16, 24, dtype=torch.bool), torch.randint(0, 383, (16, 24)))
        history.append({"step": step, "loss": 0.0, "reward": 0.1 * step, "tim/tokens": 384.0,
                        "tim/token/kl_k3": 1e-7 * (1 + 0.1 * step)})
    timing = {"total_seconds": 100.0, "setup_seconds": 10.0, "train_seconds": 90.0, "rollout_seconds": 60.0,
              "train_other_seconds": 30.0, "rollout_tokens": 3072}
    summary = {"kind": "training", "title": "synthetic run", "settings": {"steps": 8, "model": "/m"},
               "log_history": history, "findings": [], "timing": timing, "dumps": {"all steps": "dump"},
               "attached": {"rollout_source": "hf", "hooks": [], "config": {}}}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_training_report_figures_and_timings(drawn, tmp_path):
    html = build_report(_synthetic_run(tmp_path)).read_text()
    series = drawn[0]
    by_title = {ax.get_title(): ax for ax in series.axes if ax.get_visible()}
    ess = by_title["ESS of ρ (no IS correction applied)"]
    assert ess.get_ylim() == (0.0, 1.05)  # the ESS of a 1e-3 mismatch is ~0.99999: not zoomed into
    warn = RULES["tim/is/ess"].act_lo
    assert any(np.allclose(line.get_ydata(), warn) for line in ess.get_lines())
    assert any(t.get_text().strip() == f"warning: ESS < {warn:g}" for t in ess.texts)  # not a verl run
    assert by_title["k3 per token (nats)"].get_ylim()[1] >= K3_HEALTHY_MAX
    assert by_title["max |sequence log-ratio| (nats)"].get_ylim()[0] == 0.0
    # no LR decay in the logged steps: no flat panel at 1, one line under the figure instead
    assert not [t for t in by_title if "LR scale" in t]
    assert "The LR scale stays 1 at every step (lr_decay off, or it never fired): no panel." in html
    # Every axis that shows a log-prob difference names its unit.
    labelled = 0
    for fig in drawn:
        for ax in fig.axes:
            for label in (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()):
                if "log p" in label or "log-ratio" in label:
                    assert "(nats)" in label, label
                    labelled += 1
    assert labelled >= 6
    # Timings: the parts add up and the page says the rollouts are inside the loop.
    assert "of which rollouts" in html and "The parts add up: total = set-up + GRPO loop" in html
    assert "rollout time is part of the loop&#x27;s time, not added to it" in html
    assert "<td class='num'>60</td>" in html and "<td class='num'>30</td>" in html


@pytest.mark.parametrize("rollout, train", [(-800.5, -0.5), (-700.5, -0.5), (-0.5, -800.5)])
def test_a_token_past_float64s_ratio_range_is_reported_not_raised(drawn, tmp_path, rollout, train):
    """One token whose log-ratio d is ±800 (ρ = e^800 is past float64; e^-800 is 0, which a log axis cannot hold)
    or 700 (its k3 ~ 1e301): the report renders; the ratio figure's full-range axis ends at e^±700 and says how
    many tokens lie beyond it, writing their ρ as a power of e."""
    g = torch.Generator().manual_seed(0)
    r = -torch.rand(8, 30, generator=g) * 3
    t = r + 0.05 * torch.randn(8, 30, generator=g)
    r[0, 3], t[0, 3] = rollout, train
    dumper = TokenDumper(out_dir=str(tmp_path), sample_rate=1.0)
    dumper.write(1, r, t, torch.ones(8, 30, dtype=torch.bool), torch.randint(0, 383, (8, 30), generator=g))
    build_report(tmp_path, threads=1)
    d = float(torch.tensor(train) - torch.tensor(rollout))
    titles = [" ".join(ax.get_title(loc="left").split()) for fig in drawn for ax in fig.axes]
    (full,) = [x for x in titles if x.startswith("Every token: ρ from")]
    if abs(d) > figures.D_DRAWN:
        end = f"e^{d:.0f}"
        assert (f"to {end}" if d > 0 else f"from {end}") in full and "1 of them lie beyond e^±700" in full, full
    else:
        assert f"to {math.exp(d):.3g}" in full and "beyond" not in full, full
