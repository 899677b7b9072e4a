"""The hooks into GRPOTrainer (TRL 1.16): reversible instance-attribute wrappers, installed only while attached.

TRL exposes no callback that sees the rollout batch or the loss inputs, so four *instance* methods are wrapped
(the class is never touched, so other trainers in the process are unaffected). Each depends on the TRL 1.16
source named in ``TRL_SOURCES`` below; ``tests/test_trl_hook_guards.py`` fails when one of them changes shape.

- ``_generate_and_score_completions``: sees each generation batch after TRL built it (rollout log-probs
  ``sampling_per_token_logps``, ``old_per_token_logps`` when TRL computed them, masks). The monitor is updated
  here when the trainer's log-probs at the rollout weights exist; masks and IS weights are added here.
- ``_compute_loss``: when TRL skipped ``old_per_token_logps`` (on-policy, aligned accumulation: the loss
  forward runs at the rollout weights), the monitor takes the loss forward's own log-probs (no extra forward).
  It only observes: TRL's flags and the inputs pass through unchanged.
- ``_get_per_token_logps_and_entropies``: captures that forward's output (and the safe-set flags).
- ``_generate_single_turn`` (only without vLLM): records the processed log-probs of TRL's own ``generate``
  call, or swaps in the exact sampler / the injector. Decoding modes the recorder cannot follow (beam search,
  assisted decoding) are counted under ``tim/diag/unsupported_generation_mode`` and that batch is not measured.

Plus, with ``safe_vocab``, one module global: ``trl.trainer.utils._ChunkedLogProbFunction`` (the per-token
log-prob kernel of TRL's fused lm_head, looked up at call time) is replaced by a shim that returns safe-vocab
log-probs. Every wrapper takes ``*args, **kwargs`` and forwards them unchanged (signatures vary by release).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

from tim_plugins.rollout.recorder import record_processed_logprobs

__all__ = ["Patch", "TRLHooks", "TRL_SOURCES"]

logger = logging.getLogger(__name__)

# The TRL 1.16 source each hook relies on: (module, qualified name) -> what is assumed of it. The guard tests
# (tests/test_trl_hook_guards.py) check each assumption against the installed TRL.
TRL_SOURCES = {
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions"):
        "called once per generation batch with the raw inputs; returns the batch dict (masks, log-probs, "
        "advantages) that _prepare_inputs shuffles and splits row-wise",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._compute_loss"):
        "(model, inputs) -> loss; loss mask = completion_mask * tool_mask; (B,) or (B, T) advantages; the "
        "per-token policy term is positively homogeneous in the advantages (all loss types but vespo, which reads "
        "inputs['importance_sampling_ratio'] in get_gamma_weights)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._get_per_token_logps_and_entropies"):
        "(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, ...) -> "
        "(logps [B, logits_to_keep], entropies, aux_loss)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_single_turn"):
        "transformers path: one unwrapped_model.generate(..., generation_config=self.generation_config) call, "
        "returns (completion_ids cut after the first EOS, logprobs=None)",
    ("trl.trainer.grpo_trainer", "GRPOTrainer.log"):
        "averages every list in self._metrics[mode] into the logged values and clears them (the callback appends "
        "its tim/ values there, and reads completions/mean_length from it)",
    ("trl.trainer.utils", "_ChunkedLogProbFunction"):
        "looked up at call time by add_fused_lm_head; .apply(hidden, weight, bias, targets, temperature, "
        "chunk_size, final_logit_softcapping, logit_scale, outputs)",
}


class Patch:
    """setattr(obj, name, make(original)) with an exact undo (restores an own attribute or deletes ours)."""

    def __init__(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.obj, self.name = obj, name
        own = vars(obj) if not inspect.ismodule(obj) else obj.__dict__
        self._had_own = name in own
        self._previous = own.get(name)
        self.original = getattr(obj, name)
        self.replacement = make(self.original)
        setattr(obj, name, self.replacement)

    def undo(self) -> None:
        if getattr(self.obj, self.name, None) is not self.replacement:
            logger.warning("tim_plugins: %s.%s was re-patched by someone else; restoring ours anyway",
                           type(self.obj).__name__, self.name)
        if self._had_own or inspect.ismodule(self.obj):
            setattr(self.obj, self.name, self._previous)
        else:
            delattr(self.obj, self.name)


def _label_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Which shifted positions TRL's fused head scores: labels != -100, labelled as in
    trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies and scored by
    trl/trainer/utils.py add_fused_lm_head (both guarded in tests/test_trl_hook_guards.py)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    return labels[:, 1:] != -100  # [b, L-1]


class TRLHooks:
    """Installs / removes the wrappers. ``rt`` is the callback runtime (config, monitor, observers)."""

    def __init__(self, trainer, rt) -> None:
        self.trainer = trainer
        self.rt = rt
        self.patches: list[Patch] = []
        # State shared between wrappers, reset per generation batch.
        self._capture: list[torch.Tensor] | None = None  # loss-forward log-probs (deferred monitor)
        self._policy_records: list[dict] | None = None  # forwards of the policy during generation scoring
        self._seen: set[int] = set()
        self.safe_records: list[torch.Tensor] | None = None  # flat in_safe of each fused-head call (shim)
        self._logps_sig = None
        self.generation_unsupported = False  # this generation batch came from a mode the recorder cannot follow

    # ------------------------------------------------------------------------------------------- install
    def attach(self, *, generation: bool, safe_vocab_shim: Callable | None, exact_scoring: bool = False) -> None:
        t = self.trainer
        # The class's signature (instance attributes may be other wrappers taking *args, **kwargs).
        self._logps_sig = inspect.signature(type(t)._get_per_token_logps_and_entropies)
        # trl/trainer/grpo_trainer.py GRPOTrainer._generate_and_score_completions (TRL_SOURCES)
        self.patches.append(Patch(t, "_generate_and_score_completions", self._wrap_generate_and_score))
        # trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss (TRL_SOURCES)
        self.patches.append(Patch(t, "_compute_loss", self._wrap_compute_loss))
        # trl/trainer/grpo_trainer.py GRPOTrainer._get_per_token_logps_and_entropies (TRL_SOURCES)
        if exact_scoring:  # under the capture wrapper below, so the monitor sees the exact scores
            from ._exact_scoring import exact_scorer

            self.patches.append(Patch(t, "_get_per_token_logps_and_entropies", exact_scorer(t)))
        self.patches.append(Patch(t, "_get_per_token_logps_and_entropies", self._wrap_logps))
        if generation:  # trl/trainer/grpo_trainer.py GRPOTrainer._generate_single_turn (TRL_SOURCES)
            self.patches.append(Patch(t, "_generate_single_turn", self._wrap_generate_single_turn))
        if safe_vocab_shim is not None:  # trl/trainer/utils.py _ChunkedLogProbFunction, read by add_fused_lm_head
            import trl.trainer.utils as trl_utils

            self.patches.append(Patch(trl_utils, "_ChunkedLogProbFunction", safe_vocab_shim))

    def detach(self) -> None:
        while self.patches:
            self.patches.pop().undo()

    @property
    def attached(self) -> bool:
        return bool(self.patches)

    # ------------------------------------------------------------------------------------------ wrappers
    def _wrap_generate_and_score(self, original):
        def _generate_and_score_completions(*args, **kwargs):
            if not self.trainer.model.training:
                return original(*args, **kwargs)
            self._policy_records = []
            self.generation_unsupported = False
            try:
                out = original(*args, **kwargs)
                records, self._policy_records = self._policy_records, None
                self._seen = set()
                self.rt.on_generation_batch(out, records)
            finally:
                self._policy_records = None
            return out

        return _generate_and_score_completions

    def _wrap_compute_loss(self, original):
        def _compute_loss(model, inputs, *args, **kwargs):
            deferred = (
                self.trainer.model.training
                and self.rt.wants_deferred_monitor(inputs)
                and id(inputs) not in self._seen
            )
            if deferred:
                self._seen.add(id(inputs))
                self._capture = []
            try:
                loss = original(model, inputs, *args, **kwargs)
            finally:
                captured, self._capture = self._capture, None
            if deferred and captured:
                self.rt.on_loss_batch(inputs, captured[0])
            return loss

        return _compute_loss

    def _wrap_logps(self, original):
        def _get_per_token_logps_and_entropies(*args, **kwargs):
            self.safe_records = [] if self.rt.safe_vocab_active else None
            try:
                result = original(*args, **kwargs)
            finally:
                safe_flat, self.safe_records = self.safe_records, None
            bound = self._logps_sig.bind(self.trainer, *args, **kwargs)
            model = bound.arguments.get("model")
            policy = model is self.trainer.model or model is getattr(self.trainer, "model_wrapped", None)
            in_safe = None
            mapped = self._map_safe_records(bound.arguments, safe_flat) if safe_flat is not None and policy else None
            if mapped is not None:
                in_safe, pruned, labelled = mapped
                if torch.is_grad_enabled():  # the loss forward only (old/ref scoring would double count)
                    self.rt.features.note_safe(pruned, labelled)
            if self._capture is not None and policy:
                self._capture.append(result[0].detach())
            if self._policy_records is not None and policy:
                self._policy_records.append({"logps": result[0].detach(), "in_safe": in_safe})
            if in_safe is not None:
                self.rt.last_in_safe = in_safe
            return result

        return _get_per_token_logps_and_entropies

    def _map_safe_records(self, arguments: dict, flat: list[tuple[torch.Tensor, torch.Tensor]]):
        """The fused head's flat per-call (in_safe, pruned_mass) → ([B, logits_to_keep] in_safe, pruned mass and
        the labelled positions), as TRL slices its log-probs; None (counted) when the calls do not map."""
        input_ids, attention_mask = arguments["input_ids"], arguments["attention_mask"]
        logits_to_keep = arguments["logits_to_keep"]
        batch_size = arguments.get("batch_size") or input_ids.size(0)
        grids: tuple[list, list, list] = ([], [], [])
        chunks = list(range(0, input_ids.size(0), batch_size))
        if len(flat) != len(chunks):
            self.rt.count_diag("safe_vocab_unmapped")
            return None
        for start, (in_safe, pruned) in zip(chunks, flat):
            end = min(start + batch_size, input_ids.size(0))
            lm = _label_mask(input_ids[start:end], attention_mask[start:end], logits_to_keep).to(in_safe.device)
            if in_safe.numel() == lm.numel():  # every position scored (no Triton)
                in_safe, pruned = in_safe.view(lm.shape), pruned.view(lm.shape)
            elif in_safe.numel() == int(lm.sum()):  # only the labelled positions scored (Triton devices)
                in_safe = in_safe.new_zeros(lm.shape).masked_scatter(lm, in_safe)
                pruned = pruned.new_zeros(lm.shape).masked_scatter(lm, pruned)
            else:
                self.rt.count_diag("safe_vocab_unmapped")
                return None
            for grid, x in zip(grids, (in_safe, pruned, lm)):
                grid.append(x[:, -logits_to_keep:])
        return tuple(torch.cat(g, dim=0) for g in grids)

    def _wrap_generate_single_turn(self, original):
        def _generate_single_turn(*args, **kwargs):
            trainer = self.trainer
            source = self.rt.rollout_source
            if trainer.use_vllm or getattr(trainer, "use_transformers_continuous_batching", False) or source == "vllm":
                return original(*args, **kwargs)
            if source == "exact":
                return self.rt.exact_generate(original, *args, **kwargs)
            gen_model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
            if hasattr(gen_model, "get_base_model"):  # PEFT: generate runs on the transformers model inside
                gen_model = gen_model.get_base_model()
            extra = (self.rt.features.injector,) if source == "inject" else ()
            with record_processed_logprobs(gen_model, extra) as recorders:
                completion_ids, logprobs = original(*args, **kwargs)
            if logprobs is None:
                logprobs = self._recorded_logprobs(recorders, completion_ids)
            return completion_ids, logprobs

        return _generate_single_turn

    def _recorded_logprobs(self, recorders: list, completion_ids: list[list[int]]) -> list[list[float]] | None:
        """One list of processed log-probs per completion from the recorder of TRL's generate call, or None
        (counted) when that call could not be recorded: the batch then goes unmeasured, training is unaffected."""
        if len(recorders) != 1:
            self.rt.count_diag("hf_logprobs_unrecorded",
                               detail=f"{len(recorders)} generate calls in one TRL generation (1 expected)")
            return None
        recorder = recorders[0]
        n = recorder.num_steps
        reason = recorder.unsupported
        if reason is None and recorder.num_rows not in (None, len(completion_ids)):
            reason = f"{recorder.num_rows} rows generated for {len(completion_ids)} completions"
        if reason is None and any(len(ids) > n for ids in completion_ids):
            reason = f"completions longer than the {n} recorded steps"
        if reason is not None:
            self.generation_unsupported = True
            self.rt.count_diag("unsupported_generation_mode",
                               detail=f"{reason}; batches generated this way are not measured")
            return None
        if n == 0:
            return [[] for _ in completion_ids]
        last = torch.tensor([ids[n - 1] if len(ids) >= n else 0 for ids in completion_ids])
        try:
            table = recorder.finish(last).cpu()
        except Exception as err:  # a diagnostic problem never breaks the training step
            self.rt.count_diag("hf_logprobs_unrecorded", detail=repr(err))
            return None
        return [table[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
