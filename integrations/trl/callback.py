"""TIMCallback: one TRL callback that monitors, audits and (opt-in) mitigates training-inference mismatch.

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    trainer.add_callback(TIMCallback(trainer, TIMConfig()))

Like TRL's own callbacks that need the trainer (LogCompletionsCallback), it takes the trainer in ``__init__``.
The callback is the adapter's one runtime object: it translates TRL's tensors (``hooks``) and hands them to the
core's per-step pipeline (``tim_plugins.pipeline.StepPipeline``), which owns every statistic and mitigation. Its
generation-side wrappers live in ``generation.py`` (a mixin); the loss side, the lifecycle and the step's log here.

Where the pipeline measures (the trainer's log-probs of the rollout's tokens at the rollout's weights):
- TRL's ``old_per_token_logps``, when TRL computes it during generation (generation and optimisation misaligned,
  or vLLM with TRL's IS correction): the batch is measured right after TRL built it;
- otherwise the first loss forward over each row, which runs at the rollout's weights (TRL skips
  ``old_per_token_logps`` exactly when it does). No forward is added in either case.
Each loss forward then applies the pipeline's factor to TRL's per-token policy term (``translate.scale_policy_term``):
the correction's weights times the forward's own boundary mask (safe vocabulary). A dropped token carries no
policy gradient and still counts in TRL's normaliser, as a zero-loss token.

Metrics are appended to ``trainer._metrics["train"]`` at the step TRL logs, so TRL's ``log()`` averages them
with its own and they reach ``trainer.state.log_history``, wandb and tensorboard (keys added in ``on_log``
would reach neither: log_history is appended before ``on_log`` runs).
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tim_plugins._optional import note_version, require
from tim_plugins.by_key import turn_keys
from tim_plugins.capabilities import Feature, Status, check, look_through
from tim_plugins.dump import append_log_history, supersede_from, superseded_failure_line, superseded_line, write_summary
from tim_plugins.kept_set import kept_set_line
from tim_plugins.log_keys import for_step_log
from tim_plugins.parity.findings import ParityError
from tim_plugins.lr_scaling import apply_lr_scale
from tim_plugins.patching import Patch
from tim_plugins.pipeline import PipelineConfig, StepPipeline
from tim_plugins.rollout.inject import TailNoiseInjector
from tim_plugins.truncation import Truncation

from . import features, hooks, translate
from ._exact_scoring import exact_scorer
from .async_grpo import ONE_MICRO_BATCH, AsyncAttachment, is_async_grpo
from ._parity import _live_llm, main_process_value, run_audit, server_sampler
from .config import TIMConfig
from .generation import GenerationWrappers
from .kept_sets import KeptSetStore, engine_returns_kept_sets
from .server_probe import ServerProbe
from .sync_check import SyncWatch

__all__ = ["TIMCallback", "TIMState"]

logger = logging.getLogger("tim_plugins.trl")
STATE_VERSION = 2


class TIMState(TrainerCallback, ExportableState):
    """Carrier of the TIMCallback state in TRL/transformers checkpoints (``trainer_state.json``).

    A separate, argument-free class because transformers rebuilds stateful callbacks as ``type(cb)(**args)``
    (``restore_callback_states_from_checkpoint=True``), which a callback holding the trainer cannot survive.
    (TRANSFORMERS_SOURCES transformers.trainer:Trainer._load_callback_state)
    """

    def __init__(self, payload: dict | None = None) -> None:
        self.payload = payload
        self.source = None  # the live TIMCallback (not saved)

    def bind(self, source) -> None:
        """Save ``source.state_payload()`` from now on (the live callback; a rebuilt carrier is bound again)."""
        self.source = source

    def state(self) -> dict:
        payload = self.source.state_payload() if self.source is not None else self.payload
        return {"args": {}, "attributes": {"payload": payload}}


def _attached_callback(trainer) -> "TIMCallback | None":
    """The enabled TIMCallback already on ``trainer`` (its state carrier is among the trainer's callbacks until
    ``detach``), or None."""
    for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(cb, TIMState) and isinstance(cb.source, TIMCallback):
            return cb.source
    return None


def _check_is_trainer(trainer) -> None:
    """The first argument is the trainer to watch: another object (the TIMConfig or the GRPOConfig passed first, the
    trainer not built yet) fails here with the call to write, not later as a TRL hook "missing on the live TIMConfig"
    whose fix would be to report it."""
    from transformers import Trainer

    if isinstance(trainer, Trainer):
        return
    kind = type(trainer).__name__
    # None: TIMCallback() itself, as transformers builds a callback class handed to GRPOTrainer(callbacks=[...])
    why = {"TIMConfig": " (the TIMConfig goes second)", "GRPOConfig": " (the trainer's config, not the trainer)",
           "NoneType": " (GRPOTrainer(callbacks=[TIMCallback]) builds it without the trainer it watches)"}
    raise TypeError(
        f"TIMCallback(trainer, config): trainer must be the GRPOTrainer (or AsyncGRPOTrainer) to monitor, got "
        f"{kind}{why.get(kind, '')}. Fix: build the trainer first, then "
        "trainer.add_callback(TIMCallback(trainer, TIMConfig(...)))")


_LOGPS_READ = ("model", "input_ids", "attention_mask", "logits_to_keep")  # what the wrapper reads of a call


def _logps_signature(trainer_cls: type) -> inspect.Signature:
    """The signature calls to ``_get_per_token_logps_and_entropies`` are bound with: the nearest one in the MRO
    (looked at through another library's wrapper) that names every argument the wrapper reads. A subclass that
    overrides it as ``(self, *args, **kwargs)`` or ``(self, model, *args, **kwargs)`` and calls ``super()`` passes
    TRL's arguments on as they are: bound with its own signature, the policy's forwards would read as the reference
    model's and run unmeasured. The attach check (``features.MONITOR``) has made sure TRL's own names them."""
    name = "_get_per_token_logps_and_entropies"
    last = None
    for klass in trainer_cls.__mro__:
        method = klass.__dict__.get(name)
        if method is None:
            continue
        fn, _ = look_through(method, name)
        last = inspect.signature(fn)
        if all(p in last.parameters for p in _LOGPS_READ):
            return last
    return last if last is not None else inspect.signature(getattr(trainer_cls, name))


@dataclass
class _CallRecord:
    """What one wrapper call in progress holds, set on entry and cleared on exit: the only per-batch data."""

    gen_safe: list | None = None  # safe-set fields of the policy forwards of one generation batch
    safe_calls: list | None = None  # the safe-vocab head's calls within one log-prob call
    loss_inputs: dict | None = None  # the inputs of the loss call in progress
    restore: dict = field(default_factory=dict)  # inputs entries to put back after that loss call
    unsupported_batch: bool = False  # the generation batch came from a mode the recorder cannot follow


class TIMCallback(GenerationWrappers, TrainerCallback):
    """Training-inference mismatch monitor + mitigations for TRL's GRPOTrainer (see `TIMConfig`).

    Args:
        trainer: the ``GRPOTrainer`` (tested with TRL 1.9 - 1.16; each feature is checked against the installed
            TRL when the callback is created, ``features.py``).
        config: a `TIMConfig` (default: monitor + parity audit, no mitigation).
    """

    def __init__(self, trainer=None, config: TIMConfig | None = None) -> None:
        require("trl", "tim_plugins.integrations.trl.TIMCallback")
        self.trl_version = note_version("trl")
        # the transformers internals it relies on: integrations/hf/sources.py TRANSFORMERS_SOURCES
        self.transformers_version = note_version("transformers")
        config = TIMConfig() if config is None else config
        if not isinstance(config, TIMConfig):
            raise TypeError(f"TIMCallback(config=...) needs a TIMConfig, got {type(config).__name__}: {config!r}")
        self.trainer, self.config = trainer, config
        self.rollout_source = "off"
        self.truncation: Truncation | None = None
        self.injector = self.pipeline = None
        self.findings: list = []
        self.parity_specs = None
        self.generation_count = 0
        self._installation: hooks.Installation | None = None
        self._audit_reads: dict[str, bool] | None = None  # the live vLLM objects the audit may read, once checked
        self._grad_norm: float | None = None
        self._grad_norm_hooked = False  # the grad-norm signal read at each optimizer step (attach: _wrap_grad_norm)
        self._length = math.nan  # mean response length of the latest generation batch (all ranks)
        self._pending: dict[str, float] = {}  # one-off values for the next log (the audit's counts)
        self._pushed_at: int | None = None  # global step of the last push into TRL's metrics
        self._call = _CallRecord()
        self._fresh: dict | None = None  # the pipeline's state before any run (a second train() starts from it)
        self._runs = 0  # train() calls begun
        self.state_carrier = TIMState()
        self.state_carrier.bind(self)
        self.features_off: list[Status] = []  # switched off: an upstream hook they need moved (features.py)
        self.safe_route: Feature | None = None
        self.kept_sets: KeptSetStore | None = None  # the engine's kept sets, replayed (kept_sets.py)
        self._async: AsyncAttachment | None = None
        self.liger_loss = False  # the loss runs in Liger's fused GRPO loss (features.liger_grpo_loss)
        self.sync_watch: SyncWatch | None = None  # the weight-sync check (sync_check.py)
        self.server_probe: ServerProbe | None = None  # server mode's lag-0 probe (server_probe.py)
        if not config.enabled:
            return
        _check_is_trainer(trainer)
        attached = _attached_callback(trainer)
        if attached is not None:
            # each would wrap TRL's methods: its loss factor applied on top of the other's, the injector's noise added
            # twice, every batch measured twice
            raise ValueError(
                f"tim_plugins: this {type(trainer).__name__} already has a TIMCallback (rollout log-probs: "
                f"{attached.rollout_source}); one trainer takes one. Fix: keep using that one, or detach it first "
                "(first.detach()) and then add TIMCallback(trainer, ...) again")
        asynchronous = is_async_grpo(trainer)
        monitor = check(features.ASYNC_MONITOR if asynchronous else features.MONITOR, features.live(trainer))
        if not monitor.available:  # the measurement points themselves: nothing to attach to
            raise RuntimeError(f"tim_plugins: TIMCallback cannot attach to this TRL: {monitor.reason} "
                               f"(trl {monitor.version}). Fix: {monitor.fix}")
        pipeline_config = self._async_config(trainer, config) if asynchronous else self._grpo_config(trainer, config)
        self.pipeline = StepPipeline(pipeline_config, rank=trainer.accelerator.process_index, framework="trl")
        for status in self.features_off:
            self.pipeline.feature_off(status.name)
        if asynchronous:
            self._async = AsyncAttachment(self)
        else:
            self._logps_sig = _logps_signature(type(trainer))
            if self.pipeline.causes is not None and config.sync_check and trainer.use_vllm \
                    and trainer.args.vllm_mode == "colocate" \
                    and self._available(check(features.SYNC_CHECK, features.live(trainer))):
                self.sync_watch = SyncWatch(trainer, self.pipeline, config.sync_check_options)
            elif self.pipeline.causes is not None and config.sync_check and trainer.use_vllm \
                    and trainer.args.vllm_mode == "server" \
                    and self._available(check(features.SERVER_PROBE, features.live(trainer))):
                self.server_probe = ServerProbe(trainer, self.pipeline, config.sync_probe_options)
        lr = self.pipeline.lr_controller
        # the grad-norm signal read at each optimizer step (features.LR_GRAD_NORM); off: the last logged one (on_log)
        self._grad_norm_hooked = lr is not None and "grad_norm" in lr.config.signals \
            and self._available(check(features.LR_GRAD_NORM))
        self._fresh = self.pipeline.state_dict()
        # on the trainer once every check above passed: a callback refused there leaves nothing behind
        trainer.add_callback(self.state_carrier)
        self._installation = hooks.Installation(
            trainer, before_train=self._async.before_train if self._async is not None else None)

    def _grpo_config(self, trainer, config: TIMConfig) -> PipelineConfig:
        """GRPOTrainer: where the rollout log-probs come from, the safe-vocab route and what TRL's loss can take."""
        self.rollout_source = translate.rollout_source(trainer, config)
        if self.rollout_source in ("hf", "inject", "exact"):
            needed = features.EXACT_SAMPLER if self.rollout_source == "exact" else features.HF_RECORDER
            if not self._available(check(needed, features.live(trainer))):
                self.rollout_source = "unavailable"
        self.liger_loss = features.liger_grpo_loss(trainer)
        if self.liger_loss:  # Liger's fused GRPO loss: what needs TRL's loss forward is off, each with its warning
            for name, wanted in (("safe_vocab", config.safe_vocab), ("loss_factor", config.is_correction is not None),
                                 ("loss_pass", config.monitor)):
                if wanted:
                    self._available(features.liger_unsupported(name))
        if config.safe_vocab and not self.liger_loss:
            # the route first: it checks the GRPOTrainer settings safe_truncation reads (a TRL that moved one switches
            # the safe vocabulary off with its warning instead of failing on the attribute)
            self.safe_route, _ = features.safe_vocab_route(trainer)
            if self.safe_route is not None:
                # configuration mistakes fail here; a server's own min-p processor is part of the sampler's cut
                server = server_sampler(trainer)
                self.truncation = translate.safe_truncation(trainer, config, server.get("min_p", 0.0),
                                                            engine_logprobs_mode=server.get("logprobs_mode"))
                self.kept_sets = self._kept_set_store(trainer)
                # replay or recompute, and why
                logger.info(kept_set_line("trl", self.trl_version, sampling_mask=self.kept_sets is not None))
            else:
                self._available(features.safe_vocab_status(trainer))
        loss_factor = not self.liger_loss
        if loss_factor and (config.is_correction is not None or
                            (self.truncation is not None and config.mask_boundary_tokens)):
            loss_factor = self._available(check(features.LOSS_FACTOR, features.live(trainer)))
        if self.rollout_source == "inject":
            self.injector = TailNoiseInjector.from_config(config.inject_options)
        return translate.pipeline_config(trainer, config, self.rollout_source, safe_vocab=self.truncation is not None,
                                         loss_factor=loss_factor)

    def _kept_set_store(self, trainer) -> KeptSetStore | None:
        """A store for the engine's kept sets when the colocate engine hands them out (built inside
        ``kept_sets.engine_kept_sets``) and the fused head's route is on; else None (the cut is recomputed)."""
        llm = _live_llm(trainer)
        if self.safe_route is not features.SAFE_VOCAB_FUSED_HEAD or llm is None or not engine_returns_kept_sets(llm):
            return None
        return KeptSetStore() if self._available(check(features.KEPT_SET_REPLAY, features.live(trainer))) else None

    def _async_config(self, trainer, config: TIMConfig) -> PipelineConfig:
        """AsyncGRPOTrainer (``async_grpo.py``): the monitor by policy lag; what needs GRPOTrainer is switched off."""
        if config.rollout != "auto":
            raise ValueError(f"TIMConfig.rollout={config.rollout!r}: AsyncGRPOTrainer's rollouts come from its rollout "
                             "worker (the vLLM server's log-probs). Fix: rollout='auto'.")
        self.rollout_source = "vllm"
        for name, (off, _) in features.ASYNC_UNSUPPORTED.items():
            if getattr(config, name) != off:
                self._available(features.async_unsupported(name))
        if getattr(trainer.args, "gradient_accumulation_steps", None) == 1:
            logger.warning(ONE_MICRO_BATCH)
        return translate.pipeline_config(trainer, config, "vllm", safe_vocab=False, loss_factor=False,
                                         asynchronous=True)

    def _available(self, status: Status) -> bool:
        """True when ``status`` is available; else the feature is switched off with one warning (strict: raise)."""
        if status.available:
            return True
        if self.config.strict:
            raise RuntimeError(status.warning().replace("Everything else keeps working; ", "Strict mode; "))
        logger.warning(status.warning())
        self.features_off.append(status)
        return False

    # -------------------------------------------------------------------------------------- lifecycle
    def attach(self) -> None:
        """Install the wrappers (each ``hooks.TRL_SOURCES`` entry it relies on is named beside it); a no-op while they
        are installed (a second call would wrap every hook twice: the loss factor applied twice)."""
        if self._installation.patches:
            return
        t = self.trainer
        # TRANSFORMERS_SOURCES transformers.trainer:Trainer._get_grad_norm (the step's norm, before on_step_end)
        grad_norm = [(t, "_get_grad_norm", self._wrap_grad_norm)] if self._grad_norm_hooked else []
        if self._async is not None:
            self._installation.install([*self._async.wrappers(), *grad_norm])
            return
        wrappers = [*grad_norm,
            # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions
            (t, "_generate_and_score_completions", self._wrap_generation_batch),
            # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._compute_loss
            (t, "_compute_loss", self._wrap_loss),
        ]
        # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies; in exact mode
        # scored like the exact sampler, under the wrapper below so the pipeline sees the exact scores
        if self.rollout_source == "exact":
            wrappers.append((t, "_get_per_token_logps_and_entropies", exact_scorer(t)))
        wrappers.append((t, "_get_per_token_logps_and_entropies", self._wrap_logps))
        # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn
        if self.rollout_source in ("hf", "exact", "inject"):
            wrappers.append((t, "_generate_single_turn", self._wrap_single_turn))
        # hooks.TRL_SOURCES trl.generation.vllm_generation:VLLMGeneration.generate (the live engine's generate)
        if self.kept_sets is not None:
            wrappers.append((_live_llm(t), "generate", self._wrap_engine_generate))
        for watch in (self.sync_watch, self.server_probe):  # colocate: the weights read; server mode: the probe
            if watch is not None:
                wrappers.extend(watch.wrappers())
        self._installation.install(wrappers)

    def _wrap_grad_norm(self, original):
        def _get_grad_norm(*args, **kwargs):
            norm = original(*args, **kwargs)
            try:  # one host read per optimizer step, only with the grad-norm signal (transformers logs it anyway)
                self._grad_norm = float(norm)
            except Exception as err:  # the signal misses this step; the step goes on
                self._grad_norm = None
                self.pipeline.count("grad_norm_unread", detail=repr(err))
            return norm

        return _get_grad_norm

    def _safe_patch(self, arguments: dict) -> Patch:
        """The safe-vocab stand-in for the module global TRL's log-prob call looks up, installed for one call of this
        trainer's ``_get_per_token_logps_and_entropies`` (bound ``arguments``; other trainers in the process never
        see it)."""
        if self.safe_route is features.SAFE_VOCAB_FUSED_HEAD:
            # hooks.TRL_SOURCES trl.trainer.utils:_ChunkedLogProbFunction, read by add_fused_lm_head
            import trl.trainer.utils as trl_utils

            def unsupported():
                self.pipeline.count("safe_vocab_unsupported_head")

            # replayed in training only: an evaluation batch's sets are never kept (generation.py's engine wrapper),
            # so its forwards recompute the cut, which is no fallback (not counted)
            if self.kept_sets is not None and self.trainer.model.training:
                try:
                    next_sets = self.kept_sets.next_sets(arguments["input_ids"], arguments["attention_mask"],
                                                         arguments["logits_to_keep"], arguments.get("batch_size"))
                except Exception as err:  # those rows recompute (counted per head call)
                    self.pipeline.count("kept_sets_unreadable", detail=repr(err))
                    next_sets = lambda n_rows: None  # noqa: E731
                return Patch(trl_utils, "_ChunkedLogProbFunction", lambda original: hooks.ReplayHead(
                    original, self.truncation, self._on_safe_call, unsupported, next_sets,
                    lambda: self.pipeline.count("kept_sets_fallback")))
            return Patch(trl_utils, "_ChunkedLogProbFunction", lambda original: hooks.SafeVocabHead(
                original, self.truncation, self._on_safe_call, unsupported))
        # hooks.TRL_SOURCES trl.trainer.grpo_trainer:selective_log_softmax (TRL 1.9 - 1.13), in the module the
        # trainer's log-prob call reads it from (TRL's, or one a patching library rebuilt the class into)
        return Patch(features.logits_route_module(self.trainer), "selective_log_softmax",
                     lambda original: hooks.SafeLogSoftmax(original, self.truncation, self._on_safe_call))

    @property
    def installed(self) -> list[str]:
        """What is wrapped now, as ``Owner.name`` (the module's name for a module global)."""
        return self._installation.installed if self._installation is not None else []

    def detach(self) -> None:
        """Remove every wrapper and this callback from the trainer (idempotent)."""
        if self._installation is not None:
            self._installation.remove()
        if self.trainer is None:  # a disabled callback built without a trainer: nothing was added anywhere
            return
        handler = self.trainer.callback_handler
        for cb in (self, self.state_carrier):
            if cb in handler.callbacks:
                handler.remove_callback(cb)

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.config.enabled:
            return
        if state is not self.trainer.state:  # transformers hands each event the training trainer's own state
            # it would patch and report into its own trainer while this one trains unmeasured
            raise ValueError(
                f"tim_plugins: this TIMCallback was built for another trainer ({type(self.trainer).__name__} at "
                f"{id(self.trainer):#x}) than the one whose train() started; a TIMCallback measures the trainer it "
                "is given. Fix: TIMCallback(trainer, config) with the trainer that trains, one per trainer")
        # the probe judges each logging window (_push_metrics): a run that never logs would be checked once, after
        # its last step
        strategy = getattr(args.logging_strategy, "value", args.logging_strategy)
        if self.pipeline.probe is not None and str(strategy) == "no":
            raise ValueError(
                "tim_plugins: TIMConfig(parity_probe=True) with GRPOConfig(logging_strategy='no'): the probe judges "
                "each logging window's metrics, and this run logs none, so it would check once, after the last "
                "step. Fix: GRPOConfig(logging_strategy='steps', logging_steps=<N>) (the probe then acts at most N "
                "steps late), or parity_probe=False")
        self._step_lengths = []  # a step a raise cut short leaves no batch behind for the next run's first step
        # transformers may have rebuilt the carrier (restore_callback_states_from_checkpoint=True): relink it.
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, TIMState):
                cb.bind(self)
                self.state_carrier = cb
        if state.global_step == 0 and self._runs:
            self._restart(kwargs.get("optimizer") or self.trainer.optimizer,
                          kwargs.get("lr_scheduler") or self.trainer.lr_scheduler)
        self._runs += 1
        self._load(state)
        if not self._installation.patches:
            self.attach()
        audited = self.config.parity_audit and self._async is None
        if audited:
            if self._audit_reads is None:
                self._audit_reads = self._live_audit_reads()
            self.findings, self.parity_specs, counts = run_audit(
                self.trainer, self.rollout_source, self.truncation, strict=self.config.parity_strict,
                **self._audit_reads)
            self._pending.update({f"tim/parity/{severity}s": float(n) for severity, n in counts.items()})
            # the main process alone reads a vLLM server (TRL's client): its audit's errors decide every rank's
            # causes (a cause named on one rank alone would trip one rank's probe)
            self.pipeline.audited(main_process_value(
                self.trainer, [f.code for f in self.findings if f.severity == "error"]))
        if self.config.dump_dir:
            self._supersede(state.global_step + 1)
        if self.config.dump_dir and self.trainer.accelerator.is_main_process:
            # beside the dump, what `tim-plugins report DUMP_DIR` reads to speak TRL (fixes, audit, tokenizer)
            settings = {"model": getattr(self.trainer.model.config, "name_or_path", None),
                        "trainer": type(self.trainer).__name__, "trl": self.trl_version,
                        "rollout log-probs": self.rollout_source,
                        # the engine's kept sets replayed (kept_sets.py): the report's truncation section says so
                        "sampling mask": "true" if self.kept_sets is not None else "false",
                        # the report's truncation section speaks these (GRPOConfig / TIMConfig words)
                        "GRPOConfig sampling": {k: getattr(self.trainer.args, k, None)
                                                for k in ("top_p", "top_k", "min_p", "temperature")},
                        "TIMConfig safe vocabulary": {"safe_vocab": self.config.safe_vocab,
                                                      "safe_vocab_min_p": self.config.safe_vocab_min_p}}
            try:
                write_summary(self.config.dump_dir, framework="trl", settings=settings,
                              title="Training-inference mismatch report (TRL run)",
                              findings=[f.to_dict() for f in self.findings] if audited else None)
            except OSError as err:  # the report loses its audit table and fix words; training goes on
                self.pipeline.count("dump_summary_unwritten", detail=repr(err))

    def _supersede(self, first_step: int) -> None:
        """The dump folder as this attempt starts at ``first_step`` (a resume, a fresh start or ``train()`` again):
        what an earlier attempt wrote for these steps moved aside (``dump.supersede_from``), by the main process for
        every rank while the others wait, so no rank's first file of this attempt is moved with them. A failure
        costs the report its clean steps (counted, said), never the run."""
        if self.trainer.accelerator.is_main_process:
            try:
                line = superseded_line(first_step, *supersede_from(self.config.dump_dir, first_step))
            except OSError as err:
                self.pipeline.count("dump_failed", detail=repr(err))
                line = superseded_failure_line(self.config.dump_dir, first_step, err)
            if line:
                logger.warning("tim_plugins: %s", line)
        self.trainer.accelerator.wait_for_everyone()

    def _restart(self, optimizer, lr_scheduler) -> None:
        """``train()`` again without a checkpoint: transformers starts a new run (state at step 0, the LR schedule
        rebuilt; the optimizer kept), and so does the pipeline: its statistics, problem counts and LR controller as
        before the first run (the controller would otherwise read steps 1.. as stale and keep the last run's decay),
        the LR scale applied back to 1 before the first step; the injector's noise and the exact sampler's seeds
        start over as in the first run."""
        self.pipeline.load_state_dict(self._fresh)
        self.generation_count = 0
        if self.injector is not None:
            self.injector.reset()
        for status in self.features_off:
            self.pipeline.feature_off(status.name)
        self._grad_norm, self._length, self._pending, self._pushed_at = None, math.nan, {}, None
        if self.pipeline.lr_controller is not None and optimizer is not None:
            apply_lr_scale(optimizer, self.pipeline.lr_controller.scale, lr_scheduler)

    def _live_audit_reads(self) -> dict[str, bool]:
        """Which live vLLM object the audit may read (``run_audit``'s ``engine`` / ``server``): each needs its TRL
        hooks (``features.ENGINE_AUDIT`` colocate, ``features.SERVER_AUDIT`` server mode); a moved one is switched
        off alone, and the audit then reports the engine's settings as unknown."""
        args = self.trainer.args
        reads = {"engine": False, "server": False}
        if not args.use_vllm:
            return reads
        name, feature = ("server", features.SERVER_AUDIT) if args.vllm_mode == "server" else \
            ("engine", features.ENGINE_AUDIT)
        status = check(feature, features.live(self.trainer))
        reads[name] = self._available(status)
        if not reads[name]:
            self.pipeline.feature_off(status.name)
        return reads

    def on_train_end(self, args, state, control, **kwargs):
        if self._installation is not None:
            self._installation.undo()
        causes = self.pipeline.causes if self.pipeline is not None else None
        if causes is not None and self.trainer.accelerator.is_main_process:
            for line in causes.summary_lines():  # every rank names the same causes (their flags are merged)
                logger.warning(line)

    # -------------------------------------------------------------------------------- TRL -> pipeline
    # (the generation side: generation.py's GenerationWrappers)
    def _measure(self, *args, **kwargs):
        """``StepPipeline.measure``: a batch it cannot read costs its statistics, not the step (counted under
        ``tim/diag/measure_failed``; strict mode raises), except with an IS correction, whose weights the loss needs
        (it would run uncorrected)."""
        try:
            return self.pipeline.measure(*args, **kwargs)
        except Exception as err:
            if self.pipeline.config.correction is not None:
                raise
            self.pipeline.count("measure_failed", detail=repr(err))
            return None

    def _wrap_loss(self, original):
        def _compute_loss(model, inputs, *args, **kwargs):
            if not self.trainer.model.training:
                return original(model, inputs, *args, **kwargs)
            self._call.loss_inputs = inputs
            try:
                return original(model, inputs, *args, **kwargs)
            finally:
                if self._call.restore:
                    inputs.update(self._call.restore)
                self._call.loss_inputs, self._call.restore = None, {}

        return _compute_loss

    def _wrap_logps(self, original):
        def _get_per_token_logps_and_entropies(*args, **kwargs):
            try:
                arguments = self._logps_sig.bind(self.trainer, *args, **kwargs).arguments
            except TypeError as err:  # a call TRL's own signature does not take: not measured, counted
                self.pipeline.count("logps_call_unbound", detail=f"{err} (the forward runs unmeasured)")
                return original(*args, **kwargs)
            model = arguments.get("model")
            if model is None:
                self.pipeline.count("logps_call_unbound", detail="no model argument (the forward runs unmeasured)")
                return original(*args, **kwargs)
            if model is not self.trainer.model and model is not getattr(self.trainer, "model_wrapped", None) \
                    or self._scores_reference():
                # the reference model (beta > 0): full-vocabulary log-probs, TRL's own, as verl's reference worker
                # computes them: the KL term regularises the policy towards the reference's distribution, which
                # nobody samples from, so the sampler's truncation does not apply to it (docs/trl.md)
                return original(*args, **kwargs)
            self._call.safe_calls = [] if self.truncation is not None else None
            scoped = self._safe_patch(arguments) if self.truncation is not None else None
            try:
                result = original(*args, **kwargs)
                calls = self._call.safe_calls
            finally:
                if scoped is not None:
                    scoped.undo()
                self._call.safe_calls = None
            safe = None
            if calls is not None:
                try:
                    safe = translate.map_safe_calls(arguments, calls)
                except Exception as err:  # fields of shapes it does not know: as fields that do not map
                    self.pipeline.count("safe_vocab_unmapped", detail=repr(err))
                else:
                    if safe is None:
                        self.pipeline.count("safe_vocab_unmapped")
            if self._call.gen_safe is not None:
                self._call.gen_safe.append(safe)
            elif self._call.loss_inputs is not None and torch.is_grad_enabled():
                self._on_loss_forward(self._call.loss_inputs, result[0], safe)
            return result

        return _get_per_token_logps_and_entropies

    def _scores_reference(self) -> bool:
        """Whether a call with the policy model scores the reference: a PEFT policy has no reference model, and TRL
        scores the reference with the policy inside ``use_adapter(model, "ref" if "ref" in model.peft_config else
        None)``: its adapters disabled (PEFT's ``disable_adapter`` sets ``_adapters_disabled``), or the initial
        copy of a re-trained adapter, named "ref", active. PEFT's ``_adapters_disabled`` is private: the PEFT case of
        tests/test_trl_mitigations.py::test_reference_log_probs_stay_full_vocabulary_with_safe_vocab fails if it moves.
        (hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions, beta != 0 branch)"""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if getattr(model, "peft_config", None) is None:
            return False
        return bool(getattr(model, "_adapters_disabled", False)) or getattr(model, "active_adapter", None) == "ref"

    def _on_safe_call(self, fields) -> None:
        if self._call.safe_calls is not None:
            self._call.safe_calls.append(fields)

    def _on_loss_forward(self, inputs: dict, logps: torch.Tensor, safe) -> None:
        """A loss forward, before TRL reads the advantages: measure pending rows, then scale the policy term. A batch
        the callback cannot read (a GRPOTrainer subclass's own keys or shapes) costs the pass its statistics and
        factor, not the step: counted under ``tim/diag/loss_batch_unread``, TRL's loss runs as TRL computes it
        (strict mode raises); with an IS correction it raises, as the loss would otherwise run uncorrected."""
        try:
            self._loss_forward(inputs, logps, safe)
        except Exception as err:
            if self.pipeline.config.correction is not None:
                raise RuntimeError(
                    f"tim_plugins: TIMConfig(is_correction={self.config.is_correction!r}) applies its weights in "
                    f"each loss forward, and this one's batch could not be read: the loss would train uncorrected. "
                    "Fix: hand GRPOTrainer._compute_loss TRL's batch (its keys and [B, T] shapes: completion_mask, "
                    f"advantages, sampling_per_token_logps), or is_correction=None. The error: {err!r}") from err
            self.pipeline.count("loss_batch_unread", detail=f"{err!r} (the pass trains with TRL's own loss)")

    def _loss_forward(self, inputs: dict, logps: torch.Tensor, safe) -> None:
        mask = translate.response_mask(inputs)
        if inputs.pop("tim_pending", None) is not None:
            # multi-turn rollouts (tools, or a rollout_func's env_mask): TRL's tool_mask marks the model's tokens
            turn = turn_keys(inputs["tool_mask"]) if inputs.get("tool_mask") is not None else None
            weights = self._measure(inputs["sampling_per_token_logps"], logps.detach(), mask, safe=safe,
                                    token_ids=inputs["completion_ids"], step=self.trainer.state.global_step + 1,
                                    turn=turn)
            if weights is not None:
                inputs["tim_weights"] = weights  # for this batch's later passes (num_iterations > 1)
        # the pipeline's setting, not TIMConfig's: it is off where the loss factor's hook moved (features.LOSS_FACTOR)
        boundary = safe.in_safe if safe is not None and self.pipeline.config.mask_boundary else None
        factor = self.pipeline.loss_factor(mask, boundary, inputs.get("tim_weights"))
        if factor is not None:
            # from TRL's own values: a loss that scores twice in one call (a subclass) would otherwise scale what the
            # call's first forward scaled, and put that back at its end
            inputs.update(self._call.restore)
            for key, value in translate.scale_policy_term(inputs, factor, mask, self.trainer.loss_type).items():
                self._call.restore.setdefault(key, value)
        try:
            self._split(inputs, logps.detach(), mask if boundary is None else mask & boundary.bool())
        except Exception as err:  # the staleness split is a diagnostic: its failure costs the pass's split
            self.pipeline.count("measure_failed", detail=repr(err))

    def _split(self, inputs: dict, current: torch.Tensor, mask: torch.Tensor) -> None:
        """Staleness vs mismatch in this loss pass over the measured tokens (``mask``: the boundary tokens of the safe
        vocabulary left out, as the monitor leaves them out), ``tim_plugins.staleness``."""
        if self.pipeline.staleness_monitor is None:
            return
        args = translate.loss_pass_inputs(inputs, current, self.trainer.state.global_step)
        if args is not None:
            rollout, old, lag = args
            self.pipeline.loss_pass(rollout, old, current, mask, lag=lag)

    # ---------------------------------------------------------------------------------- step / log
    def on_log(self, args, state, control, logs=None, **kwargs):
        # without the step's own read (features.LR_GRAD_NORM off): the last logged norm, which on_log brings after
        # on_step_end, so one step late and only every logging_steps
        if not self._grad_norm_hooked and logs and logs.get("grad_norm") is not None:
            self._grad_norm = float(logs["grad_norm"])

    def on_step_end(self, args, state, control, **kwargs):
        if not self.config.enabled:
            return
        if self._async is not None:  # the samples this step trained (with LR decay, one collective: every rank)
            length = self._async.end_step(length=self.pipeline.lr_controller is not None)
            self._step_lengths = []  # the async trainer's length is the trained samples', not the generated ones'
        else:
            # the mean (as TRL's log() averages a window, NaN left out) of the mean lengths of the generation batches
            # generated in this step; NaN (a skipped observation) in a step that trains a batch generated earlier
            # (num_iterations > 1, steps_per_generation > gradient_accumulation_steps). Each batch is observed once,
            # at the step whose log row carries its completions/mean_length and its k3: with logging_steps=1 the
            # controller sees what `tim-plugins lr-replay` reads from TRL's log.
            values, self._step_lengths = [v for v in self._step_lengths if not math.isnan(v)], []
            length = sum(values) / len(values) if values else math.nan
        scale = self.pipeline.end_step(state.global_step, response_length=length, grad_norm=self._grad_norm)
        if scale is not None:
            # Through the scheduler's base_lrs and _last_lr as well as the param groups: TRL's logged
            # learning_rate (scheduler.get_last_lr()) shows the decay from the next step.
            apply_lr_scale(kwargs.get("optimizer") or self.trainer.optimizer, scale,
                           kwargs.get("lr_scheduler") or self.trainer.lr_scheduler)
        if control.should_log:
            self._push_metrics(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        """Runs before the epoch's own log and before the trainer's final log (transformers Trainer
        ``_run_epoch`` → ``_finalize_training``): a run that ends between two ``logging_steps`` boundaries (or
        logs per epoch) still hands its last window to TRL, whose ``log()`` adds it to that final entry.
        (TRANSFORMERS_SOURCES transformers.trainer:Trainer._run_epoch; before transformers 5.3 the epoch loop of
        TRANSFORMERS_SOURCES transformers.trainer:Trainer._inner_training_loop)"""
        if not self.config.enabled or self._pushed_at == state.global_step:
            return
        if control.should_log or control.should_training_stop or state.global_step >= state.max_steps:
            self._push_metrics(state, control)
            if not self.trainer.model.training:
                # an evaluation ran after the last step (eval_steps dividing max_steps) and left the model in eval
                # mode, where TRL's log() reads its evaluation metrics: the epoch's and the final log would drop the
                # window. Logged now as the training row it is (TRL's own window metrics with it), the model's
                # train/eval flags put back as they were.
                self._log_training_window()

    def _log_training_window(self) -> None:
        """TRL's ``log()`` of the training window (``_metrics["train"]``: TRL averages it, with our pushed values)
        while the model is in eval mode: TRL picks the window by ``model.training``, set for the call and then put
        back module by module. (hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.log)"""
        modules = list(self.trainer.model.modules())
        flags = [m.training for m in modules]
        self.trainer.model.train()
        try:
            self.trainer.log({})
        finally:
            for module, flag in zip(modules, flags):
                module.training = flag

    def _push_metrics(self, state, control) -> None:
        """Append this logging window's tim/ metrics to ``trainer._metrics["train"]``: TRL's ``log()`` averages
        them with its own into the next log entry."""
        self._pushed_at = state.global_step
        out, decision, hists = self.pipeline.compute(state.global_step, raise_on_trip=False)
        if decision is not None and decision.stop:
            logger.warning("tim_plugins: parity probe tripped at step %d (%s); stopping training", state.global_step,
                           ", ".join(f"{t.key}={t.value:.4g}" for t in decision.trips))
            control.should_save = control.should_training_stop = True
        if hists:
            self._log_histograms(hists)
        out.update(self._pending)
        self._pending = {}
        if self.config.dump_dir and self.trainer.accelerator.is_main_process:
            # beside the dump, what `tim-plugins report DUMP_DIR` reads for the per-step sections: every metric
            row = dict(out)
            # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.log: the window's mean reward, as TRL's log()
            # is about to average it (the report's reward panel)
            reward = self.trainer._metrics["train"].get("reward")
            if reward:
                row["reward"] = sum(reward) / len(reward)
            try:
                append_log_history(self.config.dump_dir, state.global_step, row)
            except OSError as err:  # a full or read-only disk costs the report its row, never the step
                self.pipeline.count("dump_failed", detail=repr(err))
        out = for_step_log(out, self.config.log_detail)
        # hooks.TRL_SOURCES trl.trainer.grpo_trainer:GRPOTrainer.log averages it (AsyncGRPOTrainer: reduces it,
        # hooks.TRL_SOURCES trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.log)
        store = self.trainer._metrics["train"]
        for key, value in out.items():
            store[key].append(float(value))
        if decision is not None and decision.action == "raise":
            # the raise ends the step before the trainer logs it: the tripped window's row is logged first (TRL's
            # log() averages the window as it would have), so the step the run stopped at is in the trainer's log
            # history and every reporting integration
            self.trainer.log({})
            raise ParityError(decision.message, trip=decision)

    def _log_histograms(self, hists: dict) -> None:
        try:
            import wandb

            if wandb.run is not None:  # commit=False: merged into the row transformers' WandbCallback commits
                wandb.log({f"tim/hist/{name}": wandb.Histogram(np_histogram=bins) for name, bins in hists.items()},
                          commit=False)
        except Exception as err:  # a logging problem never breaks the training step
            self.pipeline.count("histogram_failed", detail=repr(err))

    # ------------------------------------------------------------------------------------ checkpoint
    def state_payload(self) -> dict:
        return {"version": STATE_VERSION, "pipeline": self.pipeline.state_dict() if self.pipeline else None,
                "grad_norm": self._grad_norm,
                "length": None if math.isnan(self._length) else self._length, "generation_count": self.generation_count,
                "probe": self.server_probe.probe.state_dict() if self.server_probe is not None else None,
                "injector": self.injector.state_dict() if self.injector is not None else None}

    def _load(self, state) -> None:
        """On resume (global_step > 0), reload what the checkpoint's trainer_state.json holds for us."""
        if state.global_step <= 0:
            return
        saved = (state.stateful_callbacks or {}).get("TIMState")
        if isinstance(saved, list):
            saved = saved[-1] if saved else None
        payload = (saved or {}).get("attributes", {}).get("payload") if isinstance(saved, dict) else None
        if not payload:
            warnings.warn("tim_plugins: resuming from a checkpoint without TIM state; monitor and LR controller "
                          "start fresh", stacklevel=2)
            return
        if payload.get("version") != STATE_VERSION:
            raise RuntimeError(f"tim_plugins: checkpoint TIM state version {payload.get('version')!r} != "
                               f"{STATE_VERSION}; this tim-plugins release cannot resume it")
        if payload.get("pipeline"):
            # transformers writes trainer_state.json on the main process alone: the others take what every rank
            # shares, not its statistics and problem counts (they would count twice when the ranks merge)
            self.pipeline.load_state_dict(payload["pipeline"],
                                          shared_only=not self.trainer.accelerator.is_main_process)
        self._grad_norm = payload.get("grad_norm")
        self._length = math.nan if payload.get("length") is None else float(payload["length"])
        self.generation_count = int(payload.get("generation_count") or 0)
        if self.injector is not None and isinstance(payload.get("injector"), dict):
            self.injector.load_state_dict(payload["injector"])
        if self.server_probe is not None and isinstance(payload.get("probe"), dict):
            self.server_probe.probe.load_state_dict(payload["probe"])
