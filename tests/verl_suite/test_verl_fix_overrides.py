"""Every Hydra override the verl fixes print (``integrations/verl/fixes.py``, the min-p overrides the adapter's own
checks quote) works on verl's own ``ppo_trainer`` config, composed as ``main_ppo`` composes it: it composes, sets
the value it names, also after the user's own ``+key=`` for that key, and each finding's fix clears that finding in
the audit."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl")
pytest.importorskip("hydra")

from tim_plugins.apps.compare_settings import COMPARE_MIN_P, COMPARE_PRESETS, Setting, framework_configs  # noqa: E402
from tim_plugins.integrations.verl import fixes  # noqa: E402
from tim_plugins.integrations.verl.config import rollout_min_p_overrides  # noqa: E402
from tim_plugins.integrations.verl.parity_spec import compose_ppo_config, specs_from_overrides  # noqa: E402
from tim_plugins.parity import audit  # noqa: E402
from tim_plugins.safe_vocab import DEFAULT_MIN_P  # noqa: E402

# a Hydra override of a verl config group (or of tim-plugins' own tim node), as the fixes print them
TOKEN = re.compile(r"(?<![\w.+])(\+{0,2})((?:actor_rollout_ref|algorithm|trainer|data|reward|critic|distillation|tim)"
                   r"\.[\w.]+)=([^\s',;()]+)")
# example values of the placeholders the fixes write (`<a|b>` lists its own)
PLACEHOLDERS = {"<T>": "0.7", "<B>": "64", "<N>": "2", "<B/N>": "32"}
# keys of a Megatron actor's config (verl's ppo_megatron_trainer), printed beside the FSDP actor's
MEGATRON_KEYS = ("actor_rollout_ref.actor.megatron.",)


def _config_name(key: str) -> str:
    return "ppo_megatron_trainer" if key.startswith(MEGATRON_KEYS) else "ppo_trainer"


def _texts() -> dict[str, str]:
    out = {f"FINDING_FIXES[{k!r}]": v for k, v in fixes.FINDING_FIXES.items()}
    out.update({f"CAUSE_FIXES[{k!r}]": v for k, v in fixes.CAUSE_FIXES.items()})
    out.update({f"PART_FIXES[{k!r}]": v for k, v in fixes.PART_FIXES.items()})
    out["rollout_min_p_overrides"] = " ".join(rollout_min_p_overrides(DEFAULT_MIN_P))
    # `tim-plugins measure --compare`: each setting's verl configuration, as its console and report print it
    for item in COMPARE_PRESETS["all"]:
        setting = Setting(item.split("+")[0], COMPARE_MIN_P if "min-p" in item else 0.0, "fp32-head" in item)
        for trainer in ("float32", "bfloat16"):
            out[f"measure --compare {setting.name} ({trainer} trainer)"] = framework_configs(
                setting, trainer, "bfloat16")["verl"]
            # with the sampler's cut (measure --top-p / --top-k), which the trainer applies too
            out[f"measure --compare {setting.name} --top-p 0.9 --top-k 20 ({trainer} trainer)"] = framework_configs(
                setting, trainer, "bfloat16", top_p=0.9, top_k=20)["verl"]
    return out


def _values(value: str) -> list[str]:
    """The example values of a printed value: itself, each option of `<a|b|c>`, or PLACEHOLDERS' example."""
    if not (value.startswith("<") and value.endswith(">")):
        return [value]
    if "|" in value:
        return value[1:-1].split("|")
    assert value in PLACEHOLDERS, f"placeholder {value}: add an example value to PLACEHOLDERS"
    return [PLACEHOLDERS[value]]


def _tokens(text: str) -> list[tuple[str, str, list[str]]]:
    return [(m[1], m[2], _values(m[3])) for m in TOKEN.finditer(text)]


# each distinct override once (composing verl's config takes about a second), named by the first text printing it
CASES = list({(prefix, key, value): (where, prefix, key, value) for where, text in reversed(_texts().items())
              for prefix, key, values in _tokens(text) for value in values}.values())


def _parsed(override: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).value()


def _selected(cfg, key: str):
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, throw_on_missing=True)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def test_the_fixes_print_overrides():
    # the collection itself: a change of wording that hides the overrides from TOKEN would empty this test
    keys = {key for _, _, key, _ in CASES}
    assert {"actor_rollout_ref.rollout.dtype", "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.head_dtype",
            "actor_rollout_ref.model.override_config.attn_implementation",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors"} <= keys


@pytest.mark.parametrize("where, prefix, key, value", CASES, ids=[f"{c[0]}:{c[2]}={c[3]}" for c in CASES])
def test_each_printed_override_composes_and_sets_its_value(where, prefix, key, value):
    override = f"{prefix}{key}={value}"
    # `+key=` fails where the user has added the key already: a key verl's config lacks is printed with `++`
    assert prefix in ("", "++"), f"{where}: {override} (print ++{key}=...)"
    name = _config_name(key)
    cfg = compose_ppo_config([override], config_name=name)
    assert _selected(cfg, key) == _parsed(override), (where, override)
    if prefix == "++":
        # not in verl's config (else `key=` says it), and it works after the user's own `+key=`
        user = f"+{key}={value}"
        compose_ppo_config([user], config_name=name)
        assert _selected(compose_ppo_config([user, override], config_name=name), key) == _parsed(override), (
            where, override)


# {finding code: overrides that make the verl audit report it}; a code verl cannot produce is not listed
TRIGGERS = {
    "dtype-mismatch": ["actor_rollout_ref.rollout.dtype=float16"],
    "lm-head-precision-mismatch": ["+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.head_dtype=float32"],
    "logprobs-mode-not-processed": ["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"],
    "sampler-truncation-unmatched": ["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=20"],
    "quantized-rollout": ["actor_rollout_ref.rollout.quantization=fp8",
                          "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8"],
    "prefix-caching-on": [],
    "chunked-prefill-on": [],
    "cudagraph-on": [],
    "attention-backend-mismatch": ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                                   "+actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=FLASH_ATTN"],
    "unknown-setting": [],
}
# the fix narrows it but cannot clear it: verl has no batch-invariant actor
PARTIAL = {"batch-invariance-off"}


def _codes(overrides: list[str]) -> set[str]:
    return {f.code for f in audit(*specs_from_overrides(overrides))}


@pytest.mark.parametrize("code", sorted(TRIGGERS))
def test_each_findings_fix_clears_it_in_the_audit(code):
    """The user's overrides that cause the finding, then each alternative of its fix pasted after them."""
    trigger = TRIGGERS[code]
    assert code in _codes(trigger), code
    tokens = [t for t in _tokens(fixes.FINDING_FIXES[code]) if not t[1].startswith(MEGATRON_KEYS)]
    assert tokens, code
    # the i-th option of each `<a|b|c>` together (dtype: bfloat16 with bf16, ...)
    for i in range(max(len(values) for _, _, values in tokens)):
        fix = [f"{p}{k}={values[min(i, len(values) - 1)]}" for p, k, values in tokens]
        assert code not in _codes(trigger + fix), (code, fix)


def test_the_megatron_dtype_fix_clears_the_finding_and_passes_verls_engine_config():
    """On a Megatron actor (ppo_megatron_trainer) the audit reads the actor's dtype where verl's Megatron engine does
    (actor.megatron.dtype): a float16 rollout against its default bfloat16 is named, and each option of the printed
    Megatron fix (the rollout's dtype with megatron.dtype, the same option) clears it; verl's McoreEngineConfig
    accepts each value (it refuses float32, which the fix does not offer)."""
    from verl.utils.config import omega_conf_to_dataclass

    from tim_plugins.integrations.verl.parity_spec import specs_from_config

    def codes(overrides):
        return {f.code for f in audit(*specs_from_config(compose_ppo_config(overrides,
                                                                            config_name="ppo_megatron_trainer")))}

    trigger = ["actor_rollout_ref.rollout.dtype=float16"]
    assert "dtype-mismatch" in codes(trigger)
    tokens = _tokens(fixes.FINDING_FIXES["dtype-mismatch"])
    rollout = next(values for _, key, values in tokens if key == "actor_rollout_ref.rollout.dtype")
    megatron = next(values for _, key, values in tokens if key == "actor_rollout_ref.actor.megatron.dtype")
    assert megatron == ["bfloat16", "float16"]
    for value in megatron:
        assert value in rollout
        fix = [f"actor_rollout_ref.rollout.dtype={value}", f"actor_rollout_ref.actor.megatron.dtype={value}"]
        assert "dtype-mismatch" not in codes(trigger + fix), fix
        cfg = compose_ppo_config(trigger + fix, config_name="ppo_megatron_trainer")
        assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron).dtype == value
    with pytest.raises(Exception, match="float32"):
        omega_conf_to_dataclass(compose_ppo_config(["actor_rollout_ref.actor.megatron.dtype=float32"],
                                                   config_name="ppo_megatron_trainer").actor_rollout_ref.actor.megatron)


def test_an_unknown_rollout_dtype_is_named_by_the_fix():
    """``rollout.dtype=auto`` follows a checkpoint the driver cannot read here: the dtype is an unknown setting, and
    the printed fix's rollout dtype clears it (with the attention backend it names too)."""
    trigger = ["actor_rollout_ref.rollout.dtype=auto"]
    found = {f.code: f for f in audit(*specs_from_overrides(trigger))}
    assert "dtype" in found["unknown-setting"].message, found["unknown-setting"].message
    tokens = _tokens(fixes.FINDING_FIXES["unknown-setting"])
    for value in next(values for _, key, values in tokens if key == "actor_rollout_ref.rollout.dtype"):
        fix = [f"{p}{k}={value if k == 'actor_rollout_ref.rollout.dtype' else v[0]}" for p, k, v in tokens]
        assert "unknown-setting" not in _codes(trigger + fix), fix


def test_every_verl_finding_fix_is_covered():
    assert set(fixes.FINDING_FIXES) - set(TRIGGERS) - PARTIAL == {"temperature-mismatch",
                                                                  "sampler-penalties-unmatched"}
    # both sides read actor_rollout_ref.rollout.temperature; verl's agent loop sends no penalty
    assert not _tokens(fixes.FINDING_FIXES["sampler-penalties-unmatched"])


@pytest.mark.parametrize("alternative", [
    ["++actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.head_dtype=model"],
    ["actor_rollout_ref.rollout.dtype=float32",
     "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"],
])
def test_each_lm_head_alternative_clears_the_finding_on_its_own(alternative):
    text = fixes.FINDING_FIXES["lm-head-precision-mismatch"]
    assert all(o in text for o in alternative)
    assert "lm-head-precision-mismatch" not in _codes(TRIGGERS["lm-head-precision-mismatch"] + alternative)


def test_attention_pairs_clear_the_finding_each():
    text = fixes.FINDING_FIXES["attention-backend-mismatch"]
    tokens = [f"{p}{k}={v[0]}" for p, k, v in _tokens(text)]
    assert len(tokens) == 4
    for pair in (tokens[:2], tokens[2:]):
        assert "attention-backend-mismatch" not in _codes(TRIGGERS["attention-backend-mismatch"] + pair), pair


def test_full_determinism_makes_the_rollout_batch_invariant():
    fix = [f"{p}{k}={v[0]}" for p, k, v in _tokens(fixes.FINDING_FIXES["batch-invariance-off"])]
    rollout, trainer = specs_from_overrides(fix)
    assert rollout.batch_invariant and not trainer.batch_invariant
