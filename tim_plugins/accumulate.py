"""Mergeable counters: float64 sums and maxima that micro-batches and data-parallel ranks combine exactly.

A statistic that is a ratio of sums (a mean over tokens, a fraction of sequences) or an extreme is kept as its
parts, so merging is SUM-all-reduce of the sums and MAX-all-reduce of the maxima, never a mean of means. A
minimum is stored as the maximum of its negation. An :class:`Accumulator` keeps them in one flat buffer, sums
first, then maxima: the per-step pipeline's small statistics and the mismatch monitor's large state (layout in
``_mismatch_layout``, which its Triton kernel adds into in place) are all one, and merge the same way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["Accumulated", "Accumulator", "all_reduce_sum_max", "collective_device", "is_distributed"]


def is_distributed(group=None) -> bool:
    """Whether torch.distributed is available and initialised and ``group`` (default: the world) has more than one
    rank: the one test of whether a merge over ranks has anything to do."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1)


def collective_device(group=None) -> torch.device:
    """The device a collective over ``group`` needs its tensors on: the current CUDA device under NCCL (which
    cannot reduce host tensors), else the CPU (also without a process group)."""
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_backend(group) == "nccl" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_max(sums: torch.Tensor, maxes: torch.Tensor, group=None) -> None:
    """In place: SUM-all-reduce ``sums`` and MAX-all-reduce ``maxes`` over ``group`` (no-op on one rank).

    Every rank of the group must call it, also one that saw no batch (it contributes zeros and −inf). A tensor
    off the ``collective_device`` (a state loaded from a checkpoint lives on the CPU, a statistic of a CPU batch
    too) is reduced in a copy there and written back: NCCL refuses host tensors."""
    if not is_distributed(group):
        return
    device = collective_device(group)
    for x, op in ((sums, torch.distributed.ReduceOp.SUM), (maxes, torch.distributed.ReduceOp.MAX)):
        if not x.numel():
            continue
        there = x if x.device == device else x.to(device)
        torch.distributed.all_reduce(there, op=op, group=group)
        if there is not x:
            x.copy_(there)


@functools.lru_cache(maxsize=32)
def _empty_template(n_sums: int, n_maxes: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    state = torch.full((n_sums + n_maxes,), -math.inf, dtype=dtype, device=device)
    state[:n_sums] = 0.0
    return state


class Accumulator:
    """Named float64 sums and maxima in one flat buffer (sums, then maxima), added to on the device without host
    syncs until :meth:`merged`.

    Args:
        sums: names of the additive fields (0 when nothing was added).
        maxes: names of the maxima (−inf when nothing was added).
    """

    def __init__(self, sums: Sequence[str], maxes: Sequence[str] = ()) -> None:
        self.sum_names, self.max_names = tuple(sums), tuple(maxes)
        self._state: torch.Tensor | None = None

    @property
    def n_sums(self) -> int:
        return len(self.sum_names)

    @property
    def state(self) -> torch.Tensor | None:
        """The buffer (sums, then maxima), or None before the first batch. Read it, do not keep it: adds change it
        in place."""
        return self._state

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

        parts = [x for x in (stacked(sums), stacked(maxes)) if x is not None]
        if parts:  # torch.cat copies, so the state never aliases a caller's tensor
            self.add_state(torch.cat([x.to(parts[0].device) for x in parts]))

    def add_state(self, batch: torch.Tensor) -> None:
        """Add a batch already laid out as the state (sums, then maxima). The first batch becomes the state, so
        hand over a tensor nothing else writes to. The state moves to the batch's device and dtype (a checkpoint's
        lives on the CPU), so later adds stay on the device."""
        batch = batch.detach()  # statistics never need autograd, and maximum(out=) refuses it
        if self._state is None:
            self._state = batch
            return
        state = self.state_for(batch.device, batch.dtype)
        n = self.n_sums
        state[:n] += batch[:n]
        torch.maximum(state[n:], batch[n:], out=state[n:])

    def state_for(self, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The buffer on ``device`` in ``dtype``, created empty (zeros, then −inf) or moved there, for a producer
        that adds into it in place."""
        if self._state is None:
            self._state = self._empty(device, dtype)
        elif self._state.device != device or self._state.dtype != dtype:
            self._state = self._state.to(device, dtype)
        return self._state

    def _empty(self, device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The state of no batch: zeros, then −inf (a copy of one kept per device: one operation, not two)."""
        return _empty_template(self.n_sums, len(self.max_names), torch.device(device), dtype).clone()

    @property
    def empty(self) -> bool:
        return self._state is None

    def reset(self) -> None:
        self._state = None

    def merged_state(self, sync: bool = True, group=None) -> torch.Tensor:
        """The buffer of this rank, or of every rank merged exactly when ``sync`` and ``group`` has more than one
        rank. Then every rank must call it, also one that saw no batch: it contributes zeros and −inf. Without a
        merge it may be the state itself: read it, do not change it."""
        reduce = sync and is_distributed(group)
        if self._state is None:
            state = self._empty(collective_device(group) if reduce else "cpu")
        elif reduce:
            state = self._state.clone()  # all_reduce works in place: keep this rank's own state intact
        else:
            return self._state
        if reduce:
            all_reduce_sum_max(state[:self.n_sums], state[self.n_sums:], group)
        return state

    def merged(self, sync: bool = True, group=None) -> dict[str, float]:
        """{name: value} of this rank's state, or of every rank's merged exactly when ``sync`` (one host copy)."""
        values = self.merged_state(sync, group).cpu().tolist()
        return dict(zip(self.sum_names + self.max_names, values))

    def state_dict(self) -> dict:
        if self._state is None:
            return {"sums": None, "maxes": None}
        values = self._state.cpu().tolist()
        return {"sums": values[:self.n_sums], "maxes": values[self.n_sums:]}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("sums") is None:
            self.reset()
            return
        if len(state["sums"]) != len(self.sum_names) or len(state["maxes"]) != len(self.max_names):
            raise ValueError(f"accumulator state has {len(state['sums'])} sums and {len(state['maxes'])} maxima; "
                             f"this version keeps {len(self.sum_names)} and {len(self.max_names)}")
        self._state = torch.tensor(list(state["sums"]) + list(state["maxes"]), dtype=torch.float64)


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
