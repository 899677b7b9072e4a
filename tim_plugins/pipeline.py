"""The per-step TIM pipeline: what every adapter runs per batch, per optimizer step and per logging window.

Framework-neutral (torch only). An adapter translates its framework's tensors into [B, T] response-aligned
tensors and calls, in this order:

  measure(rollout, train, mask, safe=...)   once per batch of responses, with the trainer's log-probs of the
                                            rollout's tokens at the rollout's weights (the measurement point):
      1. boundary tokens (sampled, outside the trainer's safe set S) leave the measured tokens
         (safe vocabulary with ``mask_boundary``): their safe log-prob is not the one the rollout drew from;
      2. the IS correction, if configured, on the measured tokens -> per-token weights (0 for a dropped token);
      3. the mismatch monitor over the measured tokens (with the weights the loss applies);
      4. the safe-vocabulary statistics over every response token;
      5. the per-token dump buffers sampled sequences.
     It returns the per-token factor the loss must apply to its policy term (None: leave the loss alone).
  loss_factor(mask, in_safe, weights)       every loss pass: that factor times the pass's own boundary mask.
  loss_pass(rollout, old, current, mask)    every loss pass, where the rollout's log-probs are known: the split of
                                            the log-ratio into staleness (current vs old) and mismatch (old vs
                                            rollout), ``tim_plugins.staleness`` (``tim/staleness/*``, ``tim/split/*``).
  end_step(step, response_length=...)       once per optimizer step: the LR controller's scale, the dump file.
  compute(step)                             once per logging window: every statistic, merged exactly over the
                                            ranks (all must call it), the named causes (``tim_plugins.causes``)
                                            and the live probe's decision.
  close_loss_passes(step)                   where the loss passes end after ``compute`` closed their step's window
                                            (verl): their statistics and the staleness rule that reads them.
  sync_checked(report)                      after a checked weight sync (``tim_plugins.weight_sync``): its causes
                                            are named at once and counted in the next window.

Every statistic is a mergeable accumulator (``MismatchMonitor``, ``SafeVocabStats``, ``CorrectionStats``), so
values are exact whatever the micro-batching and the number of ranks; statistics of an empty set are NaN.
Problems with the inputs are counted under ``tim/diag/<name>`` (running totals, summed over the ranks) and never
raised, unless ``strict``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from .accumulate import all_reduce_sum_max, is_distributed
from .causes import CAUSE_KEYS, CauseConfig, CauseTracker
from .corrections import CorrectionConfig, CorrectionStats, apply_correction
from .dump import DumpConfig, TokenDumper, append_causes
from .lr_control import LengthTriggeredLRDecay, LRDecayConfig
from .metrics import DEFAULT_RATIO_BAND, MismatchMonitor, check_ratio_band
from .parity.probe import ParityProbe, ParityProbeConfig, ProbeDecision
from .safe_vocab import SafeLogprobs
from .safe_vocab_stats import SafeVocabStats, safe_loss_mask
from .by_key import KeyedStats, position_keys
from .staleness import ReusedSplit, SplitStats, split_terms, staleness_metrics

__all__ = ["PipelineConfig", "StepPipeline", "TrainingSetup", "exact_mean", "fit_bins", "length_sums", "mean_length",
           "mean_response_length", "old_logprobs", "pipeline_config", "response_length_sums", "STATE_VERSION"]

logger = logging.getLogger("tim_plugins")
STATE_VERSION = 1


@dataclass
class PipelineConfig:
    """What the pipeline does; every part is off unless set (the monitor is on by default)."""

    monitor: bool = True
    ratio_band: tuple = field(default=DEFAULT_RATIO_BAND, metadata={"help": (
        "(lo, hi) band of rho = pi_train/pi_rollout for tim/token/ratio_outside_frac")})
    safe_vocab: bool = False
    mask_boundary: bool = True
    correction: CorrectionConfig | None = None
    lr_decay: LRDecayConfig | None = None
    probe: ParityProbeConfig | None = None
    dump: DumpConfig | None = None
    staleness: bool = field(default=False, metadata={"help": "split each loss pass's log-ratio into staleness and "
                                                                 "mismatch, and its statistics by policy lag "
                                                                 "(loss_pass; needs the monitor)"})
    exact_split: bool = field(default=True, metadata={"help": "with staleness: the exact split against π_old "
                                                              "(tim/staleness/*, tim/split/*); off where π_old is "
                                                              "never computed (asynchronous trainers), which keeps "
                                                              "the statistics by lag"})
    by_position: bool = field(default=False, metadata={"help": "the mismatch by response position (log-spaced "
                                                                   "buckets, tim/by_position/*; needs the monitor)"})
    by_turn: bool = field(default=False, metadata={"help": "the mismatch by turn of multi-turn rollouts "
                                                           "(tim/by_turn/*, from the turn keys measure is given; "
                                                           "needs the monitor)"})
    causes: CauseConfig | None = field(default=None, metadata={"help": "name what causes a mismatch (a broken "
                                                                        "weight sync, a stale engine, a jump of the "
                                                                        "lag-0 floor, ...; tim/cause/*, needs the "
                                                                        "monitor): its thresholds"})
    strict: bool = False
    compile: bool | Literal["auto"] = "auto"  # MismatchMonitor(compile=...)
    histograms: bool = field(default=False, metadata={"help": "compute() also returns the monitor's histograms"})

    def __post_init__(self) -> None:
        self.ratio_band = check_ratio_band(self.ratio_band)
        if self.lr_decay is not None and "kl_k3" in self.lr_decay.signals and not self.monitor:
            raise ValueError("PipelineConfig: lr_decay.signals has 'kl_k3' but monitor=False: the k3 signal comes "
                             "from the monitor. Fix: monitor=True, or drop 'kl_k3' from the signals.")


@dataclass(frozen=True)
class TrainingSetup:
    """How the adapter's trainer runs, in framework-neutral words: what ``pipeline_config`` derives the pipeline's
    hard-wired parts from. Adapters say which case they are in; the rules live here."""

    asynchronous: bool = False  # samples carry a policy lag; pi_old at every sample's rollout weights is never computed
    # the loss's pi_old is the rollout's own log-probs (verl's bypass mode): no pass scores the batch at its rollout
    # weights before it trains, so there is no exact split either; the statistics by lag stay
    old_is_rollout: bool = False
    multi_turn: bool = True  # rollouts may hold several turns (the adapter passes turn keys to ``measure``)
    loss_factor: bool = True  # the adapter can multiply the loss's per-token policy term (boundary mask, IS weights)


def pipeline_config(*, monitor: bool = True, ratio_band=DEFAULT_RATIO_BAND, safe_vocab: bool = False,
                    mask_boundary: bool = True, correction: CorrectionConfig | None = None,
                    lr_decay: LRDecayConfig | None = None, probe: ParityProbeConfig | None = None,
                    dump: DumpConfig | None = None, strict: bool = False, histograms: bool = False,
                    causes: CauseConfig | None = CauseConfig(),
                    setup: TrainingSetup = TrainingSetup()) -> PipelineConfig:
    """The one place a ``PipelineConfig`` is built: the user's options (each None = off) and the trainer's
    ``setup`` -> the pipeline's configuration. The rules both adapters share:

    - the monitor brings the split of every loss pass (``staleness``) and the mismatch by response position, and by
      turn where rollouts can hold turns; it also brings the named causes (``causes``: their thresholds, None =
      off), whose stream rules read its lag-0 tokens;
    - asynchronous trainers, and trainers whose pi_old is the rollout, have no pi_old at the rollout's weights: no
      exact split, the statistics by lag stay;
    - without a way to scale the loss's policy term, neither the boundary mask nor an IS correction can act.
    """
    return PipelineConfig(
        monitor=monitor, ratio_band=ratio_band, safe_vocab=safe_vocab,
        mask_boundary=mask_boundary and setup.loss_factor,
        correction=correction if setup.loss_factor else None, lr_decay=lr_decay, probe=probe, dump=dump,
        staleness=monitor, exact_split=not (setup.asynchronous or setup.old_is_rollout), by_position=monitor,
        by_turn=monitor and setup.multi_turn, strict=strict, histograms=histograms,
        causes=dataclasses.replace(causes) if monitor and causes is not None else None)  # not the shared default


def old_logprobs(current: torch.Tensor, old: torch.Tensor | None, fresh) -> torch.Tensor:
    """π_old of a loss pass, [B, T]: the trainer's log-probs at the rollout's weights. Rows no optimizer step has
    touched since their rollout (``fresh``: a bool, or a [B] bool tensor, read without a host sync) are scored at
    those weights by this very pass, so π_old is π_θ (``current``) there, whatever the framework stored; elsewhere
    the framework's recomputed ``old`` (None: not computed, so π_θ)."""
    if old is None:
        return current
    if isinstance(fresh, torch.Tensor):
        return torch.where(fresh.view(-1, 1), current, old)
    return current if fresh else old


def mean_response_length(mask: torch.Tensor, *, sync: bool = True, group=None, skip_empty: bool = False) -> float:
    """Mean number of response tokens per sequence of a [B, T] mask (nested [B, j] too): ``mean_length`` of its
    rows' token counts."""
    return exact_mean(response_length_sums(mask, skip_empty=skip_empty), sync=sync, group=group)


def response_length_sums(mask: torch.Tensor, *, skip_empty: bool = False) -> torch.Tensor:
    """(total response tokens, sequences) of a [B, T] mask (nested [B, j] too), a float64 [2] tensor on its device
    for ``exact_mean`` (this rank's part; ``length_sums``)."""
    return length_sums(mask.sum(dim=1), skip_empty=skip_empty)


def length_sums(lengths: torch.Tensor, *, skip_empty: bool = False) -> torch.Tensor:
    """(sum, count) of the [B] per-sequence ``lengths``, a float64 [2] tensor. ``skip_empty``: a length-0 row is not
    a sequence (verl's synthetic padding samples, which make a batch divisible by the DP size, have an all-zero
    response mask)."""
    lengths = lengths.double()
    count = (lengths > 0).sum().double() if skip_empty else torch.tensor(float(lengths.numel()), dtype=torch.float64,
                                                                         device=lengths.device)
    return torch.stack([lengths.sum(), count])


def mean_length(lengths: torch.Tensor, *, sync: bool = True, group=None, skip_empty: bool = False) -> float:
    """Mean of the [B] per-sequence ``lengths``, exact over ``group`` when ``sync`` (every rank must call it); NaN
    without a sequence (``length_sums``' rule for ``skip_empty``)."""
    return exact_mean(length_sums(lengths, skip_empty=skip_empty), sync=sync, group=group)


def exact_mean(total_count: torch.Tensor, *, sync: bool = True, group=None) -> float:
    """total / count of a float64 [2] tensor (total, count), both summed over ``group`` first when ``sync`` (every
    rank must call it); NaN when the count is 0."""
    sums = total_count.double().clone()
    if sync:
        all_reduce_sum_max(sums, torch.empty(0, dtype=torch.float64, device=sums.device), group)
    total, count = sums.tolist()
    return total / count if count > 0 else math.nan


def fit_bins(counts, edges, max_bins: int = 512):
    """Histogram bins for loggers that take at most ``max_bins`` finite edges (wandb): empty outer bins dropped,
    then neighbours merged in pairs until it fits (counts are summed, the total is unchanged)."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    nz = np.nonzero(counts)[0]
    if nz.size:
        counts, edges = counts[nz[0]: nz[-1] + 1], edges[nz[0]: nz[-1] + 2]
    else:
        counts, edges = counts[:1], edges[:2]
    while counts.size > max_bins:
        if counts.size % 2:
            counts, edges = np.append(counts, 0.0), np.append(edges, edges[-1])
        counts = counts.reshape(-1, 2).sum(axis=1)
        edges = np.append(edges[:-1:2], edges[-1])
    finite = np.finfo(np.float64)
    edges = np.clip(np.nan_to_num(edges, posinf=finite.max, neginf=-finite.max), -finite.max, finite.max)
    return counts, edges


class StepPipeline:
    """The per-step pipeline (see the module docstring). One per process; ``rank`` names its dump files.
    ``writes=False``: a process that computes what another one writes (a sequence-parallel rank other than the one
    the framework collects outputs from) writes no dump file and no cause line, and measures all the same."""

    def __init__(self, config: PipelineConfig | None = None, *, rank: int = 0, framework: str | None = None,
                 writes: bool = True) -> None:
        self.config = c = config if config is not None else pipeline_config()
        self.rank = int(rank)
        self.writes = bool(writes)
        self.monitor = MismatchMonitor(c.ratio_band, compile=c.compile) if c.monitor else None
        # staleness: π_θ of each loss pass against π_old (the monitor's measurement point), and the variance split
        on = c.monitor and c.staleness
        self.staleness_monitor = MismatchMonitor(c.ratio_band, compile=c.compile, prefix="tim/staleness") \
            if on and c.exact_split else None
        self.split_stats = SplitStats() if on and c.exact_split else None
        self.reused_split = ReusedSplit() if on and c.exact_split else None  # the staleness rule's tokens
        self.by_lag = KeyedStats("lag") if on else None
        self.by_position = KeyedStats("position") if c.monitor and c.by_position else None
        self.by_turn = KeyedStats("turn") if c.monitor and c.by_turn else None
        wants_k3 = c.lr_decay is not None and "kl_k3" in c.lr_decay.signals
        self._step_monitor = MismatchMonitor(c.ratio_band, compile=c.compile) if wants_k3 else None
        self._last_k3 = math.nan  # end_step(carry_k3=True): the last measured step k3
        self.safe_vocab_stats = SafeVocabStats() if c.safe_vocab else None
        self.correction_stats = CorrectionStats() if c.correction is not None else None
        self.lr_controller = LengthTriggeredLRDecay(c.lr_decay) if c.lr_decay is not None else None
        self.probe = ParityProbe(c.probe) if c.probe is not None else None
        self.dumper = TokenDumper(c.dump) if c.dump is not None else None
        # the named causes: their stream rules read the monitor's lag-0 tokens; ``framework`` words the fix line
        self.causes = CauseTracker(c.causes, framework=framework) if c.causes is not None and c.monitor else None
        self.diag: dict[str, float] = {}
        self._diag_merged: tuple[dict, dict] | None = None  # (totals over the ranks, this rank's) at the last merge
        self._unknown_lag: torch.Tensor | None = None  # tokens of unknown policy lag since the last compute (device)
        self._warned: set[str] = set()
        self._dump_buffer: list[tuple[torch.Tensor, ...]] = []
        self._written_early: list = []  # the causes found at a sync since the last window, written (_write_found)

    @property
    def measures(self) -> bool:
        """Whether ``measure`` has anything to do (a statistic, a correction or the dump is on)."""
        return any(x is not None for x in (self.monitor, self.safe_vocab_stats, self.correction_stats, self.dumper))

    # ------------------------------------------------------------------------------------------ per batch
    def count(self, name: str, n: float = 1.0, detail: str | None = None) -> None:
        """Count a problem under ``tim/diag/<name>`` and log it once (``detail`` says what happened); strict
        mode raises instead."""
        if self.config.strict:
            raise RuntimeError(f"tim_plugins (strict): diagnostic problem '{name}'" + (f": {detail}" if detail else ""))
        self.diag[name] = self.diag.get(name, 0.0) + n
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("tim_plugins: %s%s (counted under tim/diag/%s; further occurrences not logged)", name,
                           f" ({detail})" if detail else "", name)

    def feature_off(self, name: str) -> None:
        """Record a feature the adapter switched off because an upstream hook moved (the adapter has warned once):
        ``tim/diag/feature_off/<name>``, 1 per rank."""
        self.diag[f"feature_off/{name}"] = 1.0

    def measure(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, *,
                safe: SafeLogprobs | None = None, is_weights: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None, step: int = 0,
                turn: torch.Tensor | None = None) -> torch.Tensor | None:
        """One batch at the measurement point.

        Args:
            rollout: [B, T] the engine's log-probs of the sampled tokens.
            train: [B, T] the trainer's log-probs of the same tokens at the rollout's weights.
            mask: [B, T] response tokens the loss sees.
            safe: with the safe vocabulary, the trainer's ``SafeLogprobs`` of this pass, fields shaped [B, T]
                (``logprobs`` may be None: ``train`` holds them).
            is_weights: [B, T] weights the framework itself applies (e.g. TRL's own vLLM correction), for the
                monitor's ``tim/is/*``; ignored when the pipeline's own correction runs.
            token_ids: [B, T] sampled token ids, for the dump.
            step: the optimizer step the batch trains (the dump's file name).
            turn: [B, T] turn index of each token in multi-turn rollouts (``by_key.turn_keys``), for
                ``tim/by_turn/*``; None for single-turn batches.
        Returns:
            [B, T] factor for the loss's policy term (IS weight; 0 for a token the boundary mask or the
            correction drops), or None when nothing changes the loss.
        """
        if rollout.shape != train.shape or mask.shape != train.shape or train.dim() != 2:
            self.count("shape_mismatch", detail=f"[B, T] each: rollout {tuple(rollout.shape)}, trainer "
                       f"{tuple(train.shape)}, mask {tuple(mask.shape)}")
            return None
        if not (rollout.is_floating_point() and train.is_floating_point()):
            self.count("logprobs_not_float", detail=f"rollout {rollout.dtype}, trainer {train.dtype}")
            return None
        if is_weights is not None and is_weights.shape != train.shape:
            # the framework's own weights are read for tim/is/* alone: the batch is measured without them
            self.count("shape_mismatch", detail=f"is_weights {tuple(is_weights.shape)} for log-probs "
                       f"{tuple(train.shape)} (a weight per sequence is not read)")
            is_weights = None
        measured = mask.bool()
        if safe is not None:
            if self.safe_vocab_stats is not None:
                self.safe_vocab_stats.update(measured, safe.in_safe, safe.pruned_mass, safe.size)
            if self.config.mask_boundary:
                measured = measured & safe.in_safe.bool()
        elif self.safe_vocab_stats is not None:
            self.count("safe_vocab_mask_unavailable")
        weights = None  # the boundary mask alone is applied by each loss pass (loss_factor)
        if self.config.correction is not None:
            res = apply_correction(self.config.correction, train.detach(), rollout.detach(), measured)
            self.correction_stats.update(res)
            weights, is_weights = res.weights.to(train.dtype), res.weights
        for monitor in (self.monitor, self._step_monitor):
            if monitor is not None:
                monitor.update(rollout, train, measured, is_weights=is_weights)
        if self.causes is not None:
            self.causes.update(rollout, train, measured)
        if self.by_position is not None:
            self.by_position.update(rollout, train, measured, position_keys(measured))
        if self.by_turn is not None and turn is not None:
            self.by_turn.update(rollout, train, measured, turn)
        if self.dumper is not None and self.writes and token_ids is not None and self.dumper.wants(step):
            self._dump_buffer.append((rollout.detach(), train.detach(), measured, token_ids))
        return weights

    def loss_pass(self, rollout: torch.Tensor, old: torch.Tensor | None, current: torch.Tensor, mask: torch.Tensor,
                  lag: torch.Tensor | None = None) -> None:
        """One loss pass over a batch whose rollout log-probs are known: [B, T] ``rollout``, ``old`` (the trainer at
        the rollout's weights, the monitor's ``train``) and ``current`` (this pass's log-probs, π_θ), ``mask`` the
        tokens the pass trains, ``lag`` [B, T] each token's policy lag in optimizer steps (``tim/by_lag/*`` of the
        whole log-ratio current − rollout: lag 0 is the mismatch floor). Where nothing is reused the adapter passes
        ``old`` as ``current``: staleness 0. ``old`` None: π_old is not available (asynchronous trainers), so there
        is no exact split, only the statistics by lag."""
        if self.by_lag is None:
            return
        shapes = [t.shape for t in (rollout, current, mask) + ((old,) if old is not None else ())]
        if any(s != shapes[0] for s in shapes):
            self.count("shape_mismatch", detail=f"loss pass: rollout, current, mask{', old' if old is not None else ''}"
                       f" {[tuple(s) for s in shapes]}")
            return
        if old is not None and self.staleness_monitor is not None:
            self.staleness_monitor.update(old.detach(), current.detach(), mask.bool())
            terms = split_terms(rollout, old, current, mask)  # once for both splits
            self.split_stats.add_terms(*terms)
            if lag is not None:
                self.reused_split.add_terms(*terms, lag)
        if lag is not None:
            self.by_lag.update(rollout, current, mask, lag)

    def measure_lagged(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor,
                       **kwargs) -> torch.Tensor | None:
        """``measure`` for an asynchronous trainer, whose batch mixes samples drawn by several policy versions.
        ``lag``: [B, T] (or [B], per sample) each token's policy lag in optimizer steps at this pass, -1 where it is
        unknown. Only lag-0 tokens were scored at their rollout's weights, so they alone are measured (the mismatch
        floor); tokens of unknown lag are summed on the device and counted once per ``compute`` under
        ``tim/diag/async_lag_unknown`` (no host read per call). Other arguments: ``measure``'s."""
        mask, lag = self._lagged(mask, lag)
        unknown = (mask & (lag < 0)).sum()
        self._unknown_lag = unknown if self._unknown_lag is None else self._unknown_lag + unknown
        return self.measure(rollout, train, mask & (lag == 0), **kwargs)

    def loss_pass_lagged(self, rollout: torch.Tensor, current: torch.Tensor, mask: torch.Tensor,
                         lag: torch.Tensor) -> None:
        """``loss_pass`` for an asynchronous trainer: π_old at every sample's rollout weights is never computed, so
        there is no exact split, only the statistics by lag (``tim/by_lag/*``) of the tokens whose lag is known
        (``lag`` as in ``measure_lagged``)."""
        mask, lag = self._lagged(mask, lag)
        self.loss_pass(rollout, None, current, mask & (lag >= 0), lag=lag.clamp(min=0))

    @staticmethod
    def _lagged(mask: torch.Tensor, lag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lag = lag.long()
        if lag.dim() == 1:
            lag = lag.view(-1, 1)
        return mask.bool(), lag.expand(mask.shape)

    def _count_unknown_lag(self) -> None:
        if self._unknown_lag is None:
            return
        unknown, self._unknown_lag = int(self._unknown_lag), None
        if unknown:
            self.count("async_lag_unknown", unknown,
                       detail="tokens whose sample's policy version is unknown (no weight-version tag)")

    def sync_checked(self, report) -> None:
        """A checked weight sync (``weight_sync.SyncReport``): its causes are logged and written beside the dump now
        and named in the next window's ``tim/cause/*`` (nothing happens when the causes are off)."""
        if self.causes is not None:
            self._write_found(self.causes.add_sync(report))

    def probed(self, causes) -> None:
        """The causes a lag-0 probe named after a weight sync (``lag0_probe.Lag0Probe.judge``): logged and written
        now and named in the next window's ``tim/cause/*``, like a sync check's."""
        if self.causes is not None:
            self._write_found(self.causes.add_found(causes))

    def _write_found(self, found: list) -> None:
        """Causes found at a sync, written beside the dump now rather than when the next window closes: the sync
        after a run's last step (verl syncs after every step; the step the probe stopped at) has no next window.
        Each row's window is the step after the cause's own (the sync after optimizer step s is named in window
        s + 1); the window that names them then leaves them out (``_write_causes``)."""
        for cause in found:
            self._write_causes(cause.step + 1, [cause])
        self._written_early.extend(found)

    def audited(self, error_codes) -> None:
        """The parity audit's error codes, for the causes' rules (the truncation rule reads them)."""
        if self.causes is not None:
            self.causes.audited(error_codes)

    @staticmethod
    def loss_factor(mask: torch.Tensor, in_safe: torch.Tensor | None,
                    weights: torch.Tensor | None) -> torch.Tensor | None:
        """The factor one loss pass applies to its policy term: the measured ``weights`` (or None) times the
        pass's own boundary mask (``in_safe`` of this pass, or None when the safe vocabulary is off / boundary
        tokens stay in the loss)."""
        if in_safe is None:
            return weights
        keep, _ = safe_loss_mask(mask, in_safe)
        keep = keep.to(weights.dtype if weights is not None else torch.float32)
        return keep if weights is None else weights * keep

    # ------------------------------------------------------------------------------------------- per step
    def end_step(self, step: int, *, response_length: float = math.nan, grad_norm: float | None = None,
                 sync: bool = True, group=None, carry_k3: bool = False) -> float | None:
        """Close one optimizer step: write the step's dump file, feed the LR controller (its k3 signal merged
        over ``group`` when ``sync``). Returns the LR scale in force from the next step, or None without LR
        decay. ``carry_k3``: when nothing was measured since the last call (the merged k3 is NaN), the last measured
        k3 stands, for an adapter whose one measurement pass covers several optimizer steps (verl's old-log-prob pass
        over the batch its mini-batches and PPO epochs train on); otherwise the signal is missing that step."""
        self.flush_dump(step)
        if self.lr_controller is None:
            return None
        signals = {}
        if self._step_monitor is not None:
            k3 = self._step_monitor.compute(sync=sync, group=group)["tim/token/kl_k3"]
            self._step_monitor.reset()
            if carry_k3 and math.isnan(k3):
                k3 = self._last_k3
            self._last_k3 = k3
            signals["kl_k3"] = k3
        if "grad_norm" in self.lr_controller.config.signals:
            signals["grad_norm"] = math.nan if grad_norm is None else float(grad_norm)
        return self.lr_controller.observe(step, response_length, **signals)

    def flush_dump(self, step: int) -> None:
        """Write the sequences ``measure`` buffered as the dump file of ``step`` (nothing buffered: nothing
        written). ``end_step`` calls it; an adapter whose measurement pass ends before its optimizer steps (verl's
        old-log-prob pass) calls it there."""
        buf, self._dump_buffer = self._dump_buffer, []
        if not buf:
            return
        width = max(x[0].shape[1] for x in buf)

        def cat(i, value):
            return torch.cat([torch.nn.functional.pad(x[i], (0, width - x[i].shape[1]), value=value) for x in buf])

        try:
            self.dumper.write(step, cat(0, 0.0), cat(1, 0.0), cat(2, False), cat(3, 0), rank=self.rank)
        except Exception as err:  # a dump problem never breaks the training step
            self.count("dump_failed", detail=repr(err))

    # ------------------------------------------------------------------------------------ per log window
    def compute(self, step: int, *, sync: bool = True, group=None, loss_passes: bool = True,
                raise_on_trip: bool = True):
        """(metrics, probe decision or None, histograms or None) of the window since the last call, then reset.

        Every rank must call it when ``sync`` (the statistics are merged over ``group``). Histograms (the
        monitor's |Δ log p| and ρ, for ``config.histograms``) are fitted to 512 bins. ``loss_passes=False`` leaves
        the loss passes' statistics to ``compute_loss_passes`` (an adapter that merges them on their own);
        ``raise_on_trip=False`` returns a probe decision to raise instead of raising (``ParityProbe.check``)."""
        out: dict[str, float] = {}
        decision, hists = None, None
        if self.monitor is not None:
            if self.monitor.updates > 0 or (sync and is_distributed(group)):
                out.update(self.monitor.compute(sync=sync, group=group))
                if self.config.histograms:
                    hists = {k: fit_bins(*v) for k, v in self.monitor.histograms(sync=sync, group=group).items()}
            self.monitor.reset()
        if loss_passes:
            out.update(self.compute_loss_passes(sync=sync, group=group))
        if self.causes is not None:  # after the split: the staleness rule reads it
            values, named = self.causes.evaluate(step, out, sync=sync, group=group)
            out.update(values)
            self._write_causes(step, named, closing=True)
        if self.monitor is not None and self.probe is not None:
            decision = self.probe.check(step, out, raise_on_trip=raise_on_trip)
            out.update(decision.metrics())
        for stats in (self.safe_vocab_stats, self.correction_stats, self.by_position, self.by_turn):
            if stats is not None and (not stats.empty or (sync and is_distributed(group))):
                out.update(stats.compute(sync=sync, group=group))
                stats.reset()
        if self.lr_controller is not None:
            out.update(self.lr_controller.metrics())
        self._count_unknown_lag()
        out.update({f"tim/diag/{k}": v for k, v in self._merged_diag(sync, group).items()})
        return out, decision, hists

    def close_loss_passes(self, step: int, *, sync: bool = True, group=None,
                          raise_on_trip: bool = True) -> tuple[dict[str, float], ProbeDecision | None]:
        """``compute_loss_passes`` for an adapter whose loss passes end after ``compute`` closed the window of
        ``step`` (verl), with the rule that reads them: the staleness cause, named in that window
        (``CauseTracker.evaluate_loss_passes``: ``tim/cause/named`` counts it), written beside the dump and acted on
        by the probe as ``compute`` would. Returns (metrics, the probe's decision on the new causes or None)."""
        out = self.compute_loss_passes(sync=sync, group=group)
        decision = None
        if self.causes is not None:
            values, named = self.causes.evaluate_loss_passes(step, out)
            out.update(values)
            self._write_causes(step, named)
            if named and self.monitor is not None and self.probe is not None:
                decision = self.probe.check_causes(step, values[CAUSE_KEYS[0]], raise_on_trip=raise_on_trip)
        return out, decision

    def _write_causes(self, step: int, named: list, *, closing: bool = False) -> None:
        """Newly named causes beside the dump, for the report's verdict (rank 0), with the step of the window that
        named them (a resumed run's ``dump.supersede_from`` sorts them by it). ``closing``: the window that names
        the causes found at a sync since the last one, which ``_write_found`` wrote already."""
        if closing:
            early, self._written_early = self._written_early, []
            named = [x for x in named if x not in early]
        if named and self.dumper is not None and self.writes and self.rank == 0:
            try:
                append_causes(self.dumper.config.out_dir, named, window=step)
            except OSError as err:
                self.count("dump_failed", detail=repr(err))

    def compute_loss_passes(self, *, sync: bool = True, group=None) -> dict[str, float]:
        """The statistics of the loss passes alone (``loss_pass``: ``tim/staleness/*``, ``tim/split/*``,
        ``tim/by_lag/*``) since the last call, merged over ``group`` when ``sync`` (every rank must call it), then
        reset. ``compute`` includes them; an adapter whose loss passes end after its measurement window was merged
        (verl: the actor update after the old-log-prob pass) calls this at the end of the update."""
        out: dict[str, float] = {}
        if self.staleness_monitor is not None:
            if self.staleness_monitor.updates > 0 or (sync and is_distributed(group)):
                out.update(staleness_metrics(self.staleness_monitor.compute(sync=sync, group=group)))
            self.staleness_monitor.reset()
        for stats in (self.split_stats, self.reused_split, self.by_lag):
            if stats is not None and (not stats.empty or (sync and is_distributed(group))):
                out.update(stats.compute(sync=sync, group=group))
                stats.reset()
        return out

    def _merged_diag(self, sync: bool, group) -> dict[str, float]:
        """The problem counts (running totals), summed over ``group`` when ``sync``: a problem one rank met is
        counted in what every rank logs. The names a rank met are unknown to the others, so they travel as
        objects (one gather per logging window)."""
        if not (sync and is_distributed(group)):
            return dict(self.diag)
        gathered: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, self.diag, group=group)
        total: dict[str, float] = {}
        for counts in gathered:
            for name, n in counts.items():
                total[name] = total.get(name, 0.0) + n
        self._diag_merged = (dict(total), dict(self.diag))  # what a checkpoint carries (state_dict)
        return dict(sorted(total.items()))

    # -------------------------------------------------------------------------------------- checkpoints
    # What is the same on every rank (fed the merged metrics): a rank that resumes from another rank's state (TRL
    # saves the main process's alone) takes only these (``load_state_dict(shared_only=True)``).
    SHARED_STATE = ("lr_controller", "probe", "causes")

    def state_dict(self) -> dict:
        """Everything to resume from. The problem counts (``diag``) are the totals over the ranks at the last
        merged window plus this rank's since (a count another rank met since is lost on resume), so that the rank
        whose state is saved carries everybody's; the statistics of a window in progress are this rank's own."""
        part = lambda x: x.state_dict() if x is not None else None  # noqa: E731
        diag = dict(self.diag)
        if self._diag_merged is not None:
            total, mine = self._diag_merged
            diag = {k: total.get(k, 0.0) + diag.get(k, 0.0) - mine.get(k, 0.0) for k in {*total, *diag}}
        # tokens of unknown lag since the last window, counted into diag only when it closes (one host read there)
        unknown = int(self._unknown_lag) if self._unknown_lag is not None else 0
        if unknown:
            diag["async_lag_unknown"] = diag.get("async_lag_unknown", 0.0) + unknown
        return {
            "version": STATE_VERSION, "monitor": part(self.monitor), "step_monitor": part(self._step_monitor),
            "staleness_monitor": part(self.staleness_monitor), "split": part(self.split_stats),
            "reused_split": part(self.reused_split), "by_lag": part(self.by_lag),
            "by_position": part(self.by_position), "by_turn": part(self.by_turn),
            "safe_vocab": part(self.safe_vocab_stats), "correction": part(self.correction_stats),
            "lr_controller": part(self.lr_controller), "probe": part(self.probe), "causes": part(self.causes),
            "diag": dict(sorted(diag.items())),
        }

    def load_state_dict(self, state: dict, *, shared_only: bool = False) -> None:
        """Resume from ``state``. ``shared_only``: the state is another rank's (TRL checkpoints the main process's
        alone): only ``SHARED_STATE`` is taken; this rank's statistics and problem counts start empty (the saved
        rank's carry the window in progress and every rank's counts, ``state_dict``), so nothing is counted twice
        when the ranks merge."""
        if state.get("version") != STATE_VERSION:
            raise RuntimeError(f"tim_plugins: pipeline state version {state.get('version')!r} != {STATE_VERSION}; "
                               "this tim-plugins release cannot resume it")
        for name, obj in (("monitor", self.monitor), ("step_monitor", self._step_monitor),
                          ("staleness_monitor", self.staleness_monitor), ("split", self.split_stats),
                          ("reused_split", self.reused_split), ("by_lag", self.by_lag),
                          ("by_position", self.by_position), ("by_turn", self.by_turn),
                          ("safe_vocab", self.safe_vocab_stats), ("correction", self.correction_stats),
                          ("lr_controller", self.lr_controller), ("probe", self.probe), ("causes", self.causes)):
            if obj is not None and state.get(name) and (name in self.SHARED_STATE or not shared_only):
                obj.load_state_dict(state[name])
        self.diag = {} if shared_only else dict(state.get("diag") or {})
        self._diag_merged = None
