"""vLLM's per-token kept sets carried by verl's vLLM rollout server (``integrations/verl/rollout.py``).

verl's own ``vLLMHttpServer.generate`` runs unchanged (the subclass calls it through ``super()``), on a server object
whose attributes are set by hand (its ``__init__`` starts Ray and a vLLM engine) and an engine stand-in: the only
stand-in here, a minimal async generator in place of vLLM's ``AsyncLLM.generate`` (the CPU build refuses
``return_sampling_mask``: Model Runner V2 needs Triton), yielding vLLM's own ``RequestOutput`` /
``CompletionOutput`` / ``SamplingMask`` objects as AsyncLLM does (intermediate outputs, then the final one carrying
the mask). The registration is checked on the registry verl's trainer reads, in this process (the plugin loads on
``import verl``).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tim_plugins.capabilities import check  # noqa: E402
from tim_plugins.integrations.verl import features  # noqa: E402
from tim_plugins.integrations.verl.sources import VERL_SOURCES  # noqa: E402
from tim_plugins.replay import KeptSets  # noqa: E402


class _Engine:
    """Stand-in for AsyncLLM.generate: yields one RequestOutput per token, the last one finished and (when given)
    carrying the mask, as vLLM attaches it to the finished output only."""

    def __init__(self, token_ids, mask_lists=None):
        self.token_ids, self.mask_lists, self.calls = list(token_ids), mask_lists, []

    async def generate(self, prompt, sampling_params, request_id, lora_request=None, priority=0):
        from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask

        self.calls.append((prompt, sampling_params, request_id))
        n = len(self.token_ids)
        for i in range(1, n + 1):
            last = i == n
            mask = SamplingMask(token_ids=self.mask_lists) if last and self.mask_lists is not None else None
            comp = CompletionOutput(index=0, text="", token_ids=self.token_ids[:i], cumulative_logprob=None,
                                    logprobs=None, finish_reason="length" if last else None, sampling_mask=mask)
            yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt["prompt_token_ids"]),
                                prompt_logprobs=None, outputs=[comp], finished=last)
            await asyncio.sleep(0)


def _server(engine):
    """A TIMvLLMHttpServer with the attributes verl's generate reads (its __init__ needs Ray and a vLLM engine)."""
    from tim_plugins.integrations.verl.rollout import TIMvLLMHttpServer

    server = object.__new__(TIMvLLMHttpServer)
    server.config = OmegaConf.create({
        "max_model_len": 64, "response_length": 16, "prompt_length": 16, "repetition_penalty": 1.0,
        "ignore_eos": False, "full_determinism": False, "seed": 0, "enable_rollout_routing_replay": False,
        "mtp": None})
    server.model_config = OmegaConf.create({"processor": None, "lora_rank": 0, "lora": {}})  # no LoRA adapter
    server._disaggregation_role = "null"
    server._pd_decode_peers = []
    server._submission_paused, server._rejecting, server._admitting = False, False, 0
    server.replica_rank, server.global_steps = 0, 3
    server._warned_missing_spec_decode_stats = False
    server.engine = engine
    return server


def _generate(server, request_id, prompt=(1, 2, 3)):
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False}
    return asyncio.run(server.generate(prompt_ids=list(prompt), sampling_params=params, request_id=request_id))


def test_the_feature_holds_and_names_only_guarded_sources():
    status = check(features.ROLLOUT_KEPT_SETS)
    assert status.available, status.warning()
    assert all((h.module, h.qualname) in VERL_SOURCES for h in features.ROLLOUT_KEPT_SETS.hooks)
    # kept out of FEATURES: the actor workers check those on every import verl, and these hooks import vLLM
    assert features.ROLLOUT_KEPT_SETS not in features.FEATURES


def test_the_plugin_registers_the_kept_set_replica_under_vllm():
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from tim_plugins.integrations.verl import plugin
    from tim_plugins.integrations.verl.rollout import TIMvLLMHttpServer, TIMvLLMReplica

    assert plugin.REGISTERED["rollout_loader"] is not None
    cls = RolloutReplicaRegistry.get("vllm")
    assert cls is TIMvLLMReplica and issubclass(cls, vLLMReplica)  # the kept sets and the sync reads
    assert issubclass(TIMvLLMHttpServer, vLLMHttpServer) and TIMvLLMReplica.SERVER is TIMvLLMHttpServer


def test_generate_returns_the_engine_kept_sets_packed():
    lists = [[5, 9, 2], [7], [1, 3, 4, 8]]
    engine = _Engine([9, 7, 4], lists)
    server = _server(engine)
    out = _generate(server, "req-a")
    assert list(out.token_ids) == [9, 7, 4] and out.stop_reason == "completed"
    assert out.extra_fields["global_steps"] == 3  # verl's own fields untouched
    packed = out.extra_fields["tim_kept_sets"]
    assert packed["ids"].dtype == np.int32 and packed["offsets"].dtype == np.int64
    np.testing.assert_array_equal(packed["offsets"], [0, 3, 4, 8])
    np.testing.assert_array_equal(packed["ids"], [5, 9, 2, 7, 1, 3, 4, 8])
    assert KeptSets.from_csr(packed["ids"], packed["offsets"]).to_lists() == lists
    # verl's generate reached the engine with vLLM's SamplingParams and the request id
    from vllm import SamplingParams

    assert isinstance(engine.calls[0][1], SamplingParams) and engine.calls[0][2] == "req-a"
    assert server._tim_masks == {}  # popped: nothing accumulates over requests
    # the wrapper is installed once, on this engine instance only
    wrapped = engine.generate
    out2 = _generate(server, "req-b")
    assert engine.generate is wrapped and "tim_kept_sets" in out2.extra_fields
    assert "generate" not in vars(_Engine([1]))


def test_inert_without_a_mask_and_with_a_mask_that_does_not_line_up():
    out = _generate(_server(_Engine([4, 5])), "req-c")
    assert "tim_kept_sets" not in out.extra_fields and list(out.token_ids) == [4, 5]
    # one set fewer than tokens: not placeable, so nothing is carried (the trainer recomputes)
    out = _generate(_server(_Engine([4, 5], [[4, 1]])), "req-d")
    assert "tim_kept_sets" not in out.extra_fields


def test_two_servers_keep_their_own_masks():
    a, b = _server(_Engine([1, 2], [[1], [2, 3]])), _server(_Engine([6], [[6, 0]]))

    async def both():
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False}
        return await asyncio.gather(a.generate([1], dict(params), "same-id"), b.generate([1], dict(params), "same-id"))

    out_a, out_b = asyncio.run(both())
    assert KeptSets.from_csr(**out_a.extra_fields["tim_kept_sets"]).to_lists() == [[1], [2, 3]]
    assert KeptSets.from_csr(**out_b.extra_fields["tim_kept_sets"]).to_lists() == [[6, 0]]
    assert torch.equal(KeptSets.from_csr(**out_b.extra_fields["tim_kept_sets"]).sizes, torch.tensor([2]))


def test_the_loader_drops_the_kept_sets_alone_when_their_hook_moved(monkeypatch, capsys):
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from tim_plugins.integrations.verl import plugin
    from tim_plugins.integrations.verl.rollout import TIMSyncReadsReplica

    async def generate(self, prompt_ids, sampling_params):  # request_id gone
        raise AssertionError("never called")

    monkeypatch.setattr(vLLMHttpServer, "generate", generate)
    cls = plugin._vllm_replica_loader()
    assert cls is TIMSyncReadsReplica and issubclass(cls, vLLMReplica)
    assert cls.SERVER.generate is generate  # verl's generate (here the changed one), not the kept-set wrapper
    err = capsys.readouterr().err
    assert "verl_rollout_kept_sets" in err and "takes no request_id" in err

    # the sync reads' hook moved too: verl's own replica
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        raise AssertionError("never called")

    monkeypatch.setattr(vLLMHttpServer, "collective_rpc", collective_rpc)
    assert plugin._vllm_replica_loader() is vLLMReplica
    assert "verl_rollout_sync_reads" in capsys.readouterr().err


def test_the_driver_reads_whether_the_run_asks_vllm_for_its_sets():
    from tim_plugins.integrations.verl.composed import asks_sampling_mask as _asks_sampling_mask

    def cfg(name, vllm):
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": name, "engine_kwargs": {"vllm": vllm}}}})

    assert _asks_sampling_mask(cfg("vllm", {"return_sampling_mask": True}))
    assert _asks_sampling_mask(cfg("vllm", {"return_sampling_mask": "true"}))  # as a CLI override may arrive
    assert not _asks_sampling_mask(cfg("vllm", {}))
    assert not _asks_sampling_mask(cfg("vllm", None))
    assert not _asks_sampling_mask(cfg("sglang", {"return_sampling_mask": True}))
