"""The report's per-token numbers as it computed them before the streaming queries (``tim_plugins.report.query``):
the whole dump read into memory (``read_dump``) and numpy / ``mismatch_metrics`` over it. The tests keep it as the
reference the queries must equal (to float rounding); the product no longer has it.

It also turns raw per-token arrays into the figures' inputs the way the figures themselves did before they took
aggregates (the figure tests draw from it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from tim_plugins.report.figures import PROB_EDGES, PROB_MIN_COUNT, RHO_QUANTILES, RhoSource, abs_diff_bins

_KEYS = ("step", "rank", "sequence", "position", "token_id", "rollout_logprob", "train_logprob")


@dataclass
class Tokens:
    """Valid rows of a dump (finite log-probs above the invalid-placeholder threshold, no key null), as numpy arrays;
    ``invalid_step``: the step of each invalid row that has one (the monitor's ``tim/invalid_tokens`` per step)."""

    step: np.ndarray
    rank: np.ndarray
    sequence: np.ndarray
    position: np.ndarray
    rollout: np.ndarray
    train: np.ndarray
    invalid: int
    invalid_step: np.ndarray

    @property
    def d(self) -> np.ndarray:
        return self.train - self.rollout

    @property
    def sequence_key(self) -> np.ndarray:
        return (self.step.astype(np.int64) << 40) + (self.rank.astype(np.int64) << 32) + self.sequence.astype(np.int64)

    @property
    def size(self) -> int:
        return int(self.rollout.size)


def load_tokens(dump_dir: str | Path) -> Tokens:
    from tim_plugins.dump import read_dump
    from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD

    table = read_dump(dump_dir)
    col = lambda name: table.column(name).to_numpy()  # noqa: E731
    null = lambda name: table.column(name).is_null().to_numpy()  # noqa: E731
    rollout, train = col("rollout_logprob").astype(np.float64), col("train_logprob").astype(np.float64)
    ok = (np.isfinite(rollout) & np.isfinite(train) & (rollout > INVALID_LOGPROB_THRESHOLD)
          & (train > INVALID_LOGPROB_THRESHOLD))
    for key in ("step", "rank", "sequence", "position"):  # a row without a key is invalid
        ok &= ~null(key)
    bad = ~ok & ~null("step")
    key = lambda name: table.column(name).filter(pa.array(ok)).to_numpy()  # noqa: E731
    return Tokens(key("step"), key("rank"), key("sequence"), key("position"), rollout[ok], train[ok],
                  int((~ok).sum()), table.column("step").filter(pa.array(bad)).to_numpy().astype(np.int64))


def _metrics_of(tokens: Tokens, sel: np.ndarray) -> dict:
    import torch

    from tim_plugins.metrics import mismatch_metrics

    _, row = np.unique(tokens.sequence_key[sel], return_inverse=True)
    pos = tokens.position[sel]
    shape = (int(row.max()) + 1, int(pos.max()) + 1) if row.size else (1, 1)  # no valid row: one masked-out cell
    rollout = torch.zeros(shape, dtype=torch.float64)
    train = torch.zeros(shape, dtype=torch.float64)
    mask = torch.zeros(shape, dtype=torch.bool)
    idx = (torch.from_numpy(row.astype(np.int64)), torch.from_numpy(pos.astype(np.int64)))
    rollout[idx] = torch.from_numpy(tokens.rollout[sel])
    train[idx] = torch.from_numpy(tokens.train[sel])
    mask[idx] = True
    rho = torch.exp(train - rollout).masked_fill(~mask, 0.0)
    return mismatch_metrics(rollout, train, mask, is_weights=rho)


def metrics_by_step(tokens: Tokens) -> tuple[np.ndarray, list[dict]]:
    """Every step with a row (valid or not): ``mismatch_metrics`` of its valid rows, its invalid rows counted."""
    steps = np.union1d(np.unique(tokens.step), np.unique(tokens.invalid_step))
    out = []
    for s in steps:
        m = _metrics_of(tokens, tokens.step == s)
        m["tim/invalid_tokens"] = float((tokens.invalid_step == s).sum())
        out.append(m)
    return steps, out


def overall_metrics(tokens: Tokens) -> dict:
    m = _metrics_of(tokens, np.ones(tokens.size, dtype=bool))
    m["tim/invalid_tokens"] = float(tokens.invalid_step.size)
    return m


def columns_from_dump(dump_dir: str | Path) -> dict[str, np.ndarray]:
    """The dump's columns (every row scored; rows in the dump's own order)."""
    from tim_plugins.dump import read_dump

    table = read_dump(dump_dir)
    return {k: table.column(k).to_numpy() for k in _KEYS}


def largest_disagreements(dump_dir, n: int = 15, context: int = 4) -> list[dict]:
    from tim_plugins.report.disagreements import largest_disagreements as from_columns

    return from_columns(columns_from_dump(dump_dir), n, context)


# ----------------------------------------------------------------------------- figures' inputs from arrays
def prob_curve(d: np.ndarray, lp: np.ndarray, quantile: bool) -> dict:
    """Per bin of 1 − p: tokens, Σ|d| and (bins of at least ``PROB_MIN_COUNT`` tokens) the p99 of |d|, binned as
    ``np.digitize`` then clip, the p99 by ``np.quantile``."""
    edges = PROB_EDGES
    q = np.clip(-np.expm1(lp), 1e-7, 1.0)
    idx = np.clip(np.digitize(q, edges) - 1, 0, len(edges) - 2)
    a = np.abs(d)
    out = {"count": np.bincount(idx, minlength=len(edges) - 1),
           "sum": np.bincount(idx, a, minlength=len(edges) - 1)}
    if quantile:
        out["quantile"] = np.array([np.quantile(a[idx == i], 0.99) if (idx == i).sum() >= PROB_MIN_COUNT else np.nan
                                    for i in range(len(edges) - 1)])
    return out


def abs_histograms(ds: dict[str, np.ndarray]):
    """(``{name: (counts, zeros)}``, bins) of ``abs_diff_histogram``: shared bins from the pooled |d| > 0."""
    pos = np.concatenate([np.abs(d)[np.abs(d) > 0] for d in ds.values()] or [np.zeros(0)])
    bins = abs_diff_bins(float(pos.min()), float(pos.max())) if pos.size else None
    hists = {}
    for name, d in ds.items():
        a = np.abs(d)
        counts = np.histogram(a[a > 0], bins=bins)[0] if bins is not None else np.zeros(0, dtype=np.int64)
        hists[name] = (counts, int((a == 0).sum()))
    return hists, bins


def rho_source(ds: dict[str, np.ndarray]) -> RhoSource:
    alld = np.concatenate(list(ds.values()) or [np.zeros(0)]).astype(np.float64)
    alld = alld[np.isfinite(alld)]
    if not alld.size:
        return RhoSource(0, math.nan, math.nan, math.nan, math.nan, lambda *_: ({}, 0, 0), tuple(ds))
    qlo, qhi = np.quantile(alld, RHO_QUANTILES)
    rho_all = np.exp(alld)

    def counts(edges, log, lo_d, hi_d):
        lo, hi = edges[0], edges[-1]  # np.exp(lo_d), np.exp(hi_d): as the data's
        out = {}
        for name, d in ds.items():
            rho = np.exp(np.asarray(d, dtype=np.float64))
            out[name] = np.histogram(rho[(rho >= lo) & (rho <= hi)], bins=edges)[0]
        return out, int((rho_all < lo).sum()), int((rho_all > hi).sum())

    return RhoSource(int(alld.size), float(alld.min()), float(alld.max()), float(qlo), float(qhi), counts, tuple(ds))


def position_profile(d: np.ndarray, pos: np.ndarray):
    """(positions, tokens, Σ|d|) per position."""
    positions, inverse = np.unique(pos, return_inverse=True)
    return positions, np.bincount(inverse), np.bincount(inverse, np.abs(d))


def sequence_points(d: np.ndarray, key: np.ndarray):
    """(length, Σ_t d) per sequence, in key order."""
    _, inverse = np.unique(key, return_inverse=True)
    return np.bincount(inverse), np.bincount(inverse, d)


# ------------------------------------------------------------------------------------------ the equality check
def _close(a, b, what: str, rel: float = 1e-9, abs_: float = 1e-12) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    same_nan = np.isnan(a) == np.isnan(b)
    assert same_nan.all(), (what, a, b)
    ok = np.isnan(a) | (a == b) | (np.abs(a - b) <= rel * np.maximum(np.abs(a), np.abs(b)) + abs_)
    assert ok.all(), (what, a[~ok], b[~ok])


def _same_metrics(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for k in want:
        _close(got[k], want[k], f"{what} {k}")


def assert_same_numbers(dump_dir, label: str = "dump") -> None:
    """Every number the report draws or tabulates from the dump at ``dump_dir``, from the streaming queries,
    equals the in-memory computation above (to float rounding: sums in another order)."""
    import tim_plugins.report.tokens as tokens
    from tim_plugins.report.query import engine

    old = load_tokens(dump_dir)
    with engine():
        new = tokens.load_tokens(dump_dir)
        assert (new.size, new.invalid) == (old.size, old.invalid)
        steps, metrics = tokens.metrics_by_step(new)
        old_steps, old_metrics = metrics_by_step(old)
        assert steps.tolist() == old_steps.tolist()
        for s, m, o in zip(steps, metrics, old_metrics):
            _same_metrics(m, o, f"step {s}")
        if old.size:
            _same_metrics(tokens.overall_metrics(new), overall_metrics(old), "overall")
        dumps = {label: new}
        d = {label: old.d}
        curve, want = tokens.prob_curves(dumps, quantile=True)[label], prob_curve(old.d, old.rollout, True)
        assert curve["count"].tolist() == want["count"].tolist()
        _close(curve["sum"], want["sum"], "prob sum")
        _close(curve["quantile"], want["quantile"], "prob p99")
        (hists, bins), (want_hists, want_bins) = tokens.abs_histograms(dumps), abs_histograms(d)
        assert (bins is None) == (want_bins is None)
        if bins is not None:
            _close(bins, want_bins, "abs bins", rel=0, abs_=0)
        assert hists[label][1] == want_hists[label][1]
        assert np.asarray(hists[label][0]).tolist() == np.asarray(want_hists[label][0]).tolist()
        src, want_src = tokens.rho_source(dumps), rho_source(d)
        assert src.n == want_src.n
        _close([src.dmin, src.dmax, src.qlo, src.qhi], [want_src.dmin, want_src.dmax, want_src.qlo, want_src.qhi],
               "rho stats", rel=0, abs_=0)
        if src.n:
            for lo_d, hi_d in ((src.qlo, src.qhi), (src.dmin, src.dmax)):  # the zoom's and the full range's bins
                lo, hi = float(np.exp(min(lo_d, -1e-3))), float(np.exp(max(hi_d, 1e-3)))
                for log in (False, True):
                    edges = np.geomspace(lo, hi, 80) if log else np.linspace(lo, hi, 80)
                    edges[0], edges[-1] = lo, hi
                    got_c, got_b, got_a = src.counts(edges, log, min(lo_d, -1e-3), max(hi_d, 1e-3))
                    want_c, want_b, want_a = want_src.counts(edges, log, min(lo_d, -1e-3), max(hi_d, 1e-3))
                    assert (got_b, got_a) == (want_b, want_a)
                    assert np.asarray(got_c[label]).tolist() == np.asarray(want_c[label]).tolist()
        pos, n, s = tokens.position_profiles(dumps)[label]
        want_pos, want_n, want_s = position_profile(old.d, old.position)
        assert pos.tolist() == want_pos.tolist() and n.tolist() == want_n.tolist()
        _close(s, want_s, "position sums")
        length, sum_d = tokens.sequence_points(dumps)[label]
        want_length, want_sum = sequence_points(old.d, old.sequence_key)
        assert length.tolist() == want_length.tolist()
        _close(sum_d, want_sum, "sequence sums")
        from tim_plugins.report.disagreements import dump_disagreements

        got_rows, want_rows = dump_disagreements(new), largest_disagreements(dump_dir)
        assert [{k: (bool(v) if k in ("start", "end") else v) for k, v in r.items()} for r in want_rows] == got_rows
