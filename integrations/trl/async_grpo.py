"""TIMCallback on TRL's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, TRL 1.16): mismatch and
staleness told apart by policy lag.

There a rollout worker samples with a vLLM server while the trainer trains; each sample carries the ``model_version``
(weight sync count) that sampled it, and the loss's ratio π_θ / π_rollout mixes staleness (the policy moved since)
with the mismatch (the same weights scored by two stacks). π_old at the rollout's weights is never computed, so the
split is statistical: every trained token is keyed by its **policy lag**, the optimizer steps between the weights
that sampled it and the weights that score it, and the log-ratio's statistics go by lag (``tim/by_lag/<lag>/*``):
lag 0 is the mismatch floor (those tokens also feed the monitor, ``tim/token/*``), the growth with lag is
staleness.

The lag is counted at the loss, not where TRL counts ``sample/staleness_*`` (when the dataloader fetches the
sample): accelerate's dispatcher fetches one batch ahead, so a batch fetched in step s trains in step s + 1, one
weight sync later. It is an upper bound per token where a generation straddles a sync: TRL tags a whole group with
the version current when its first rollout started, and the server's in-flight requests go on with the new weights
(its pause keeps them), so a stale bucket may hold some tokens sampled by newer weights (the lag-0 bucket does not).

Where it hooks (``hooks.TRL_SOURCES``, checked by ``features.ASYNC_MONITOR``), every patch inside ``train()``
(installed as it starts or at train begin, undone on every exit, ``hooks.Installation``):
- ``trainer.rollout_queue`` (read once by ``get_train_dataloader``, as ``train()`` starts) is wrapped by a recorder:
  each drained ``RolloutSample``'s ``model_version``, kept with its ``old_log_probs`` object (the dict TRL yields
  holds that same object);
- ``TreeRow.pack`` (the collator packs each rank's row with it, on the main process; patched on the class while
  this trainer's ``train()`` runs, acting on that thread's rows only): its output gains
  ``tim_weights_step``, per trained token the global step at which its sample's weights were synced; the
  collator pads and the dispatcher scatters it with the other per-token columns, so every rank has its own;
- ``compute_loss``: a forward hook on the model reads ``outputs.log_probs`` of TRL's own forward (no extra
  forward); the trained tokens' columns (``token_index >= 0``) are laid out per sample (``translate.packed_rows``).
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict

import torch

from tim_plugins.by_key import policy_lag, turn_keys
from tim_plugins.pipeline import exact_mean

from . import translate

__all__ = ["ONE_MICRO_BATCH", "AsyncAttachment", "is_async_grpo"]

_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
_KEEP = 1 << 16  # samples drained but never packed (dropped as stale by TRL): the oldest records are let go
# the per-token columns of a packed row that translate.packed_rows reads
_PACKED_KEYS = ("token_index", "segment_id", "attention_mask", "position_ids", "old_log_probs", "shift_labels",
                "tim_weights_step")


# said at attach time where gradient_accumulation_steps is 1: the dispatcher's one batch ahead (module docstring) is
# then every batch
ONE_MICRO_BATCH = (
    "tim-plugins: AsyncGRPOTrainer with gradient_accumulation_steps=1: each step's one batch was fetched a step ahead "
    "and trains one weight sync after the weights that sampled it, so no token is trained at lag 0 after the first "
    "step: the mismatch floor (tim/token/*, the lag-0 rules, the LR decay's k3 signal) is the first step's alone, "
    "and a later rise of the mismatch (a weight transfer that stopped loading, say) reads as staleness by lag "
    "(tim/by_lag/1). Fix: gradient_accumulation_steps >= 2 (the step's other batches are fetched after the sync).")


def is_async_grpo(trainer) -> bool:
    """Whether ``trainer`` is TRL's AsyncGRPOTrainer (or a subclass), without importing trl.experimental."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(trainer, getattr(module, "AsyncGRPOTrainer", ()))


class _RecordingQueue:
    """The rollout worker's queue as TRL drains it, recording each sample's model_version (its ``get`` is the only
    call that changes; everything else is the queue's own).
    (hooks.TRL_SOURCES trl.experimental.async_grpo.async_grpo_trainer:RolloutQueueDataset.__iter__: the dict it
    yields holds the sample's old_log_probs object, the key here)"""

    def __init__(self, inner, versions: OrderedDict) -> None:
        self.inner, self.versions = inner, versions

    def get(self, *args, **kwargs):
        sample = self.inner.get(*args, **kwargs)
        try:
            logps, version = sample.old_log_probs, int(sample.model_version)
        except (AttributeError, TypeError, ValueError):
            return sample  # its tokens count as of unknown lag
        self.versions[id(logps)] = (logps, version)  # the object kept: its id stays unique until packed
        while len(self.versions) > _KEEP:
            self.versions.popitem(last=False)
        return sample

    def __getattr__(self, name):
        return getattr(self.inner, name)


class AsyncAttachment:
    """What ``TIMCallback`` installs on an AsyncGRPOTrainer, and the per-loss translation into the pipeline."""

    def __init__(self, callback) -> None:
        self.cb, self.trainer = callback, callback.trainer
        self.versions: OrderedDict = OrderedDict()  # id(old_log_probs) -> (old_log_probs, model_version)
        self.synced_at: dict[int, int] = {}  # model_version -> global step whose weights it carries
        self.lengths = torch.zeros(2, dtype=torch.float64)  # this step's (trained tokens, samples), this rank
        self.pending: list[tuple[dict, torch.Tensor, int]] = []  # this step's loss calls, laid out at its end
        self._thread: int | None = None  # the thread whose train() runs with the patches (its collator packs)

    def before_train(self) -> list:
        """The patches installed as ``train()`` starts (``hooks.Installation``; undone on every exit of ``train()``):
        what TRL reads before any callback event. Each ``train()`` is a run of its own: what a run that raised left
        (the loss calls of its unfinished step, the samples it drained, the steps its versions were synced at, in
        its own step numbering) is let go, so a version synced before this run counts as of unknown lag."""
        from trl.experimental.async_grpo.packing import TreeRow

        self.versions.clear()
        self.synced_at.clear()
        self.pending = []
        self.lengths = torch.zeros_like(self.lengths)
        self._thread = threading.get_ident()
        out = []
        if getattr(self.trainer, "rollout_queue", None) is not None:  # main process only
            # hooks.TRL_SOURCES trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.get_train_dataloader
            # reads it as train() starts, before on_train_begin
            out.append((self.trainer, "rollout_queue", lambda queue: _RecordingQueue(queue, self.versions)))
        # hooks.TRL_SOURCES trl.experimental.async_grpo.packing:TreeRow.pack, a method of the rows TRL's collator
        # builds per batch (no instance to patch): on the class for the duration of this trainer's train(), and
        # acting only on the thread that runs it (the collator packs there: TRL's dataloader has no workers)
        out.append((TreeRow, "pack", self._wrap_pack))
        return out

    def wrappers(self) -> list:
        # hooks.TRL_SOURCES trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.compute_loss
        return [(self.trainer, "compute_loss", self._wrap_loss)]

    # ------------------------------------------------------------------------------------------ main process
    def _wrap_pack(self, original):
        def pack(row):
            out = original(row)
            if threading.get_ident() != self._thread:  # another trainer's rows
                return out
            try:
                # the version live now was synced at the end of the step just finished (fetches run at a step's
                # start)
                self.synced_at.setdefault(int(self.trainer.model_version), int(self.trainer.state.global_step))
                steps = []
                for sample in row.samples:  # each sample is packed once: its record goes
                    known = self.versions.pop(id(sample.get("old_log_probs")), None)
                    steps.append(self.synced_at.get(known[1], -1) if known is not None else -1)
                # hooks.TRL_SOURCES trl.experimental.async_grpo.async_grpo_trainer:DataCollatorForRollout.torch_call
                # pads it with the other per-token columns
                out["tim_weights_step"] = torch.tensor(steps, dtype=torch.long)[out["segment_id"]] \
                    if steps else torch.zeros(0, dtype=torch.long)
            except Exception as err:  # a diagnostic problem never breaks the training step: the lags go unknown
                self.cb.pipeline.count("async_lag_unknown", detail=f"packing: {err!r}")
                out["tim_weights_step"] = torch.full_like(out["segment_id"], -1)  # every row has the column
            return out

        return pack

    # -------------------------------------------------------------------------------------------- every rank
    def end_step(self, length: bool) -> float:
        """Close this rank's optimizer step: the step's loss calls into the pipeline (``_flush``), then with
        ``length`` the mean trained tokens per sample over them on every rank (the LR decay's length signal; a
        collective: every rank calls it); NaN without."""
        self._flush()
        mean = exact_mean(self.lengths) if length else math.nan
        self.lengths = torch.zeros_like(self.lengths)
        return mean

    def _flush(self) -> None:
        """The step's loss calls, kept on the device by ``_on_loss``, laid out per sample and handed to the
        pipeline after the optimizer step: the layout's host reads (the packed rows' sample and column counts)
        wait for the device once the step's work is queued, not between its micro-batches."""
        pending, self.pending = self.pending, []
        pipeline = self.cb.pipeline
        for inputs, log_probs, step in pending:
            try:
                rows = translate.packed_rows(inputs, log_probs)
            except Exception as err:  # a diagnostic problem never breaks the training step
                pipeline.count("async_batch_unread", detail=repr(err))
                continue
            if rows is None:
                continue
            per_sample = rows["mask"].sum(1)
            self.lengths = self.lengths.to(per_sample.device) + torch.stack(
                [per_sample.sum(), (per_sample > 0).sum()]).double()
            weights_step = rows["weights_step"]  # -1: the sample's policy version was not seen (synced before)
            lag = policy_lag(weights_step, step)
            pipeline.measure_lagged(rows["rollout"], rows["current"], rows["mask"], lag, token_ids=rows["token_ids"],
                                    step=step + 1, turn=turn_keys(rows["mask"]))
            pipeline.loss_pass_lagged(rows["rollout"], rows["current"], rows["mask"], lag)

    def _wrap_loss(self, original):
        def compute_loss(model, inputs, *args, **kwargs):
            if not self.trainer.model.training:
                return original(model, inputs, *args, **kwargs)
            outputs = []
            handle = model.register_forward_hook(lambda module, a, out: outputs.append(out))
            try:
                loss = original(model, inputs, *args, **kwargs)
            finally:
                handle.remove()
            self._on_loss(inputs, outputs)
            return loss

        return compute_loss

    def _on_loss(self, inputs: dict, outputs: list) -> None:
        """One loss call: what the step's end lays out (``_flush``), kept as device tensors (no host read here)."""
        log_probs = getattr(outputs[0], "log_probs", None) if len(outputs) == 1 else None
        if log_probs is None:
            self.cb.pipeline.count("async_logprobs_unread", detail=f"{len(outputs)} model forwards in one compute_loss")
            return
        kept = {k: inputs[k] for k in _PACKED_KEYS if k in inputs}
        self.pending.append((kept, log_probs.detach(), int(self.trainer.state.global_step)))
