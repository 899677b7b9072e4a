"""The capabilities behind TIMCallback, each calling the torch-only core (no formula lives here).

Safe vocabulary, IS correction, LR decay, parity audit / probe, exact sampler, injector, Parquet dump and wandb
histograms. Each imports its core module lazily, only when switched on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

__all__ = ["Features", "SafeVocabHead"]

logger = logging.getLogger("tim_plugins.trl")

# TIMConfig.lr_decay_signals → LengthTriggeredLRDecay signal names
_LR_SIGNAL_NAMES = {"k3": "kl_k3", "grad_norm": "grad_norm"}


class SafeVocabHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` (same ``apply`` signature, trl/kernels/chunked_logprob.py)
    and returns safe-vocab log-probs (and the safe distribution's entropy) from the same hidden states.

    Only the per-token kernel changes: TRL still runs the backbone, selects the scored positions and scatters
    the result back. Heads the core function cannot reproduce (bias, logit softcapping) fall back to TRL's
    kernel and are counted (``tim/diag/safe_vocab_unsupported_head``).
    """

    def __init__(self, original, owner) -> None:
        self.original = original
        self.owner = owner  # the TIMCallback

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        from tim_plugins.safe_vocab import safe_logprobs_from_hidden

        trunc = self.owner.features.safe_truncation
        if bias is not None or final_logit_softcapping is not None:
            self.owner.count_diag("safe_vocab_unsupported_head")
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, outputs)
        # z·s/T = z/(T/s): a logit scale folds into the temperature.
        eff_t = float(temperature) / float(logit_scale)
        res = safe_logprobs_from_hidden(
            hidden, weight, targets, min_p=trunc["min_p"], temperature=eff_t, top_p=trunc["top_p"],
            top_k=trunc["top_k"], order=trunc["order"], compute_entropy="entropy" in outputs,
        )
        records = self.owner.hooks.safe_records
        if records is not None:  # mapped to [B, T] (and the pruned mass noted) once TRL's log-prob call returns
            records.append((res.in_safe.detach(), res.pruned_mass.detach()))
        extra = (None, None, None)
        if any(name in outputs for name in ("log_sum_sq_probs", "mean_logits", "is_top1")):
            with torch.no_grad():
                full = self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                           final_logit_softcapping, logit_scale, outputs)
            extra = tuple(full[2:])
        return (res.logprobs, res.entropy, *extra)


def _fit_bins(counts, edges, max_bins: int = 512):
    """wandb.Histogram takes <= 512 bins with finite edges: drop empty outer bins, then merge neighbours in
    pairs until it fits (counts are summed, so the total is unchanged)."""
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


class Features:
    def __init__(self, owner) -> None:
        self.owner = owner
        self.trainer = owner.trainer
        self.config = owner.config
        self.dumper = None
        self.controller = None
        self.probe = None
        self.safe_truncation: dict[str, Any] | None = None
        self.correction_config = None
        self._pending_lr_state = None
        self.injector = None
        self._dump_buffer: list[tuple] = []

    # ------------------------------------------------------------------------------------- validation
    def resolve_rollout_source(self) -> str:
        t, c = self.trainer, self.config
        if c.rollout in ("exact", "inject"):
            return c.rollout
        if t.use_vllm:
            if c.rollout == "hf":
                raise ValueError(
                    "TIMConfig.rollout='hf' but the trainer uses vLLM (GRPOConfig.use_vllm=True): the rollouts come "
                    "from vLLM. Use rollout='auto', or set use_vllm=False to record HF generate's log-probs.")
            return "vllm"
        if getattr(t, "rollout_func", None) is not None:
            return "custom"  # the user's rollout_func returns "logprobs" itself
        if getattr(t, "use_transformers_continuous_batching", False):
            return "unavailable"
        return "hf"

    def validate(self) -> None:
        t, c, a = self.trainer, self.config, self.trainer.args
        src = self.owner.rollout_source
        if src == "unavailable" and c.monitor:
            logger.warning("tim_plugins: use_transformers_continuous_batching=True returns no log-probs; the "
                           "monitor has no rollout log-probs (set it False, or use vLLM)")
        if src in ("exact", "inject") and t.use_vllm:
            raise ValueError(
                f"TIMConfig.rollout={c.rollout!r} replaces TRL's transformers generation and needs "
                "GRPOConfig.use_vllm=False (got use_vllm=True).")
        if src == "exact":
            bad = {k: v for k, v in (("top_p", t.top_p), ("top_k", t.top_k), ("min_p", t.min_p),
                                     ("repetition_penalty", t.repetition_penalty))
                   if v not in (None, 0, 1.0, 0.0) and not (k == "top_k" and v <= 0)}
            if bad:
                raise ValueError(
                    f"TIMConfig.rollout='exact' samples softmax(logits/T) only, but GRPOConfig sets {bad}: switch "
                    "those off (top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0) for exact rollouts.")
        if c.safe_vocab:
            from tim_plugins.truncation import Truncation

            min_p = c.safe_vocab_min_p if c.safe_vocab_min_p is not None else a.min_p
            if min_p is None or min_p <= 0:
                raise ValueError(
                    f"TIMConfig.safe_vocab=True needs a min_p: GRPOConfig.min_p={a.min_p!r} and "
                    f"TIMConfig.safe_vocab_min_p={c.safe_vocab_min_p!r}. Set GRPOConfig(min_p=1e-4) so the sampler "
                    "prunes the same tail the trainer excludes (tim_plugins.truncation.DEFAULT_MIN_P = 1e-4).")
            if a.min_p is not None and c.safe_vocab_min_p is not None and a.min_p != c.safe_vocab_min_p:
                logger.warning("tim_plugins: safe_vocab_min_p=%g differs from GRPOConfig.min_p=%g: the trainer's "
                               "safe set is not the sampler's", c.safe_vocab_min_p, a.min_p)
            top_k = int(t.top_k or 0)
            self.safe_truncation = {
                "min_p": float(min_p), "top_p": float(t.top_p if t.top_p is not None else 1.0),
                "top_k": top_k if top_k > 0 else 0, "order": "vllm" if t.use_vllm else "hf",
            }
            Truncation(temperature=float(t.temperature), **self.safe_truncation)  # validates, quoting values
            head = t.model.get_output_embeddings()
            if getattr(head, "bias", None) is not None:
                raise ValueError("TIMConfig.safe_vocab=True: the lm_head has a bias, which the safe-vocab head does "
                                 "not support; use safe_vocab=False for this model.")
            softcap = getattr(t.model.config.get_text_config(), "final_logit_softcapping", None)
            if softcap is not None:
                raise ValueError(f"TIMConfig.safe_vocab=True: final_logit_softcapping={softcap!r} is not supported "
                                 "by the safe-vocab head; use safe_vocab=False for this model.")
        if c.is_correction is not None:
            from tim_plugins.corrections import CorrectionConfig

            if t.use_vllm and t.vllm_importance_sampling_correction:
                raise ValueError(
                    f"TIMConfig.is_correction={c.is_correction!r} with vLLM rollouts while TRL's own correction is on "
                    "(GRPOConfig.vllm_importance_sampling_correction=True): pick one. Set "
                    "vllm_importance_sampling_correction=False to use ours, or is_correction=None to keep TRL's.")
            self.correction_config = CorrectionConfig(mode=c.is_correction, **c.is_correction_options)
        if c.lr_decay:
            from tim_plugins.lr_control import LengthTriggeredLRDecay

            options = dict(c.lr_decay_options)
            if c.lr_decay_signals and "signals" not in options:
                options["signals"] = tuple(_LR_SIGNAL_NAMES[s] for s in c.lr_decay_signals)
            self.controller = LengthTriggeredLRDecay(**options)
            if "k3" in c.lr_decay_signals:
                from tim_plugins.metrics import MismatchMonitor

                self.owner.step_monitor = MismatchMonitor(ratio_band=c.ratio_band)
        if c.parity_probe:
            from tim_plugins.parity.probe import ParityProbe

            self.probe = ParityProbe(**c.parity_probe_options)
        if c.dump_dir is not None:
            self.dumper = self._make_dumper(c.dump_dir)
        if src == "inject":
            from tim_plugins.rollout.inject import TailNoiseInjector

            try:
                self.injector = TailNoiseInjector(**c.inject_options)
            except TypeError as err:
                raise ValueError(f"TIMConfig.inject_options={c.inject_options!r}: {err}; valid keys: scale, tau, "
                                 "mode, seed, bias_sign (tim_plugins.rollout.inject.TailNoiseInjector)") from err
        if c.inject_options and src != "inject":
            raise ValueError(f"TIMConfig.inject_options={c.inject_options!r} given but rollout={c.rollout!r}; set "
                             "rollout='inject' or drop inject_options.")

    # ------------------------------------------------------------------------------------- safe vocab
    def safe_vocab_shim(self):
        return lambda original: SafeVocabHead(original, self.owner)

    def note_safe(self, pruned_mass: torch.Tensor, labelled: torch.Tensor) -> None:
        """``tim/safe_vocab/pruned_mass_mean`` of one loss forward, over the positions TRL labels (its loss
        positions): the fused head scores every position on devices without Triton, prompt and padding too."""
        total, n = torch.stack([torch.where(labelled, pruned_mass.double(), 0.0).sum(),
                                labelled.sum().double()]).tolist()  # one host sync
        if n:
            self.owner.add_metric("tim/safe_vocab/pruned_mass_mean", total / n)

    def score_at_rollout_weights(self, out: dict):
        """The trainer's log-probs of the batch at the current (= rollout) weights, when TRL did not compute
        them (one extra no-grad forward; only with IS correction or boundary masking on)."""
        t = self.trainer
        if "pixel_values" in out:
            self.owner.count_diag("multimodal_rescoring_unsupported")
            return None, None
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        self.owner.hooks._policy_records = []
        try:
            with torch.no_grad():
                logps, _, _ = t._get_per_token_logps_and_entropies(
                    t.model, ids, attn, out["completion_ids"].size(1), batch_size=t.args.per_device_train_batch_size)
            records = self.owner.hooks._policy_records
        finally:
            self.owner.hooks._policy_records = None
        in_safe = records[0]["in_safe"] if records else None
        return logps, in_safe

    def apply_boundary_mask(self, mask: torch.Tensor, in_safe) -> torch.Tensor:
        from tim_plugins.safe_vocab import safe_loss_mask

        if in_safe is None or in_safe.shape != mask.shape:
            self.owner.count_diag("safe_vocab_mask_unavailable")
            return mask
        keep, boundary = safe_loss_mask(mask, in_safe)
        n = float(boundary)
        self.owner.add_metric("tim/safe_vocab/boundary_frac", n / max(1.0, float(mask.sum())))
        return keep.bool()

    def set_loss_mask(self, out: dict, mask: torch.Tensor, new_mask: torch.Tensor) -> None:
        """Narrow TRL's loss mask through ``tool_mask`` (only the loss reads it; ``completion_mask`` also feeds
        the attention mask) and take the removed tokens out of ``num_items_in_batch`` (dapo/cispo normaliser)."""
        t = self.trainer
        tool = out.get("tool_mask")
        base = torch.ones_like(out["completion_mask"]) if tool is None else tool
        out["tool_mask"] = base * new_mask.to(base.dtype)
        removed = (mask & ~new_mask).sum()
        out["num_items_in_batch"] = out["num_items_in_batch"] - t.accelerator.gather(removed).sum()

    # ------------------------------------------------------------------------------------ IS correction
    def apply_is_correction(self, train, rollout, mask):
        from tim_plugins.corrections import apply_correction

        if train is None:
            self.owner.count_diag("is_correction_without_train_logprobs")
            return None, mask
        res = apply_correction(self.correction_config, train, rollout, mask)
        for key, value in res.metrics().items():
            self.owner.add_metric(key, value)
        return res.weights.to(train.dtype), res.mask.bool()

    def apply_is_weights(self, out: dict, weights: torch.Tensor, mask: torch.Tensor) -> None:
        """Make TRL's loss apply the correction's per-token weights, reading TRL's configuration as it is.

        TRL multiplies its per-token loss by ``inputs["importance_sampling_ratio"]`` only under ``use_vllm and
        vllm_importance_sampling_correction`` (trl/trainer/grpo_trainer.py, ``GRPOTrainer._compute_loss``). The
        same product is reached through an input TRL reads in every mode: ``_compute_loss`` accepts (B, T)
        advantages, and for every loss type but vespo the per-token policy term is positively homogeneous in
        them (-min(r·A, clip(r)·A), -sg(min(r, ε))·A·log p, sapo's soft gate · A, ...): with w >= 0, A·w gives
        exactly w × TRL's term, ahead of the same masks and the same KL term TRL's vLLM branch leaves unweighted.
        vespo folds the ratio into its sequence weight instead (``get_gamma_weights`` reads
        ``inputs["importance_sampling_ratio"]`` whether or not vLLM is used); there the weights go in that key,
        1 outside TRL's loss mask as TRL's own ratio is. ``tests/test_trl_hook_guards.py`` checks both routes
        against TRL's vLLM branch for every loss type.

        Args:
            out: TRL's generation batch (edited in place; ``tim_is_weights`` keeps the weights applied).
            weights: [B, T] correction weights (0 where the correction dropped a token).
            mask: [B, T] TRL's own loss mask (before any narrowing by the callback).
        """
        out["tim_is_weights"] = weights
        if self.trainer.loss_type == "vespo":
            out["importance_sampling_ratio"] = torch.where(mask.bool(), weights, torch.ones_like(weights))
            return
        adv = out["advantages"]
        adv = adv if adv.dim() == 2 else adv.unsqueeze(1)
        out["advantages"] = adv * weights.to(adv.dtype)

    # ---------------------------------------------------------------------------------------- LR decay
    def lr_decay_step(self, step: int, step_metrics: dict, optimizer, scheduler) -> None:
        from tim_plugins.lr_scaling import apply_lr_scale

        signals = {}
        names = self.controller.config.signals
        if "kl_k3" in names:
            signals["kl_k3"] = step_metrics.get("tim/token/kl_k3", math.nan)
        if "grad_norm" in names:
            signals["grad_norm"] = self.owner.last_grad_norm if self.owner.last_grad_norm is not None else math.nan
        length = self.owner.last_mean_length
        scale = self.controller.observe(step, length if length is not None else math.nan, **signals)
        if optimizer is None:
            optimizer = self.trainer.optimizer
        if scheduler is None:
            scheduler = self.trainer.lr_scheduler
        # Scales the scheduler's base_lrs and _last_lr with the param groups: TRL's logged learning_rate
        # (scheduler.get_last_lr()) shows the decay at this step; the applied scale lives in the param groups.
        apply_lr_scale(optimizer, scale, scheduler)

    def lr_metrics(self) -> dict:
        return self.controller.metrics() if self.controller is not None else {}

    def lr_state(self):
        return self.controller.state_dict() if self.controller is not None else None

    def load_lr_state(self, state) -> None:
        if self.controller is not None and state:
            self.controller.load_state_dict(state)

    # ------------------------------------------------------------------------------------------ parity
    def probe_check(self, step: int, metrics: dict):
        return self.probe.check(step, metrics)

    def probe_state(self):
        return self.probe.state_dict() if self.probe is not None else None

    def load_probe_state(self, state) -> None:
        if self.probe is not None and state:
            self.probe.load_state_dict(state)

    def run_parity_audit(self) -> None:
        from ._parity import run_audit

        run_audit(self.owner)

    # ---------------------------------------------------------------------------------- dump / wandb
    def _make_dumper(self, path):
        from tim_plugins.dump import TokenDumper

        return TokenDumper(out_dir=str(path), **self.owner.config.dump_options)

    def dump(self, rollout, train, mask, batch) -> None:
        """Buffer this batch for the step's dump (one Parquet file per step and rank, written at step end)."""
        step = self.trainer.state.global_step + 1
        if self.dumper.wants(step) and batch.get("completion_ids") is not None:
            self._dump_buffer.append((rollout.detach(), train.detach(), mask, batch["completion_ids"]))

    def flush_dump(self, step: int) -> None:
        buf, self._dump_buffer = self._dump_buffer, []
        if not buf:
            return
        width = max(x[0].shape[1] for x in buf)

        def cat(i, value):
            return torch.cat([torch.nn.functional.pad(x[i], (0, width - x[i].shape[1]), value=value) for x in buf])

        try:
            self.dumper.write(step, cat(0, 0.0), cat(1, 0.0), cat(2, False), cat(3, 0),
                              rank=self.trainer.accelerator.process_index)
        except Exception as err:  # a dump problem never breaks the training step
            self.owner.count_diag("dump_failed")
            logger.debug("tim_plugins: dump failed: %r", err)

    def log_histograms(self, monitor) -> None:
        args = self.trainer.args
        if not args.report_to or "wandb" not in args.report_to:
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is None:
            return
        try:
            hists = {name: _fit_bins(counts, edges) for name, (counts, edges) in monitor.histograms().items()}
            # commit=False: merged into the row transformers' WandbCallback commits for this step's logs.
            wandb.log({f"tim/hist/{name}": wandb.Histogram(np_histogram=(counts, edges))
                       for name, (counts, edges) in hists.items()}, commit=False)
        except Exception as err:  # a logging problem never breaks the training step
            self.owner.count_diag("histogram_failed")
            logger.debug("tim_plugins: histogram logging failed: %r", err)

    # ------------------------------------------------------------------------------- rollout choices
    def exact_generate(self, prompt_ids, images=None, multimodal_fields=None, num_generations=None, *args, **kwargs):
        from tim_plugins.rollout.exact import exact_generate

        t = self.trainer
        if images is not None:
            raise ValueError("TIMConfig.rollout='exact' supports text-only prompts")
        device = t.accelerator.device
        width = max(len(p) for p in prompt_ids)
        pad = t._tokenizer.pad_token_id
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):  # left padding, as TRL's transformers path
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        model = t.accelerator.unwrap_model(t.model_wrapped)
        seed = int(t.args.seed) * 1_000_003 + self.owner.generation_count
        with torch.no_grad():
            comp, comp_mask, logps = exact_generate(
                model, ids.to(device), attn.to(device), max_new_tokens=t.max_completion_length,
                temperature=float(t.temperature), seed=seed, pad_token_id=pad, eos_token_id=t.eos_token_ids)
        completion_ids, logprobs = [], []
        for row, m, lp in zip(comp.cpu(), comp_mask.cpu().bool(), logps.cpu()):
            completion_ids.append(row[m].tolist())
            logprobs.append(lp[m].tolist())
        return completion_ids, logprobs

