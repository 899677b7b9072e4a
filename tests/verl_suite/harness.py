"""Test helper: verl 0.9.1's FSDP2 engine on CPU (world size 1 or 2, gloo), built from verl's own dataclasses and
driven like ``TrainingWorker`` does (infer_batch / train_batch / lr_scheduler_step with ``partial(ppo_loss)``)."""

from __future__ import annotations

import os
from functools import partial

# tests/verl_suite/conftest.py has registered and selected the CPU platform before anything imported verl's engines.
import torch  # noqa: E402


def init_dist(rank: int = 0, world: int = 1, port: int = 29561) -> None:
    if torch.distributed.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def build_engine(model_path: str, *, remove_padding: bool = True, optimizer_impl: str = "torch.optim",
                 optimizer: str = "AdamW", lr: float = 1e-3, dtype: str = "fp32", total_steps: int = 10,
                 engine_cls: type | None = None, fused: bool = False, strategy: str = "fsdp2", lora_rank: int = 0):
    """The engine verl's registry picks (ours, once the plugin is loaded), or ``engine_cls`` built the same way;
    ``strategy``: verl's ``actor.strategy``, "fsdp2" or "fsdp" (FSDP1); ``lora_rank`` > 0: a LoRA actor (verl's
    ``model.lora_rank``, every linear layer)."""
    import tim_plugins.integrations.verl.plugin  # noqa: F401  (registrations, as the entry point does)
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig
    from verl.workers.config.engine import FSDPEngineConfig
    from verl.workers.config.optimizer import FSDPOptimizerConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=str(model_path), use_remove_padding=remove_padding,
                                 enable_gradient_checkpointing=False,
                                 override_config={"attn_implementation": "sdpa"}, use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": "torch"} if fused else {},
                                 **({"lora_rank": lora_rank, "lora_alpha": 2 * lora_rank,
                                     "target_modules": "all-linear"} if lora_rank else {}))
    mp = {"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(strategy=strategy, use_torch_compile=False, mixed_precision=mp,
                                     micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
    engine_config.use_remove_padding = remove_padding
    optim_config = FSDPOptimizerConfig(lr=lr, optimizer_impl=optimizer_impl, optimizer=optimizer,
                                       total_training_steps=total_steps, clip_grad=1.0)
    model_config.model_type = "language_model"
    engine_cls = engine_cls or EngineRegistry.get_engine_cls("language_model", strategy)
    engine = engine_cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim_config,
                        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def make_batch(vocab: int, *, batch: int = 4, prompt: int = 5, response: int = 7, seed: int = 0,
               rollout_noise: float = 0.05, temperature: float = 1.0, rows: slice | None = None,
               padding_samples: int = 0):
    """A left/right padded verl batch (as after rollout) converted the way ray_trainer does for the engine; its
    last ``padding_samples`` rows as verl's synthetic padding samples (one response token, response mask all zero:
    verl.trainer.ppo.padding_utils). Returns (TensorDict for the engine, dict of the padded tensors)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (batch, prompt), generator=g)
    responses = torch.randint(3, vocab, (batch, response), generator=g)
    attn = torch.ones(batch, prompt + response, dtype=torch.long)
    resp_mask = torch.ones(batch, response, dtype=torch.long)
    for i in range(batch):  # left-pad prompts, right-pad responses by row-dependent amounts
        attn[i, : i % 3] = 0
        cut = response - (i % 4)
        attn[i, prompt + cut:] = 0
        resp_mask[i, cut:] = 0
    if batch > 1:
        resp_mask[-1, 1:] = 0  # an almost empty response
        attn[-1, prompt + 1:] = 0
    for i in range(batch - padding_samples, batch):
        attn[i] = 0
        attn[i, : prompt + 1] = 1
        resp_mask[i] = 0
    input_ids = torch.cat([prompts, responses], dim=1) * attn
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    rollout_lp = -torch.rand(batch, response, generator=g) * 3 - rollout_noise
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attn,
        "position_ids": position_ids, "response_mask": resp_mask, "rollout_log_probs": rollout_lp,
        "advantages": torch.randn(batch, response, generator=g),
    }
    if rows is not None:
        tensors = {k: v[rows] for k, v in tensors.items()}
    dp = DataProto.from_single_dict({k: v.clone() for k, v in tensors.items()})
    td = left_right_2_no_padding(dp.to_tensordict())
    tu.assign_non_tensor(td, temperature=temperature)
    return td, tensors


def infer(engine, td, *, use_remove_padding: bool = True, fused: bool = False):
    from verl.utils import tensordict_utils as tu

    td = td.copy()
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, max_token_len_per_gpu=4096, use_fused_kernels=fused,
                         calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        out = engine.infer_batch(td, loss_function=None)
    return out


def old_log_probs_padded(out, td):
    """[B, R] response log-probs from the engine output (as verl's trainer extracts old_log_probs)."""
    from verl.workers.utils.padding import no_padding_2_padding

    lp = out["model_output"]["log_probs"]
    return no_padding_2_padding(lp, td)


def train_step(engine, td, old_log_probs, *, use_remove_padding: bool = True, actor_overrides: dict | None = None,
               fused: bool = False):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    td = td.copy()
    if td["response_mask"].is_nested and not old_log_probs.is_nested:  # V1 layout: responses are ragged rows
        old_log_probs = response_nested(old_log_probs, td)
    td["old_log_probs"] = old_log_probs
    cfg = {"strategy": "fsdp2", "rollout_n": 1, "ppo_micro_batch_size_per_gpu": 2, "ppo_mini_batch_size": 4,
           "use_dynamic_bsz": False, **(actor_overrides or {})}
    actor_config = FSDPActorConfig(**cfg)
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, max_token_len_per_gpu=4096, use_fused_kernels=fused,
                         calculate_entropy=False, global_batch_size=td.batch_size[0])
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=partial(ppo_loss, config=actor_config))
        lr = engine.lr_scheduler_step()
    return out, lr


def to_v1_layout(raw: dict, *, temperature: float = 1.0, extra_fields: list[dict] | None = None):
    """The same batch in the layout verl's V1 trainer hands the engine: one ragged (nested jagged) row per sample,
    as the agent loop stores samples in TransferQueue (trainer/ppo/v1/agent_loop_tq.py) and verl batches them
    (``list_of_dict_to_tensordict``); no ``max_response_len`` and no dense padding. ``extra_fields``: one dict per
    sample, the agent loop's per-sample ``extra_fields`` field (the rollout server's ``TokenOutput.extra_fields``)."""
    from verl.utils import tensordict_utils as tu

    prompt_width = raw["prompts"].shape[1]
    rows = []
    for i in range(raw["input_ids"].shape[0]):
        keep = raw["attention_mask"][i].bool()
        p_keep, r_keep = keep[:prompt_width], keep[prompt_width:]
        prompts, responses = raw["prompts"][i][p_keep], raw["responses"][i][r_keep]
        n = int(r_keep.sum())
        rows.append({
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses]),
            "position_ids": torch.arange(len(prompts) + n),
            "response_mask": raw["response_mask"][i][:n].clone(), "loss_mask": raw["response_mask"][i][:n].clone(),
            "rollout_log_probs": raw["rollout_log_probs"][i][:n].clone(), "advantages": raw["advantages"][i][:n].clone(),
        })
        if extra_fields is not None:
            rows[-1]["extra_fields"] = extra_fields[i]
    td = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(td, temperature=temperature)
    return td


def response_nested(values: torch.Tensor, td) -> torch.Tensor:
    """[B, R] padded response values as the ragged rows of ``td``'s responses (V1 layout)."""
    from verl.workers.utils.padding import response_to_nested

    return response_to_nested(values, td["response_mask"])


class Rollout:
    """The rollout engine of the weight-sync check's engine-level tests: a transformers copy of the model on random
    weights (verl starts its vLLM rollout on dummy weights, ``load_format=dummy``) in ``dtype``, loaded by name from
    the actor engine's ``get_per_tensor_param`` stream, as verl's ``update_weights`` does; ``skip``: a name prefix the
    load drops (the broken sync). Read with the vLLM reader (``VLLMWeights``), which reads a plain module directly."""

    def __init__(self, model_path: str, seed: int = 0, dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(seed)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.streamed: list[str] = []

    def reader(self):
        from tim_plugins.integrations.vllm.weights import VLLMWeights

        return VLLMWeights(self.model, self.dtype)

    async def load(self, engine, skip: str | None):
        """What verl's update_weights does with the stream, as one awaitable: every tensor written in place."""
        weights, peft = engine.get_per_tensor_param()
        assert peft is None
        self.streamed = []
        with torch.no_grad():
            for name, tensor in weights:
                self.streamed.append(name)
                if skip is None or not name.startswith(skip):
                    self.params[name].copy_(tensor)


def worker_read(rollout: Rollout):
    """``read(requests)`` of ``rollout`` as the vLLM server answers the sync check: one worker's answer, through JSON
    as it crosses msgpack and Ray."""
    import json

    from tim_plugins.integrations.vllm.worker_reads import read_requests

    async def read(requests):
        return [json.loads(json.dumps(read_requests(rollout.reader(), requests)))]

    return read


def checked_sync(engine, rollout: Rollout, step: int, skip: str | None = None):
    """One weight sync of ``engine`` into ``rollout`` through the engine's ``SyncWatch.around``, as verl's worker
    drives it (``read``: ``worker_read``; one rank). Returns the sync's report, None when the sync was not checked."""
    import asyncio

    watch = engine.tim_sync_watch
    before = len(watch.check.reports)

    async def gather(reports):
        return reports, True

    asyncio.run(watch.around(step, lambda: rollout.load(engine, skip), worker_read(rollout), gather))
    return watch.check.reports[before] if len(watch.check.reports) > before else None


def assert_left_out_layer_named_stale(report, rollout: Rollout, first: list, layer: list, synced: dict,
                                      actor: dict) -> None:
    """A later checked sync whose export left out ``layer`` (names the ``first`` checked sync streamed): the copy
    still holds ``synced`` (the first sync's values) while the actor's ``actor`` moved, and the report names exactly
    that layer stale, each tensor marked never sent (the FSDP and the Megatron suites' export tests)."""
    assert len(layer) >= 9 and rollout.streamed == [n for n in first if n not in layer]
    assert all(torch.equal(rollout.params[n].detach(), synced[n])
               and not torch.equal(synced[n], actor[n].to(synced[n].dtype)) for n in layer)
    assert report.not_sent == layer and report.names("stale") == layer
    assert {n for n, s in report.statuses.items() if s != "ok"} == set(layer)
    assert [c.code for c in report.causes] == ["sync-tensors-stale"]
    assert set(report.causes[0].tensors) == set(layer) and f"{len(layer)} of them never sent" in \
        report.causes[0].message


def recording_ppo_loss(config, calls: list):
    """verl's ``ppo_loss`` with the actor ``config`` (FSDP's or Megatron's), recording each call's (current, old,
    rollout, mask) response-aligned, in float64: what verl's loss was handed. Either engine's call form (Megatron
    passes the output and the data positionally)."""
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from tim_plugins.integrations.verl.micro_batch import padded_response

    verl_loss = partial(ppo_loss, config=config)

    def loss(model_output, data, dp_group=None):
        current = no_padding_2_padding(model_output["log_probs"], data).detach().double()
        w = current.shape[1]
        calls.append((current, padded_response(data["old_log_probs"], w).double(),
                      padded_response(data["rollout_log_probs"], w).double(),
                      padded_response(data["response_mask"], w).bool()))
        return verl_loss(model_output=model_output, data=data, dp_group=dp_group)

    return loss
