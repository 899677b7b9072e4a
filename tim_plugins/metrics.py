"""Per-token training-inference mismatch metrics, computed in one vectorised pass and merged exactly.

Per valid token, d = log p_train − log p_rollout and ρ = exp(d) = π_train / π_rollout.

The monitor keeps only additive state (sums, counts, histogram bins) and maxima (a minimum is stored as the
maximum of its negation), so micro-batches and data-parallel ranks merge exactly: SUM-all-reduce one part of
the state, MAX-all-reduce the other, never a mean of means. Nothing leaves the device until ``compute()``.
The state is one ``tim_plugins.accumulate.Accumulator`` buffer (adds, merges, checkpoints) in the layout of
``_mismatch_layout``; a batch is added by the torch pass (``_mismatch_pass``) or, on CUDA, by one Triton kernel
(``_mismatch_kernel``) in place; ``_derive`` alone turns a state into the metrics.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping

import torch

from tim_plugins._mismatch_layout import (
    DEFAULT_RATIO_BAND,
    HISTOGRAM_BINS_PER_DECADE,
    HISTOGRAM_RANGE,
    INVALID_LOGPROB_THRESHOLD,
    MAX_FIELDS,
    N_ABS_BINS,
    N_SUMS,
    PROB_BUCKET_EDGES,
    SUM_FIELDS,
    abs_diff_bin_edges,
    unpack,
)
from tim_plugins._mismatch_pass import batch_state
from tim_plugins._optional import is_triton_available
from tim_plugins.accumulate import Accumulator
from tim_plugins._mismatch_derive import _BIN_EDGES, _derive, _fold_signed

__all__ = [
    "PROB_BUCKET_EDGES", "HISTOGRAM_RANGE", "HISTOGRAM_BINS_PER_DECADE", "INVALID_LOGPROB_THRESHOLD",
    "DEFAULT_RATIO_BAND", "COMPILE_ENV", "check_ratio_band", "mismatch_metrics", "MismatchMonitor",
    "abs_diff_bin_edges",
]

# "1" / "0": what compile="auto" means (default: the Triton kernel on CUDA, eager torch elsewhere).
COMPILE_ENV = "TIM_PLUGINS_COMPILE"
# The ρ histogram spans e^-10 .. e^10; its outer bins hold everything beyond.
_RATIO_LOG_RANGE = 10.0


def _slot_names(fields) -> tuple[str, ...]:
    """One name per state slot (``hist[3]`` for a field of several), in layout order."""
    return tuple(name if size == 1 else f"{name}[{i}]" for name, size in fields for i in range(size))


_SUM_SLOTS, _MAX_SLOTS = _slot_names(SUM_FIELDS), _slot_names(MAX_FIELDS)


def check_ratio_band(band, where: str = "ratio_band", fix: str = "ratio_band=(0.5, 2.0)") -> tuple[float, float]:
    """``band`` as (lo, hi) floats with 0 < lo < 1 < hi < inf (a band of ρ around 1), else a ValueError that
    quotes ``where``, the value, the rule and ``fix``. Two real numbers, not strings or bools: a quoted "0.5"
    is a configuration slip, not a band. Every setting of the band (the monitor, the adapters' configs) is
    checked here, so they all accept the same values."""
    lo = hi = math.nan
    if not isinstance(band, (str, bytes)):
        try:
            items = list(band)
            if len(items) == 2 and not any(isinstance(x, (str, bytes, bool)) for x in items):
                lo, hi = float(items[0]), float(items[1])
        except (TypeError, ValueError):
            pass
    if not 0.0 < lo < 1.0 < hi < math.inf:
        raise ValueError(f"{where}={band!r} is invalid: it must be two numbers (lo, hi) with 0 < lo < 1 < hi < inf, "
                         f"a band of ρ around 1. Fix: e.g. {fix}")
    return lo, hi


class MismatchMonitor:
    """Accumulates mismatch statistics over micro-batches (and ranks) until ``compute()``.

    Args:
        ratio_band: (lo, hi) band for ``tim/token/ratio_outside_frac`` (fraction of tokens with ρ outside).
        compile: ``True`` / ``False`` / ``"auto"``. On CUDA, ``True``/``"auto"`` add each batch with one
            Triton kernel (``torch.compile`` of the torch pass if Triton is missing). Elsewhere ``"auto"`` means
            eager unless env ``TIM_PLUGINS_COMPILE=1``, and ``True`` fuses the pass with ``torch.compile``.
            ``False`` (or ``"auto"`` with ``TIM_PLUGINS_COMPILE=0``): plain eager torch everywhere. A failing
            kernel warns once and leaves the batches to the torch pass; a failing compiler, to eager torch.
        prefix: metric key prefix.
    """

    def __init__(
        self, ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND, *, compile: bool | str = "auto",
        prefix: str = "tim",
    ) -> None:
        self.ratio_band = ratio_band
        self.compile = compile
        self.prefix = prefix
        self._acc = Accumulator(_SUM_SLOTS, _MAX_SLOTS)  # float64 (float32 on MPS), layout ``_mismatch_layout``
        self._kernel_failed = False
        self._compile_failed = False
        self.updates = 0

    @property
    def ratio_band(self) -> tuple[float, float]:
        return self._ratio_band

    @ratio_band.setter
    def ratio_band(self, band: tuple[float, float]) -> None:
        self._ratio_band = check_ratio_band(band)
        self._log_band = (math.log(self._ratio_band[0]), math.log(self._ratio_band[1]))

    @property
    def compile(self) -> bool | str:
        return self._compile

    @compile.setter
    def compile(self, compile: bool | str) -> None:
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile={compile!r} is invalid: use True, False or 'auto'.")
        self._compile = compile

    # ---------------------------------------------------------------------------------------------- state
    @property
    def _state(self) -> torch.Tensor | None:
        """The state vector (sums, then maxima), or None before the first batch."""
        return self._acc.state

    def reset(self) -> None:
        self._acc.reset()
        self.updates = 0

    def state_dict(self) -> dict:
        return {"ratio_band": list(self.ratio_band), "updates": self.updates, **self._acc.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Resume the statistics. The configured ``ratio_band`` stays: the band is a setting, and a run resumed
        with another one counts its ratios with the one it was given (the saved band is kept for the record)."""
        self.updates = int(state["updates"])
        if state["sums"] is not None and len(state["sums"]) != N_SUMS:
            raise ValueError(
                f"monitor state has {len(state['sums'])} sum slots, this version expects {N_SUMS}: the "
                "checkpoint was written by an incompatible tim-plugins version; reset the monitor instead."
            )
        self._acc.load_state_dict(state)

    # --------------------------------------------------------------------------------------------- update
    def update(
        self,
        rollout_logprobs: torch.Tensor,
        train_logprobs: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_weights: torch.Tensor | None = None,
    ) -> "MismatchMonitor":
        """Add one micro-batch.

        Args:
            rollout_logprobs: [B, T] sampled-token log-probs reported by the inference engine (any float dtype).
            train_logprobs: [B, T] the trainer's recomputation of the same tokens.
            mask: [B, T] response-token mask (bool or 0/1); ``None`` means every token is a response token.
            is_weights: [B, T] importance weights the framework actually applied (after truncation/masking).
        """
        rollout, train, mask, is_weights = _checked(rollout_logprobs, train_logprobs, mask, is_weights)
        path = self._path(rollout.device)
        if path != "kernel" or not self._kernel_update(rollout, train, mask, is_weights):
            batch = None
            if path != "eager":
                try:
                    batch = batch_state(rollout, train, mask, is_weights, *self._log_band, compiled=True)
                except Exception as err:  # never let a compiler problem break a training step
                    warnings.warn(f"tim_plugins: torch.compile of the mismatch pass failed ({err!r}); using eager.")
                    self._compile_failed = True
            if batch is None:
                batch = batch_state(rollout, train, mask, is_weights, *self._log_band)
            self._acc.add_state(batch)
        self.updates += 1
        return self

    def _path(self, device: torch.device) -> str:
        """"kernel" (CUDA with Triton), "compiled" (torch.compile) or "eager"; see ``compile``."""
        wanted = self.compile
        if wanted == "auto":  # CPU: eager, since inductor needs a C++ compiler and ~10 s once
            env = os.environ.get(COMPILE_ENV)
            wanted = device.type == "cuda" if env is None else env == "1"
        if not wanted:
            return "eager"
        if device.type == "cuda" and not self._kernel_failed and is_triton_available():
            return "kernel"
        return "eager" if self._compile_failed else "compiled"

    def _kernel_update(self, rollout, train, mask, is_weights) -> bool:
        """Add the batch with the Triton kernel; False (after a warning) if the kernel fails."""
        if rollout.numel() == 0:
            return True  # nothing to add
        fresh = self._acc.empty
        try:
            from tim_plugins._mismatch_kernel import add_batch  # imports triton: CUDA batches only

            add_batch(self._acc.state_for(rollout.device, torch.float64), rollout, train, mask, is_weights,
                      *self._log_band)
        except Exception as err:  # never let a kernel problem break a training step
            # (A compile or launch error comes before any program has run, so the state is as it was.)
            warnings.warn(f"tim_plugins: the Triton mismatch kernel failed ({err!r}); using torch.")
            self._kernel_failed = True
            if fresh:
                self._acc.reset()
            return False
        return True

    # -------------------------------------------------------------------------------------------- compute
    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        """Return the metric dict (one device → host copy). With ``sync`` and an initialised process group the
        state of all ranks is merged exactly first (every rank must call it then, also one that saw no batch).
        Undefined statistics (no valid token) are NaN."""
        return _derive(unpack(self._acc.merged_state(sync, group).cpu().numpy()), self.prefix)

    def histograms(self, sync: bool = False, group=None) -> dict[str, tuple]:
        """Histograms for ``wandb.Histogram(np_histogram=...)``: ``{"abs_diff": (counts, edges),
        "ratio": (counts, edges)}`` as numpy arrays. Bins below 1e-8 / above 1e3 are clipped to the range."""
        import numpy as np

        hist = unpack(self._acc.merged_state(sync, group).cpu().numpy())["hist"]
        e = np.asarray(_BIN_EDGES)  # E_0 .. E_K
        # |d| bins [0, E_0), [E_0, E_1), ..., [E_{K-1}, E_K]: the overflow bin (>= E_K) joins the last one.
        abs_counts = _fold_signed(hist)
        abs_counts[-2] += abs_counts[-1]
        abs_edges = np.concatenate([[0.0], e])
        # ρ = exp(d) bins from the signed d histogram; d-space edges -E_K .. -E_0, E_0 .. E_K, overflow bins
        # merged into their neighbours. exp is monotone, so the ρ edges are exp of the d edges.
        c = N_ABS_BINS - 1  # index of the |d| < E_0 bin
        neg = hist[1:c].copy()
        neg[0] += hist[0]
        pos = hist[c + 1 : -1].copy()
        pos[-1] += hist[-1]
        counts = np.concatenate([neg, [hist[c]], pos])
        d_edges = np.concatenate([-e[::-1], e])
        # Keep ρ within [e^-10, e^10] so the edges stay finite: the outer bins absorb the rest.
        keep = np.nonzero(np.abs(d_edges) <= _RATIO_LOG_RANGE)[0]
        first, last = keep[0], keep[-1]
        counts = np.concatenate([
            [counts[: first + 1].sum()], counts[first + 1 : last - 1], [counts[last - 1 :].sum()]
        ])
        return {"abs_diff": (abs_counts[:-1], abs_edges), "ratio": (counts, np.exp(d_edges[first : last + 1]))}


def _checked(rollout, train, mask, is_weights):
    """Shape/type checks at the API boundary (raise); value problems are counted by the pass, never raised."""
    if not isinstance(rollout, torch.Tensor) or not isinstance(train, torch.Tensor):
        raise TypeError(f"rollout_logprobs and train_logprobs must be torch.Tensor, got {type(rollout).__name__} "
                        f"and {type(train).__name__}")
    if rollout.dim() == 1 and train.dim() == 1:  # one sequence
        rollout, train = rollout.unsqueeze(0), train.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
        is_weights = None if is_weights is None else is_weights.reshape(1, -1)
    shape = rollout.shape
    if len(shape) != 2 or train.shape != shape:
        raise ValueError(f"rollout_logprobs {tuple(shape)} and train_logprobs {tuple(train.shape)} must both have "
                         "shape [B, T] (batch, response tokens).")
    for name, x in (("mask", mask), ("is_weights", is_weights)):
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} {tuple(x.shape)} must have the log-probs' shape {tuple(shape)}.")
    if not rollout.is_floating_point() or not train.is_floating_point():
        raise TypeError(f"log-probs must be floating point, got {rollout.dtype} and {train.dtype}")
    # Statistics never need autograd; any float dtype and any mask dtype are read by the pass as they are.
    device = rollout.device
    if mask is None:
        mask = torch.ones(shape, dtype=torch.bool, device=device)
    train, mask = train.detach().to(device), mask.detach().to(device)
    is_weights = None if is_weights is None else is_weights.detach().to(device)
    return rollout.detach(), train, mask, is_weights


def mismatch_metrics(
    rollout_logprobs: torch.Tensor,
    train_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    **options,
) -> dict[str, float]:
    """Mismatch metrics of one batch (see ``MismatchMonitor`` for arguments and keys).

    Options: ``is_weights`` ([B, T]), ``ratio_band`` ((lo, hi)), ``compile``, ``prefix``.
    """
    is_weights = options.pop("is_weights", None)
    monitor = MismatchMonitor(**options)
    monitor.update(rollout_logprobs, train_logprobs, mask, is_weights=is_weights)
    return monitor.compute(sync=False)
