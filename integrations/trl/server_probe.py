"""The lag-0 probe of TRL's vLLM server (``vllm_mode="server"``) at its weight syncs (the rule:
``tim_plugins.lag0_probe``).

In server mode the engine's weights live in the server's process and cannot be read. The probe scores a fixed batch
on both sides instead: a few rows of the run's first generation batch (prompt and completion tokens, padding dropped,
``Lag0ProbeConfig.max_tokens`` at most each: a longer row's first token and its completion's end; rows spread over
the batch's prompts), taken once. The server scores them
through TRL's own client, ``VLLMClient.get_sequence_logprobs`` (vLLM's prompt log-probs: temperature 1, no sampler
processing), the trainer's model in one no-grad forward (``log_softmax`` of its logits, in float32). The reference is
taken at that first generation, when both sides hold the weights that sampled it (a resumed run's, against the floor
its checkpoint carried: ``TIMCallback``'s state); after each probed sync
(``VLLMGeneration.sync_weights`` wrapped on the trainer's instance, scored once it returns: the weights sent and the
prefix cache reset) both score the batch again and ``Lag0Probe.judge`` names what it finds.

Every rank runs the trainer's forward (FSDP or ZeRO-3 parameters are gathered in it); the main process, the only one
holding TRL's client, asks the server and judges. A cause named there reaches the other ranks through the window's
merged flags (``CauseTracker.evaluate``). A problem inside the probe is counted (``tim/diag/lag0_probe_failed``) and
never breaks the sync; a reference scoring that failed on the main process (or has no usable token) switches the probe
off on every rank, there being nothing to judge a sync against; a vision-language batch (images beside the token ids)
switches it off (``tim/diag/lag0_probe_unsupported``).
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from tim_plugins.lag0_probe import HISTORY, Lag0Probe, Lag0ProbeConfig

__all__ = ["ServerProbe", "probe_sequences", "trainer_logprobs"]

# the keys of a GRPO generation batch that carry a prompt's images (trl.trainer.grpo_trainer's
# _generate_and_score_completions adds them for a vision-language model)
_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
               "image_position_ids", "num_images")


class ServerProbe:
    """The lag-0 probe of one trainer's vLLM server (owned by ``TIMCallback``)."""

    def __init__(self, trainer, pipeline, config: Lag0ProbeConfig) -> None:
        self.trainer, self.pipeline = trainer, pipeline
        self.probe = Lag0Probe(config)
        self.sequences: list[list[int]] | None = None
        # the last HISTORY scorings' wall times (both sides; the main process waits for both)
        self.seconds: deque[float] = deque(maxlen=HISTORY)

    def wrappers(self) -> list:
        # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration.sync_weights
        return [(self.trainer.vllm_generation, "sync_weights", self._wrap)]

    def captured(self, batch: dict) -> None:
        """A training generation batch (``_generate_and_score_completions``' output): the first gives the probe's
        batch and its reference scoring."""
        if self.sequences is not None:
            return
        media = sorted(k for k in _MEDIA_KEYS if batch.get(k) is not None)
        if media:  # the probe scores token ids alone: a model that also reads images would score other inputs
            self.sequences = []
            self.pipeline.count("lag0_probe_unsupported", detail=f"a multimodal batch ({', '.join(media)})")
            return
        failed = False
        try:
            self.sequences = probe_sequences(batch, self.probe.config)
            engine, trainer, mask = self._score()
            if engine is not None and not math.isfinite(self.probe.set_reference(engine, trainer, mask)):
                failed = True
                self.pipeline.count("lag0_probe_failed", detail="the reference scoring has no token both sides "
                                    "scored with a finite log-prob")
            elif engine is not None:  # a resumed run: the reference against the floor its checkpoint carried
                self.pipeline.probed(self.probe.judge_reference(self.trainer.state.global_step))
        except Exception as err:  # the probe costs its own result, never the step
            failed = True
            self.pipeline.count("lag0_probe_failed", detail=repr(err))
        # Without a reference no sync can be judged: off on every rank, or each would keep scoring the batch at every
        # sync for nothing. Only the main process holds the reference (TRL's client), and every rank runs the
        # forwards together (a sharded model's need all of them): its word decides, once, here.
        ok = not failed and bool(self.sequences)
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            flag = torch.tensor([int(ok)], device=self.trainer.accelerator.device)
            ok = bool(broadcast(flag, from_process=0).item())
        if not ok or self.sequences is None:
            self.sequences = []

    def _wrap(self, original):
        def sync_weights(*args, **kwargs):
            result = original(*args, **kwargs)
            if self.sequences is None and self.trainer.state.global_step > 0:
                # a resumed run's first sync comes before its batch and reference (captured): counted, as the run
                # that was not interrupted counts it, so that every_n_syncs goes on where it was; the reference
                # taken next judges it (judge_reference)
                self.probe.due()
                return result
            if not self.sequences or not self.probe.due():
                return result
            try:
                engine, trainer, mask = self._score()
                if engine is not None and self.probe.reference is not None:
                    self.pipeline.probed(self.probe.judge(self.trainer.state.global_step, engine, trainer, mask))
                    if self.probe.history[-1]["tokens"] == 0:  # judged nothing: say so rather than stay silent
                        self.pipeline.count("lag0_probe_failed", detail="no token of the probe's batch has a finite "
                                            "log-prob on both sides after the sync (the server's NaN reach TRL's "
                                            "client as -inf)")
            except Exception as err:
                self.pipeline.count("lag0_probe_failed", detail=repr(err))
            return result

        return sync_weights

    def _score(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(the server's [K, T] log-probs, or None off the main process; the trainer's; the scored tokens): position
        j is token j + 1 of each sequence given the ones before it."""
        t, t0 = self.trainer, time.perf_counter()
        trainer, mask = trainer_logprobs(t.model, self.sequences, t.accelerator)
        if not t.accelerator.is_main_process:
            self.seconds.append(time.perf_counter() - t0)
            return None, trainer, mask
        # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration._init_vllm (vllm_client) and
        # hooks.TRL_SOURCES trl.generation.vllm_client:VLLMClient.get_sequence_logprobs
        client = t.vllm_generation.vllm_client
        out = client.get_sequence_logprobs(self.sequences, prompt_lengths=[1] * len(self.sequences), top_logprobs=0,
                                           temperature=1.0)
        engine = torch.full(trainer.shape, math.nan, dtype=torch.float64)
        for i, rows in enumerate(out["actual_logprobs"]):
            values = [row[0] for row in rows][: trainer.shape[1]]
            engine[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
        self.seconds.append(time.perf_counter() - t0)
        return engine, trainer, mask


def probe_sequences(batch: dict, config: Lag0ProbeConfig) -> list[list[int]]:
    """The probe's fixed batch from a GRPO generation batch: ``config.sequences`` rows spread over the batch (one per
    prompt group where there are enough), each its prompt tokens then its completion tokens (the masks' ones); a row
    longer than ``config.max_tokens`` keeps its first token (a BOS or the template's first, which the model's
    attention leans on) and its last ``max_tokens`` - 1, the completion's end: the tokens training scores, however
    long a prompt the rows share. Rows shorter than two tokens are left out."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"].bool()
    rows = prompt_ids.shape[0]
    stride = max(1, rows // config.sequences)
    out = []
    for i in range(0, rows, stride):
        seq = torch.cat([prompt_ids[i][prompt_mask[i]], completion_ids[i][completion_mask[i]]])
        if seq.numel() > config.max_tokens:
            seq = torch.cat([seq[:1], seq[seq.numel() - config.max_tokens + 1:]])
        seq = seq.tolist()
        if len(seq) >= 2:
            out.append([int(x) for x in seq])
        if len(out) == config.sequences:
            break
    if not out:
        raise ValueError("no generated row of two tokens or more to probe with")
    return out


def trainer_logprobs(model, sequences: list[list[int]], accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of ``sequences`` (one right-padded no-grad forward in eval mode, under the
    accelerator's autocast; ``log_softmax`` in float32): ([K, T] float64 on the CPU, NaN past each sequence's end;
    the [K, T] mask of its tokens), T = the longest sequence's length - 1."""
    k, length = len(sequences), max(len(s) for s in sequences)
    ids = torch.zeros(k, length, dtype=torch.long)
    attention = torch.zeros(k, length, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
    device = accelerator.device
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), accelerator.autocast():
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
    finally:
        model.train(training)
    targets = ids[:, 1:].to(logits.device)
    out = torch.empty(k, length - 1, dtype=torch.float64)
    for i in range(k):  # one row's [T, V] float32 log-softmax at a time
        out[i] = torch.log_softmax(logits[i, :-1].float(), dim=-1).gather(-1, targets[i, :, None])[:, 0].double().cpu()
    mask = attention[:, 1:].bool()
    return out.masked_fill(~mask, math.nan), mask
