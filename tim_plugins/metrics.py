"""Per-token training-inference mismatch metrics, computed in one vectorised pass and merged exactly.

Per valid token, d = log p_train − log p_rollout and ρ = exp(d) = π_train / π_rollout.

The monitor keeps only additive state (sums, counts, histogram bins) and maxima (a minimum is stored as the
maximum of its negation), so micro-batches and data-parallel ranks merge exactly: SUM-all-reduce one tensor,
MAX-all-reduce another, never a mean of means. Nothing leaves the device until ``compute()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from tim_plugins._mismatch_pass import (
    HISTOGRAM_BINS_PER_DECADE,
    HISTOGRAM_RANGE,
    INVALID_LOGPROB_THRESHOLD,
    N_BUCKETS,
    N_PASS_MAXES,
    N_PASS_SUMS,
    PROB_BUCKET_EDGES,
    batch_stats,
    cell_counts,
    compiled_batch_stats,
    want_compile,
)
from tim_plugins._monitor_cuda import _CudaPath
from tim_plugins._monitor_inputs import check_inputs

__all__ = [
    "PROB_BUCKET_EDGES",
    "HISTOGRAM_RANGE",
    "HISTOGRAM_BINS_PER_DECADE",
    "INVALID_LOGPROB_THRESHOLD",
    "DEFAULT_RATIO_BAND",
    "mismatch_metrics",
    "MismatchMonitor",
    "abs_diff_bin_edges",
]

DEFAULT_RATIO_BAND: tuple[float, float] = (0.5, 2.0)
# The ρ histogram spans e^-10 .. e^10; its outer bins hold everything beyond.
_RATIO_LOG_RANGE = 10.0


def abs_diff_bin_edges(device: torch.device | str = "cpu") -> torch.Tensor:
    """The |d| histogram's inner edges E_0 < ... < E_K (float64). Bin i holds E_{i-1} <= |d| < E_i."""
    lo, hi = HISTOGRAM_RANGE
    decades = round(math.log10(hi / lo))
    n = decades * HISTOGRAM_BINS_PER_DECADE + 1
    return torch.logspace(math.log10(lo), math.log10(hi), n, dtype=torch.float64, device=device)


_BIN_EDGES_LIST = abs_diff_bin_edges().tolist()


def _prob_key(lo: float, hi: float) -> str:
    return f"{lo:g}-{hi:g}"


_BUCKET_KEYS = tuple(_prob_key(lo, hi) for lo, hi in zip(PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:]))


# Layout of the additive state vector. Histogram and bucket slots follow these scalar slots.
_SUM_FIELDS = (
    "tokens", "invalid", "abs_d", "abs_p", "neg_d", "k3", "rho_m1", "rho_m1_sq", "outside",
    "seqs", "seq_log_ratio", "is_tokens", "is_w", "is_w2", "is_masked",
)
if len(_SUM_FIELDS) != N_PASS_SUMS + 2:  # tokens and invalid come from the histogram, the rest from the pass
    raise RuntimeError("tim_plugins: _SUM_FIELDS is out of step with batch_stats")
# Layout of the max state vector (min x stored as max −x).
_MAX_FIELDS = ("abs_d_max", "abs_p_max", "rho_m1_max", "neg_rho_m1_min", "seq_abs_max", "is_w_max", "neg_is_w_min")
if len(_MAX_FIELDS) != N_PASS_MAXES:
    raise RuntimeError("tim_plugins: _MAX_FIELDS is out of step with batch_stats")


@dataclass(frozen=True)
class _Layout:
    n_edges: int  # K + 1 inner edges of |d|

    @cached_property
    def n_abs_bins(self) -> int:  # bin 0: |d| < E_0 ... bin K+1: |d| >= E_K
        return self.n_edges + 1

    @cached_property
    def n_signed_bins(self) -> int:  # negative bins, the shared "≈0" bin, positive bins
        return 2 * self.n_abs_bins - 1

    @cached_property
    def hist_offset(self) -> int:
        return len(_SUM_FIELDS)

    @cached_property
    def bucket_count_offset(self) -> int:
        return self.hist_offset + self.n_signed_bins

    @cached_property
    def bucket_abs_offset(self) -> int:
        return self.bucket_count_offset + N_BUCKETS

    @cached_property
    def n_sums(self) -> int:
        return self.bucket_abs_offset + N_BUCKETS

    @cached_property
    def n_state(self) -> int:  # the state buffer: the sums, then the maxima
        return self.n_sums + len(_MAX_FIELDS)


class MismatchMonitor(_CudaPath):
    """Accumulates mismatch statistics over micro-batches (and ranks) until ``compute()``.

    Args:
        ratio_band: (lo, hi) band for ``tim/token/ratio_outside_frac`` (fraction of tokens with ρ outside).
        compile: ``True`` / ``False`` / ``"auto"``. On CUDA, ``True``/``"auto"`` run the per-batch pass as one
            Triton kernel (``_mismatch_triton``; torch.compile if Triton is missing). Elsewhere ``"auto"``
            means eager unless env ``TIM_PLUGINS_COMPILE=1``, and ``True`` fuses the pass with
            ``torch.compile``. ``False``: plain eager torch everywhere. Any failure falls back to eager.
        prefix: metric key prefix.
    """

    def __init__(
        self,
        ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND,
        *,
        compile: bool | str = "auto",
        prefix: str = "tim",
    ) -> None:
        # update()'s launch from a plan (``launch_planned``), set by the first Triton launch; dropped when the
        # compile setting changes or the kernel fails (the ratio band is part of each plan's key).
        self._planned = None
        self.ratio_band = ratio_band
        self.compile = compile
        self.prefix = prefix
        self._layout = _Layout(n_edges=abs_diff_bin_edges().numel())
        # One float64 buffer: the additive slots, then the maxima (one device → host copy in compute()).
        self._state: torch.Tensor | None = None
        # The buffer of the last reset, reused by the Triton path, which overwrites it ("fresh") in its launch.
        self._spare_state: torch.Tensor | None = None
        # The metric vector the last Triton launch derived from the state (TUNING["DEVICE_METRICS"]): while
        # set, compute() reads it instead of deriving the metrics on the host.
        self._device_metrics: torch.Tensor | None = None
        self._compile_failed = False
        self._triton_failed = False
        self._triton_choice: tuple | None = None  # (compile setting, whether the Triton path runs)
        self._kernel_scratch: dict = {}
        self._metric_view: tuple = (None, None, False)  # compute()'s cached numpy view of the device metric vector
        self._empty_states: dict = {}
        self.updates = 0

    @property
    def ratio_band(self) -> tuple[float, float]:
        return self._ratio_band

    @ratio_band.setter
    def ratio_band(self, band: tuple[float, float]) -> None:
        lo, hi = (float(x) for x in band)
        if not (0.0 < lo < 1.0 < hi) or not math.isfinite(hi):
            raise ValueError(
                f"ratio_band={tuple(band)!r} is invalid: it must satisfy 0 < lo < 1 < hi < inf "
                "(a band around ρ = 1), e.g. ratio_band=(0.5, 2.0)."
            )
        self._ratio_band = (lo, hi)
        self._log_band = (math.log(lo), math.log(hi))

    @property
    def compile(self) -> bool | str:
        return self._compile

    @compile.setter
    def compile(self, compile: bool | str) -> None:
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile={compile!r} is invalid: use True, False or 'auto'.")
        self._compile = compile
        self._planned = None  # the path is chosen again

    # ---------------------------------------------------------------------------------------------- state
    def reset(self) -> None:
        if self._state is not None:
            self._spare_state = self._state
        self._state = None
        self._device_metrics = None
        self.updates = 0

    @property
    def _sums(self) -> torch.Tensor | None:
        return None if self._state is None else self._state[: self._layout.n_sums]

    @property
    def _maxes(self) -> torch.Tensor | None:
        return None if self._state is None else self._state[self._layout.n_sums :]

    def _new_state(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """An empty state (zeros, then −inf), copied from one kept per device: one launch per step, not two."""
        empty = self._empty_states.get((device, dtype))
        if empty is None:
            empty = torch.full((self._layout.n_state,), -math.inf, dtype=dtype, device=device)
            empty[: self._layout.n_sums] = 0.0
            self._empty_states[(device, dtype)] = empty
        return empty.clone()

    def _ensure_state(self, device: torch.device, dtype: torch.dtype) -> None:
        if self._state is None:
            self._state = self._new_state(device, dtype)
        elif self._state.device != device:  # state restored from a checkpoint lives on the CPU
            self._state = self._state.to(device)

    def state_dict(self) -> dict:
        return {
            "ratio_band": list(self.ratio_band),
            "updates": self.updates,
            "sums": None if self._sums is None else self._sums.detach().cpu().tolist(),
            "maxes": None if self._maxes is None else self._maxes.detach().cpu().tolist(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.ratio_band = state["ratio_band"]
        self.updates = int(state["updates"])
        self._device_metrics = None
        if state["sums"] is None:
            self._state = None
            return
        if len(state["sums"]) != self._layout.n_sums:
            raise ValueError(
                f"monitor state has {len(state['sums'])} sum slots, this version expects {self._layout.n_sums}: "
                "the checkpoint was written by an incompatible tim-plugins version; reset the monitor instead."
            )
        self._state = torch.tensor(list(state["sums"]) + list(state["maxes"]), dtype=torch.float64)

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
        planned = self._planned
        if planned is not None:
            # The CUDA path for inputs like those of an earlier launch: ``launch_planned`` launches from that
            # launch's plan, whose key match proves the checks below, or returns False.
            state = self._state
            fresh = state is None
            if fresh:  # the kernel overwrites the last reset's buffer
                state = self._spare_state
            if state is not None:
                try:
                    vector = planned(self._kernel_scratch, state, fresh, rollout_logprobs, train_logprobs, mask,
                                     is_weights, self._log_band)
                except Exception as err:  # never let a kernel problem break a training step
                    self._kernel_failed(err)
                    vector = False
                if vector is not False:
                    if fresh:
                        self._state, self._spare_state = state, None
                    self._device_metrics = vector
                    self.updates += 1
                    return self
        rollout_logprobs, train_logprobs, mask, is_weights = check_inputs(
            rollout_logprobs, train_logprobs, mask, is_weights
        )
        if self._use_triton(rollout_logprobs) and self._update_triton(
            rollout_logprobs, train_logprobs, mask, is_weights
        ):
            self.updates += 1
            return self
        device = rollout_logprobs.device
        args = (rollout_logprobs, train_logprobs, mask, is_weights, *self._log_band, self._layout.n_signed_bins)
        out = None
        if not self._compile_failed and want_compile(self.compile, device):
            try:
                out = compiled_batch_stats()(*args)
            except Exception as err:  # never let a compiler problem break a training step
                import warnings

                warnings.warn(f"tim_plugins: torch.compile of the mismatch pass failed ({err!r}); using eager.")
                self._compile_failed = True
        if out is None:
            out = batch_stats(*args)
        self._device_metrics = None  # the state changes without the kernel: compute() derives on the host
        pass_sums, bucket_abs, maxes, cell = out
        n_sb = self._layout.n_signed_bins
        counts = cell_counts(cell, N_BUCKETS * n_sb + 1)  # joint (bucket, d bin) cells, then the invalid cell
        joint = counts[:-1].view(N_BUCKETS, n_sb)
        bucket_counts = joint.sum(1)
        sums = torch.cat([
            bucket_counts.sum().view(1), counts[-1:], pass_sums, joint.sum(0), bucket_counts, bucket_abs
        ])
        self._ensure_state(device, sums.dtype)
        self._sums.add_(sums)
        torch.maximum(self._maxes, maxes, out=self._maxes)
        self.updates += 1
        return self

    # -------------------------------------------------------------------------------------------- compute
    @staticmethod
    def _reduces(sync: bool, group) -> bool:
        return (
            sync and torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1
        )

    def _merged_state(self, sync: bool, group) -> torch.Tensor:
        """The state buffer (sums, then maxima), merged over ranks when ``sync`` (a copy then)."""
        n = self._layout.n_sums
        reduce = self._reduces(sync, group)
        if self._state is None:
            # Every rank must call compute(), even one that saw no batch: it contributes zeros / −inf.
            device = _collective_device(group) if reduce else torch.device("cpu")
            state = self._new_state(device, torch.float64)
        elif reduce:  # all_reduce works in place: keep this rank's own state intact
            state = self._state.clone()
        else:
            state = self._state
        if reduce:
            torch.distributed.all_reduce(state[:n], op=torch.distributed.ReduceOp.SUM, group=group)
            torch.distributed.all_reduce(state[n:], op=torch.distributed.ReduceOp.MAX, group=group)
        return state

    def compute(self, sync: bool = True, group=None) -> dict[str, float]:
        """Return the metric dict (one host transfer). With ``sync`` and an initialised process group the
        state of all ranks is merged exactly first. Undefined statistics (no valid token) are NaN."""
        vector = self._device_metrics
        if vector is not None and not self._reduces(sync, group):
            # The last launch derived the metrics from this very state: read and label them.
            view = self._metric_view
            if view[0] is not vector:  # (vector, numpy view when in host memory, whether the kernel writes it)
                host = not vector.is_cuda
                view = self._metric_view = (vector, vector.numpy() if host else None, host and self._state.is_cuda)
            keys, is_keys = self._metric_keys()  # (before the wait: the kernel may still be running)
            if view[2]:  # pinned host memory the kernel writes into
                wait_for_metrics(self._kernel_scratch, self._state.device)
            values = vector.tolist() if view[1] is None else view[1].tolist()  # a device vector: one copy
            out = dict(zip(keys, values))  # the vector holds compute()'s values in key order
            if values[-1] > 0:  # IS count
                out.update(zip(is_keys, values[len(keys) : len(keys) + len(is_keys)]))
            return out
        lay = self._layout
        host = self._merged_state(sync, group).cpu().numpy()  # the one device → host copy
        (n, invalid, abs_d, abs_p, neg_d, k3, rho_m1, rho_m1_sq, outside, seqs, seq_log_ratio, is_n, is_w, is_w2,
         is_masked) = host[: len(_SUM_FIELDS)].tolist()
        abs_d_max, abs_p_max, rho_m1_max, neg_rho_m1_min, seq_abs_max, is_w_max, neg_is_w_min = (
            host[lay.n_sums :].tolist()
        )
        buckets = host[lay.bucket_count_offset : lay.n_sums].tolist()  # counts ×5, then |d| sums ×5
        nan = math.nan
        if n > 0:
            inv_n = 1.0 / n
            # |d| maxima include the zeros of masked tokens: defined only if n > 0
            abs_d_max = abs_d_max if abs_d_max != -math.inf else nan
            token = [
                abs_d * inv_n, abs_d_max, abs_p * inv_n, abs_p_max if abs_p_max != -math.inf else nan,
                neg_d * inv_n, k3 * inv_n,
                (2.0 * rho_m1 + rho_m1_sq) * inv_n,  # chi2 = E[ρ²] − 1 = 2 E[ρ − 1] + E[(ρ − 1)²]
                1.0 + rho_m1 * inv_n, 1.0 - neg_rho_m1_min,
                1.0 + rho_m1_max if rho_m1_max != -math.inf else nan, outside * inv_n,
            ]
            token += _hist_quantiles(
                _fold_signed(host[lay.hist_offset : lay.bucket_count_offset]), (0.99, 0.999), abs_d_max
            )
        else:
            token = [nan] * 13
        seq = [seqs, seq_log_ratio / seqs, seq_abs_max] if seqs > 0 else [seqs, nan, nan]
        by_prob = []
        for count, abs_sum in zip(buckets[:N_BUCKETS], buckets[N_BUCKETS:]):
            by_prob += (count, abs_sum / count if count > 0 else nan)
        keys, is_keys = self._metric_keys()
        out = dict(zip(keys, [n, invalid, *token, *seq, *by_prob]))
        if is_n > 0:
            out.update(zip(is_keys, (
                is_w / is_n, -neg_is_w_min, is_w_max, is_masked / is_n,
                # Kish effective sample size, normalised to [0, 1]: (Σw)² / (N Σw²)
                is_w * is_w / (is_n * is_w2) if is_w2 > 0 else 0.0,
            )))
        return out

    def _metric_keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """compute()'s keys, in its value order, formatted once per prefix."""
        cached = self.__dict__.get("_keys_cache")
        if cached is not None and cached[0] == self.prefix:
            return cached[1]
        p = self.prefix
        token = (
            "abs_diff_mean", "abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_max", "kl_k1", "kl_k3", "chi2",
            "ratio_mean", "ratio_min", "ratio_max", "ratio_outside_frac", "abs_diff_p99", "abs_diff_p999",
        )
        keys = [f"{p}/tokens", f"{p}/invalid_tokens", *(f"{p}/token/{k}" for k in token)]
        keys += [f"{p}/seq/count", f"{p}/seq/log_ratio_mean", f"{p}/seq/log_ratio_abs_max"]
        for bucket in _BUCKET_KEYS:
            keys += [f"{p}/by_prob/{bucket}/count", f"{p}/by_prob/{bucket}/abs_diff_mean"]
        is_keys = tuple(f"{p}/is/{k}" for k in ("weight_mean", "weight_min", "weight_max", "masked_frac", "ess"))
        self._keys_cache = (p, (tuple(keys), is_keys))
        return self._keys_cache[1]

    def histograms(self, sync: bool = False, group=None) -> dict[str, tuple]:
        """Histograms for ``wandb.Histogram(np_histogram=...)``: ``{"abs_diff": (counts, edges),
        "ratio": (counts, edges)}`` as numpy arrays. Bins below 1e-8 / above 1e3 are clipped to the range."""
        import numpy as np

        sums = self._merged_state(sync, group)
        lay = self._layout
        hist = sums[lay.hist_offset : lay.hist_offset + lay.n_signed_bins].cpu().numpy()
        e = abs_diff_bin_edges().numpy()  # E_0 .. E_K
        # |d| bins [0, E_0), [E_0, E_1), ..., [E_{K-1}, E_K]: the overflow bin (>= E_K) joins the last one.
        abs_counts = _fold_signed(hist)
        abs_counts[-2] += abs_counts[-1]
        abs_edges = np.concatenate([[0.0], e])
        # ρ = exp(d) bins from the signed d histogram; d-space edges -E_K .. -E_0, E_0 .. E_K, overflow bins
        # merged into their neighbours. exp is monotone, so the ρ edges are exp of the d edges.
        c = lay.n_abs_bins - 1  # index of the |d| < E_0 bin
        neg = hist[1:c].copy()
        neg[0] += hist[0]
        pos = hist[c + 1 : -1].copy()
        pos[-1] += hist[-1]
        counts = np.concatenate([neg, [hist[c]], pos])
        d_edges = np.concatenate([-e[::-1], e])
        # Keep ρ within [e^-RATIO_LOG_RANGE, e^RATIO_LOG_RANGE] so the edges stay finite: outer bins absorb
        # the rest.
        keep = np.nonzero(np.abs(d_edges) <= _RATIO_LOG_RANGE)[0]
        first, last = keep[0], keep[-1]
        counts = np.concatenate([
            [counts[: first + 1].sum()], counts[first + 1 : last - 1], [counts[last - 1 :].sum()]
        ])
        ratio_edges = np.exp(d_edges[first : last + 1])
        return {"abs_diff": (abs_counts[:-1], abs_edges), "ratio": (counts, ratio_edges)}


def wait_for_metrics(*args, **kwargs) -> None:
    global wait_for_metrics
    from tim_plugins._mismatch_launch import wait_for_metrics as wait  # imports triton: CUDA path only

    wait_for_metrics = wait
    return wait(*args, **kwargs)


def _collective_device(group) -> torch.device:
    backend = torch.distributed.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fold_signed(hist):
    """Signed d histogram (numpy) → |d| histogram (bin 0 is |d| < E_0, the last bin |d| >= E_K)."""
    centre = (len(hist) - 1) // 2
    folded = hist[centre:].copy()  # bin i >= 1 holds +d of |d| bin i; add the mirrored −d bin
    folded[1:] += hist[:centre][::-1]
    return folded


def _hist_quantiles(abs_counts, qs: tuple[float, ...], exact_max: float) -> list[float]:
    """For each q: the upper edge of the bin holding the q-quantile of |d|, capped at the exact max; 0.0 if it
    lies below the histogram's resolution (1e-8)."""
    cum = abs_counts.cumsum()
    total = float(cum[-1]) if cum.size else 0.0
    if total <= 0:
        return [math.nan] * len(qs)
    # First bin whose cumulative count reaches q·N.
    found = cum.searchsorted([q * total for q in qs], side="left").tolist()
    edges = _BIN_EDGES_LIST
    return [0.0 if i == 0 else min(edges[i] if i < len(edges) else math.inf, exact_max) for i in found]


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
