"""Guards on the transformers internals (5.x) tim-plugins relies on (``integrations/hf/sources.py``
``TRANSFORMERS_SOURCES``).

Every entry resolves; each assumption is checked against the installed transformers: signatures, statements in
the source (``inspect.getsource``) and behaviour where cheap. That the recorder's log-probs equal ``generate``'s
own processed scores is tested in ``test_trl_recorder.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

from tim_plugins.integrations.hf.recorder import RECORDABLE_MODES, record_processed_logprobs  # noqa: E402
from tim_plugins.integrations.hf.sources import TRANSFORMERS_SINCE, TRANSFORMERS_SOURCES  # noqa: E402
from upstream import flat as _flat  # noqa: E402
from upstream import resolve as _resolve  # noqa: E402
from upstream import source  # noqa: E402


def _src(module: str, qualname: str) -> str:
    return _flat(source(module, qualname))


GU = "transformers.generation.utils"


@pytest.mark.parametrize("key", sorted(TRANSFORMERS_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_named_source_exists(key):
    """Every entry resolves on the installed transformers, except one that exists only from a later release on
    (TRANSFORMERS_SINCE): that one exists exactly from its release on."""
    module, qualname = key
    if key in TRANSFORMERS_SINCE and _installed() < _release(TRANSFORMERS_SINCE[key]):
        with pytest.raises(AttributeError):
            _resolve(module, qualname)
        return
    assert _resolve(module, qualname) is not None, f"{module}:{qualname} is gone: revisit TRANSFORMERS_SOURCES"


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def _installed() -> tuple[int, ...]:
    import transformers

    return _release(transformers.__version__)


def test_generate_asks_the_instance_for_its_processors_once_by_keyword():
    src = _src(GU, "GenerationMixin.generate")
    assert src.count("self._get_logits_processor(") == 1
    call = src[src.index("self._get_logits_processor("):]
    call = call[: call.index(")")]
    assert "generation_config=generation_config" in call and "logits_processor=logits_processor" in call


def test_get_logits_processor_merges_the_callers_processors_before_the_warpers():
    params = list(inspect.signature(_resolve(GU, "GenerationMixin._get_logits_processor")).parameters)
    assert params[:6] == ["self", "generation_config", "input_ids_seq_length", "encoder_input_ids",
                          "prefix_allowed_tokens_fn", "logits_processor"]
    src = _src(GU, "GenerationMixin._get_logits_processor")
    order = [src.index(s) for s in (
        "processors = self._merge_criteria_processor_list(processors, logits_processor)",
        "if generation_config.do_sample:",
        "processors.append(TemperatureLogitsWarper(generation_config.temperature))",
        "TopKLogitsWarper(top_k=generation_config.top_k",
        "TopPLogitsWarper(top_p=generation_config.top_p",
        "MinPLogitsWarper(min_p=generation_config.min_p",
        "if generation_config.watermarking_config is not None:",
        "processors.append(LogitNormalization())",
        "return processors")]
    assert order == sorted(order)
    merge = _src(GU, "GenerationMixin._merge_criteria_processor_list")
    assert "for custom in custom_list: if custom not in final_list: final_list.append(custom)" in merge


def test_get_logits_processor_order_on_a_real_config(toy_model_path):
    """The list transformers builds: the caller's processor before the warpers, the recorder (appended) last."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model = AutoModelForCausalLM.from_pretrained(toy_model_path)

    class Mine:
        def __call__(self, input_ids, scores):
            return scores

    mine = Mine()
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
    procs = model._get_logits_processor(generation_config=config, logits_processor=LogitsProcessorList([mine]),
                                        device="cpu", model_kwargs={})
    kinds = [type(p) for p in procs]
    assert kinds.index(Mine) < kinds.index(TemperatureLogitsWarper) < kinds.index(TopKLogitsWarper) \
        < kinds.index(TopPLogitsWarper) < kinds.index(MinPLogitsWarper) == len(kinds) - 1


def test_sample_loop_feeds_the_whole_sequence_and_samples_the_processed_scores():
    src = _src(GU, "GenerationMixin._sample")
    # the last position's logits, copied to fp32 (transformers >= 5.2x index it as [:, -1], earlier as [:, -1, :]:
    # the same tensor)
    last = next((s for s in ("outputs.logits[:, -1, :]", "outputs.logits[:, -1]")
                 if f"next_token_logits = {s}.to(copy=True, dtype=torch.float32" in src), None)
    assert last is not None, "GenerationMixin._sample no longer takes the last position's logits as assumed"
    steps = [src.index(s) for s in (
        f"next_token_logits = {last}.to(copy=True, dtype=torch.float32",
        "next_token_scores = logits_processor(input_ids, next_token_logits)",
        "probs = nn.functional.softmax(next_token_scores, dim=-1)",
        "next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)",
        "input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)")]
    assert steps == sorted(steps)
    assert "next_tokens = torch.argmax(next_token_scores, dim=-1)" in src


def test_generation_modes_the_recorder_follows():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import GenerationMode

    assert set(RECORDABLE_MODES) <= {m.value for m in GenerationMode}
    assert GenerationConfig(do_sample=True).get_generation_mode() == "sample"
    assert GenerationConfig(do_sample=False).get_generation_mode() == "greedy_search"
    for cfg in (GenerationConfig(num_beams=2), GenerationConfig(num_beams=2, do_sample=True)):
        assert cfg.get_generation_mode().value not in RECORDABLE_MODES


def test_attn_implementation_is_what_the_model_runs(toy_model_path):
    from transformers import AutoModelForCausalLM
    from transformers.configuration_utils import PreTrainedConfig

    from tim_plugins.integrations.hf.parity_spec import spec_from_hf_model

    assert isinstance(inspect.getattr_static(PreTrainedConfig, "_attn_implementation"), property)
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(toy_model_path, attn_implementation=impl)
        assert model.config._attn_implementation == impl
        assert spec_from_hf_model(model).attention_backend == impl


def test_callback_state_is_rebuilt_from_args_and_attributes():
    src = _src("transformers.trainer", "Trainer._load_callback_state")
    for stmt in ('args = callback_data.get("args", {})', 'attributes = callback_data.get("attributes", {})',
                 "new_callback = type(callback)(**args)", "setattr(new_callback, attribute, value)"):
        assert stmt in src, stmt
    assert "callback.__class__.__name__ == stored_callback" in src
    save = _src("transformers.trainer", "Trainer._save_checkpoint")
    assert "cb_name = cb.__class__.__name__ cb_state = cb.state()" in save


def test_tim_state_survives_transformers_rebuild():
    """TIMState through the exact rebuild _load_callback_state performs (type(cb)(**args), then setattr)."""
    pytest.importorskip("trl")
    from tim_plugins.integrations.trl.callback import TIMState

    saved = TIMState({"version": 2, "pipeline": {"x": [1.0, 2.0]}}).state()
    rebuilt = type(TIMState())(**saved.get("args", {}))
    for attribute, value in saved.get("attributes", {}).items():
        setattr(rebuilt, attribute, value)
    assert rebuilt.state() == saved


def test_epoch_end_runs_before_the_epochs_log():
    import re

    # the epoch loop: Trainer._run_epoch from transformers 5.3 on, inside Trainer._inner_training_loop before
    since = TRANSFORMERS_SINCE[("transformers.trainer", "Trainer._run_epoch")]
    loop = "Trainer._run_epoch" if _installed() >= _release(since) else "Trainer._inner_training_loop"
    src = _src("transformers.trainer", loop)
    ends = [m.end() for m in re.finditer(
        r"self\.control = self\.callback_handler\.on_epoch_end\((?:self\.)?args, self\.state, self\.control\)", src)]
    assert len(ends) == 1, loop
    assert src.index("self._maybe_log_save_evaluate(", ends[0]) > ends[0]


def test_the_step_grad_norm_is_read_before_on_step_end():
    """The LR decay's grad-norm signal (features.LR_GRAD_NORM): the epoch loop takes the step's norm from
    self._get_grad_norm (looked up on the instance) after clipping, before the optimizer step and on_step_end, and
    logs that value."""
    import re

    since = TRANSFORMERS_SINCE[("transformers.trainer", "Trainer._run_epoch")]
    loop = "Trainer._run_epoch" if _installed() >= _release(since) else "Trainer._inner_training_loop"
    src = _src("transformers.trainer", loop)
    read = [m.start() for m in re.finditer(r"grad_norm = self\._get_grad_norm\(model, grad_norm=grad_norm\)", src)]
    assert len(read) == 1, loop
    assert src.index("grad_norm = self._clip_grad_norm(model)") < read[0] < src.index("self.optimizer.step()", read[0])
    assert src.index("self.callback_handler.on_step_end(", read[0]) < src.index("self._maybe_log_save_evaluate(",
                                                                                 read[0])
    assert "grad_norm," in src[src.index("self._maybe_log_save_evaluate(", read[0]):]
    get = _src("transformers.trainer", "Trainer._get_grad_norm")
    assert "clip_grad_norm_(model.parameters(), float(\"inf\"))" in get and "return grad_norm" in get


def test_recorder_warns_once_on_an_untested_transformers(toy_model_path, monkeypatch, caplog):
    """An untested transformers is one warning per process, never an exception: the recorder still records (its
    hook is checked by the capability check, integrations/trl/features.py HF_RECORDER)."""
    import logging

    import tim_plugins._optional as optional

    low, high = optional.SUPPORTED_RANGES["transformers"]
    untested = f"{int(high.split('.')[0]) + 1}.0.0"
    monkeypatch.setattr(optional, "package_version", lambda dist: untested if dist == "transformers" else None)
    monkeypatch.setattr(optional, "_NOTED", set())
    monkeypatch.delenv("TIM_PLUGINS_SKIP_VERSION_CHECK", raising=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_path)
    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        for _ in range(2):
            with record_processed_logprobs(model) as recorders:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=2,
                                     min_new_tokens=2, pad_token_id=0)
            assert len(recorders) == 1 and recorders[0].unsupported is None and recorders[0].num_steps == 2
            assert out.shape == (1, 5)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"tim_plugins: transformers {untested} is outside the tested range (>={low},<{high}); every "
                      "feature is checked against it when it attaches and one whose hook moved is switched off with "
                      "a warning. `tim-plugins doctor` lists them."]
    assert "_get_logits_processor" not in vars(model)
