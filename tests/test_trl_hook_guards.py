"""Guards on the TRL internals the adapter relies on (``integrations/trl/hooks.py`` ``TRL_SOURCES``), on the
installed TRL (1.9 - 1.16).

Each test fails when the named TRL source changes the shape the adapter assumes, and says which hook to revisit.
An entry serves one feature (``hooks.TRL_SOURCE_FEATURES``): its assumptions are checked where the capability check
(``integrations/trl/features.py``) finds that feature available; where it does not, the test asserts the feature is
reported off with the reason. At least one safe-vocabulary route is available on every tested release.
The policy-term route (``translate.scale_policy_term``) is checked against TRL's own vLLM-branch product, for every
loss type TRL documents, with ratios that clip and a KL term: the reference is TRL's ``_compute_loss`` itself.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import re
import sys

import pytest
import torch
from packaging.version import Version

pytest.importorskip("trl")
pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tim_plugins._optional import package_version  # noqa: E402
from tim_plugins.capabilities import check  # noqa: E402
from tim_plugins.integrations.trl import features  # noqa: E402
from tim_plugins.integrations.trl.hooks import TRL_SOURCE_FEATURES, TRL_SOURCES  # noqa: E402
from tim_plugins.integrations.trl.translate import scale_policy_term  # noqa: E402
from tim_plugins.toy_model import synthetic_prompts  # noqa: E402

pytestmark = pytest.mark.trl

TRL = Version(package_version("trl"))

# The TRL releases on which each feature must be available ([from, before); the supported stacks run TRL 1.9.0 and
# 1.16.0, the latest lane the newest): a hook that moves there fails these tests instead of switching its feature off
# unnoticed. The fused head's kernel holds from 1.15 with Triton, from 1.16 without; TRL 1.14 has neither route.
FEATURE_RELEASES = {
    "monitor": ("1.9", None), "loss_factor": ("1.9", None), "hf_recorder": ("1.9", None),
    "exact_sampler": ("1.9", None), "parity_audit_engine": ("1.9", None),
    "safe_vocab_fused_head": ("1.16", None), "safe_vocab_logits": ("1.9", "1.14"),
    "parity_audit_server": ("1.16", None),  # VLLMClient.get_server_info
    "async_monitor": ("1.16", None),  # the packed AsyncGRPOTrainer (trl.experimental.async_grpo.packing)
    "kept_set_replay": ("1.9", None),  # the colocate LLM global and generate call (TRL 1.9 and 1.16 read alike)
    "sync_check": ("1.9", None),  # sync_weights writes through model_runner.model.load_weights (1.9, 1.12, 1.14, 1.16)
    "sync_probe_server": ("1.9", None),  # VLLMClient.get_sequence_logprobs (TRL's own server to 1.10, vLLM's after)
    "lr_grad_norm": ("1.9", None),  # transformers' Trainer._get_grad_norm (5.5 - 5.25: tests/test_transformers_sources)
}
# Features that need vLLM installed besides TRL: TRL binds its colocate ``LLM`` global only when vLLM imports, so
# without vLLM (the `latest` lane) the feature is off, for that reason.
NEEDS_VLLM = {"kept_set_replay"}


# The features a GRPOTrainer on TRL's transformers generation (the toy trainer below) is checked with at attach, on
# the live trainer (their GRPOTrainer.__init__ settings); the audit's engine read needs a vLLM trainer, the
# asynchronous monitor an AsyncGRPOTrainer (their own tests check those on the live object).
ON_HF_TRAINER = ("monitor", "loss_factor", "safe_vocab_fused_head", "safe_vocab_logits", "hf_recorder",
                 "exact_sampler")


def expected(name: str) -> bool:
    """Whether feature ``name`` must be available on the installed TRL (FEATURE_RELEASES); "safe_vocab" (the routes
    as one, ``features.trl_features``) when one of its routes must."""
    if name == "safe_vocab":
        return any(expected(f.name) for f in features.SAFE_VOCAB_ROUTES)
    if name in NEEDS_VLLM and importlib.util.find_spec("vllm") is None:
        return False
    first, before = FEATURE_RELEASES[name]
    return TRL >= Version(first) and (before is None or TRL < Version(before))

# The loss types GRPOConfig.loss_type's help text defines (TRL 1.9 - 1.16 define the same eight); a release adding
# one fails test_loss_types_are_the_documented_ones until the IS route is checked for it below.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _src(obj) -> str:
    return inspect.getsource(obj)


def _resolves(module: str, qualname: str) -> bool:
    try:
        return _resolve(module, qualname) is not None
    except (ImportError, AttributeError):
        return False


def _entry_of(hook) -> tuple[str, str] | None:
    """The TRL_SOURCES entry a feature's hook checks (the entry itself or an attribute of it), None for another
    registry's symbol."""
    for module, qualname in TRL_SOURCES:
        if hook.module == module and (hook.qualname == qualname or hook.qualname.startswith(qualname + ".")):
            return module, qualname
    return None


def test_each_entry_names_exactly_the_features_that_check_it():
    """An entry's features (TRL_SOURCE_FEATURES) are those with a hook on it, so a moved entry switches off exactly
    the features it lists and no other."""
    assert set(TRL_SOURCE_FEATURES) == set(TRL_SOURCES)
    assert set(FEATURE_RELEASES) == {f.name for f in features.FEATURES}
    checked: dict[tuple, set] = {key: set() for key in TRL_SOURCES}
    for feature in features.FEATURES:
        for hook in feature.hooks:
            if _entry_of(hook) is not None:
                checked[_entry_of(hook)].add(feature.name)
    assert {key: set(names) for key, names in TRL_SOURCE_FEATURES.items()} == checked


@pytest.fixture(scope="module")
def live_trainer(toy_model_path, tmp_path_factory):
    """A GRPOTrainer as TRL builds it (the live object the settings' checks read)."""
    return make_trainer(toy_model_path, tmp_path_factory.mktemp("live"), max_steps=1)


def _check(name: str, trainer):
    """Feature ``name``'s status, on the live trainer where the callback checks it there."""
    return check(features.feature(name), features.live(trainer) if name in ON_HF_TRAINER else None)


def test_every_feature_the_installed_trl_supports_is_available(live_trainer):
    for feature in features.FEATURES:
        for status in (check(feature), _check(feature.name, live_trainer)):
            if expected(feature.name):
                assert status.available, \
                    f"{status.warning()} (expected on trl {TRL}: revisit integrations/trl/hooks.py)"
            else:
                assert not status.available and status.reason and status.fix, status


def test_the_settings_the_adapter_reads_are_on_the_live_trainer(live_trainer):
    """Every GRPOTrainer.__init__ attribute a feature reads (hooks.TRL_SOURCES) is on the trainer TRL built, and is
    deferred (named) where the check has no trainer (the doctor)."""
    init = ("trl.trainer.grpo_trainer", "GRPOTrainer.__init__")
    read = {a for f in features.FEATURES for h in f.hooks if (h.module, h.qualname) == init for a in h.attrs}
    assert {"trainer.use_vllm", "trainer.top_p", "trainer.rollout_func"} <= read
    for path in read:
        assert hasattr(live_trainer, path.split(".", 1)[1]), f"{path}: revisit integrations/trl/hooks.py"
    assert "trainer.use_vllm" in check(features.MONITOR).deferred and not check(
        features.MONITOR, features.live(live_trainer)).deferred


@pytest.mark.parametrize("key", sorted(TRL_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_named_source_exists(key, live_trainer):
    """Where one of the entry's features must hold on the installed TRL, the source is there and that feature is
    available (on the live trainer, for its settings); where the source is gone the feature is reported off, naming
    what moved."""
    module, qualname = key
    for name in TRL_SOURCE_FEATURES[key]:
        status = _check(name, live_trainer)
        if expected(name):
            assert _resolves(module, qualname), f"{module}.{qualname} is gone: revisit integrations/trl/hooks.py"
            assert status.available, f"{status.warning()} (expected on trl {TRL})"
        else:
            assert not status.available and status.reason and status.fix and status.name in status.warning()
        if not _resolves(module, qualname):  # off, naming what moved, or the module it needs that is missing
            assert not status.available and (qualname.split(".")[0] in status.reason
                                              or status.reason.endswith(" is not installed")), (key, status)


def test_the_source_guard_fails_when_a_source_moves(monkeypatch, live_trainer):
    """The guard above, run on a TRL whose source moved (monkeypatched away here): it fails, naming the source."""
    key = ("trl.trainer.grpo_trainer", "GRPOTrainer._generate_single_turn")
    test_every_named_source_exists(key, live_trainer)  # holds as installed
    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(AssertionError, match="_generate_single_turn"):
        test_every_named_source_exists(key, live_trainer)


def test_a_moved_setting_switches_off_only_the_features_that_read_it(monkeypatch, tmp_path, toy_model_path):
    """A TRL whose GRPOTrainer renamed ``self.top_p`` (its module rebuilt from TRL's own source with the attribute
    renamed, as a release would): the features that read trainer.top_p (the safe-vocabulary routes, the exact
    sampler) are off on its live trainer, naming the attribute; those that do not (monitor, loss factor, HF
    recorder) stay on; and the guard of that entry fails."""
    from touched import rebuilt_grpo_module

    moved = rebuilt_grpo_module(lambda text: text.replace("self.top_p", "self.nucleus"), monkeypatch, tmp_path)
    trainer = make_trainer(toy_model_path, tmp_path, trainer_cls=moved.GRPOTrainer, max_steps=1)
    assert not hasattr(trainer, "top_p") and hasattr(trainer, "nucleus")
    for feature in features.FEATURES:
        if feature.name not in ON_HF_TRAINER:
            continue
        status = check(feature, features.live(trainer))
        reads_top_p = feature in features.SAFE_VOCAB_ROUTES or feature is features.EXACT_SAMPLER
        if reads_top_p:
            assert not status.available and "trainer.top_p is missing" in status.reason, status
        elif expected(feature.name):
            assert status.available, status.warning()
    with pytest.raises(AssertionError, match="trainer.top_p"):
        test_every_named_source_exists(("trl.trainer.grpo_trainer", "GRPOTrainer.__init__"), trainer)


def test_a_safe_vocabulary_route_is_available():
    """TRL >= 1.16 (1.15 with Triton): the fused head's kernel; TRL 1.9 - 1.13: selective_log_softmax on full
    logits (1.14 has neither: not a tested release)."""
    from packaging.version import Version

    route, statuses = features.safe_vocab_route()
    assert route is not None, [s.reason for s in statuses]
    trl = Version(statuses[0].version)
    if trl >= Version("1.16"):
        assert route is features.SAFE_VOCAB_FUSED_HEAD
    elif trl < Version("1.14"):
        assert route is features.SAFE_VOCAB_LOGITS
    assert features.safe_vocab_status().available


def test_loss_types_are_the_documented_ones():
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    # each loss type the help text defines ("'name': what it does"); TRL 1.9's "Supported values are ..." sentence
    # lists only four of the eight it defines and implements
    documented = set(re.findall(r"'([a-z_]+)'(?: \(default\))?:", help_text))
    assert documented == set(LOSS_TYPES)
    loss = _src(GRPOTrainer._compute_loss)
    for loss_type in LOSS_TYPES:  # each one has its own branch in TRL's loss
        assert f'"{loss_type}"' in loss, loss_type


def test_signatures_the_wrappers_bind():
    sig = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    assert list(sig.parameters)[:7] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                        "batch_size", "compute_entropy"]
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    assert list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)[:2] == ["self", "prompt_ids"]


@pytest.mark.parametrize("route", features.SAFE_VOCAB_ROUTES, ids=lambda f: f.name)
def test_safe_vocab_route_sources(route):
    """The statements each safe-vocabulary route relies on, where the installed TRL has that route; where it does
    not, the route is reported off (test_a_safe_vocabulary_route_is_available: one of them is on)."""
    status = check(route)
    if not expected(route.name):
        assert not status.available and status.reason and status.fix, status
        return
    assert status.available, f"{status.warning()} (expected on trl {TRL})"
    logps = _src(GRPOTrainer._get_per_token_logps_and_entropies)
    if route is features.SAFE_VOCAB_FUSED_HEAD:
        import trl.trainer.utils as trl_utils

        params = list(inspect.signature(trl_utils._ChunkedLogProbFunction.forward).parameters)
        assert params[1:] == ["hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                              "final_logit_softcapping", "logit_scale", "outputs"]
        # translate._label_mask rebuilds the positions the fused head scores, as TRL labels them.
        assert "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)" in logps
        assert "labels[:, :-logits_to_keep] = -100" in logps and "fused_lm_head=True" in logps
        # The fused head looks the kernel up as a module global at call time (the safe-vocab shim replaces it).
        assert "_ChunkedLogProbFunction.apply(" in _src(trl_utils.add_fused_lm_head)
        return
    import trl.trainer.grpo_trainer as grpo

    # TRL 1.9 - 1.13: full logits [b, logits_to_keep, V], divided by the temperature (in place on 1.9, into a new
    # tensor on 1.10 - 1.13), then the module global selective_log_softmax (looked up at call time:
    # hooks.SafeLogSoftmax replaces it for one call) on the completion ids; TRL's logps are its result, unchanged.
    assert list(inspect.signature(grpo.selective_log_softmax).parameters) == ["logits", "index"]
    divide = next(d for d in ("logits.div_(self.temperature)", "logits = logits / self.temperature") if d in logps)
    steps = [logps.index(stmt) for stmt in (
        "logits = logits[:, :-1, :]", "logits = logits[:, -logits_to_keep:, :]", divide,
        "completion_ids = input_ids_batch[:, -logits_to_keep:]",
        "logps = selective_log_softmax(logits, completion_ids)", "all_logps.append(logps)")]
    assert steps == sorted(steps)
    assert logps.count("selective_log_softmax(") == 1


def test_the_route_guard_fails_when_its_route_moves(monkeypatch):
    """The route guard above, on a TRL whose route moved (test_trl_capabilities' simulation): it fails."""
    from test_trl_capabilities import _move_safe_vocab_route

    route, _ = features.safe_vocab_route()
    test_safe_vocab_route_sources(route)  # holds as installed
    symbol, problem = _move_safe_vocab_route(monkeypatch)
    with pytest.raises(AssertionError, match=problem):
        test_safe_vocab_route_sources(route)


def test_sources_hold_the_assumed_statements():
    loss = _src(GRPOTrainer._compute_loss)
    # (B, T) advantages pass through unchanged (the IS route folds the weights into them).
    assert "if advantages.dim() == 1:" in loss
    # TRL's own IS product exists only in the vLLM branch, and vespo reads the ratio key directly.
    branch = (r"if self\.use_vllm and self\.vllm_importance_sampling_correction and self\.loss_type != \"vespo\":"
              r"\s*per_token_loss = per_token_loss \* inputs\[\"importance_sampling_ratio\"\]")
    assert re.search(branch, loss)
    assert 'importance_sampling_ratio=inputs.get("importance_sampling_ratio")' in loss
    # The loss mask the adapter reads (translate.response_mask), and the inputs the loss reads only after its
    # log-prob call (the adapter scales them from inside that call, translate.scale_policy_term).
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in loss
    forward = loss.index("self._get_per_token_logps_and_entropies(")
    assert forward < loss.index('advantages = inputs["advantages"]')
    assert forward < loss.index('importance_sampling_ratio=inputs.get("importance_sampling_ratio")')
    assert loss.count('inputs["advantages"]') == 1
    # old_per_token_logps is the generation's first policy forward, computed exactly when TRL needs it
    gen = _src(GRPOTrainer._generate_and_score_completions)
    assert "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(" in gen
    assert "if self.args.gradient_accumulation_steps % generate_every != 0 or (" in gen
    assert gen.index("old_per_token_logps, _, _ =") < gen.index("ref_per_token_logps")
    single = _src(GRPOTrainer._generate_single_turn)
    assert "unwrapped_model.generate(" in single and "generation_config=self.generation_config" in single
    assert "logprobs = None" in single
    # TIMCallback._push_metrics appends to trainer._metrics["train"]; TRL's log() averages and clears it.
    log = _src(GRPOTrainer.log)
    assert "for key, val in self._metrics[mode].items():" in log and "self._metrics[mode].clear()" in log
    prepare = _src(GRPOTrainer._prepare_inputs)
    assert "self._generate_and_score_completions(generation_batch)" in prepare
    assert "shuffle_sequence_dict" in prepare and "split_tensor_dict" in prepare


def test_vllm_generation_attributes_the_audit_reads():
    """_parity.py reads trainer.vllm_generation.llm (colocate) and .vllm_client.get_server_info() (server)."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    init = _src(GRPOTrainer.__init__)
    assert "self.vllm_generation = VLLMGeneration(" in init and "if self.use_vllm:" in init
    assert "self._init_vllm()" in _src(VLLMGeneration.__init__)
    gen = re.sub(r"\s+", " ", _src(VLLMGeneration._init_vllm))
    assert "self.llm = LLM(" in gen and "self.vllm_client = VLLMClient(" in gen
    assert gen.index('elif self.mode == "colocate":') < gen.index("self.llm = LLM(")
    server = check(features.SERVER_AUDIT)
    if not server.available:  # TRL < 1.16: no /server_info client; the audit says the engine args are unknown
        assert "get_server_info" in server.reason and not hasattr(VLLMClient, "get_server_info"), server
        return
    assert list(inspect.signature(VLLMClient.get_server_info).parameters) == ["self"]
    info = _src(VLLMClient.get_server_info)
    assert 'f"{self.base_url}/server_info", params={"config_format": "json"}' in info
    assert 'return response.json()["vllm_config"]' in info


def test_the_sync_the_weight_check_wraps():
    """sync_check.SyncWatch: GRPOTrainer syncs through self.vllm_generation.sync_weights() when global_step moved
    (from step 0 on); colocate, TRL's sync writes each parameter through the engine model's load_weights (where the
    check samples what was sent), named as _fix_param_name_to_vllm names them."""
    from trl.generation.vllm_generation import VLLMGeneration

    single = re.sub(r"\s+", " ", _src(GRPOTrainer._generate_single_turn))
    assert "if self.state.global_step != self._last_loaded_step:" in single
    assert "self.vllm_generation.sync_weights()" in single
    assert "self._last_loaded_step = -1" in _src(GRPOTrainer.__init__)
    sync = re.sub(r"\s+", " ", _src(VLLMGeneration.sync_weights))
    push = getattr(VLLMGeneration, "_push_param_to_vllm", None)  # TRL 1.9: the colocate write in its own method
    assert ".model_runner.model.load_weights([(name, param)])" in sync or (
        push is not None and ".model_runner.model.load_weights([(name, param)])" in _src(push)
        and "self._push_param_to_vllm(" in _src(VLLMGeneration))
    assert "for name, param in self._iter_named_params():" in sync or \
        "self._fix_param_name_to_vllm(name)" in _src(VLLMGeneration)  # TRL 1.9's loop in sync_weights
    assert list(inspect.signature(VLLMGeneration._fix_param_name_to_vllm).parameters)[:2] == ["self", "name"]
    # a PEFT model (sync_check._peft_tensors): the adapters merged for the sync, the base names sent, the adapters'
    # own skipped; in _iter_named_params from TRL 1.11, in sync_weights before
    peft_path = re.sub(r"\s+", " ", _src(getattr(VLLMGeneration, "_iter_named_params", VLLMGeneration.sync_weights)))
    for line in ("model.merge_adapter()", 'name = name.removeprefix("base_model.model.").replace(".base_layer", "")',
                 "if model.prefix in name: continue", 'if "original_module" in name: continue',
                 'name = self._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])',
                 "model.unmerge_adapter()"):
        assert line in peft_path, line


def test_the_client_scoring_the_server_probe_reads():
    """server_probe.ServerProbe: TRL's client scores given sequences (sequences, prompt_lengths, top_logprobs,
    temperature) and returns each token's own log-prob as 'actual_logprobs' from prompt_length on; from TRL 1.11 as
    vLLM's prompt log-probs of a one-token completion request (TRL 1.9 - 1.10: TRL's own server endpoint)."""
    from trl.generation.vllm_client import VLLMClient

    params = list(inspect.signature(VLLMClient.get_sequence_logprobs).parameters)
    assert params[:5] == ["self", "sequences", "prompt_lengths", "top_logprobs", "temperature"]
    assert "actual_logprobs" in _src(VLLMClient)
    if TRL >= Version("1.11"):
        scoring = re.sub(r"\s+", " ", _src(VLLMClient.get_sequence_logprobs))
        for fragment in ('"max_tokens": 1', '"prompt_logprobs": top_logprobs', 'f"{self.base_url}/v1/completions"'):
            assert fragment in scoring, fragment
        fmt = re.sub(r"\s+", " ", _src(VLLMClient._format_sequence_logprobs))
        assert 'for position in range(prompt_length, len(choice["prompt_logprobs"])):' in fmt
        assert 'actual = position_logprobs.get(str(sequence[position]))' in fmt


@pytest.fixture(scope="module")
def batch_and_trainer(toy_model_path, tmp_path_factory):
    trainer = make_trainer(toy_model_path, tmp_path_factory.mktemp("guard"), max_steps=1, beta=0.04,
                           epsilon=0.1, delta=1.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; _compute_loss reads it
    prompts = synthetic_prompts(2)
    with torch.no_grad():
        batch = trainer._generate_and_score_completions(
            [{"prompt": p} for p in prompts for _ in range(trainer.num_generations)])
    mask = batch["completion_mask"].bool()
    g = torch.Generator().manual_seed(0)
    shape = mask.shape
    # Old and reference log-probs away from the current ones, so r = pi/pi_old spreads over the clip range.
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), shape[1])
    batch["old_per_token_logps"] = logps + 0.4 * torch.randn(shape, generator=g)
    batch["ref_per_token_logps"] = logps + 0.2 * torch.randn(shape, generator=g)
    # Advantages of both signs, and weights well away from 1 (0.2 .. 3), zero off the mask.
    batch["advantages"] = torch.randn(shape[0], generator=g)
    weights = torch.where(mask, 0.2 + 2.8 * torch.rand(shape, generator=g), torch.zeros(()))
    return trainer, batch, weights, mask


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_is_weights_route_equals_trls_vllm_product(batch_and_trainer, loss_type, level):
    trainer, batch, weights, mask = batch_and_trainer
    trainer.loss_type, trainer.importance_sampling_level = loss_type, level
    assert not trainer.use_vllm
    # Reference: TRL's own vLLM branch, its flags raised on this test trainer only, ratio 1 off the mask (TRL's
    # own ratio is exp(0) there).
    ref_inputs = copy.copy(batch)
    ref_inputs["importance_sampling_ratio"] = torch.where(mask, weights, torch.ones(()))
    flags = (trainer.use_vllm, trainer.vllm_importance_sampling_correction)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        ref_loss, ref_grads = _loss_and_grads(trainer, ref_inputs)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = flags
    plain_loss, _ = _loss_and_grads(trainer, copy.copy(batch))
    # The adapter's route, with TRL's flags as configured.
    ours = copy.copy(batch)
    saved = scale_policy_term(ours, weights, mask, trainer.loss_type)
    assert set(saved) == ({"importance_sampling_ratio", "advantages"} if loss_type == "vespo" else {"advantages"})
    loss, grads = _loss_and_grads(trainer, ours)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-7), (loss_type, level, float(loss), float(ref_loss))
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        # float32 rounding scales with the tensor's largest entries, not each element's own size (measured: 8.3e-7
        # at a largest |grad| of 3.5, TRL 1.9 luspo): relative to the tensor's scale
        err, scale = float((g - r).abs().max()), float(r.abs().max())
        assert err <= 1e-5 * scale + 1e-7, (loss_type, level, err, scale)
    # The weights matter here (the check above could not pass with weights ignored).
    assert abs(float(ref_loss) - float(plain_loss)) > 1e-3 * max(1.0, abs(float(plain_loss)))


def test_a_dropped_token_under_vespo_leaves_its_rows_other_tokens_trained(batch_and_trainer):
    """vespo folds its importance-sampling ratio into one weight per sequence, φ(w) with log w summed over the row: a
    0 handed through the ratio (a token the safe set or a dropping correction leaves out) would clamp log w to
    log 1e-8 and take the gradient of every token of the row. The route drops the token alone. The reference: a naive
    vespo loss built from TRL's own log-prob call and ``get_gamma_weights``, each row's φ over the kept tokens'
    positive weights (the dropped token's own π/π_old still in w), the dropped tokens' policy terms removed, TRL's
    k3 term kept (times π/π_old under ``use_bias_correction_kl``); its normaliser read off TRL's loss of the same batch without weights (the naive loss without
    weights must equal TRL's up to that one constant, value and gradients)."""
    trainer, batch, weights, mask = batch_and_trainer
    trainer.loss_type, trainer.importance_sampling_level = "vespo", "token"
    model, args = trainer.model, trainer.args
    adv = batch["advantages"].unsqueeze(1)
    drop = torch.zeros_like(mask)
    for i in range(mask.shape[0]):  # one token of every row with two or more
        where = mask[i].nonzero().flatten()
        if where.numel() >= 2:
            drop[i, where[where.numel() // 2]] = True
    assert drop.any()
    factor = torch.where(drop, torch.zeros(()), weights)

    def naive(kept: torch.Tensor, ratio):
        model.zero_grad(set_to_none=True)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), mask.shape[1])
        m = mask.float()
        phi = trainer.get_gamma_weights(
            advantages=adv, log_ratio_per_token=logps.detach() - batch["old_per_token_logps"], mask=m,
            importance_sampling_ratio=ratio, k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos,
            k_neg=args.vespo_k_neg, lambda_neg=args.vespo_lambda_neg)
        gap = batch["ref_per_token_logps"] - logps
        kl = torch.exp(gap) - gap - 1
        if getattr(args, "use_bias_correction_kl", False):  # TRL's KL term times π/π_old (from TRL 1.12)
            kl = kl * torch.exp(logps - batch["old_per_token_logps"])
        total = ((-phi * adv * logps * kept.float() + trainer.beta * kl) * m).sum()
        total.backward()
        return total.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    def close(a, b, scale=1.0):
        return all(float((x * scale - y).abs().max()) <= 1e-5 * float(y.abs().max()) + 1e-7 for x, y in zip(a, b))

    plain_loss, plain_grads = _loss_and_grads(trainer, copy.copy(batch))
    plain_sum, plain_sum_grads = naive(torch.ones_like(mask), None)
    normaliser = float(plain_sum) / float(plain_loss)
    assert normaliser > 0 and close(plain_sum_grads, plain_grads, 1 / normaliser)

    ours = copy.copy(batch)
    saved = scale_policy_term(ours, factor, mask, "vespo")
    assert set(saved) == {"importance_sampling_ratio", "advantages"}
    loss, grads = _loss_and_grads(trainer, ours)
    want_sum, want_grads = naive(~drop, torch.where(mask & ~drop, weights, torch.ones(())))
    assert abs(float(loss) - float(want_sum) / normaliser) <= 1e-5 * abs(float(loss)) + 1e-7
    assert len(grads) == len(want_grads) and close(want_grads, grads, 1 / normaliser)
    # The check tells the routes apart: the ratio carrying the 0 (the row's φ at 2e-15) trains another loss.
    through_ratio = copy.copy(batch)
    through_ratio["importance_sampling_ratio"] = torch.where(mask, factor, torch.ones(()))
    old_loss, _ = _loss_and_grads(trainer, through_ratio)
    assert abs(float(old_loss) - float(loss)) > 1e-3 * max(1.0, abs(float(loss)))


def test_the_logits_route_module_is_the_one_whose_call_names_the_global(monkeypatch):
    """TRL 1.9 - 1.13's log-prob call looks ``selective_log_softmax`` up in its module's globals. A user's subclass
    that overrides the call and passes it on with ``super()`` (in a module without that global), or wraps it with
    functools.wraps, leaves the lookup in the base's module: that module is the one the stand-in patches, not the
    subclass's (which has nothing to patch)."""
    import functools
    import types

    base = types.ModuleType("fake_grpo_trainer")
    exec("def selective_log_softmax(logits, index):\n    return logits\n"
         "class Trainer:\n"
         "    def _get_per_token_logps_and_entropies(self, model, input_ids):\n"
         "        return selective_log_softmax(input_ids, None)\n", base.__dict__)
    user = types.ModuleType("fake_user_trainer")
    user.Base, user.functools = base.Trainer, functools
    exec("class Mine(Base):\n"
         "    def _get_per_token_logps_and_entropies(self, *args, **kwargs):\n"
         "        return super()._get_per_token_logps_and_entropies(*args, **kwargs)\n"
         "def logged(f):\n"
         "    @functools.wraps(f)\n"
         "    def inner(*a, **k):\n"
         "        return f(*a, **k)\n"
         "    return inner\n"
         "class Wrapped(Mine):\n"
         "    _get_per_token_logps_and_entropies = logged(Mine._get_per_token_logps_and_entropies)\n",
         user.__dict__)
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    for cls in (base.Trainer, user.Mine, user.Wrapped):
        assert features.logits_route_module(cls()) is base, cls
    # a class rebuilt into a namespace that is no module: nothing to patch (the check refuses the route)
    ghost = {"__name__": "not_a_module"}
    exec("def selective_log_softmax(l, i):\n    return l\n"
         "class Ghost:\n"
         "    def _get_per_token_logps_and_entropies(self, model, input_ids):\n"
         "        return selective_log_softmax(input_ids, None)\n", ghost)
    assert features.logits_route_module(ghost["Ghost"]()) is None
