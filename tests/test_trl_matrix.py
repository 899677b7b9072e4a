"""TIMCallback across GRPOTrainer's configuration space (real GRPOTrainer runs on the toy model, CPU).

Default configuration: the run is bit-identical to a run without the callback (every logged value but the tim/
keys and wall-clock timings, and every final parameter), and tim/ metrics are logged at least once per run.
Opt-in modes (IS correction, safe vocabulary): TRL's own invariants hold: no token TRL masked comes back, the
dapo normaliser counts exactly the tokens left in the loss, and a batch TRL masks entirely (every completion
truncated, ``mask_truncated_completions=True``) gives loss 0 and leaves the parameters unchanged.

Tool calling runs TRL's real tool loop: a logits processor (test-side) makes the toy model emit one tool call,
which TRL parses, executes and answers before the second turn. Two completions per prompt, 2-3 optimizer steps
per run, so the matrix stays CI-sized.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_callback import Capture  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.toy_model import synthetic_prompts  # noqa: E402

pytestmark = pytest.mark.trl

MCL = 6  # max_completion_length
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# Tool calling on the toy tokenizer: a compact prefix-preserving template that renders tool calls and results,
# and the matching (legacy, transformers < 5.13) response schema TRL parses completions with.
TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<T>{{ m.content }}</T>"
    "{%- elif m.role == 'assistant' -%}<A>{{ m.content }}"
    "{%- for c in (m.tool_calls or []) -%}<C>{{ c.function | tojson }}</C>{%- endfor -%}<E>"
    "{%- else -%}<U>{{ m.content }}<E>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<A>{%- endif -%}")
TOOL_SCHEMA = {
    "x-regex": r"^(?P<content>(?:(?!<C>)[\s\S])*?)(?P<tool_calls>(?:<C>(?:(?!</C>)[\s\S])+</C>)+)?\s*(?:<E>|$)",
    "type": "object",
    "properties": {
        "role": {"const": "assistant"}, "content": {"type": "string"},
        "tool_calls": {"type": "array", "x-regex-iterator": r"<C>\s*(.+?)\s*</C>", "items": {
            "x-parser": "json", "x-parser-args": {"transform": "{type: 'function', function: @}"}, "type": "object",
            "properties": {"type": {"const": "function"}, "function": {"type": "object", "properties": {
                "name": {"type": "string"}, "arguments": {"type": "object", "additionalProperties": {}}}}}}},
    },
}
# The same grammar as a new-style response template (transformers >= 5.13 parse with it and ignore the legacy
# schema; TRL's add_response_schema sets one or the other the same way): the tool calls between <C> and </C>, the
# content up to <E> (what follows, the EOS, is dropped as the schema's regex drops it).
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<A>",
    "fields": {
        "tool_calls": {"open": "<C>", "close_pattern": r"</C>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<E>[\s\S]*", "content": "text"},
    },
}
TOOL_CALL = '<C>{"name": "double", "arguments": {"x": 1}}</C><E>'


def double(x: int) -> int:
    """Double a number.

    Args:
        x: the number to double
    """
    return 2 * x


class _ForceToolCall:
    """A logits processor that makes the toy model emit TOOL_CALL then EOS at the start of its first turn
    (a random toy model never calls a tool by itself); later turns (inside TRL's tool loop) sample freely."""

    def __init__(self, token_ids: list[int], start: int) -> None:
        self.token_ids, self.start = token_ids, start

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.start
        if t >= len(self.token_ids):
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.token_ids[t]] = 0.0
        return forced


def _install_tool_forcing(trainer) -> None:
    """Test-side instance attributes (installed before the callback, which wraps on top of them)."""
    tok = trainer.processing_class
    ids = tok(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    model, state = trainer.model, {"in_loop": False}
    get_processors, tool_loop = model._get_logits_processor, trainer._tool_call_loop

    def _get_logits_processor(*args, **kwargs):
        processors = get_processors(*args, **kwargs)
        if not state["in_loop"]:
            processors.insert(0, _ForceToolCall(ids, kwargs["input_ids_seq_length"]))
        return processors

    def _tool_call_loop(*args, **kwargs):
        state["in_loop"] = True
        try:
            return tool_loop(*args, **kwargs)
        finally:
            state["in_loop"] = False

    model._get_logits_processor = _get_logits_processor
    trainer._tool_call_loop = _tool_call_loop


def _set_response_parser(tokenizer) -> None:
    """The parser the installed transformers reads: a ``response_template`` where ``parse_response`` takes the
    chat's ``prefix`` (transformers >= 5.13), else the legacy ``response_schema``."""
    import inspect

    if "prefix" in inspect.signature(tokenizer.parse_response).parameters:
        tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    else:
        tokenizer.response_schema = TOOL_SCHEMA


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def reward_length(completions, **kwargs):
    return [len(_text(c)) / 10.0 for c in completions]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in _text(c))) for c in completions]


def reward_n_tokens(completions, completion_ids, **kwargs):
    """Completion length in tokens: with ``_ForceEndings`` a group's ended and truncated rows always differ."""
    return [float(len(ids)) for ids in completion_ids]


class _ForceEndings:
    """A logits processor that fixes which completions end and which TRL truncates, whatever the sampler draws:
    the first row of each group samples one token (EOS and padding excluded) and then ends (EOS forced), the
    other rows never sample EOS or padding (cut at max_completion_length, so masked by
    ``mask_truncated_completions``). Without it, whether a 6-token completion of the toy model ends is a draw:
    which rows end (and whether any loss token has a non-zero advantage at all) moved with the bit-level
    numerics of the installed stack, so the mask-truncated case checked nothing on some fresh installs."""

    def __init__(self, eos: int, pad: int, group: int, start: int) -> None:
        self.eos, self.pad, self.group, self.start = eos, pad, group, start

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.start
        scores = scores.clone()
        scores[:, [self.eos, self.pad]] = -float("inf")
        if t == 1:
            ends = torch.arange(scores.shape[0]) % self.group == 0
            scores[ends] = -float("inf")
            scores[ends, self.eos] = 0.0
        return scores


def _install_endings(trainer) -> None:
    """Test-side instance attribute (installed before the callback, which wraps on top of it)."""
    tok, model = trainer.processing_class, trainer.model
    get_processors = model._get_logits_processor

    def _get_logits_processor(*args, **kwargs):
        processors = get_processors(*args, **kwargs)
        processors.insert(0, _ForceEndings(tok.eos_token_id, tok.pad_token_id, trainer.num_generations,
                                           kwargs["input_ids_seq_length"]))
        return processors

    model._get_logits_processor = _get_logits_processor


def _prompts(conversational: bool) -> list:
    prompts = synthetic_prompts(32)
    return [[{"role": "user", "content": p}] for p in prompts] if conversational else prompts


# name -> (GRPOConfig overrides, setup options)
DEFAULT_MATRIX = {
    **{f"loss-{lt}": ({"loss_type": lt}, {}) for lt in LOSS_TYPES},
    "num-iterations-2": ({"num_iterations": 2}, {}),
    "grad-accum-2": ({"gradient_accumulation_steps": 2}, {}),
    "steps-per-generation-2": ({"steps_per_generation": 2}, {}),
    # gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0: TRL scores old log-probs
    "misaligned-accum": ({"gradient_accumulation_steps": 3, "steps_per_generation": 2}, {}),
    "iterations-and-accum": ({"num_iterations": 2, "gradient_accumulation_steps": 2, "loss_type": "grpo"}, {}),
    "beam-search": ({"generation_kwargs": {"num_beams": 2}}, {"unsupported": True}),
    "beam-search-greedy": ({"generation_kwargs": {"num_beams": 2, "do_sample": False}}, {"unsupported": True}),
    "greedy": ({"generation_kwargs": {"do_sample": False}}, {}),
    "sampler-knobs": ({"temperature": 0.7, "top_k": 8, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2,
                       "generation_kwargs": {"no_repeat_ngram_size": 3}}, {"sampler_processing": True}),
    "mask-truncated": ({"mask_truncated_completions": True}, {}),
    "all-truncated": ({"mask_truncated_completions": True, "generation_kwargs": {"min_new_tokens": MCL}},
                      {"all_masked": True}),
    "max-steps-below-logging-steps": ({"max_steps": 3, "logging_steps": 10}, {}),
    "logging-per-epoch": ({"logging_strategy": "epoch", "max_steps": -1, "num_train_epochs": 1}, {"n_prompts": 4}),
    "iterable-dataset": ({}, {"iterable": True}),
    "several-rewards": ({"reward_weights": [1.0, 0.5]}, {"rewards": (reward_length, reward_digits)}),
    "beta": ({"beta": 0.04}, {}),
    "conversational": ({}, {"conversational": True}),
    "sequence-level-ratio": ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, {}),
    "entropy-mask-and-opsm": ({"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.5}, {}),
    # Forced tool call (the sampler sees a one-token distribution there: a large, correctly measured mismatch).
    "tools": ({"max_completion_length": 72}, {"tools": True, "sampler_processing": True}),
}


def make(model_path, out_dir, overrides: dict, setup: dict) -> GRPOTrainer:
    opts = dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=MCL, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
        gradient_checkpointing=False, learning_rate=1e-3, seed=0, disable_tqdm=True,
    )
    opts.update(overrides)
    chat = setup.get("conversational") or setup.get("tools")
    ds = datasets.Dataset.from_dict({"prompt": _prompts(bool(chat))[: setup.get("n_prompts")]})
    if setup.get("iterable"):
        ds = ds.to_iterable_dataset()
    processing_class = None
    if chat:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model_path)
        processing_class.chat_template = TOOL_TEMPLATE if setup.get("tools") else CHAT_TEMPLATE
        if setup.get("tools"):
            _set_response_parser(processing_class)
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=list(setup.get("rewards", (reward_length,))),
                          args=GRPOConfig(**opts), train_dataset=ds, processing_class=processing_class,
                          tools=[double] if setup.get("tools") else None)
    if setup.get("tools"):
        _install_tool_forcing(trainer)
    if setup.get("endings"):
        _install_endings(trainer)
    return trainer


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _trl_logs(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith("tim/") and k not in TIMING_KEYS}
            for h in trainer.state.log_history]


def _tim_entries(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith("tim/")} for h in trainer.state.log_history
            if any(k.startswith("tim/") for k in h)]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("name", list(DEFAULT_MATRIX))
def test_default_config_is_bit_identical_and_logs_tim(toy_model_path, tmp_path, name):
    overrides, setup = DEFAULT_MATRIX[name]
    plain = make(toy_model_path, tmp_path / "plain", overrides, setup)
    plain.train()
    trainer = make(toy_model_path, tmp_path / "tim", overrides, setup)
    cap = Capture(trainer) if setup.get("tools") else None  # (copies only: training stays bit-identical)
    cb = TIMCallback(trainer, TIMConfig(log_detail=True))
    trainer.add_callback(cb)
    trainer.train()
    # Bit-identical training: TRL's logged values and every final parameter.
    ref_logs, logs = _trl_logs(plain), _trl_logs(trainer)
    assert len(logs) == len(ref_logs)
    for ref, got in zip(ref_logs, logs):
        assert ref.keys() == got.keys()
        assert all(_same(ref[k], got[k]) for k in ref), {k: (ref[k], got[k]) for k in ref if not _same(ref[k], got[k])}
    ref_params, params = _params(plain), _params(trainer)
    assert all(torch.equal(ref_params[n], params[n]) for n in ref_params)
    # tim/ metrics reached TRL's log at least once, in the same entries as TRL's own metrics.
    entries = _tim_entries(trainer)
    assert entries, "no tim/ metric was logged"
    steps = trainer.state.global_step
    if setup.get("unsupported"):
        # Every generation batch came from beam search: counted, not measured, no crash.
        assert entries[-1]["tim/diag/unsupported_generation_mode"] == cb.generation_count >= 1
        assert not any("tim/tokens" in e for e in entries)
        return
    tokens = [e["tim/tokens"] for e in entries if "tim/tokens" in e]
    assert tokens, entries
    if setup.get("all_masked"):
        assert sum(tokens) == 0.0  # TRL masked every token: none measured
    else:
        assert sum(tokens) > 0
        worst = max(e.get("tim/token/abs_diff_max") or 0.0 for e in entries)
        # Same weights and dtype on both sides: only kernel-order noise, unless the sampler truncates or
        # penalises (processed log-probs renormalised over what it kept): then the monitor must see it.
        assert worst > 1e-3 if setup.get("sampler_processing") else worst < 1e-3
    assert not any(k.startswith("tim/diag/") for e in entries for k in e), entries
    if setup.get("tools"):  # TRL's tool loop ran and its tool-result tokens are out of what was measured
        calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
        assert calls and min(calls) > 0
        measured_by_trl = sum(int(_loss_mask(b).sum()) for b in cap.trl_built)  # completion_mask × tool_mask
        assert sum(tokens) == measured_by_trl < sum(int(b["completion_mask"].sum()) for b in cap.trl_built)
        # the forced call's tokens had a one-token distribution at the sampler (log p = 0): named for what they
        # are, not as an engine sampling from other weights (same weights on both sides here)
        named = {c.code for c in cb.pipeline.causes.named}
        assert "sampler-constrained" in named and "engine-stale" not in named, named
    if overrides.get("logging_strategy") == "epoch":  # one log entry per epoch, carrying the epoch's window
        step_logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(step_logs) == 1 and "tim/tokens" in step_logs[0] and steps == 2
    if overrides.get("logging_steps", 1) > steps:
        # No logging_steps boundary was reached: the tim/ window went out with TRL's final log entry.
        assert len(entries) == 1 and "train_runtime" in trainer.state.log_history[-1]
        final = trainer.state.log_history[-1]
        assert "tim/tokens" in final and "completions/mean_length" in final


# ------------------------------------------------------------------------------------------ opt-in modes
TIS_CLIP = 1.5
OPT_IN_MODES = {
    # With an injected mismatch: with the same weights on both sides ρ = 1 ± 1e-6 and min(ρ, C) = 1 whether the
    # correction acts or not; here the clip binds on some tokens and others weigh well below 1.
    "token_tis": (lambda: TIMConfig(log_detail=True, is_correction="token_tis", is_correction_options={"token_clip": TIS_CLIP},
                                    rollout="inject",
                                    inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}), {}),
    # IcePop with a band tight enough to drop tokens under the injected mismatch: masks narrow.
    "icepop_inject": (lambda: TIMConfig(log_detail=True, is_correction="icepop", is_correction_options={"icepop_band": (0.8, 1.25)},
                                           rollout="inject",
                                           inject_options={"scale": 1.0, "tau": 0.5, "mode": "bias", "seed": 0}), {}),
    "safe_vocab": (lambda: TIMConfig(log_detail=True, safe_vocab=True), {"min_p": 0.05}),
    "safe_vocab+seq_tis": (lambda: TIMConfig(log_detail=True, safe_vocab=True, is_correction="seq_tis"), {"min_p": 0.05}),
}

OPT_IN_CONFIGS = {
    "plain": ({}, {}),
    "all-truncated": ({"mask_truncated_completions": True, "generation_kwargs": {"min_new_tokens": MCL}}, {}),
    # Half the rows end (2 tokens), half are truncated and masked; rewards by length, so every group has a
    # non-zero advantage on the rows left in the loss (the checks below need some; see _ForceEndings).
    "mask-truncated-grpo": ({"mask_truncated_completions": True, "loss_type": "grpo"},
                            {"endings": True, "rewards": (reward_n_tokens,)}),
    "accum-iterations-bnpo": ({"gradient_accumulation_steps": 2, "num_iterations": 2, "loss_type": "bnpo"}, {}),
    "steps-per-generation-dr-grpo-beta": ({"steps_per_generation": 2, "loss_type": "dr_grpo", "beta": 0.04}, {}),
    "vespo": ({"loss_type": "vespo"}, {}),
    "tools": ({"max_completion_length": 72}, {"tools": True}),
    "beam-search": ({"generation_kwargs": {"num_beams": 2}}, {}),
}


def _row_key(batch, i):
    return tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist())


def _loss_mask(batch):
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask


# Every mode on every configuration, but tool runs (the slowest: two generation turns) only for the two modes
# that edit masks and weights most directly.
OPT_IN_CASES = [(m, c) for m in OPT_IN_MODES for c in OPT_IN_CONFIGS
                if c != "tools" or m in ("token_tis", "safe_vocab")]


def _naive_logps(model, batch, temperature: float) -> torch.Tensor:
    """[B, T, V] float64 log-softmax(logits / T) at the completion positions of ``batch``: one plain forward of
    ``model`` on prompt + completion, as TRL scores them (same ids, same attention mask)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    t = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -t - 1:-1]
    return torch.log_softmax(logits.double() / temperature, -1)


class NaiveReference:
    """Test-side wrappers installed before ``Capture`` (innermost, right around TRL): the full-vocabulary
    log-probs of each generation batch at the rollout weights (for the IS weights) and of each loss batch at the
    loss forward's weights (for the safe vocabulary), computed with a plain forward of the model, keyed by row
    content (TRL shuffles rows between generation and loss)."""

    def __init__(self, trainer):
        self.at_rollout = {}  # row key -> [T] log-prob of each completion token at the rollout weights
        self.in_loss = []  # per loss call: [B, T, V] log-probs at the loss forward's weights
        gen, loss = trainer._generate_and_score_completions, trainer._compute_loss

        def _generate_and_score_completions(*a, **k):
            out = gen(*a, **k)
            lp = _naive_logps(trainer.model, out, trainer.temperature)
            tokens = lp.gather(-1, out["completion_ids"][..., None])[..., 0]
            for i in range(tokens.shape[0]):
                self.at_rollout[_row_key(out, i)] = tokens[i]
            return out

        def _compute_loss(model, inputs, *a, **k):
            self.in_loss.append(_naive_logps(trainer.model, inputs, trainer.temperature))
            return loss(model, inputs, *a, **k)

        trainer._generate_and_score_completions = _generate_and_score_completions
        trainer._compute_loss = _compute_loss


def _factor_read(trainer, read: dict, i: int, width: int) -> torch.Tensor:
    """[T] float64: what TRL's loss multiplied row i's policy term by, as it read its inputs (``Capture``): the
    per-token advantages (every loss type but vespo), or the importance-sampling ratio vespo reads (1 if absent)."""
    if trainer.loss_type == "vespo":
        ratio = read.get("importance_sampling_ratio")
        return torch.ones(width, dtype=torch.float64) if ratio is None else ratio[i].double().expand(width)
    return read["advantages"][i].double().expand(width)  # (T,) once weighted; a (B,) row is unweighted


def _check_token_tis_weights(trainer, cap, ref, require_clip: bool) -> None:
    """The weights TRL's loss applied equal a naive min(ρ, C), ρ = exp(train − rollout), with the train log-probs
    from a plain forward at the rollout weights and the rollout log-probs TRL built the batch with. Applied
    weights, as TRL's loss read them: its per-token advantages over TRL's own (B,) advantages (every loss type
    but vespo), or the importance-sampling ratio vespo reads. Some weights are well below 1 (an adapter applying
    none fails), and with ``require_clip`` the clip binds on some token (one applying ρ unclipped fails)."""
    built = {}
    for b in cap.trl_built:
        for i in range(b["completion_ids"].shape[0]):
            built[_row_key(b, i)] = (b["advantages"][i], b["sampling_per_token_logps"][i], _loss_mask(b)[i])
    checked = clipped = low = 0
    for (_, inputs, _), read in zip(cap.losses, cap.read_in_loss, strict=True):
        for i in range(inputs["completion_ids"].shape[0]):
            key = _row_key(inputs, i)
            adv, rollout, mask = built[key]
            want = torch.clamp(torch.exp(ref.at_rollout[key] - rollout.double()), max=TIS_CLIP)[mask]
            factor = _factor_read(trainer, read, i, mask.shape[0])[mask]
            if trainer.loss_type != "vespo":
                if abs(float(adv)) < 1e-6:  # a group with equal rewards: the weights do not show in A · w
                    continue
                factor = factor / float(adv)
            assert torch.allclose(factor, want, rtol=1e-4, atol=1e-6), (factor, want)
            checked += int(mask.sum())
            clipped += int((want >= TIS_CLIP).sum())
            low += int((want < 0.9).sum())
    assert checked > 0 and low > 0 and (clipped > 0 or not require_clip), (checked, clipped, low)


def _check_safe_vocab_logps(cap, ref, min_p: float) -> None:
    """The log-probs TRL's loss used equal a naive log-softmax renormalised over the min-p set (HF's rule: p >=
    min_p · max p, after the temperature) of the same weights, on the loss tokens inside that set, and differ
    from the full-vocabulary ones. (The sampler prunes with the same rule here, so sampled tokens outside the set,
    which the boundary mask handles, hardly occur: tests/test_trl_mitigations.py checks that mask.)"""
    compared, raised = 0, 0.0
    for full, (_, inputs, used) in zip(ref.in_loss, cap.losses, strict=True):
        p = full.exp()
        keep = p >= min_p * p.amax(-1, keepdim=True)
        log_z = torch.logsumexp(full.masked_fill(~keep, -math.inf), -1)
        tokens = inputs["completion_ids"][..., None]
        mask = _loss_mask(inputs)
        mask = mask & keep.gather(-1, tokens)[..., 0]
        safe = (full.gather(-1, tokens)[..., 0] - log_z)[mask]
        assert torch.allclose(used.double()[mask], safe, rtol=0, atol=2e-5), (used.double()[mask] - safe).abs().max()
        compared += int(mask.sum())
        raised = max(raised, float((-log_z[mask]).max()) if mask.any() else 0.0)
        assert bool((-log_z[mask] >= 0).all())  # renormalising over a subset raises every kept log-prob
    assert compared > 0 and raised > 1e-3, (compared, raised)


@pytest.mark.parametrize("mode,config", OPT_IN_CASES)
def test_opt_in_modes_keep_trls_invariants(toy_model_path, tmp_path, mode, config):
    make_cfg, extra = OPT_IN_MODES[mode]
    overrides, setup = OPT_IN_CONFIGS[config]
    overrides = {**overrides, **extra}
    trainer = make(toy_model_path, tmp_path, overrides, setup)
    ref = NaiveReference(trainer)
    cap = Capture(trainer)
    before = _params(trainer)
    tim = make_cfg()
    if config == "beam-search" and tim.is_correction is not None:
        # beam search yields no rollout log-probs: a correction could not act, so the attach refuses it rather
        # than let the loss train uncorrected
        with pytest.raises(ValueError, match=r"is_correction=.*num_beams.*would train uncorrected.*Fix: drop "
                                             r"'num_beams' from generation_kwargs"):
            TIMCallback(trainer, tim)
        return
    cb = TIMCallback(trainer, tim)
    trainer.add_callback(cb)
    trainer.train()
    assert _tim_entries(trainer), "no tim/ metric was logged"
    # TRL's own loss mask per row (content-keyed: TRL shuffles rows before the loss).
    trl_masks = {}
    for built in cap.trl_built:
        for i in range(built["completion_ids"].shape[0]):
            trl_masks[_row_key(built, i)] = _loss_mask(built)[i]
    assert cap.losses
    # The callback never edits TRL's masks; a token it drops keeps TRL's mask and gets a zero policy term (the
    # advantage TRL's loss read is 0 where TRL's own is not).
    trl_adv = {}
    for built in cap.trl_built:
        adv = built["advantages"]
        for i in range(built["completion_ids"].shape[0]):
            trl_adv[_row_key(built, i)] = adv[i]
    dropped = 0
    for (_, inputs, _), read in zip(cap.losses, cap.read_in_loss):
        mask = _loss_mask(inputs)
        for i in range(mask.shape[0]):
            assert torch.equal(mask[i], trl_masks[_row_key(inputs, i)]), "the callback edited TRL's loss mask"
            if trainer.loss_type == "vespo":  # a drop reaches vespo through its advantages, never its IS ratio
                ratio = read.get("importance_sampling_ratio")
                assert ratio is None or not bool((mask[i] & (ratio[i] == 0)).any()), "a 0 in vespo's sequence weight"
            if read["advantages"].dim() == 2:
                dropped += int((mask[i] & (read["advantages"][i] == 0) & (trl_adv[_row_key(inputs, i)] != 0)).sum())
    one_micro_batch = all(overrides.get(k, 1) == 1 for k in ("gradient_accumulation_steps", "steps_per_generation",
                                                            "num_iterations"))
    if one_micro_batch:
        for _, inputs, _ in cap.losses:  # the dapo/cispo/vespo normaliser counts the tokens left in the loss
            assert float(inputs["num_items_in_batch"]) == float(_loss_mask(inputs).sum())
    if config == "all-truncated":
        assert all(float(v) == 0.0 for v in cap.loss_values)
        assert all(h["loss"] == 0.0 for h in trainer.state.log_history if "loss" in h)
        after = _params(trainer)
        assert all(torch.equal(before[n], after[n]) for n in before), "parameters moved on fully masked batches"
    elif config == "beam-search":  # not measured (no correction: refused above): counted, TRL trained as configured
        key = "tim/diag/unsupported_generation_mode"
        assert [h[key] for h in trainer.state.log_history if key in h][-1] == len(cap.trl_built) >= 1
    elif mode == "icepop_inject":
        # A step whose tokens TRL all masked has no kept fraction: logged as None (or NaN), left out here.
        kept = [v for h in trainer.state.log_history if (v := h.get("tim/correction/kept_frac")) is not None
                and not math.isnan(v)]
        assert kept and min(kept) < 1.0  # the correction dropped tokens ...
        assert dropped > 0  # ... and TRL's loss gave them no policy term
    if config not in ("all-truncated", "beam-search"):  # (measured and corrected batches only)
        if mode == "token_tis":
            _check_token_tis_weights(trainer, cap, ref, require_clip=config == "plain")
        elif mode.startswith("safe_vocab"):
            _check_safe_vocab_logps(cap, ref, extra["min_p"])
