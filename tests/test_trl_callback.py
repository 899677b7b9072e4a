"""TIMCallback on a real TRL GRPOTrainer (HF generation path, CPU, the toy model).

References are independent: the naive mismatch formulas written here, the core safe-vocab function on full
logits, the linear LR schedule of transformers, and runs without the plugin.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.toy_model import synthetic_prompts  # noqa: E402

pytestmark = pytest.mark.trl

LR0 = 1e-3
# The stale-engine runs train at ten times the toy runs' rate, so that the trainer's policy leaves the stale engine's
# by more than numerics within a step or two (at 1e-3 a step moves the toy policy's confident tokens too little for
# the lag-0 rules to be sure, and whether it does depended on the batch's draw)
STALE_LR = 1e-2


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def make_trainer(model_path, tmp_path, reward=_reward, trainer_cls=None, prompts=None, eval_prompts=None,
                 **overrides):
    """The toy GRPOTrainer (``trainer_cls``: a subclass or a rebuilt class instead; ``prompts``: the dataset's, else
    64 synthetic ones; ``eval_prompts``: an evaluation dataset's, else none), GRPOConfig ``overrides``."""
    opts = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=6, max_steps=2, logging_steps=1, report_to=[],
        save_strategy="no", gradient_checkpointing=False, learning_rate=LR0, seed=0, disable_tqdm=True,
    )
    opts.update(overrides)
    ds = datasets.Dataset.from_dict({"prompt": synthetic_prompts(64) if prompts is None else list(prompts)})
    evals = None if eval_prompts is None else datasets.Dataset.from_dict({"prompt": list(eval_prompts)})
    return (trainer_cls or GRPOTrainer)(model=str(model_path), reward_funcs=reward, args=GRPOConfig(**opts),
                                        train_dataset=ds, eval_dataset=evals)


class Capture:
    """Test-side wrappers (installed before the callback attaches, so ours wrap these): record what TRL
    passes around, keyed by the optimizer step being computed."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.generations = []  # (step, out dict)
        self.trl_built = []  # copies of what TRL put in each out dict, before any wrapper outside this one edits it
        self.losses = []  # (step, inputs, per_token_logps)
        self.loss_values = []  # what TRL's _compute_loss returned
        self.flags_in_loss = []  # (use_vllm, vllm_importance_sampling_correction) as TRL read them in the loss
        # what TRL's loss read as inputs["advantages"] / ["importance_sampling_ratio"] (a wrapper outside this one
        # may scale them for the duration of the call)
        self.read_in_loss = []
        gen, loss, logps = (trainer._generate_and_score_completions, trainer._compute_loss,
                            trainer._get_per_token_logps_and_entropies)
        self._in_loss = None

        def _generate_and_score_completions(*a, **k):
            out = gen(*a, **k)
            self.generations.append((trainer.state.global_step + 1, out))
            self.trl_built.append({k: v.detach().clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

        def _compute_loss(model, inputs, *a, **k):
            self._in_loss = []
            self.flags_in_loss.append((trainer.use_vllm, trainer.vllm_importance_sampling_correction))
            try:
                result = loss(model, inputs, *a, **k)
            finally:
                got, self._in_loss = self._in_loss, None
            self.losses.append((trainer.state.global_step + 1, inputs, got[0]))
            self.read_in_loss.append({k: inputs[k].detach().clone() for k in ("advantages", "importance_sampling_ratio")
                                      if inputs.get(k) is not None})
            self.loss_values.append(result.detach().clone())
            return result

        def _get_per_token_logps_and_entropies(*a, **k):
            result = logps(*a, **k)
            if self._in_loss is not None:
                self._in_loss.append(result[0].detach().clone())
            return result

        trainer._generate_and_score_completions = _generate_and_score_completions
        trainer._compute_loss = _compute_loss
        trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies
        self.wrappers = {"_generate_and_score_completions": _generate_and_score_completions,
                         "_compute_loss": _compute_loss,
                         "_get_per_token_logps_and_entropies": _get_per_token_logps_and_entropies}


def naive_metrics(rollout, train, mask):
    """Independent reference: d = train − rollout over masked tokens."""
    m = mask.bool()
    d = (train.double() - rollout.double())[m]
    rho = torch.exp(d)
    return {
        "tim/tokens": float(m.sum()),
        "tim/token/abs_diff_mean": float(d.abs().mean()),
        "tim/token/abs_diff_max": float(d.abs().max()),
        "tim/token/kl_k1": float((-d).mean()),
        "tim/token/kl_k3": float((rho - 1 - d).mean()),
        "tim/token/ratio_max": float(rho.max()),
    }


def _loss_mask(batch):
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask


def _logged(trainer, step):
    return next(h for h in trainer.state.log_history if h.get("step") == step and "loss" in h)


def _check_against_reference(trainer, cap):
    """Each logged step's tim/* equals the naive formulas on the tensors TRL used (old log-probs when TRL
    computed them at generation, else the loss forward's own log-probs)."""
    checked = 0
    for step in sorted({s for s, _ in cap.generations} | {s for s, _, _ in cap.losses}):
        ro, tr, ms = [], [], []
        for s, out in cap.generations:
            if s == step and out.get("old_per_token_logps") is not None:
                ro.append(out["sampling_per_token_logps"]), tr.append(out["old_per_token_logps"])
                ms.append(_loss_mask(out))
        for s, inputs, logps in cap.losses:
            if s == step and inputs.get("old_per_token_logps") is None:
                ro.append(inputs["sampling_per_token_logps"]), tr.append(logps), ms.append(_loss_mask(inputs))
        if not ro:
            continue
        width = max(x.shape[1] for x in ro)

        def cat(xs):
            return torch.cat([torch.nn.functional.pad(x.float(), (0, width - x.shape[1])) for x in xs])

        ref = naive_metrics(cat(ro), cat(tr), cat(ms))
        logged = _logged(trainer, step)
        for key, value in ref.items():
            assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-12), (step, key)
        _no_cause(logged, step)
        checked += 1
    return checked


def _no_cause(logged: dict, step) -> None:
    """A fault-free run names no cause (tim_plugins.causes): none named, no confident lag-0 disagreement."""
    assert logged["tim/cause/named"] == 0, step
    assert logged["tim/cause/confident_disagreements"] == 0, step


def check_vllm_step(trainer, cap, step) -> dict:
    """vLLM rollouts (colocate or server): the step's tim/* equal the naive formulas on TRL's own tensors (vLLM
    processed log-probs vs the trainer at the rollout weights) and TRL's own mean |d|. Returns the log entry."""
    (out,) = [o for s, o in cap.generations if s == step]
    ref = naive_metrics(out["sampling_per_token_logps"], out["old_per_token_logps"], _loss_mask(out))
    logged = _logged(trainer, step)
    for key, value in ref.items():
        assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-12), (step, key)
    assert logged["tim/token/abs_diff_mean"] == pytest.approx(logged["sampling/sampling_logp_difference/mean"],
                                                              rel=1e-4)
    # IS weights seen by the monitor are TRL's own (sequence_mask by default), over the same tokens.
    mask = _loss_mask(out).bool()
    w = out["importance_sampling_ratio"].expand_as(out["sampling_per_token_logps"])[mask].double()
    assert logged["tim/tokens"] == int(mask.sum()) > 0
    assert logged["tim/is/weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert logged["tim/is/weight_min"] == pytest.approx(float(w.min()), rel=1e-5)
    assert logged["tim/is/weight_max"] == pytest.approx(float(w.max()), rel=1e-5)
    assert logged["tim/is/ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * (w * w).sum())), rel=1e-5)
    _no_cause(logged, step)
    return logged


@pytest.mark.parametrize(
    "loss_type,ga,num_iterations",
    [("dapo", 1, 1), ("grpo", 2, 2), ("dr_grpo", 2, 1)],
)
def test_hf_rollout_metrics_equal_reference(toy_model_path, tmp_path, loss_type, ga, num_iterations):
    trainer = make_trainer(toy_model_path, tmp_path, loss_type=loss_type, gradient_accumulation_steps=ga,
                           num_iterations=num_iterations, max_steps=2)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()
    # Every generation batch carried HF-generate log-probs (TRL alone gives none without vLLM).
    assert cap.generations and all(o.get("sampling_per_token_logps") is not None for _, o in cap.generations)
    assert _check_against_reference(trainer, cap) >= 1
    first = _logged(trainer, 1)
    # Same weights, fp32, KV-cache decode vs full forward: tiny but counted mismatch.
    assert 0.0 <= first["tim/token/abs_diff_max"] < 1e-3
    assert first["tim/invalid_tokens"] == 0.0
    # Wrappers removed at train end: only the test's own (installed before the callback) remain.
    assert "_generate_single_turn" not in vars(trainer)
    for name, fn in cap.wrappers.items():
        assert vars(trainer)[name] is fn, name


# MismatchMonitor's probability buckets as its keys name them (tim/by_prob/<lo>-<hi>/...): [lo, hi) of p_rollout.
_P_BUCKETS = ((0.0, 0.01), (0.01, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.0))


def naive_all_metrics(rollout, train, mask, band=(0.5, 2.0)):
    """Independent reference for every sampled-token key the callback logs from its monitor, in float64 from the
    same tensors: d = train − rollout over the masked tokens, ρ = e^d, p = e^rollout. expm1 keeps ρ − 1 and
    k3 = ρ − 1 − d accurate at the fp32-noise |d| ~ 1e-7 of the toy model (e^d − 1 would cancel to ~1e-9)."""
    m = mask.bool()
    rollout, train = rollout.double(), train.double()
    d_all = torch.where(m, train - rollout, torch.zeros_like(train))
    d, p = d_all[m], rollout[m].exp()
    rho_m1 = torch.expm1(d)
    seq_rows = m.any(-1)
    seq_d = d_all.sum(-1)[seq_rows]
    ad = d.abs().sort().values

    def order_stat(q):  # the smallest |d| with at least a fraction q of the tokens at or below it
        return float(ad[max(0, math.ceil(q * len(ad)) - 1)])

    out = {
        "tim/tokens": float(m.sum()), "tim/invalid_tokens": 0.0,
        "tim/token/abs_diff_mean": float(d.abs().mean()), "tim/token/abs_diff_max": float(d.abs().max()),
        "tim/token/prob_abs_diff_mean": float((p * rho_m1.abs()).mean()),
        "tim/token/prob_abs_diff_max": float((p * rho_m1.abs()).max()),
        "tim/token/kl_k1": float((-d).mean()), "tim/token/kl_k3": float((rho_m1 - d).mean()),
        "tim/token/chi2": float(torch.expm1(2 * d).mean()),  # E[ρ²] − 1
        "tim/token/ratio_mean": 1.0 + float(rho_m1.mean()),
        "tim/token/ratio_min": float(d.min().exp()), "tim/token/ratio_max": float(d.max().exp()),
        "tim/token/ratio_outside_frac": float(((d.exp() < band[0]) | (d.exp() > band[1])).double().mean()),
        "tim/token/abs_diff_p99": order_stat(0.99), "tim/token/abs_diff_p999": order_stat(0.999),
        "tim/seq/count": float(seq_rows.sum()), "tim/seq/log_ratio_mean": float(seq_d.mean()),
        "tim/seq/log_ratio_abs_max": float(seq_d.abs().max()),
    }
    for lo, hi in _P_BUCKETS:
        sel = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
        out[f"tim/by_prob/{lo:g}-{hi:g}/count"] = float(sel.sum())
        out[f"tim/by_prob/{lo:g}-{hi:g}/abs_diff_mean"] = float(d[sel].abs().mean()) if sel.any() else math.nan
    return out


def test_monitor_equals_naive_formulas_on_captured_tensors(toy_model_path, tmp_path):
    """Every sampled-token metric the callback logs equals the naive float64 formulas on the tensors TRL used."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    cap = Capture(trainer)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(log_detail=True)))
    trainer.train()
    # One optimizer step without old log-probs: the monitor compares the loss forward's log-probs.
    assert cap.losses and all(inputs.get("old_per_token_logps") is None for _, inputs, _ in cap.losses)
    width = max(logps.shape[1] for _, _, logps in cap.losses)

    def cat(xs):
        return torch.cat([torch.nn.functional.pad(x.double(), (0, width - x.shape[1])) for x in xs])

    ref = naive_all_metrics(cat([i["sampling_per_token_logps"] for _, i, _ in cap.losses]),
                            cat([logps for _, _, logps in cap.losses]),
                            cat([_loss_mask(i) for _, i, _ in cap.losses]))
    logged = _logged(trainer, 1)
    # The reference covers every sampled-token key logged (a new metric needs a formula here), and no IS
    # weights were applied on this path.
    monitor_keys = {k for k in logged if k.startswith(("tim/token/", "tim/seq/", "tim/by_prob/"))}
    assert monitor_keys | {"tim/tokens", "tim/invalid_tokens"} == set(ref)
    assert not [k for k in logged if k.startswith("tim/is/")]
    assert ref["tim/token/abs_diff_max"] > 0  # the toy model's fp32 noise: a monitor logging zeros fails below
    # d is exact in float32, so counts and sums of |d| match to float64 rounding; ρ − 1, k3 and p·|ρ − 1| are
    # computed per token in float32 by the monitor (~1e-7 relative).
    exact = {"tim/tokens", "tim/invalid_tokens", "tim/token/abs_diff_mean", "tim/token/abs_diff_max",
             "tim/token/kl_k1", "tim/seq/count", "tim/seq/log_ratio_mean", "tim/seq/log_ratio_abs_max",
             "tim/token/ratio_outside_frac"} | {k for k in ref if k.startswith("tim/by_prob/")}
    for key, value in ref.items():
        got = logged[key]
        if math.isnan(value):
            assert got is None, key  # TRL logs a NaN metric as None
        elif key in ("tim/token/abs_diff_p99", "tim/token/abs_diff_p999"):
            # read from a log histogram (32 bins a decade from 1e-8): the upper edge of the bin holding the
            # quantile, capped at the maximum
            cap_ = min(ref["tim/token/abs_diff_max"], max(value * 10 ** (1 / 32), 1e-8))
            assert value <= got <= cap_ * (1 + 1e-12), (key, got, value)
        else:
            assert got == pytest.approx(value, rel=1e-12 if key in exact else 1e-6, abs=0), key


def _same(logged, dumped, rel=1e-9) -> bool:
    """TRL's logged value against the dump's: TRL logs a NaN metric as None, the dump keeps NaN."""
    if logged is None:
        return math.isnan(dumped)
    return logged == pytest.approx(dumped, rel=rel, abs=1e-12)


def test_the_default_log_is_compact_and_the_dump_keeps_every_metric(toy_model_path, tmp_path):
    """TIMConfig() logs the metrics read each step (tim_plugins.log_keys) in TRL's log; the dump's log_history.jsonl
    keeps every metric of the same steps, with the same values where both have them, so the report (which reads
    it) loses nothing; log_detail=True logs them all in TRL's log as well, the same values."""
    from tim_plugins.dump import LOG_HISTORY, complete_log_history, read_log_history
    from tim_plugins.log_keys import STEP_KEYS, in_step_log

    runs = {}
    for detail in (False, True):
        trainer = make_trainer(toy_model_path, tmp_path / str(detail), num_iterations=2, max_steps=2)
        dump = tmp_path / str(detail) / "dump"
        trainer.add_callback(TIMCallback(trainer, TIMConfig(dump_dir=str(dump), log_detail=detail)))
        trainer.train()
        runs[detail] = ([h for h in trainer.state.log_history if "loss" in h], read_log_history(dump / LOG_HISTORY))
    compact, full = runs[False]
    assert [h["step"] for h in compact] == [r["step"] for r in full] == [1, 2]
    for h, r in zip(compact, full):
        logged = {k for k in h if k.startswith("tim/")}
        assert logged and all(in_step_log(k) for k in logged), sorted(logged - set(STEP_KEYS))
        assert len(logged) <= 15
        assert [k for k in logged if not _same(h[k], r[k], rel=1e-12)] == []
    # the detail families are in the dump's history: by probability and position (at the step that samples), by
    # lag and the staleness split (every loss pass)
    for family in ("tim/by_prob/", "tim/by_position/", "tim/by_lag/", "tim/split/", "tim/staleness/"):
        assert any(k.startswith(family) for r in full for k in r), family
    assert [set(h) for h in complete_log_history(compact, full)] == [set(h) | set(r) for h, r in zip(compact, full)]
    detailed, _ = runs[True]
    for h, r in zip(detailed, full):  # the same seed and the same steps: every metric logged, the dump's values
        assert {k for k in h if k.startswith("tim/")} == {k for k in r if k.startswith("tim/")}
        assert [k for k in r if k != "step" and not _same(h[k], r[k])] == []
    # TRL's own reward of each window beside them (a window that generated nothing, num_iterations' second step,
    # has none in TRL's log either): the report's reward panel
    rewards = [h.get("reward") for h in compact]
    assert rewards[0] is not None and rewards[1] is None
    assert [r.get("reward") for r in full] == [pytest.approx(x, rel=1e-6) if x is not None else None for x in rewards]
    from tim_plugins.report.training_page import step_table

    table = step_table({"log_history": full}, None)
    measured = [r["step"] for r in full if "tim/tokens" in r]  # the step that generated (and measured) its batch
    assert table["step"].tolist() == measured == [1] and table["reward"][0] == pytest.approx(rewards[0], rel=1e-6)


def test_a_log_history_that_cannot_be_written_costs_the_row_not_the_step(toy_model_path, tmp_path):
    """The dump's log_history.jsonl unwritable (here a folder of that name; a full or read-only disk alike):
    training runs its steps and the failure is counted under tim/diag/dump_failed, once per step it hit."""
    from tim_plugins.dump import LOG_HISTORY

    dump = tmp_path / "dump"
    (dump / LOG_HISTORY).mkdir(parents=True)
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=3)
    trainer.add_callback(TIMCallback(trainer, TIMConfig(dump_dir=str(dump), log_detail=True)))
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    # counted after each step's row was pushed: seen in the next step's row
    assert [h.get("tim/diag/dump_failed") for h in steps] == [None, 1.0, 2.0]


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_disabled_detached_and_monitor_only_are_numerically_identical(toy_model_path, tmp_path):
    runs = {}
    for name in ("plain", "disabled", "detached", "monitor"):
        trainer = make_trainer(toy_model_path, tmp_path / name, max_steps=2)
        if name == "disabled":
            trainer.add_callback(TIMCallback(trainer, TIMConfig(enabled=False)))
        elif name == "detached":
            cb = TIMCallback(trainer, TIMConfig())
            trainer.add_callback(cb)
            cb.detach()
        elif name == "monitor":
            trainer.add_callback(TIMCallback(trainer, TIMConfig()))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = (_params(trainer), losses)
    ref_params, ref_losses = runs["plain"]
    for name, (params, losses) in runs.items():
        assert losses == ref_losses, name
        for key, value in ref_params.items():
            assert torch.equal(params[key], value), (name, key)


def test_attach_twice_installs_each_wrapper_once(toy_model_path, tmp_path):
    """``attach`` is public: a second call while the wrappers are on adds none (each hook would run twice, the loss
    factor applied twice); after ``detach`` nothing is left on the trainer."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    plain = {name: getattr(trainer, name) for name in ("_compute_loss", "_get_per_token_logps_and_entropies")}
    cb = TIMCallback(trainer, TIMConfig())
    cb.attach()
    once = list(cb.installed)
    cb.attach()
    assert cb.installed == once and len(once) == len(set(once)) >= 3
    cb.detach()
    assert cb.installed == [] and all(getattr(trainer, n) == f for n, f in plain.items())


def test_config_validation_quotes_values(toy_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"ratio_band=\(2, 3\)"):
        TIMConfig(ratio_band=(2, 3))
    with pytest.raises(ValueError, match="'bogus'"):
        TIMConfig(rollout="bogus")
    with pytest.raises(ValueError, match="'tis'"):
        TIMConfig(is_correction="tis")
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'sample_rat' \(did you mean 'sample_rate'\?\)"):
        TIMConfig(dump_options={"sample_rat": 1.0})
    with pytest.raises(ValueError, match="sample_rate=1.5"):
        TIMConfig(dump_dir=str(tmp_path), dump_options={"sample_rate": 1.5})
    trainer = make_trainer(toy_model_path, tmp_path)
    with pytest.raises(ValueError, match="min_p=None"):
        TIMCallback(trainer, TIMConfig(safe_vocab=True))
    # every field, with its own help text (the dataclass's metadata), and none empty
    assert TIMConfig.help_texts() == {f.name: f.metadata["help"] for f in dataclasses.fields(TIMConfig)}
    assert all(TIMConfig.help_texts().values())


def test_a_first_argument_that_is_not_the_trainer_is_named_with_the_call_to_write(toy_model_path, tmp_path):
    """TIMCallback(TIMConfig()), TIMCallback(args, ...), TIMCallback(None), GRPOTrainer(callbacks=[TIMCallback]): a
    TypeError that names what was passed and the call to write (it was a RuntimeError blaming "this TRL":
    "trainer.use_vllm is missing on the live TIMConfig", fixed by reporting it; and for the class, Python's missing
    positional argument)."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    for wrong, named in ((TIMConfig(), "got TIMConfig (the TIMConfig goes second)"),
                         (args, "got GRPOConfig (the trainer's config, not the trainer)"), (None, "got NoneType")):
        with pytest.raises(TypeError) as err:
            TIMCallback(wrong, TIMConfig())
        assert named in str(err.value), err.value
        assert "trainer.add_callback(TIMCallback(trainer, TIMConfig(...)))" in str(err.value), err.value
    # the class handed to GRPOTrainer(callbacks=[...]): transformers builds it with no argument
    with pytest.raises(TypeError, match=r"callbacks=\[TIMCallback\]\) builds it without the trainer.*Fix: build "
                                        r"the trainer first, then trainer\.add_callback"):
        GRPOTrainer(model=str(toy_model_path), reward_funcs=lambda **kw: [0.0], args=args, callbacks=[TIMCallback],
                    train_dataset=datasets.Dataset.from_dict({"prompt": ["a", "b"]}))


def test_config_help_prints_every_field_with_its_default_and_text(capsys):
    """The README's ``TIMConfig.help()`` prints the fields (the dict is ``help_texts()``)."""
    import dataclasses

    assert TIMConfig.help() is None
    printed = capsys.readouterr().out
    fields = dataclasses.fields(TIMConfig)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields}
    assert sum(line.startswith("  ") and not line.startswith("   ") for line in printed.splitlines()) == len(fields)
    flat = " ".join(printed.split())
    for f in fields:
        assert " ".join(f.metadata["help"].split()) in flat, f.name
        core = f.metadata.get("options")
        if core is None:
            assert f"  {f.name} = {defaults[f.name]!r}\n" in printed, f.name
            continue
        # an option group: the core dataclass's own fields, defaults and help, listed under it
        assert f"  {f.name}: {core.__name__}, by field:\n" in printed, f.name
        for sub in dataclasses.fields(core):
            default = "(required)" if sub.default is dataclasses.MISSING else sub.default
            assert f"      {f.name}.{sub.name} = {default!r}\n" in printed, (f.name, sub.name)
            assert " ".join(sub.metadata["help"].split()) in flat, (f.name, sub.name)
    assert {f.name for f in fields if "options" in f.metadata} == {n for n in defaults if n.endswith("_options")}


def test_a_second_callback_on_one_trainer_is_refused_until_the_first_is_detached(toy_model_path, tmp_path):
    """Two live TIMCallbacks on one trainer (a notebook cell run twice) would each wrap TRL's methods: the IS weights
    applied twice to the advantages TRL's loss reads, the injector's noise added twice. The second is refused with
    the fix; once the first is detached, a new one attaches and TRL's loss reads its weights once."""
    config = TIMConfig(rollout="inject", inject_options={"scale": 1.0}, is_correction="token_tis",
                       is_correction_options={"token_clip": 2.0})
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1)
    cap = Capture(trainer)
    first = TIMCallback(trainer, config)
    trainer.add_callback(first)
    with pytest.raises(ValueError, match=r"already has a TIMCallback.*Fix: .*\.detach\(\)"):
        TIMCallback(trainer, config)
    TIMCallback(trainer, TIMConfig(enabled=False))  # a disabled one attaches nothing: no conflict
    first.detach()
    trainer.add_callback(TIMCallback(trainer, config))
    trainer.train()
    # the independent reference: TRL's own advantages times the token TIS weights min(exp(train - rollout), 2) of
    # the rows' loss forward on the loss mask (1 elsewhere), computed here from TRL's tensors
    adv, w = token_tis_reference(cap)  # TRL's advantages, put back after the loss (rows shuffled from generation)
    assert sorted(adv.tolist()) == pytest.approx(sorted(cap.trl_built[0]["advantages"].double().tolist()))
    expected = (adv if adv.dim() == 2 else adv.unsqueeze(1)) * w
    read = cap.read_in_loss[0]["advantages"].double()
    assert torch.allclose(read, expected, rtol=1e-5, atol=1e-6)


def token_tis_reference(cap: "Capture", clip: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(TRL's advantages of the one loss call ``cap`` saw, after the call; the token TIS weights
    min(exp(train - rollout), clip) of its loss forward on the loss mask, 1 elsewhere), from TRL's tensors; the
    weights must differ from 1 (the injected noise moved them)."""
    (_, inputs, logps), = cap.losses
    mask = _loss_mask(inputs)
    w = torch.exp(logps.double() - inputs["sampling_per_token_logps"].double()).clamp(max=clip)
    w = torch.where(mask, w, torch.ones_like(w))
    assert not torch.allclose(w, torch.ones_like(w), atol=1e-3)
    return inputs["advantages"].double(), w


def test_a_callback_built_for_another_trainer_is_refused_when_training_starts(toy_model_path, tmp_path):
    """A TIMCallback is bound to the trainer it was built with; added to another trainer it would patch and report
    into its own trainer while the other one trains unmeasured. That trainer's train() fails before any step."""
    own = make_trainer(toy_model_path, tmp_path / "own", max_steps=1)
    other = make_trainer(toy_model_path, tmp_path / "other", max_steps=1)
    cb = TIMCallback(own, TIMConfig())
    other.add_callback(cb)
    with pytest.raises(ValueError, match=r"built for another trainer.*Fix: TIMCallback\(trainer"):
        other.train()
    assert other.state.global_step == 0
    assert cb.installed == [] and "_compute_loss" not in vars(own)  # nothing patched on either trainer
    other.remove_callback(cb)
    other.add_callback(TIMCallback(other, TIMConfig()))
    other.train()
    assert _logged(other, 1)["tim/tokens"] > 0


@pytest.mark.parametrize("logging", [{"logging_steps": 3}, {"logging_strategy": "epoch"}])
def test_an_evaluation_at_the_last_step_keeps_the_last_windows_metrics(toy_model_path, tmp_path, logging):
    """eval_steps dividing max_steps: transformers evaluates after the last step, which leaves the model in eval mode,
    and TRL's log() then reads its evaluation metrics, not the training window's. The last window (step 4, after
    the step-3 log; with per-epoch logging every step) still reaches trainer.state.log_history as training metrics,
    with TRL's own window metrics: every row of the dump's log_history.jsonl is in it with the same values, no tim/
    key is logged as an evaluation metric, and the logged windows' tokens are every training batch's loss-mask
    tokens (TRL's tensors). Before, the last window went to the dump alone."""
    from tim_plugins.dump import LOG_HISTORY, read_log_history

    trainer = make_trainer(toy_model_path, tmp_path, eval_prompts=synthetic_prompts(4), max_steps=4,
                           eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, **logging)
    trained = []
    generate = trainer._generate_and_score_completions

    def record(*args, **kwargs):  # installed before the callback wraps it: TRL's own batches
        out = generate(*args, **kwargs)
        if trainer.model.training:
            trained.append(float(_loss_mask(out).sum()))
        return out

    trainer._generate_and_score_completions = record
    dump = tmp_path / "dump"
    trainer.add_callback(TIMCallback(trainer, TIMConfig(dump_dir=str(dump), log_detail=True)))
    trainer.train()
    history = trainer.state.log_history
    assert [h["step"] for h in history if "eval_loss" in h] == [2, 4]  # the evaluations ran, the last at step 4
    assert not any(k.startswith("eval_tim/") for h in history for k in h)
    dumped = read_log_history(dump / LOG_HISTORY)
    assert [r["step"] for r in dumped] == ([3, 4] if "logging_steps" in logging else [4])
    for r in dumped:
        (row,) = [h for h in history if h["step"] == r["step"] and "tim/tokens" in h]
        assert "reward" in row  # TRL's own metrics of the same window
        assert [k for k in r if k != "step" and not _same(row[k], r[k], rel=1e-12)] == []
    assert sum(h["tim/tokens"] for h in history if "tim/tokens" in h) == sum(trained) > 0 and len(trained) == 4


def test_a_min_p_the_trainer_does_not_apply_names_its_truncation_and_no_floor_jump(toy_model_path, tmp_path,
                                                                                   caplog):
    """``GRPOConfig(min_p=0.05)`` in TRL's own generation: the sampler renormalises over the kept tokens, the trainer
    scores the full vocabulary, the same weights on both sides. The lag-0 floor is then the kept mass's bias and
    moves with each batch's distributions (0.01-0.02 nats at some steps, 0.07-0.13 at others on the toy model), so
    the floor-jump rule, recomputed here from the logged floors, jumps: that is no pipeline change, and only the
    truncation is named (at the steps whose mean ρ is below 1 - truncation_bias). Before, floor-jump was named too,
    pointing at the weight sync. With the printed fix (``TIMConfig(safe_vocab=True)``) nothing is named. The run
    closes with one line for the truncation: the windows and steps it was named at, its first message, its fix."""
    import logging

    from tim_plugins.causes import CauseConfig, cause_fix

    c = CauseConfig()
    for safe_vocab in (False, True):
        trainer = make_trainer(toy_model_path, tmp_path / str(safe_vocab), min_p=0.05, max_steps=6)
        cb = TIMCallback(trainer, TIMConfig(log_detail=True, safe_vocab=safe_vocab))
        trainer.add_callback(cb)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tim_plugins.trl"):
            trainer.train()
        closing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tim-plugins: this run named")]
        rows = [_logged(trainer, step) for step in range(1, 7)]
        named = {(x.step, x.code) for x in cb.pipeline.causes.named}
        if safe_vocab:
            assert named == set() and all(r["tim/cause/named"] == 0 for r in rows) and closing == []
            continue
        assert "sampler-truncation-unmatched" in {f.code for f in cb.findings}
        kept, jumps = [], []
        for step, row in enumerate(rows, start=1):
            floor = row["tim/token/abs_diff_mean"]
            median = statistics.median(kept[-c.floor_window:]) if kept else None
            if median is not None and floor > c.floor_jump_factor * median and floor - median > c.floor_jump_min:
                jumps.append(step)
            else:
                kept.append(floor)
        # the floor moved as a broken sync's would on this stack (steps 2, 4 and 6 on the main lock); another stack
        # may sample otherwise: what must hold anywhere is that only the truncation is named. The rule's side on
        # recorded floors: tests/test_causes.py::test_the_floor_of_a_sampler_the_trainer_does_not_match_is_no_jump
        print(f"[min-p floors] {[round(r['tim/token/abs_diff_mean'], 4) for r in rows]}, rule's jumps at {jumps}")
        truncated = [s for s, r in enumerate(rows, start=1) if r["tim/token/ratio_mean"] < 1 - c.truncation_bias]
        assert truncated and named == {(s, "truncation") for s in truncated}
        first = next(x for x in cb.pipeline.causes.named if x.step == truncated[0])
        span = (f"at step {truncated[0]}" if len(truncated) == 1 else
                f"in {len(truncated)} windows, steps {truncated[0]} to {truncated[-1]}")
        assert closing == [f"tim-plugins: this run named [truncation] {span} (first: {first.message}). Fix (TRL): "
                           f"{cause_fix('truncation', 'trl')}"]
        assert [r["tim/cause/named"] for r in rows] == [float(s in truncated) for s in range(1, 7)]
        assert all(r["tim/cause/confident_disagreements"] == 0 for r in rows)
