"""The weight-sync check on verl's weight syncs (``tim_plugins.weight_sync``; the causes it names:
``tim_plugins.causes``).

verl syncs the rollout from the actor in ``ActorRolloutRefWorker.update_weights``: colocated (the ``naive`` checkpoint
engine of the sync and colocate_async trainer modes), the actor engine's ``get_per_tensor_param()`` (full HF-named
tensors, from the FSDP or the Megatron engine) streams into the rollout's ``update_weights``, which sends it in
buckets over ZMQ (CUDA IPC or shared memory) to vLLM's worker processes, where verl's worker extension loads each
bucket into the model (``load_weights``) and post-processes it. What is observed, and where:

1. in the actor worker's process, the engine's ``get_per_tensor_param`` is teed (``engine_mixin``): each tensor's
   fixed sample of elements is taken as it streams (``SyncWatch.observing``); nothing is copied or kept;
2. when verl's ``update_weights`` has returned (every bucket loaded and post-processed), the rank that holds the
   rollout server's handle asks the server for the engine's values at those elements
   (``worker.TIMActorRolloutRefWorker.update_weights`` -> ``rollout._SyncReads.tim_read_weights`` -> vLLM's
   ``collective_rpc`` -> ``worker_extension.TIMWorkerExtension.tim_read_weights`` in each vLLM worker, read with
   ``integrations.vllm.weights.VLLMWeights``); what crosses processes is the names, shapes and element indices one
   way and the values as plain lists the other (``integrations.vllm.worker_reads``), a few kB per tensor at most;
3. that rank compares (``SyncCheck.finish``): the report names the causes with the tensors' names. Every rank's
   report (one per rollout replica: each replica is read by its own rank) is gathered over the world group and handed
   to the pipeline of the first rank that holds outputs (``StepPipeline.sync_checked``): the console line at once,
   ``tim/cause/*`` in the next window's metrics (the old-log-prob pass of the next step), which the driver logs
   through verl's tracker, and the probe's warn / raise / stop on a named cause.

Only what the actor streams is sampled; a tensor its export leaves out is named from the next checked sync on
(``SyncWatch.observing``): each full sync is expected to stream every name an earlier checked one streamed, and one
it did not send is stale after an optimizer step (its tensors marked never sent). An export that never streamed a
tensor, from the first checked sync on, is not seen here (the lag-0 probe and the stream rules judge the tokens).

A LoRA actor is checked too: with ``lora.merge=true`` verl streams merged weights under the base names (a plain
sync); with the adapter sync (``lora.merge=false``) the adapter matrices are compared with the slot buffers vLLM
computes with (``integrations.vllm.lora_weights``), and the base weights of the first sync like any others.

The disaggregated sync (a checkpoint engine other than ``naive``: ``nccl``, ``nixl`` ...; verl's ``separate_async``
mode syncs its standalone rollout replicas so) is checked in two halves, because the rollout loads in other workers
after the actor has sent: the actor's ``update_weights`` only sends, and the first rank samples the stream and keeps
the record (``sent``); when verl's checkpoint manager has returned (every replica loaded), the driver asks the actor
ranks to read the replicas (``trainer.TIMTrainerMixin`` -> ``worker.TIMActorRolloutRefWorker.tim_read_replicas`` ->
``read_replicas``): that rank reads every replica's server as above and compares each with the one record, each
replica against its own previous reads. The driver switches this on only where its hook holds
(``features.SYNC_CHECK_DISAGGREGATED``).

A checked sync that no rank could read (a disaggregated sync without the driver's half, the ``delta_sharded``
backend, which drives the engine itself; verl's own server, without the reads) is counted
(``tim/diag/sync_check_unavailable``), and a problem inside the check is counted (``tim/diag/sync_check_failed``):
neither ever breaks the sync.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Iterable, Iterator

from tim_plugins.weight_sync import SyncCheck, SyncCheckConfig, SyncRecord, SyncReport

__all__ = ["SyncWatch"]

logger = logging.getLogger("tim_plugins.verl")


class SyncWatch:
    """The sync check of one actor engine (owned by ``TIMEngineMixin``; ``pipeline``: the engine's
    ``StepPipeline``). ``around`` runs one sync with the check: ``begin``, verl's sync (whose stream the engine passes
    through ``observing``), then ``requests`` / ``finish`` on the rank that reads the engine, and ``deliver`` of every
    rank's report on every rank."""

    def __init__(self, config: SyncCheckConfig, pipeline, holds_outputs: Callable[[], bool] = lambda: True,
                 handed: Callable[[], None] = lambda: None) -> None:
        """``holds_outputs``: whether this rank's pipeline computes the metrics the driver logs (the engine's);
        ``handed``: called on that rank after a checked sync's reports reached its pipeline (the engine keeps the
        cause tracker's state where verl's next checkpoint saves it: verl may save one before the next window)."""
        self.pipeline, self.holds_outputs, self.handed = pipeline, holds_outputs, handed
        self.check = SyncCheck(config)
        self.record: SyncRecord | None = None
        self.checked = False  # whether the sync in flight is one the check compares (the same on every rank)
        self._said: set[str] = set()
        # the disaggregated syncs: counted apart from the colocated ones (separate_async runs both), and each
        # replica compared against its own previous reads (the per-tensor indices are the config's, the same in all)
        self._remote: list[SyncCheck] = [SyncCheck(config)]
        self.sent_record: SyncRecord | None = None
        self.sent_checked = False
        # every name a checked full sync (no LoRA adapter) streamed: each later one is expected to stream them too
        self._streamed: dict[str, None] = {}

    async def around(self, step: int | None, sync: Callable[[], Awaitable], read: Callable[[list], Awaitable] | None,
                     gather: Callable[[list], Awaitable[tuple[list, bool]]]):
        """One weight sync at verl's global step ``step`` with the check; returns ``sync()``'s result.

        ``sync()``: verl's sync (it streams the engine's ``get_per_tensor_param`` and returns once the engine has
        loaded it); ``read(requests)``: the engine's answers (``worker_reads``), None where this rank cannot read;
        ``gather(reports)``: (every rank's reports, whether this rank hands them to its pipeline)."""
        if not self.begin(step, readable=read is not None):
            return await sync()
        try:
            result = await sync()
        except BaseException:
            self.abandon("verl's update_weights raised")
            raise
        report = None
        if self.record is not None:
            try:
                answers = await read(self.requests())
            except Exception as err:  # a failed read costs the check, never the sync
                self.abandon(f"reading the rollout engine failed ({type(err).__name__}: {err})")
                answers = None
            report = self.finish(answers)
        reports, here = await gather([] if report is None else [report])
        self.deliver(reports, here=here)
        return result

    async def sent(self, step: int | None, send: Callable[[], Awaitable], *, reads_here: bool):
        """The actor's half of one disaggregated sync at verl's global step ``step``: ``send()`` (verl's
        ``update_weights`` in a checkpoint-engine mode: it streams the engine's ``get_per_tensor_param`` to the
        checkpoint engine and returns once sent, before the rollout has loaded), its stream sampled on the rank that
        reads the replicas afterwards (``reads_here``); ``read_replicas`` completes it."""
        if self.sent_checked:  # the previous sync's reads never came: that sync goes unread
            self._say("the driver did not ask for the replicas' weights after the previous sync")
        record = self._remote[0].begin(int(step or 0))
        self.sent_checked = record is not None
        self.sent_record = self.record = record if reads_here else None  # self.record: what observing samples into
        try:
            return await send()
        except BaseException:  # verl's sync raised: nothing to read after it
            self.sent_record, self.sent_checked = None, False
            raise
        finally:
            self.record = None

    async def read_replicas(self, reads: list, gather: Callable[[list], Awaitable[tuple[list, bool]]]) -> None:
        """The driver's half of the disaggregated sync ``sent`` started, once every replica has loaded: ``reads``, one
        per rollout replica, ``read(requests)`` -> that replica's answers (None: a replica whose server cannot be
        read). The rank holding the record reads and compares every replica; every rank's reports are gathered
        and delivered as in ``around``. A sync the check skips (``every_n_syncs``) reads nothing, on every rank."""
        record, checked = self.sent_record, self.sent_checked
        self.sent_record, self.sent_checked = None, False
        if not checked:
            return
        reports: list = []
        if record is not None:
            from tim_plugins.integrations.vllm.worker_reads import WorkerReads, sync_requests

            requests = sync_requests(record)
            for j, read in enumerate(reads):
                if read is None:
                    self._say("a rollout replica's server does not answer the sync reads (verl's own vLLM server)")
                    continue
                while len(self._remote) <= j:
                    self._remote.append(SyncCheck(self.check.config))
                try:
                    answers = await read(requests)
                    reports.append(self._remote[j].finish(record, WorkerReads(requests, answers)))
                except Exception as err:  # a failed read costs this replica's check, never the run
                    self._say(f"reading a rollout replica failed ({type(err).__name__}: {err})")
        all_reports, here = await gather(reports)
        if here:
            self._hand_over(all_reports)

    def _say(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            logger.warning("tim-plugins: the weight-sync check reads nothing at this sync: %s", reason)

    def begin(self, step: int | None, *, readable: bool) -> bool:
        """A sync at verl's global step ``step`` is about to run: whether it is checked (every ``every_n_syncs``-th,
        the same on every rank). The stream is sampled only where the engine can be read (``readable``)."""
        record = self.check.begin(int(step or 0))
        self.checked = record is not None
        self.record = record if readable else None
        return self.checked

    def observing(self, weights: Iterable, peft_config=None) -> Iterator:
        """The engine's ``get_per_tensor_param`` stream, sampled as it passes while a sync is checked.

        With a LoRA adapter (``peft_config`` set, ``lora.merge=false``) verl streams the adapter matrices, and at the
        first sync onto dummy weights the base weights as a second stream: both are sampled, the adapter's
        ``lora_B`` times the adapter's scaling, which vLLM folds into it (``lora_weights``). An adapter whose scaling
        is not one number (``rank_pattern`` / ``alpha_pattern``) has its ``lora_B`` passed on unsampled."""
        record = self.record
        if record is None:
            return weights
        if peft_config is None:
            if self._streamed:
                record.expect(self._streamed)
            return self._learning(record.observing(weights), record)
        from tim_plugins.integrations.vllm.lora_weights import lora_scaling

        scaling = lora_scaling(peft_config)

        def observed():
            for name, tensor in weights:
                if not name.endswith(".lora_B.weight"):
                    record.observe(name, tensor)
                elif scaling is not None:
                    record.observe(name, tensor, scale=scaling)
                yield name, tensor

        return observed()

    def _learning(self, stream: Iterator, record: SyncRecord) -> Iterator:
        """``stream`` passed on; once it has all passed, its names join those every later full sync must stream.
        verl's export of a full sync (FSDP's state dict, Megatron's bridge) is the same set of names each time, so a
        name an earlier checked sync streamed and this one does not is a tensor the export left out: the engine
        still holds its earlier values (``SyncCheck.finish``: stale after an optimizer step). The first checked sync
        has nothing to expect; a LoRA adapter's syncs (the base weights at the first only) are not expected."""
        yield from stream
        self._streamed.update((name, None) for name, sent in record.sent.items() if sent.streamed)

    def requests(self) -> list:
        """What to read from the engine after the sync (``worker_reads.sync_requests``)."""
        from tim_plugins.integrations.vllm.worker_reads import sync_requests

        return sync_requests(self.record) if self.record is not None else []

    def finish(self, answers: list | None) -> SyncReport | None:
        """Compare the engine's answers (one per vLLM worker of this rank's replica, ``worker_reads``) with what was
        streamed; None where this rank read nothing."""
        record, self.record = self.record, None
        if record is None or not answers:
            return None
        from tim_plugins.integrations.vllm.worker_reads import WorkerReads, sync_requests

        try:
            return self.check.finish(record, WorkerReads(sync_requests(record), answers))
        except Exception as err:  # the check costs its own result, never the sync
            self.pipeline.count("sync_check_failed", detail=repr(err))
            return None

    def abandon(self, reason: str) -> None:
        """This rank reads nothing at this sync (each ``reason`` logged once); the sync's delivery counts it when no
        rank read anything."""
        if self.record is not None:
            self._say(reason)
        self.record = None

    def deliver(self, reports: list, *, here: bool) -> None:
        """Every rank's report of this sync (None where a rank read nothing): handed to this rank's pipeline when
        ``here`` (one rank of the run: the first that holds outputs), else dropped (that rank names them)."""
        checked, self.checked = self.checked, False
        if here and checked:
            self._hand_over(reports)

    def _hand_over(self, reports: list) -> None:
        """A checked sync's reports to this rank's pipeline; a sync no rank could read is counted."""
        done = [r for r in reports if r is not None]
        if not done:
            self.pipeline.count("sync_check_unavailable", detail="no rank could read the rollout engine's weights "
                                "at this sync (a disaggregated sync read by nobody, or verl's own rollout server)")
        for report in done:
            unread = report.names("unread")
            if unread:
                self.pipeline.count("sync_check_unread", len(unread),
                                    detail=f"tensors the vLLM engine's layout does not let us read: {unread[:4]}")
            self.pipeline.sync_checked(report)
        if done:
            self.handed()
