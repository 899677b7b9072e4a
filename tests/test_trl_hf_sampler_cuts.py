"""``TIMConfig(safe_vocab=True)`` on TRL's transformers generation refuses the cuts it cannot follow: top-h,
typical-p, epsilon and eta (``GRPOConfig.generation_kwargs``, or the model's generation_config where TRL leaves the
key unset). The safe vocabulary cuts at top-k / top-p / min-p only; with one of these on, the tokens TRL's generate
keeps are not the safe vocabulary's. The refusal names the value, the rule and a fix; the fix, applied, attaches, and
the kept sets then agree.

The reference is independent of the adapter: the kept set of TRL's own ``generate(output_scores=True)`` (its finite
processed scores) against the kept set the safe vocabulary computes from the trainer's logits of the same tokens.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_parity_trl_hf_sampler_keys import _trl_generate  # noqa: E402
from test_trl_callback import make_trainer  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.integrations.trl.translate import safe_truncation  # noqa: E402
from tim_plugins.truncation import Truncation, truncation_threshold  # noqa: E402

pytestmark = pytest.mark.trl

PROMPTS = ([5, 6, 5], [7])
MIN_P = 0.02  # the cut the safe vocabulary follows, beside the one it cannot
CUTS = {"typical_p": 0.5, "epsilon_cutoff": 0.05, "eta_cutoff": 0.05, "top_h": 0.5}


def kept_sets_agree(trainer, trunc: Truncation) -> bool:
    """The reference: at every step of TRL's own generation, the tokens it keeps (finite processed scores) are those
    the safe vocabulary keeps from the trainer's logits of the same prefix."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    for prompt in PROMPTS:
        sequences, scores = _trl_generate(trainer, prompt)
        with torch.no_grad():
            logits = model(input_ids=sequences).logits[0, len(prompt) - 1:-1].float() / trainer.temperature
        kept = logits >= truncation_threshold(logits, trunc)[:, None]
        if not torch.equal(kept, torch.stack([torch.isfinite(s[0]) for s in scores])):
            return False
    return True


def safe_cut(trainer) -> Truncation:
    """The cut the safe vocabulary would apply, the sampler's min-p (transformers' order), where it is refused."""
    return Truncation(min_p=MIN_P, order="hf", temperature=float(trainer.temperature))


def refusal(trainer) -> str:
    with pytest.raises(ValueError) as err:
        TIMCallback(trainer, TIMConfig(safe_vocab=True))
    return str(err.value)


@pytest.mark.parametrize("key", list(CUTS))
def test_a_cut_the_safe_vocabulary_cannot_follow_is_refused_and_the_printed_fix_attaches(key, toy_model_path,
                                                                                         tmp_path):
    value = CUTS[key]
    trainer = make_trainer(toy_model_path, tmp_path / "cut", max_steps=1, min_p=MIN_P,
                           generation_kwargs={key: value})
    assert not kept_sets_agree(trainer, safe_cut(trainer))  # transformers keeps another set: the case has teeth
    msg = refusal(trainer)
    assert msg.startswith(f"TIMConfig.safe_vocab=True with TRL's transformers generation, where "
                          f"GRPOConfig.generation_kwargs sets {{{key!r}: {value!r}}}, is invalid"), msg
    assert "top-k, top-p and min-p only" in msg, msg  # the rule
    fix = msg.split("Fix: ", 1)[1]
    assert fix.startswith(f"drop {key!r} from generation_kwargs") and fix.endswith("or safe_vocab=False"), fix
    # every fix printed, applied: dropping the key, and (where one exists) setting its neutral value there
    fixed = [{}]
    setting = re.search(rf"set {key}=([^ )]+) there", fix)
    if setting:
        fixed.append({key: float(setting.group(1))})
    assert bool(setting) is (key != "top_h")  # top-h cuts to at most 100 tokens whatever its value
    for i, gen in enumerate(fixed):
        trainer = make_trainer(toy_model_path, tmp_path / f"fixed{i}", max_steps=1, min_p=MIN_P,
                               generation_kwargs=gen)
        TIMCallback(trainer, TIMConfig(safe_vocab=True))  # attaches
        assert kept_sets_agree(trainer, safe_truncation(trainer, TIMConfig(safe_vocab=True)))


def test_a_cut_from_the_models_generation_config_is_refused_with_a_fix_that_works(toy_model_path, tmp_path):
    """TRL's GenerationConfig leaves typical_p None: transformers takes the model's. Dropping it from generation_kwargs
    changes nothing then; the fix sets the neutral value there."""
    path = tmp_path / "model"
    shutil.copytree(toy_model_path, path)
    gc_file = path / "generation_config.json"
    gc_file.write_text(json.dumps({**json.loads(gc_file.read_text()), "typical_p": 0.5}))
    trainer = make_trainer(path, tmp_path / "cut", max_steps=1, min_p=MIN_P)
    assert not kept_sets_agree(trainer, safe_cut(trainer))
    msg = refusal(trainer)
    assert "where the model's generation_config sets {'typical_p': 0.5} (TRL's GenerationConfig leaves it None" \
           in msg, msg
    fix = msg.split("Fix: ", 1)[1]
    assert fix == "add {'typical_p': 1.0} to GRPOConfig.generation_kwargs, or safe_vocab=False", fix
    trainer = make_trainer(path, tmp_path / "fixed", max_steps=1, min_p=MIN_P, generation_kwargs={"typical_p": 1.0})
    TIMCallback(trainer, TIMConfig(safe_vocab=True))
    assert kept_sets_agree(trainer, safe_truncation(trainer, TIMConfig(safe_vocab=True)))
    # generation_kwargs' own typical_p with the model's there too: dropping it would hand it to the model's
    trainer = make_trainer(path, tmp_path / "both", max_steps=1, min_p=MIN_P, generation_kwargs={"typical_p": 0.7})
    fix = refusal(trainer).split("Fix: ", 1)[1]
    assert fix.startswith("set typical_p=1.0 in generation_kwargs (the model's generation_config cuts too)"), fix


def test_greedy_decoding_is_refused_as_greedy_first(toy_model_path, tmp_path):
    """do_sample=False: transformers applies no warper at all (typical-p neither); the greedy refusal is the one."""
    trainer = make_trainer(toy_model_path, tmp_path, max_steps=1, min_p=MIN_P,
                           generation_kwargs={"do_sample": False, "typical_p": 0.5})
    assert "with greedy decoding (generation_kwargs['do_sample']=False)" in refusal(trainer)
