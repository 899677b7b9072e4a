"""The TIM injector's vLLM processor without an engine: the settings a request may carry (refused at
``validate_params`` by the HF injector's own rules), the seeds it accepts (the same as the HF injector, any integer),
and a row whose perturbation fails inside the engine step (left unperturbed and counted, never raised). The
processor inside a running engine: ``test_measure_vllm.py``."""

from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from tim_plugins.integrations.vllm import inject  # noqa: E402
from tim_plugins.rollout.inject import InjectorConfig, TailNoiseInjector, calibrate_scale, perturb_tail  # noqa: E402

pytestmark = pytest.mark.vllm

V1 = inject.AdapterLogitsProcessor is not None
V2 = hasattr(inject, "TailNoiseV2LogitsProcessor")


def _v1_rows(params: SamplingParams, prompt: list, outputs: list, z: torch.Tensor):
    """(processor, a step) for one row through vLLM's own AdapterLogitsProcessor batch handling."""
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate

    proc = inject.TailNoiseLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=1, added=[(0, params, prompt, list(outputs))], removed=[], moved=[]))
    return proc, lambda: proc.apply(z.clone())


def _v2_rows(params: SamplingParams, prompt: list, z: torch.Tensor):
    """(processor, a step) for one row sampling its first token in the V2 runner's interface."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

    tokens = torch.full((1, 16), -1, dtype=torch.long)
    tokens[0, : len(prompt)] = torch.tensor(prompt)
    state = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=1, vocab_size=z.shape[-1],
                                   all_token_ids=SimpleNamespace(gpu=tokens),
                                   prompt_len=SimpleNamespace(np=np.array([len(prompt)])), prefill_len=None,
                                   total_len=None)
    proc = inject.TailNoiseV2LogitsProcessor(None, state)
    assert proc.add_request(0, params) is True
    rows = torch.tensor([0])
    ctx = LogitsContext(expanded_idx_mapping=rows, idx_mapping=rows, idx_mapping_np=rows.numpy(),
                        expanded_local_pos=torch.zeros_like(rows), input_ids=torch.tensor([prompt[-1]]),
                        pos=torch.tensor([len(prompt) - 1]), seq_lens_upper_bound_np=np.array([len(prompt)]))
    return proc, lambda: proc.apply(z.clone(), ctx)


def _runners():
    return [name for name, have in (("v1", V1), ("v2", V2)) if have]


def _run(runner: str, params: SamplingParams, prompt: list, z: torch.Tensor):
    return _v1_rows(params, prompt, [], z) if runner == "v1" else _v2_rows(params, prompt, z)


def _reference_draw(seed_bytes: bytes, prompt: list, z: torch.Tensor, scale: float, tau: float) -> torch.Tensor:
    """The first step's perturbation restated: blake2b(prompt digest, the seed's 8 bytes, 0 outputs)."""
    h = hashlib.blake2b(hashlib.blake2b(",".join(map(str, prompt)).encode(), digest_size=16).digest(), digest_size=8)
    h.update(seed_bytes)
    h.update((0).to_bytes(4, "little"))
    gen = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    return perturb_tail(z, scale, tau=tau, mode="noise", generator=gen)


BAD_SETTINGS = [
    {"scale": float("nan")}, {"scale": float("inf")}, {"scale": -0.5}, {"scale": "0.5"},
    {"scale": 1.0, "tau": 0.0}, {"scale": 1.0, "tau": float("nan")}, {"scale": 1.0, "mode": "shift"},
    {"scale": 1.0, "bias_sign": 0.5}, {"scale": 1.0, "seed": 1.5},
    {"scale": 1e39},  # finite, but its shifts overflow the float32 logits (the sampled distribution turns to NaN)
]


@pytest.mark.parametrize("raw", BAD_SETTINGS, ids=repr)
def test_validate_params_refuses_what_the_injector_refuses(raw):
    """A request's settings pass the processor's validation exactly when the HF injector (``InjectorConfig``)
    takes them; the refusal names the request's key, the bad value and the rule."""
    with pytest.raises(ValueError) as ref:
        InjectorConfig(**raw)
    params = SamplingParams(temperature=1.0, extra_args={"tim_inject": raw})
    for cls in {inject.TailNoiseLogitsProcessor, getattr(inject, "TailNoiseV2LogitsProcessor", None)} - {None}:
        with pytest.raises(ValueError) as err:
            cls.validate_params(params)
        assert "extra_args['tim_inject']" in str(err.value) and str(ref.value) in str(err.value)


def test_validate_params_refuses_settings_it_would_ignore():
    """A key the processor does not read (a profile, a typo) is refused, not dropped: the request would otherwise
    run unlike the HF injector it was built from."""
    profiled = {"scale": 1.0, "profile": {"p": [0.5], "mean_abs_diff": [0.1]}}
    InjectorConfig(**profiled)  # the HF injector takes a profile
    for raw in (profiled, {"scale": 1.0, "sigma": 2.0}):
        with pytest.raises(ValueError, match="does not read"):
            inject.TailNoiseLogitsProcessor.validate_params(SamplingParams(extra_args={"tim_inject": raw}))
    for raw in (0.5, [], 0, "", False):  # a falsy non-dict is refused too, not taken as "off"
        with pytest.raises(ValueError, match="must be a dict"):
            inject.TailNoiseLogitsProcessor.validate_params(SamplingParams(extra_args={"tim_inject": raw}))
    for off in ({}, None):  # no settings: no injection
        inject.TailNoiseLogitsProcessor.validate_params(SamplingParams(extra_args={"tim_inject": off}))
    good = SamplingParams(extra_args=TailNoiseInjector(0.5, tau=0.2, mode="bias", seed=-3, bias_sign=-1)
                          .to_extra_args())
    inject.TailNoiseLogitsProcessor.validate_params(good)


@pytest.mark.parametrize("runner", _runners())
def test_any_integer_seed_perturbs_in_the_engine_step(runner):
    """Seeds outside int64 (``random.getrandbits(64)``) are taken at validation and perturb the row, as the HF
    injector takes them: the seed counts modulo 2**64. Seeds in int64 keep their draws (the signed 8-byte encoding
    restated); 2**63 draws what -2**63 does (the same 64 bits, as torch's ``manual_seed`` maps them). An injector
    with a seed beyond vLLM's extra_args range ([-2**63, 2**64)) sends it modulo 2**64: 2**64 + 3 draws what 3
    does."""
    prompt, z = [5, 6, 7], torch.randn(1, 64, generator=torch.Generator().manual_seed(0))

    def draw(extra_args):
        params = SamplingParams(temperature=1.0, extra_args=extra_args)
        inject.TailNoiseLogitsProcessor.validate_params(params)
        return _run(runner, params, prompt, z)[1]()[0]

    def raw(seed):
        return {"tim_inject": {"scale": 2.0, "tau": 0.5, "seed": seed}}

    for seed in (0, 3, -1, -2**63, 2**63 - 1):
        want = _reference_draw(seed.to_bytes(8, "little", signed=True), prompt, z[0], 2.0, 0.5)
        assert torch.equal(draw(raw(seed)), want), seed
    for seed, same_as in ((2**63, -2**63), (2**64 - 1, -1), (2**63 + 12345, None)):
        out = draw(raw(seed))
        assert not torch.equal(out, z[0]), seed
        if same_as is not None:
            assert torch.equal(out, draw(raw(same_as))), seed
    for seed, same_as in ((2**64 + 3, 3), (-2**63 - 1, 2**63 - 1), (7**40, None)):
        out = draw(TailNoiseInjector(2.0, tau=0.5, seed=seed).to_extra_args())
        assert not torch.equal(out, z[0]), seed
        if same_as is not None:
            assert torch.equal(out, draw(raw(same_as))), seed


def test_the_hf_injector_takes_the_same_seeds():
    """The HF injector, its calibration (seed + 1) and the vLLM processor accept the same seeds: any integer,
    modulo 2**64 (torch's own mapping of a negative seed). Reference: torch generators seeded here."""
    z = torch.randn(3, 57, generator=torch.Generator().manual_seed(0))
    for seed, bits in ((2**64 + 3, 3), (2**63, 2**63), (-1, 2**64 - 1), (-2**64 - 2, 2**64 - 2)):
        want = perturb_tail(z, 0.5, tau=0.2, mode="noise", generator=torch.Generator().manual_seed(bits))
        assert torch.equal(TailNoiseInjector(0.5, tau=0.2, seed=seed)(None, z), want), seed
    logits = torch.randn(50, 97, generator=torch.Generator().manual_seed(1)) * 2.5
    top = calibrate_scale(logits, 1e-3, TailNoiseInjector(seed=2**64 - 1, tau=0.3))
    wrapped = calibrate_scale(logits, 1e-3, TailNoiseInjector(seed=-1, tau=0.3))
    assert top.scale == wrapped.scale > 0
    for bad in (1.5, True, "7"):
        with pytest.raises(ValueError, match="seed"):
            TailNoiseInjector(0.5, seed=bad)


@pytest.mark.parametrize("runner", _runners())
def test_a_failing_row_is_left_unperturbed_and_counted(runner, monkeypatch, caplog):
    """An error in a row's perturbation inside vLLM's engine step (which would stop the engine) leaves that row's
    logits as they came, counts it on the processor and logs the first one only."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("no draw")

    monkeypatch.setattr(inject, "perturb_tail", broken)
    params = SamplingParams(temperature=1.0, extra_args={"tim_inject": {"scale": 2.0, "tau": 0.5}})
    z = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="tim_plugins.vllm"):
        proc, step = _run(runner, params, [5, 6, 7], z)
        assert torch.equal(step(), z) and proc.skipped_rows == 1
        assert torch.equal(step(), z) and proc.skipped_rows == 2
    warned = [r for r in caplog.records if "left a row unperturbed" in r.getMessage()]
    assert len(warned) == 1 and "no draw" in warned[0].getMessage()
