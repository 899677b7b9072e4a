"""Per-token rows of a dump as numpy columns, and the core monitor's metrics recomputed from them per step.

The report never re-implements a metric: per-step values come from ``tim_plugins.metrics.mismatch_metrics`` on
the dump's rows laid out as [sequences, positions] again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Tokens", "has_dump", "load_tokens", "run_tokens", "metrics_by_step", "overall_metrics"]


@dataclass
class Tokens:
    """Valid rows of a dump (finite log-probs above the invalid-placeholder threshold), as numpy arrays."""

    step: np.ndarray
    rank: np.ndarray
    sequence: np.ndarray
    position: np.ndarray
    rollout: np.ndarray
    train: np.ndarray
    invalid: int

    @property
    def d(self) -> np.ndarray:
        return self.train - self.rollout

    @property
    def sequence_key(self) -> np.ndarray:
        return (self.step.astype(np.int64) << 40) + (self.rank.astype(np.int64) << 32) + self.sequence.astype(np.int64)

    @property
    def size(self) -> int:
        return int(self.rollout.size)


def has_dump(folder: Path) -> bool:
    """Whether ``folder`` holds per-token dump files (the names ``tim_plugins.dump`` writes)."""
    return folder.is_dir() and any(folder.glob("step_*-rank_*.parquet"))


def run_tokens(summary: dict, run_dir: Path, name: str = "all steps") -> Tokens | None:
    """The tokens of a run's dump ``name`` (its folder from ``summary["dumps"]``), or None without one."""
    folder = Path(run_dir) / summary.get("dumps", {}).get(name, "dump" if name == "all steps" else "")
    return load_tokens(folder) if has_dump(folder) else None


def load_tokens(dump_dir: str | Path) -> Tokens:
    from tim_plugins.dump import read_dump
    from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD

    table = read_dump(dump_dir)
    col = lambda name: table.column(name).to_numpy()  # noqa: E731
    rollout, train = col("rollout_logprob").astype(np.float64), col("train_logprob").astype(np.float64)
    ok = (np.isfinite(rollout) & np.isfinite(train) & (rollout > INVALID_LOGPROB_THRESHOLD)
          & (train > INVALID_LOGPROB_THRESHOLD))
    return Tokens(col("step")[ok], col("rank")[ok], col("sequence")[ok], col("position")[ok], rollout[ok],
                  train[ok], int((~ok).sum()))


def _metrics_of(tokens: Tokens, sel: np.ndarray) -> dict:
    import torch

    from tim_plugins.metrics import mismatch_metrics

    _, row = np.unique(tokens.sequence_key[sel], return_inverse=True)
    pos = tokens.position[sel]
    shape = (int(row.max()) + 1, int(pos.max()) + 1) if row.size else (0, 0)
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
    """(steps, one ``mismatch_metrics`` dict per step) over the dump's rows of each step, with the token IS
    ratios ρ passed as ``is_weights`` so ``tim/is/ess`` is the effective sample size of the uncorrected ρ."""
    steps = np.unique(tokens.step)
    return steps, [_metrics_of(tokens, tokens.step == s) for s in steps]


def overall_metrics(tokens: Tokens) -> dict:
    """``mismatch_metrics`` over every row of the dump (sequences of all steps), ρ as ``is_weights``."""
    return _metrics_of(tokens, np.ones(tokens.size, dtype=bool))
