"""Mergeable counters: float64 sums and maxima that micro-batches and data-parallel ranks combine exactly.

A statistic that is a ratio of sums (a mean over tokens, a fraction of sequences) or an extreme is kept as its
parts, so merging is SUM-all-reduce of the sums and MAX-all-reduce of the maxima, never a mean of means. A
minimum is stored as the maximum of its negation. The mismatch monitor keeps its own, larger state of the same
kind (``_mismatch_layout``); the smaller accumulators of the per-step pipeline share this class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["Accumulated", "Accumulator", "all_reduce_sum_max"]


def all_reduce_sum_max(sums: torch.Tensor, maxes: torch.Tensor, group=None) -> None:
    """In place: SUM-all-reduce ``sums`` and MAX-all-reduce ``maxes`` over ``group`` (no-op on one rank).

    Every rank of the group must call it, also one that saw no batch (it contributes zeros and −inf)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size(group) <= 1:
        return
    if sums.numel():
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=group)
    if maxes.numel():
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)


def _collective_device(group) -> torch.device:
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_backend(group) == "nccl" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Accumulator:
    """Named float64 sums and maxima, added to on the device without host syncs until :meth:`merged`.

    Args:
        sums: names of the additive fields (0 when nothing was added).
        maxes: names of the maxima (−inf when nothing was added).
    """

    def __init__(self, sums: Sequence[str], maxes: Sequence[str] = ()) -> None:
        self.sum_names, self.max_names = tuple(sums), tuple(maxes)
        self._sums: torch.Tensor | None = None
        self._maxes: torch.Tensor | None = None

    def add(self, sums: Sequence[torch.Tensor], maxes: Sequence[torch.Tensor] = ()) -> None:
        """Add one batch: 0-d tensors (any dtype) in the order of the names given at construction, or one 1-d
        tensor each (a keyed statistic's many fields, added without splitting them into scalars)."""
        if len(sums) != len(self.sum_names) or len(maxes) != len(self.max_names):
            raise ValueError(f"Accumulator.add: expected {len(self.sum_names)} sums and {len(self.max_names)} "
                             f"maxima, got {len(sums)} and {len(maxes)}")

        def stacked(xs):
            if isinstance(xs, torch.Tensor):
                return xs.double()
            return torch.stack([torch.as_tensor(x).double() for x in xs]) if len(xs) else None

        s, m = stacked(sums), stacked(maxes)
        if self._sums is None and self._maxes is None:
            self._sums, self._maxes = s, m
            return
        if s is not None:
            self._sums = self._sums + s.to(self._sums.device)
        if m is not None:
            self._maxes = torch.maximum(self._maxes, m.to(self._maxes.device))

    @property
    def empty(self) -> bool:
        return self._sums is None and self._maxes is None

    def reset(self) -> None:
        self._sums = self._maxes = None

    def merged(self, sync: bool = True, group=None) -> dict[str, float]:
        """{name: value} of this rank's state, or of every rank's merged exactly when ``sync`` (one host copy)."""
        device = self._sums.device if self._sums is not None else (
            self._maxes.device if self._maxes is not None else _collective_device(group))
        sums = self._sums.clone() if self._sums is not None else torch.zeros(len(self.sum_names),
                                                                             dtype=torch.float64, device=device)
        maxes = self._maxes.clone() if self._maxes is not None else torch.full(
            (len(self.max_names),), -math.inf, dtype=torch.float64, device=device)
        if sync:
            all_reduce_sum_max(sums, maxes, group)
        values = torch.cat([sums, maxes]).cpu().tolist()
        return dict(zip(self.sum_names + self.max_names, values))

    def state_dict(self) -> dict:
        if self.empty:
            return {"sums": None, "maxes": None}
        values = self.merged(sync=False)
        return {"sums": [values[n] for n in self.sum_names], "maxes": [values[n] for n in self.max_names]}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("sums") is None:
            self.reset()
            return
        if len(state["sums"]) != len(self.sum_names) or len(state["maxes"]) != len(self.max_names):
            raise ValueError(f"accumulator state has {len(state['sums'])} sums and {len(state['maxes'])} maxima; "
                             f"this version keeps {len(self.sum_names)} and {len(self.max_names)}")
        self._sums = torch.tensor(state["sums"], dtype=torch.float64)
        self._maxes = torch.tensor(state["maxes"], dtype=torch.float64)


class Accumulated:
    """Base of a statistic kept in one :class:`Accumulator` (``self._acc``, set by the subclass): emptiness, reset
    and the state dict are the accumulator's."""

    _acc: Accumulator

    @property
    def empty(self) -> bool:
        """True when no batch was added since the last reset."""
        return self._acc.empty

    def reset(self) -> None:
        self._acc.reset()

    def state_dict(self) -> dict:
        return self._acc.state_dict()

    def load_state_dict(self, state) -> None:
        self._acc.load_state_dict(state)
