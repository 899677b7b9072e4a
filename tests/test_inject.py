"""TIM injector: the perturbation formula, HF generate integration, calibration to a target k3 (±20 %)."""

from __future__ import annotations

import pytest
import torch

from tim_plugins.metrics import mismatch_metrics
from tim_plugins.rollout.inject import TailNoiseInjector, calibrate_injector, calibrate_scale, perturb_tail

transformers = pytest.importorskip("transformers")


def test_only_tail_tokens_move():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 101, generator=gen) * 3
    z[0, 7] = float("-inf")  # masked by an earlier processor: stays masked
    tau = 0.05
    p = torch.softmax(z, -1)
    tail = (p < tau) & torch.isfinite(z)
    noisy = perturb_tail(z, 0.7, tau=tau, mode="noise", generator=torch.Generator().manual_seed(1))
    assert torch.equal(noisy[~tail], z[~tail])
    assert (noisy[tail] != z[tail]).all()
    eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(noisy[tail], z[tail] + 0.7 * eps[tail], atol=0, rtol=0)
    biased = perturb_tail(z, 0.4, tau=tau, mode="bias", bias_sign=-1)
    assert torch.equal(biased[tail], z[tail] - 0.4) and torch.equal(biased[~tail], z[~tail])
    with pytest.raises(ValueError, match="'shift'"):
        perturb_tail(z, 0.4, tau=tau, mode="shift")


def test_injector_is_deterministic_under_seed():
    z = torch.randn(3, 57)
    a, b, c = (TailNoiseInjector(0.5, tau=0.2, seed=s) for s in (3, 3, 4))
    first = a(None, z)
    assert torch.equal(first, b(None, z)) and not torch.equal(first, c(None, z))
    second = a(None, z)
    assert not torch.equal(first, second)  # a fresh draw every step
    a.reset()
    assert torch.equal(a(None, z), first)
    assert TailNoiseInjector(0.0)(None, z) is z
    assert a.to_extra_args() == {"tim_inject": {"scale": 0.5, "tau": 0.2, "mode": "noise", "seed": 3,
                                                "bias_sign": 1.0}}


@pytest.fixture(scope="module")
def toy(toy_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(toy_model_path)
    tok.padding_side = "left"
    return model, tok


def _batch(tok, n, seed):
    from tim_plugins.toy_model import synthetic_prompts

    return tok(synthetic_prompts(n, seed=seed), return_tensors="pt", padding=True)


def _rollout(model, enc, injector, temperature, seed, max_new_tokens=24):
    """HF sampling with the injector; returns rollout (reported) and trainer log-probs + mask."""
    injector.reset()
    torch.manual_seed(seed)
    out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         logits_processor=[injector], output_scores=True, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.generation_config.pad_token_id)
    p = enc.input_ids.shape[1]
    completion = out.sequences[:, p:]
    scores = torch.stack(out.scores, 1)  # processed: after the injector and the temperature warper
    rollout = torch.log_softmax(scores.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    is_eos = completion == model.generation_config.eos_token_id
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to and including the first EOS
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=torch.cat([enc.attention_mask, mask.long()], 1)).logits
    train = torch.log_softmax(logits[:, p - 1:-1].float() / temperature, -1).gather(
        -1, completion.unsqueeze(-1)).squeeze(-1)
    return rollout, train, mask, out


def test_reported_logprobs_are_those_of_the_perturbed_distribution(toy):
    model, tok = toy
    enc = _batch(tok, 4, seed=9)
    injector = TailNoiseInjector(0.8, tau=0.1, seed=5)
    rollout, train, mask, out = _rollout(model, enc, injector, temperature=0.8, seed=0, max_new_tokens=8)
    raw = torch.stack(out.logits, 1)  # before any processor
    replay = TailNoiseInjector(0.8, tau=0.1, seed=5)  # the same noise sequence, applied step by step
    expected = torch.stack([replay(None, raw[:, t]) for t in range(raw.shape[1])], 1) / 0.8
    assert torch.allclose(torch.stack(out.scores, 1), expected, rtol=1e-6, atol=1e-6)
    k3 = mismatch_metrics(rollout, train, mask)["tim/token/kl_k3"]
    assert k3 > 1e-4  # and the trainer sees the unperturbed model


def test_calibrate_scale_hits_the_target_on_the_probe():
    logits = torch.randn(400, 211, generator=torch.Generator().manual_seed(0)) * 2.5
    for mode in ("noise", "bias"):
        injector = TailNoiseInjector(tau=0.05, mode=mode, seed=1)
        res = calibrate_scale(logits, 3e-3, injector)
        assert res.k3 == pytest.approx(3e-3, rel=0.011) and injector.scale == res.scale > 0
        # Independently of the sampled k3 the bisection stops on: the exact KL(q ‖ p) over the whole vocabulary
        # at the chosen scale, with the same perturbation draws, is the target (to the k3 estimate's sampling
        # error over 400 × 16 tokens).
        z_q = perturb_tail(logits, res.scale, tau=0.05, mode=mode, generator=torch.Generator().manual_seed(1))
        log_q, log_p = torch.log_softmax(z_q.double(), -1), torch.log_softmax(logits.double(), -1)
        kl = float((log_q.exp() * (log_q - log_p)).sum(-1).mean())
        assert kl == pytest.approx(3e-3, rel=0.1)
    with pytest.raises(ValueError, match="target_k3=0"):
        calibrate_scale(logits, 0, TailNoiseInjector())


@pytest.mark.parametrize("target", [1e-3, 1e-2])
def test_injection_reaches_target_k3_within_20_percent(toy, target):
    model, tok = toy
    probe = _batch(tok, 40, seed=1)
    injector, res = calibrate_injector(model, probe.input_ids, probe.attention_mask, target_k3=target,
                                       max_new_tokens=16, temperature=1.0, tau=0.1, mode="noise", seed=3)
    assert res.k3 == pytest.approx(target, rel=0.05)
    evaluation = _batch(tok, 160, seed=2)  # fresh prompts, fresh sampling
    rollout, train, mask, _ = _rollout(model, evaluation, injector, temperature=1.0, seed=11, max_new_tokens=16)
    k3 = mismatch_metrics(rollout, train, mask)["tim/token/kl_k3"]
    print(f"target {target:g}: scale {injector.scale:.4g}, probe k3 {res.k3:.4g}, eval k3 {k3:.4g} "
          f"({int(mask.sum())} tokens), ratio {k3 / target:.3f}")
    assert 0.8 * target <= k3 <= 1.2 * target
