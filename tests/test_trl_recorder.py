"""The processed-log-prob recorder TRL's transformers path uses (tim_plugins.integrations.hf.recorder) under the decoding
modes a GRPOConfig's ``generation_kwargs`` can select: recorded where it can follow the steps, never raising
inside ``generate`` where it cannot."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tim_plugins.integrations.hf.recorder import (  # noqa: E402
    RECORDABLE_MODES,
    ProcessedLogprobRecorder,
    record_processed_logprobs,
)

pytestmark = pytest.mark.trl


@pytest.fixture(scope="module")
def model_and_prompts(toy_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_path)
    model = AutoModelForCausalLM.from_pretrained(toy_model_path).eval()
    tok.padding_side = "left"
    enc = tok(["Q: 3 + 4 = ? A:", "sort 3 1 2 ->", "The red"], return_tensors="pt", padding=True)
    return model, tok, enc


def _generate(model, tok, enc, **kwargs):
    torch.manual_seed(0)
    with record_processed_logprobs(model) as recorders:
        out = model.generate(**enc, max_new_tokens=5, pad_token_id=tok.pad_token_id, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    assert "_get_logits_processor" not in vars(model)  # the patch is gone
    return out, recorders


@pytest.mark.parametrize("kwargs", [dict(do_sample=True, top_k=0, temperature=0.7, min_p=0.05),
                                    dict(do_sample=False, repetition_penalty=1.3)])
def test_recorded_logprobs_equal_generates_processed_scores(model_and_prompts, kwargs):
    model, tok, enc = model_and_prompts
    out, (rec,) = _generate(model, tok, enc, **kwargs)
    assert rec.unsupported is None
    comp = out.sequences[:, enc["input_ids"].shape[1]:]
    got = rec.finish(comp[:, -1])
    # Reference: generate's own processed scores (output_scores), renormalised, at the emitted token.
    ref = torch.stack([torch.log_softmax(s.float(), -1).gather(1, comp[:, t: t + 1]).squeeze(1)
                       for t, s in enumerate(out.scores)], dim=1)
    live = torch.isfinite(ref)  # rows padded after EOS emit pad under -inf scores
    assert got.shape == ref.shape
    assert torch.allclose(got[live], ref[live], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs,mode", [(dict(num_beams=2, do_sample=False), "beam_search"),
                                         (dict(num_beams=2, do_sample=True), "beam_sample")])
def test_beam_modes_are_reported_not_raised(model_and_prompts, kwargs, mode):
    model, tok, enc = model_and_prompts
    out, (rec,) = _generate(model, tok, enc, **kwargs)
    assert mode not in RECORDABLE_MODES
    assert out.sequences.shape[0] == enc["input_ids"].shape[0]  # generate itself ran to the end
    assert rec.unsupported == f"generation mode '{mode}'"
    with pytest.raises(RuntimeError, match=mode):
        rec.finish(out.sequences[:, -1])


def test_recorder_stops_on_calls_it_cannot_follow():
    rec = ProcessedLogprobRecorder()
    scores = torch.randn(2, 7)
    assert rec(torch.zeros(2, 3, dtype=torch.long), scores) is scores
    # Rows multiplied (what beam search does) → stop, scores pass through untouched.
    wider = torch.randn(4, 7)
    assert rec(torch.zeros(4, 4, dtype=torch.long), wider) is wider
    assert rec.unsupported is not None and "(4, 4)" in rec.unsupported
    assert rec(torch.zeros(2, 5, dtype=torch.long), scores) is scores  # stays stopped
    # Steps that do not extend by one token (assisted decoding re-scores candidates).
    rec = ProcessedLogprobRecorder()
    rec(torch.zeros(2, 3, dtype=torch.long), scores)
    rec(torch.zeros(2, 3, dtype=torch.long), scores)
    assert rec.unsupported is not None
    # Anything unexpected inside is caught, never raised into generate.
    rec = ProcessedLogprobRecorder()
    rec(torch.zeros(2, 3, dtype=torch.long), scores)
    bad_ids = torch.full((2, 4), 99, dtype=torch.long)  # token id outside the 7-wide scores
    assert rec(bad_ids, scores) is scores
    assert "recording failed" in rec.unsupported
    with pytest.raises(RuntimeError, match="recording failed"):
        rec.finish(torch.zeros(2, dtype=torch.long))


def test_finish_checks_rows():
    rec = ProcessedLogprobRecorder()
    scores = torch.log_softmax(torch.randn(3, 5), -1)
    rec(torch.zeros(3, 2, dtype=torch.long), scores)
    with pytest.raises(RuntimeError, match="3 recorded rows"):
        rec.finish(torch.zeros(6, dtype=torch.long))
    got = rec.finish(torch.tensor([0, 1, 2]))
    assert torch.allclose(got[:, 0], scores[torch.arange(3), torch.tensor([0, 1, 2])], atol=1e-6)
