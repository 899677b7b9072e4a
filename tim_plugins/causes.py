"""What is causing the mismatch: named causes, one registry, and the rules that name them.

The monitor measures how far the engine's and the trainer's log-probs of the same tokens disagree; this module says
*why*, where the evidence allows. Each cause is a stable code in ``CAUSES`` (title, why it matters, the rule that
names it, the knobs that fix it in the core's words; a trainer framework's words are its adapter's data,
``tim_plugins.fixes``, merged by ``CauseInfo.fix``). The registry feeds the README / docs table
(``causes_markdown``), the console line (``Cause.line``), the report's verdict and the ``tim/cause/*`` metrics.

Families, and where their evidence comes from:

- **a broken weight sync** (``sync-*``): the engine does not hold what the trainer sent at a weight sync
  (``tim_plugins.weight_sync``: an adapter hands the sent tensors and a reader of the engine's weights);
- **an engine that does not follow the sync** (``probe-*``): where the engine's weights cannot be read (a remote
  server), a fixed batch scored by both sides after each sync (``tim_plugins.lag0_probe``): the engine's answers did
  not move while the trainer's did, or their per-token gap moved away from the one at lag 0;
- **a stale engine** (``engine-stale``): lag-0 tokens the engine was confident in (p_rollout >= ``confident_p``) that
  the trainer scores more than ``confident_gap`` nats lower. At lag 0 both sides should hold the same weights, so
  only other weights (or a truncation keeping less than e^-2 of the mass) move a confident token that far; numerics
  move it by at most (e^{2ε} − 1)(1 − p). Where the parity audit found a truncation the trainer does not apply
  (``sampler-truncation-unmatched``), the engine's log-probs are renormalised over the kept tokens and a small kept
  mass moves them that far on any weights: neither this rule nor ``sampler-constrained`` reads the tokens then
  (``truncation`` names the bias; the sync check, or the lag-0 probe, tells a stale engine apart);
- **a constrained sampler** (``sampler-constrained``): lag-0 tokens the engine gave p = 1 exactly (log-prob 0: the
  sampler's distribution held one token, left by structured outputs, a grammar or a logits processor) that the
  trainer scores more than ``confident_gap`` nats lower. Such a token says nothing about the engine's weights: it is
  kept out of ``engine-stale``'s count. Where the parity audit found sampler processing the trainer does not
  recompute (``sampler-penalties-unmatched``: structured outputs, custom logits processors, penalties, logit bias,
  bad words), such processing also leaves a few tokens at a position and moves confident tokens that far, so the
  confident disagreements are named here too, not ``engine-stale`` (the sync check, or the lag-0 probe, tells a stale
  engine apart). Otherwise it is named when ``engine-stale`` is not (an engine on other weights moves the tokens it
  did not force as well);
- **a jump of the lag-0 floor** (``floor-jump``): the window's mean |Δ log p| at lag 0 above ``floor_jump_factor``
  times the median of the trailing ``floor_window`` windows and ``floor_jump_min`` nats above it. Not named where
  the parity audit found sampler processing the trainer does not apply (``sampler-truncation-unmatched``,
  ``sampler-penalties-unmatched``): the floor is then the kept mass's or the penalties' bias, not the two stacks'
  numerics, and it moves with each batch's distributions (vLLM's min-p 0.05 on the toy model: 0.013-0.025 nats at
  odd steps, 0.07-0.13 at even ones, every weight synced); ``tim/cause/floor_jump`` still reports the ratio;
- **staleness** (``staleness``): the policy moved between sampling and the loss pass, and that part of the
  log-ratio is what makes it unhealthy (``tim/split/*``, ``tim/staleness/*`` of ``tim_plugins.staleness``; an
  asynchronous trainer, which computes no π_old at each sample's weights, or one whose π_old is the rollout (verl's
  bypass mode): ``tim/by_lag/*``, the stale tokens' k3 above the lag-0 floor);
- **truncation** (``truncation``): the sampler truncates and the trainer does not (the parity audit's
  ``sampler-truncation-unmatched``), and the measured ρ shows the kept-mass bias.

Numerics (dtype, kernels) stay the default explanation of a measured mismatch when no cause is named: that is what
the parity audit and its fixes address.

Adapters do not call the rules themselves: the per-step pipeline (``tim_plugins.pipeline.StepPipeline``) owns a
`CauseTracker` (``PipelineConfig.causes``), feeds it every measured batch and every sync check, and evaluates it in
``compute``: ``tim/cause/*`` (``CAUSE_KEYS``), one console line per newly named cause, and a trip of the live probe
(warn / raise / stop) when a cause is named and the probe is on.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable

import torch

from tim_plugins._mismatch_layout import valid_logprob_pair
from tim_plugins.accumulate import all_reduce_sum_max, collective_device, is_distributed
from tim_plugins.cause_registry import (CAUSE_KEYS, CAUSE_PREFIX, CAUSES, FLOOR_JUMP_MIN, UNMATCHED_PROCESSING, Cause,
                                        CauseInfo, cause_fix, causes_markdown, run_summary_lines, summarize_names,
                                        tally_cause, tally_window)

__all__ = [
    "CAUSES", "CAUSE_KEYS", "CAUSE_PREFIX", "Cause", "CauseConfig", "CauseInfo", "CauseTracker", "FloorHistory",
    "UNMATCHED_PROCESSING", "cause_fix", "causes_markdown", "confident_disagreements", "run_summary_lines",
    "summarize_names", "tally_cause", "tally_window", "window_by_lag",
]

logger = logging.getLogger("tim_plugins.causes")

@dataclass
class CauseConfig:
    """The thresholds of the stream rules (the sync check has its own, ``weight_sync.SyncCheckConfig``). Where the
    defaults were measured (fault-free runs and faulty ones): docs/causes.md, "Thresholds"."""

    confident_p: float = field(default=0.5, metadata={"help": (
        "a lag-0 token counts as confident when the engine gave it p >= this")})
    confident_gap: float = field(default=2.0, metadata={"help": (
        "... and disagrees when the trainer scores it more than this many nats lower")})
    confident_min_tokens: int = field(default=2, metadata={"help": (
        "engine-stale is named when a window holds at least this many confident disagreements")})
    floor_jump_factor: float = field(default=4.0, metadata={"help": (
        "floor-jump: the window's lag-0 mean |Δ log p| above this times the trailing median ...")})
    floor_jump_min: float = field(default=FLOOR_JUMP_MIN, metadata={"help": (
        "... and more than this many nats above it")})
    floor_window: int = field(default=8, metadata={"help": "windows in the trailing median of the lag-0 floor"})
    floor_min_tokens: int = field(default=16, metadata={"help": (
        "floor-jump: a window with fewer lag-0 tokens is neither judged nor kept in the trailing median (one tail "
        "token moves a mean over a handful of them past the rule's margins; an asynchronous trainer's window may "
        "hold few lag-0 tokens)")})
    staleness_share: float = field(default=0.5, metadata={"help": (
        "staleness is named when its part explains at least this share of Var(log-ratio) (an asynchronous "
        "trainer: of the k3 of the tokens trained at lag >= 1, their k3 above the lag-0 floor) ...")})
    staleness_k3: float = field(default=0.015, metadata={"help": (
        "... and its k3 (the policy's move since sampling) is above this: PPO's usual early stop of updates on one "
        "batch, 1.5 x a target KL of 0.01 (a reused batch below it is ordinary PPO, not a cause)")})
    truncation_bias: float = field(default=0.02, metadata={"help": (
        "truncation is named when the audit found it unmatched and the mean ρ is below 1 - this")})

    def __post_init__(self) -> None:
        checks = {
            "confident_p": (0.0 < self.confident_p < 1.0, "must be in (0, 1)"),
            "confident_gap": (self.confident_gap > 0 and math.isfinite(self.confident_gap), "must be > 0"),
            "confident_min_tokens": (_whole(self.confident_min_tokens), "must be an integer >= 1"),
            "floor_jump_factor": (self.floor_jump_factor > 1 and math.isfinite(self.floor_jump_factor),
                                  "must be > 1"),
            "floor_jump_min": (self.floor_jump_min > 0 and math.isfinite(self.floor_jump_min), "must be > 0 (at 0, "
                               "a floor of exactly 0, an exact-match pipeline's, would name any later rounding a "
                               "jump)"),
            "floor_window": (_whole(self.floor_window), "must be an integer >= 1"),
            "floor_min_tokens": (_whole(self.floor_min_tokens), "must be an integer >= 1"),
            "staleness_share": (0.0 < self.staleness_share <= 1.0, "must be in (0, 1]"),
            "staleness_k3": (self.staleness_k3 > 0 and math.isfinite(self.staleness_k3), "must be > 0"),
            "truncation_bias": (0.0 < self.truncation_bias < 1.0, "must be in (0, 1)"),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                raise ValueError(f"CauseConfig.{name}={getattr(self, name)!r} is invalid: {rule}")


def _whole(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


def confident_disagreements(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, *,
                            p: float = 0.5, gap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(disagreeing, confident, forced) token counts of a [B, T] batch at lag 0, as 0-d tensors on its device (no
    host read): ``confident`` = tokens of ``mask`` with ``p`` <= p_rollout < 1; ``disagreeing`` = those the trainer
    scores more than ``gap`` nats lower; ``forced`` = tokens with p_rollout = 1 (a one-token distribution at the
    sampler: log-prob 0, or a rounding above it) that the trainer scores more than ``gap`` nats lower. Tokens with an invalid log-prob on either
    side (non-finite, a placeholder) are left out, as the monitor leaves them out."""
    keep = mask.bool() & valid_logprob_pair(rollout, train)
    # float32 resolves these thresholds (nats, not ulps): no float64 copies of the batch on every step
    dtype = torch.promote_types(torch.promote_types(rollout.dtype, train.dtype), torch.float32)
    r, t = rollout.detach().to(dtype), train.detach().to(dtype)
    far = t < r - gap
    one_token = keep & (r >= 0)
    confident = keep & (r >= math.log(p)) & ~one_token
    return (confident & far).sum(), confident.sum(), (one_token & far).sum()


class FloorHistory:
    """The lag-0 floor's trailing windows and the jump rule (``judge``): the ratio of a value to the median of the
    last ``window`` values kept (NaN before any); jumped when that ratio exceeds ``factor`` and the value the median
    by more than ``min_gap``. A jumped value is not kept: a floor that stays up keeps being named."""

    def __init__(self, window: int, factor: float, min_gap: float) -> None:
        self.window, self.factor, self.min_gap = int(window), float(factor), float(min_gap)
        self.values: list[float] = []

    def judge(self, value: float) -> tuple[float, bool]:
        """(ratio to the trailing median, jumped); keeps ``value`` unless it jumped. NaN / inf values are neither
        judged nor kept."""
        if not math.isfinite(value):
            return math.nan, False
        if not self.values:
            self.values.append(value)
            return math.nan, False
        median = statistics.median(self.values[-self.window:])
        ratio = value / median if median > 0 else (math.inf if value > 0 else 1.0)
        jumped = ratio > self.factor and value - median > self.min_gap
        if not jumped:
            self.values.append(value)
            del self.values[:-self.window]
        return ratio, jumped

    def median(self) -> float:
        return statistics.median(self.values[-self.window:]) if self.values else math.nan


NAMED_KEPT = 256  # CauseTracker.named's length (the causes of the last windows)
LOGGED_KEPT = 1024  # how many logged causes CauseTracker remembers not to log twice
_FLAG_CODES = tuple(CAUSES)  # one merged flag per code (max over ranks): every rank names the same causes


class CauseTracker:
    """The named causes of a run, window by window (``StepPipeline`` owns one).

    ``update`` takes each measured lag-0 batch (device sums, no host read); ``add_sync`` a sync check's causes
    (``weight_sync.SyncReport``), ``add_found`` other checks' (the lag-0 probe); ``audited`` the parity audit's
    codes; ``evaluate`` closes a window: the merged counts (every rank must call it when ``sync``), the rules,
    ``tim/cause/*`` and the causes named in the window; ``evaluate_loss_passes`` adds the staleness rule's causes
    to it where the loss passes end after it was closed.
    ``framework`` picks the fix words of the console line."""

    def __init__(self, config: CauseConfig | None = None, *, framework: str | None = None) -> None:
        self.config = c = config if config is not None else CauseConfig()
        self.framework = framework
        self.floor = FloorHistory(c.floor_window, c.floor_jump_factor, c.floor_jump_min)
        self.audit_codes: set[str] = set()
        # the last NAMED_KEPT causes named (checkpointed: a cause that persists is named in every window; every one
        # of them is in causes.jsonl beside the dump, which the report reads)
        self.named: list[Cause] = []
        self.tally: dict[str, dict] = {}  # every code the run named: its windows, first and last steps (tally_window)
        self.lag0_k3 = math.nan  # the last lag-0 floor an asynchronous trainer's window measured (the rule by lag)
        self._counts: torch.Tensor | None = None  # [disagreeing, confident, forced], float64, on the batches' device
        self._sync: list[Cause] = []  # sync causes found since the last window
        self._sync_bad = self._sync_checked = -math.inf
        # sync causes of a window a checkpoint cut (load_state_dict): named in it, but the attempt that found them
        # logged them and wrote them beside the dump already
        self._carried: list[Cause] = []
        self._window_codes: set[str] = set()  # the codes named in the last window (evaluate_loss_passes adds to it)
        # the causes logged, the last LOGGED_KEPT (a sync cause's key holds its step: one per faulty sync)
        self._logged: dict[tuple, None] = {}

    # ------------------------------------------------------------------------------------------- inputs
    def update(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor) -> None:
        """One measured batch ([B, T] log-probs at lag 0 and the measured tokens)."""
        c = self.config
        counts = torch.stack(confident_disagreements(rollout, train, mask, p=c.confident_p,
                                                     gap=c.confident_gap)).double()
        # onto the batch's device: counts carried from a checkpoint sit on the CPU (no host copy per batch)
        self._counts = counts if self._counts is None else self._counts.to(counts.device) + counts

    def add_sync(self, report) -> list[Cause]:
        """A sync check's result (``weight_sync.SyncReport``): its causes are named in the next window and logged
        now (the sync happens between windows; the line should not wait for the step's end). Returns the causes
        new to the window (``add_found``)."""
        self._sync_bad = max(self._sync_bad, float(report.bad_tensors))
        self._sync_checked = max(self._sync_checked, float(report.checked_tensors))
        return self.add_found(report.causes)

    def add_found(self, causes: Iterable[Cause]) -> list[Cause]:
        """Causes an adapter's check found between windows (a sync check's, the lag-0 probe's,
        ``tim_plugins.lag0_probe``): named in the next window, logged now. Returns those new to the window."""
        new = []
        for cause in causes:
            # the same fault found on several replicas (verl hands a rank every replica's sync report; two pipeline
            # stages each read their own rollout server): one cause, as the console logs it once
            if cause not in self._sync:
                self._sync.append(cause)
                new.append(cause)
            self._log(cause)
        return new

    def drop_window(self) -> None:
        """Forget the window in progress (its stream counts, the causes its sync checks found, those carried into
        it): ``evaluate`` after closing it, an adapter switched off before it closed."""
        self._counts, self._sync, self._carried = None, [], []
        self._sync_bad = self._sync_checked = -math.inf

    def audited(self, codes: Iterable[str]) -> None:
        """The parity audit's error codes (the truncation rule needs ``sampler-truncation-unmatched``, which also
        keeps the confident-token rules quiet; the constrained sampler's ``sampler-penalties-unmatched``)."""
        self.audit_codes = set(codes)

    # ------------------------------------------------------------------------------------------ windows
    def evaluate(self, step: int, metrics: dict, *, sync: bool = True, group=None) -> tuple[dict, list[Cause]]:
        """Close the window ending at ``step``: (``tim/cause/*`` values, the causes named in it). ``metrics`` are
        the window's merged pipeline metrics (the monitor's ``tim/token/*``, the split's ``tim/split/*``)."""
        c = self.config
        reduce = sync and is_distributed(group)
        device = collective_device(group) if reduce else "cpu"
        sums = (self._counts.to(device) if self._counts is not None
                else torch.zeros(3, dtype=torch.float64, device=device)).clone()
        flags = [1.0 if any(x.code == code for x in self._sync) else -math.inf for code in _FLAG_CODES]
        maxes = torch.tensor([self._sync_bad, self._sync_checked, *flags], dtype=torch.float64, device=device)
        if reduce:
            all_reduce_sum_max(sums, maxes, group)
        disagreeing, confident, forced = sums.tolist()
        bad, checked, *flag_values = maxes.tolist()
        found: list[Cause] = list(self._sync)
        if reduce and any(flag > 0 for flag in flag_values):
            # a check found a cause on some rank: every rank sees the same merged flags, so every rank gathers
            found.extend(self._other_ranks_causes(found, group))
        for code, flag in zip(_FLAG_CODES, flag_values):  # named on another rank, its details not received
            if flag > 0 and not any(x.code == code for x in found):
                found.append(Cause(code, step, f"{CAUSES[code].title} (found on another rank; its log has the "
                                                f"tensors)"))
        constrained = "sampler-penalties-unmatched" in self.audit_codes
        # the kept-mass renormalisation moves confident tokens on any weights (the module docstring)
        truncated = "sampler-truncation-unmatched" in self.audit_codes
        if disagreeing >= c.confident_min_tokens and not constrained and not truncated:
            found.append(Cause("engine-stale", step,
                               f"{int(disagreeing)} of {int(confident)} lag-0 tokens the engine gave p >= "
                               f"{c.confident_p:g} are scored > {c.confident_gap:g} nats lower by the trainer",
                               evidence={"confident_disagreements": disagreeing, "confident_tokens": confident}))
        elif forced + (disagreeing if constrained else 0) >= c.confident_min_tokens and not truncated:
            seen = [f"{int(forced)} lag-0 tokens the engine gave p = 1 (its sampler left one token: structured "
                    f"outputs, a grammar, a logits processor)"] if forced else []
            if constrained and disagreeing:
                seen.append(f"{int(disagreeing)} of {int(confident)} lag-0 tokens the engine gave p >= "
                            f"{c.confident_p:g} under the sampler processing the parity audit found "
                            f"(sampler-penalties-unmatched)")
            found.append(Cause("sampler-constrained", step,
                               f"{' and '.join(seen)} are scored > {c.confident_gap:g} nats lower by the trainer",
                               evidence={"forced_disagreements": forced, "confident_disagreements": disagreeing,
                                         "confident_tokens": confident, "audit_processing": constrained}))
        floor, tokens = metrics.get("tim/token/abs_diff_mean"), metrics.get("tim/tokens")
        enough = tokens is None or not tokens < c.floor_min_tokens  # a window without the count is judged
        ratio, jumped = self.floor.judge(float(floor)) if floor is not None and enough else (math.nan, False)
        # sampler processing the trainer does not apply makes the floor its bias, which moves batch by batch
        if jumped and not self.audit_codes.intersection(UNMATCHED_PROCESSING):
            found.append(Cause("floor-jump", step,
                               f"lag-0 mean |Δ log p| {floor:.3g} is {ratio:.3g}x its trailing median "
                               f"{self.floor.median():.3g}", evidence={"floor": floor, "ratio": ratio}))
        found.extend(self._staleness_causes(step, metrics))
        found.extend(self._truncation_causes(step, metrics))
        carried = self._carried
        self.drop_window()
        for cause in found:
            if cause not in carried:
                self._log(cause)
        self._keep(found)
        self._window_codes = {x.code for x in found}
        out = {
            CAUSE_KEYS[0]: float(len({x.code for x in found})),
            CAUSE_KEYS[1]: disagreeing,
            CAUSE_KEYS[2]: ratio,
            CAUSE_KEYS[3]: bad if bad > -math.inf else math.nan,
            CAUSE_KEYS[4]: checked if checked > -math.inf else math.nan,
        }
        return out, [x for x in found if x not in carried]

    @staticmethod
    def _other_ranks_causes(own: list[Cause], group) -> list[Cause]:
        """The causes other ranks' checks found since the last window, of the codes this rank has none of: each as
        its rank named it (step, tensors, evidence; the message says which rank), all of the lowest rank's for a code
        several found. Every rank of ``group`` must call it (one object gather): rank 0's console and the report's
        causes.jsonl then name a fault of another rank's engine with its tensors. A failed gather costs the details
        (the caller names the code alone)."""
        try:
            gathered: list = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(gathered, [x.to_dict() for x in own], group=group)
            me = torch.distributed.get_rank(group)
        except Exception as err:  # noqa: BLE001 (a diagnostic's collective: the details are lost, not the step)
            logger.warning("tim_plugins: the other ranks' causes could not be gathered (%r)", err)
            return []
        have, out = {x.code for x in own}, []
        lowest: dict[str, int] = {}  # each code this rank lacks: the lowest rank that found it
        for rank, causes in enumerate(gathered):
            if rank == me:
                continue
            for d in causes or ():
                # every cause of that rank: a window can hold several syncs, each named
                # with its own step and tensors (the console, causes.jsonl and the run's closing line read them)
                if d["code"] in have or lowest.setdefault(d["code"], rank) != rank:
                    continue
                out.append(Cause(d["code"], d["step"], f"{d['message']} (on rank {rank})", tuple(d["tensors"]),
                                 dict(d["evidence"])))
        return out

    def evaluate_loss_passes(self, step: int, metrics: dict) -> tuple[dict, list[Cause]]:
        """The rule that reads the loss passes (``staleness``) where they end after the window was closed (verl: the
        actor update after the old-log-prob pass): ``metrics`` are their merged statistics (``tim/split/*``,
        ``tim/staleness/*``, the same on every rank: no collective). Returns ({``tim/cause/named``: the window's
        count with the new causes} or {} when none is new, the causes newly named)."""
        found = [x for x in self._staleness_causes(step, metrics) if x.code not in self._window_codes]
        if not found:
            return {}, []
        for cause in found:
            self._log(cause)
        self._keep(found)
        self._window_codes |= {x.code for x in found}
        return {CAUSE_KEYS[0]: float(len(self._window_codes))}, found

    def _staleness_causes(self, step: int, metrics: dict) -> list[Cause]:
        """The exact split's rule, over the reused tokens (``tim/split/reused_*``: trained after at least one
        optimizer step since their rollout; the fresh tokens of the window, whose staleness is 0, would dilute both
        figures by their share), else over every loss-pass token where the passes carried no lag."""
        c, out = self.config, []
        if not (_finite(metrics.get("tim/split/tokens")) and metrics["tim/split/tokens"] > 0):
            return self._lag_staleness_causes(step, metrics)  # no exact split: an asynchronous trainer
        reused = metrics.get("tim/split/reused_tokens")
        if reused is not None:
            if not (_finite(reused) and reused > 0):
                return out  # nothing was reused: no staleness
            share, k3 = metrics.get("tim/split/reused_staleness_var_share"), metrics.get(
                "tim/split/reused_staleness_kl_k3")
            where = f" of the {int(reused)} tokens trained after an optimizer step since sampling"
        else:
            share, k3, where = metrics.get("tim/split/staleness_var_share"), metrics.get(
                "tim/staleness/token/kl_k3"), ""
        limit = c.staleness_k3
        if _finite(share) and _finite(k3) and share >= c.staleness_share and k3 > limit:
            # a share above 1: the mismatch part moves against the staleness part (a negative covariance)
            explains = f"{share:.0%}" if share <= 1 else f"all ({share:.0%}: the mismatch part partly offsets it)"
            out.append(Cause("staleness", step, f"the staleness part explains {explains} of the log-ratio's "
                                                f"variance{where} and its k3 there is {k3:.3g} (ordinary PPO reuse "
                                                f"<= {limit:g})",
                             evidence={"staleness_var_share": share, "staleness_k3": k3,
                                       **({"reused_tokens": reused} if reused is not None else {})}))
        return out

    def _lag_staleness_causes(self, step: int, metrics: dict) -> list[Cause]:
        """The staleness rule where π_old at each sample's rollout weights is never computed (an asynchronous
        trainer: ``tim/by_lag/*`` alone). d = s + m with s = 0 at lag 0, and for small log-ratios k3 ≈ E[d²]/2, so
        the k3 of the tokens trained at lag >= 1 less the lag-0 floor estimates the staleness part's own k3: named
        when that part is at least ``staleness_share`` of their k3 and above ``staleness_k3``. The floor is the
        window's lag-0 tokens' k3, else the monitor's (``tim/token/kl_k3``: the lag-0 tokens it measured), else the
        last window's that had one (a trainer that fetches each batch a sync ahead trains no token at lag 0 after its
        first step: TRL's AsyncGRPOTrainer with one micro-batch per step); before any, nothing is judged."""
        c = self.config
        lags = window_by_lag(metrics)
        stale = [(n, k3) for lag, (n, k3) in lags.items() if lag >= 1]
        floor = lags[0][1] if 0 in lags else metrics.get("tim/token/kl_k3")
        if _finite(floor):
            self.lag0_k3 = float(floor)
        floor = self.lag0_k3
        if not stale or not _finite(floor):
            return []
        tokens = sum(n for n, _ in stale)
        k3 = sum(n * v for n, v in stale) / tokens
        part = k3 - max(float(floor), 0.0)
        if not (part > c.staleness_k3 and part >= c.staleness_share * k3):
            return []
        newest, oldest = min(lag for lag in lags if lag >= 1), max(lag for lag in lags if lag >= 1)
        more = " or more" if f"tim/by_lag/{oldest}+/count" in metrics else ""  # the open-ended last bucket
        after = (f"{newest} to {oldest}{more} optimizer steps" if newest < oldest else
                 f"{oldest}{more} optimizer step{'s' if oldest > 1 or more else ''}")
        return [Cause("staleness", step, f"the {int(tokens)} tokens trained {after} after the weights that "
                                         f"sampled them have k3 {k3:.3g} against {float(floor):.3g} at "
                                         f"lag 0: the policy's move is {part / k3:.0%} of it, k3 {part:.3g} "
                                         f"(ordinary PPO reuse <= {c.staleness_k3:g})",
                      evidence={"stale_k3": k3, "lag0_k3": float(floor), "stale_tokens": tokens,
                                "staleness_k3": part})]

    def _truncation_causes(self, step: int, metrics: dict) -> list[Cause]:
        c, out = self.config, []
        ratio = metrics.get("tim/token/ratio_mean")
        if "sampler-truncation-unmatched" in self.audit_codes and _finite(ratio) and ratio < 1 - c.truncation_bias:
            out.append(Cause("truncation", step, f"the trainer does not apply the sampler's truncation as set, and "
                                                 f"the mean ρ is {ratio:.3g} (the kept mass)",
                             evidence={"ratio_mean": ratio}))
        return out

    def _keep(self, found: list[Cause]) -> None:
        """Keep the causes newly named in the window being closed (``evaluate``, or ``evaluate_loss_passes`` with codes
        new to it): each code counts as one window of the tally, however many syncs of the window named it."""
        self.named.extend(found)
        del self.named[:-NAMED_KEPT]
        tally_window(self.tally, found)

    def summary_lines(self) -> list[str]:
        """The lines that close the run (``run_summary_lines``; [] when nothing was named)."""
        return run_summary_lines(self.tally, self.framework)

    def _log(self, cause: Cause) -> None:
        key = (cause.code, cause.tensors, cause.message if cause.code.startswith("sync") else None)
        if key in self._logged:
            return
        self._logged[key] = None
        if len(self._logged) > LOGGED_KEPT:
            del self._logged[next(iter(self._logged))]
        logger.warning(cause.line(self.framework))

    # ------------------------------------------------------------------------------------- checkpoints
    # The parity audit's codes are not carried: they describe the configuration of the attempt that runs, whose own
    # start-up audit sets them (``audited``), whether a checkpoint is loaded before it (TRL) or after (verl).
    # The window in progress (a checkpoint saved between two logging windows: TRL's save_steps need not be a multiple
    # of its logging_steps) is carried too, as the monitor's is: its stream counts and the causes its sync checks found
    # (the window that closes after the resume judges the tokens and syncs before the checkpoint as well). It is the
    # saving rank's own: another rank that loads this state (TRL: every rank loads the main process's) leaves it, or
    # the merge over ranks would count it once per rank.
    def state_dict(self) -> dict:
        window = {"rank": _rank(), "counts": None if self._counts is None else self._counts.tolist(),
                  "sync": [x.to_dict() for x in self._sync],
                  "sync_bad": self._sync_bad if self._sync_bad > -math.inf else None,
                  "sync_checked": self._sync_checked if self._sync_checked > -math.inf else None}
        return {"floor": list(self.floor.values), "named": [x.to_dict() for x in self.named],
                "tally": {k: dict(v) for k, v in self.tally.items()}, "lag0_k3": self.lag0_k3, "window": window}

    def load_state_dict(self, state: dict) -> None:
        self.floor.values = [float(v) for v in state.get("floor", [])]
        self.lag0_k3 = float(state.get("lag0_k3", math.nan))
        self.named = [Cause.from_dict(d) for d in state.get("named", [])]
        self.tally = {k: dict(v) for k, v in (state.get("tally") or {}).items()}
        if not self.tally:  # a state saved before the tally: the causes it kept
            for cause in self.named:
                tally_cause(self.tally, cause)
        window = state.get("window") or {}
        if window.get("rank") != _rank():
            return
        # added to what this attempt measured before the state was loaded (verl loads it before a window is judged;
        # its states are stored as windows close and after checked syncs: theirs holds at most the causes of the
        # syncs after the last window)
        if window.get("counts") is not None:
            carried = torch.tensor([float(v) for v in window["counts"]], dtype=torch.float64)
            self._counts = carried if self._counts is None else self._counts + carried.to(self._counts.device)
        for d in window.get("sync") or ():
            cause = Cause.from_dict(d)
            if cause not in self._sync:
                self._sync.append(cause)
                self._carried.append(cause)
        for name in ("sync_bad", "sync_checked"):
            if window.get(name) is not None:
                setattr(self, f"_{name}", max(getattr(self, f"_{name}"), float(window[name])))


def _rank() -> int:
    """This process's rank (0 without a process group): whose window in progress a state carries."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def window_by_lag(metrics: dict) -> dict[int, tuple[float, float]]:
    """{policy lag: (tokens, k3)} of one window's ``tim/by_lag/<lag>/*`` (an open-ended last bucket ``<k>+`` as k),
    the lags with tokens and a finite k3 only."""
    out = {}
    for key, n in metrics.items():
        if not (key.startswith("tim/by_lag/") and key.endswith("/count")) or not _finite(n) or n <= 0:
            continue
        label = key[len("tim/by_lag/"):-len("/count")]
        k3 = metrics.get(f"tim/by_lag/{label}/kl_k3")
        if label.rstrip("+").isdigit() and _finite(k3):
            out[int(label.rstrip("+"))] = (float(n), float(k3))
    return out
