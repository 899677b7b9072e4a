"""Guards on the verl 0.9.1 internals the verl adapter relies on (``integrations/verl/sources.py`` ``VERL_SOURCES``).

Every entry resolves; each assumption is checked against the installed verl: signatures the overrides bind,
statements in the source (``inspect.getsource``), and behaviour where it is cheap (the small functions run on
tensors, the registries and the trainer-mode lookup). A failure names the entry to revisit. The engine's numerics
against stock verl and against the core formulas are tested end to end in ``test_verl_engine.py``, the trainer and
workers in ``test_verl_config.py`` and ``test_verl_main_ppo.py``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import sys
import types

import pytest

pytest.importorskip("verl")

import harness as H  # noqa: E402
import torch  # noqa: E402

from tim_plugins.integrations.verl.sources import (  # noqa: E402
    VERL_CONFIG_KEYS,
    VERL_MEGATRON_CONFIG_KEYS,
    VERL_OPTIONAL_CONFIG_KEYS,
    VERL_SOURCES,
)
from upstream import flat as _flat  # noqa: E402
from upstream import resolve as _resolve  # noqa: E402
from upstream import source as _src  # noqa: E402

TI = "verl.workers.engine.fsdp.transformer_impl"
TB = "verl.trainer.ppo.v1.trainer_base"


def _params(module: str, qualname: str) -> list[str]:
    """The callable's parameters as written; ``_ray_trace_ctx`` is Ray's, added to a class's methods once any test in
    the process made the class an actor (ray.actor's tracing injection), not verl's."""
    return [p for p in inspect.signature(_resolve(module, qualname)).parameters if p != "_ray_trace_ctx"]


@pytest.mark.parametrize("key", sorted(VERL_SOURCES), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_named_source_exists(key):
    module, qualname = key
    assert _resolve(module, qualname) is not None, f"{module}:{qualname} is gone: revisit VERL_SOURCES"


# ------------------------------------------------------------------------------------------------ actor engine
def test_engine_class_and_the_attributes_the_engine_reads():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

    from tim_plugins.integrations.verl.engine import TIMFSDPEngineWithLMHead

    assert issubclass(TIMFSDPEngineWithLMHead, FSDPEngineWithLMHead)
    init = _src(TI, "FSDPEngine.__init__")
    assert "self.model_config = model_config" in init and "self.engine_config = engine_config" in init
    assert "self.optimizer = optimizer" in _src(TI, "FSDPEngine")
    from verl.workers.config import HFModelConfig
    from verl.workers.config.engine import FSDPEngineConfig

    assert "use_fused_kernels" in HFModelConfig.__dataclass_fields__
    assert "use_fused_kernels" in FSDPEngineConfig.__dataclass_fields__
    # The five overrides exist on the parent with the signatures the subclass keeps.
    for name, params in (("prepare_model_outputs", ["self", "output", "output_args", "micro_batch",
                                                    "logits_processor_func"]),
                         ("forward_step", ["self", "micro_batch", "loss_function", "forward_only"]),
                         ("forward_backward_batch", ["self", "data", "loss_function", "forward_only"]),
                         ("train_batch", ["self", "data", "loss_function"]),
                         ("lr_scheduler_step", ["self"])):
        assert list(inspect.signature(getattr(FSDPEngineWithLMHead, name)).parameters) == params, name
        assert list(inspect.signature(getattr(TIMFSDPEngineWithLMHead, name)).parameters) == params, name
    assert inspect.signature(FSDPEngine.forward_backward_batch).parameters["forward_only"].default is False


def test_prepare_model_inputs_fills_the_output_args_the_engine_reads():
    src = _src(TI, "FSDPEngineWithLMHead.prepare_model_inputs")
    assert 'output_args = {"temperature_is_one": temperature_is_one}' in src
    assert "temperature_is_one = _is_scalar_unit_temperature(temperature)" in src
    for stmt in ('output_args["pad_size"] = static_pad_size + sp_pad_size',
                 'output_args["input_ids_rmpad_rolled"] = input_ids_rmpad_rolled',
                 'output_args["temperature_rmpad"] = temperature_rmpad',
                 'output_args["temperature"] = temperature'):
        assert stmt in src, stmt
    # packed labels: the sequence rolled by one
    assert "input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1)" in src
    assert "input_ids_rmpad_rolled = torch.roll(input_ids.values(), shifts=-1, dims=0)" in src


def test_prepare_model_outputs_as_the_safe_vocab_override_rebuilds_it():
    src = _flat(_src(TI, "FSDPEngineWithLMHead.prepare_model_outputs"))
    for key, default in (("use_remove_padding", "True"), ("use_fused_kernels", "False"),
                         ("calculate_entropy", "False")):
        assert f'tu.get_non_tensor_data(data=micro_batch, key="{key}", default={default})' in src, key
    assert 'temperature_is_one = output_args.get("temperature_is_one", False)' in src
    # packed path
    assert 'input_ids_rmpad_rolled = output_args["input_ids_rmpad_rolled"]' in src
    assert 'temperature_rmpad = output_args["temperature_rmpad"]' in src
    assert "logits_rmpad = output.logits.squeeze(0)" in src
    assert "if isinstance(logits_rmpad, DTensor): logits_rmpad = logits_rmpad.full_tensor()" in src
    assert ("logits_rmpad = _scale_logits_by_temperature( logits_rmpad, temperature_rmpad.unsqueeze(-1), "
            "is_unit_temperature=temperature_is_one, )") in src
    assert "logprobs_from_logits( logits=logits_rmpad, labels=input_ids_rmpad_rolled," in src
    assert 'pad_size = output_args["pad_size"]' in src
    assert "log_probs = self._gather_and_unpad_packed(log_probs, pad_size)" in src
    assert "cu_seqlens = input_ids.offsets()" in src and 'input_ids = micro_batch["input_ids"]' in src
    assert "log_probs = torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)" in src
    # padded path
    assert 'logits = output.logits # (bsz, response_length, vocab_size)' in src
    assert 'temperature = output_args["temperature"] # (bsz,)' in src
    assert "temperature = temperature.unsqueeze(-1).unsqueeze(-1)" in src
    assert "seq_lengths = cu_seqlens.diff()" in src
    assert "logits = torch.nested.narrow(logits, 1, starts, seq_lengths, layout=torch.jagged)" in src
    assert "logits_rmpad = torch.cat([t for t in logits.unbind()])" in src
    # fused kernels: log-probs from the model, no logits
    assert "log_probs = output.log_probs.squeeze(0)" in src
    # the outputs the override replaces, and output.logits never written (the override rescales it itself)
    assert 'model_output["log_probs"] = log_probs' in src and 'model_output["entropy"] = entropy' in src
    assert "output.logits =" not in src and "output.logits.div_" not in src
    # the distillation call of the loss function (the boundary-mask wrapper passes it through)
    assert "logits_processor_func(student_logits=logits_rmpad.unsqueeze(0), data=micro_batch)" in src


def test_scale_logits_by_temperature_is_out_of_place():
    from verl.workers.engine.fsdp.transformer_impl import _scale_logits_by_temperature

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    before = logits.clone()
    temps = torch.tensor([0.7, 1.0, 1.3, 0.0, 2.0]).unsqueeze(-1)
    out = _scale_logits_by_temperature(logits, temps, is_unit_temperature=False)
    assert torch.equal(logits, before)  # out of place: the caller's output.logits stay raw
    assert torch.equal(out, before / temps.clamp(min=1e-8))
    assert _scale_logits_by_temperature(logits, temps, is_unit_temperature=True) is logits


def test_gather_and_unpad_packed_drops_the_tail_without_sp():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    src = _src(TI, "FSDPEngine._gather_and_unpad_packed")
    assert "gather_outputs_and_unpad(tensor, gather_dim=0, unpad_dim=0, padding_size=pad_size)" in src
    assert _params(TI, "FSDPEngine._gather_and_unpad_packed") == ["self", "tensor", "pad_size"]
    x = torch.arange(10.0)
    no_sp = types.SimpleNamespace(use_ulysses_sp=False)
    assert torch.equal(FSDPEngine._gather_and_unpad_packed(no_sp, x, 3), x[:7])
    assert FSDPEngine._gather_and_unpad_packed(no_sp, x, 0) is x


def test_forward_step_calls_the_hooks_on_the_same_micro_batch():
    src = _flat(_src(TI, "FSDPEngineWithLMHead.forward_step"))
    assert ("model_output = self.prepare_model_outputs( output=raw_output, output_args=output_args, "
            "micro_batch=micro_batch, logits_processor_func=loss_function )") in src
    assert ("loss, metrics = loss_function( model_output=model_output, data=micro_batch, "
            "dp_group=self.get_data_parallel_group() )") in src
    assert src.index("self.prepare_model_outputs(") < src.index("loss_function( model_output=")
    assert '"model_output": detach_tree(model_output),' in src and "return loss, output" in src


def test_forward_backward_batch_normalises_before_the_micro_batches():
    src = _flat(_src(TI, "FSDPEngine.forward_backward_batch"))
    assert 'batch_num_tokens = data["loss_mask"].sum()' in src
    assert "tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())" in src
    loop = src.index("for micro_batch_idx, micro_batch in enumerate(micro_batches):")
    assert src.index('data["loss_mask"].sum()') < loop
    assert ("self.forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)"
            in src[loop:])
    # the V1 batch's loss mask is its response mask as it arrives (left_right_2_no_padding)
    assert 'data["loss_mask"] = data["response_mask"]' in _src("verl.workers.utils.padding",
                                                                 "left_right_2_no_padding")


def test_train_and_infer_batch_are_the_base_engines():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

    for cls in (FSDPEngine, FSDPEngineWithLMHead):
        assert "train_batch" not in vars(cls) and "infer_batch" not in vars(cls), cls
    train = _src("verl.workers.engine.base", "BaseEngine.train_batch")
    zero, fb, step = (train.index(s) for s in ("self.optimizer_zero_grad()",
                                               "self.forward_backward_batch(data, loss_function, forward_only=False)",
                                               "self.optimizer_step()"))
    assert zero < fb < step
    infer = _src("verl.workers.engine.base", "BaseEngine.infer_batch")
    assert "with torch.no_grad():" in infer
    assert "self.forward_backward_batch(data, loss_function, forward_only=True)" in infer


def test_lr_scheduler_step_returns_the_first_groups_lr():
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=4)
    engine = types.SimpleNamespace(lr_scheduler=sched)
    lrs = []
    for _ in range(5):
        opt.step()
        lrs.append(FSDPEngine.lr_scheduler_step(engine))
    assert lrs == pytest.approx([0.5 * min(1.0, s / 4) for s in range(1, 6)])


def test_lr_scheduler_rewrites_the_lr_written_from_outside():
    """optim.py's reason to scale inside step(): verl's LambdaLR sets every group's lr on each step."""
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    src = _src(TI, "FSDPEngine._build_lr_scheduler")
    assert "get_constant_schedule_with_warmup(optimizer=optimizer" in src
    assert "get_cosine_schedule_with_warmup(" in src
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    opt.step()
    sched.step()
    expected = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 123.0
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] < expected  # the schedule's next value, not 123


def test_data_parallel_group_without_sp_is_the_world():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert FSDPEngine.get_data_parallel_group(types.SimpleNamespace(ulysses_device_mesh=None)) is \
        torch.distributed.group.WORLD
    assert 'get_group(mesh_dim="dp")' in _src(TI, "FSDPEngine.get_data_parallel_group")


def test_training_worker_steps_the_scheduler_after_the_last_mini_batch():
    mini = _flat(_src("verl.workers.engine_workers", "TrainingWorker.train_mini_batch"))
    assert "update_lr_scheduler=batch_idx == total_num_iterations - 1," in mini
    assert "actor_output = self.train_batch(mini_batch_td)" in mini
    train = _flat(_src("verl.workers.engine_workers", "TrainingWorker.train_batch"))
    call = train.index("output = self.engine.train_batch(data, loss_function=self.loss_fn)")
    lr = train.index("if update_lr_scheduler: lr = self.engine.lr_scheduler_step()")
    assert call < lr
    assert 'output["metrics"]["lr"] = lr' in train
    assert "use_remove_padding=self.model_config.get(" in train and \
        "use_fused_kernels=self.engine_config.use_fused_kernels," in train


def test_the_reference_of_a_lora_actor_is_scored_inside_the_engines_disable_adapter():
    """verl's worker runs the reference pass of a LoRA actor (``no_lora_adapter``) inside ``engine.disable_adapter()``
    and calls it nowhere else on the actor; the tim engine's override keeps the parent's signature."""
    from verl.workers.engine.base import BaseEngine

    from tim_plugins.integrations.verl.engine import TIMFSDPEngineWithLMHead

    infer = _flat(_src("verl.workers.engine_workers", "TrainingWorker.infer_batch"))
    assert 'no_lora_adapter = tu.pop(data, key="no_lora_adapter", default=False)' in infer
    assert "adapter_ctx = self.engine.disable_adapter() if no_lora_adapter else nullcontext()" in infer
    assert infer.index("with adapter_ctx:") < infer.index("output = self.engine.infer_batch(data, loss_function")
    assert 'metadata["no_lora_adapter"] = True' in _src(TB, "PPOTrainer._compute_ref_log_prob")
    assert list(inspect.signature(BaseEngine.disable_adapter).parameters) == ["self"]
    assert list(inspect.signature(TIMFSDPEngineWithLMHead.disable_adapter).parameters) == ["self"]


def test_get_non_tensor_data_unwraps_and_defaults():
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    assert _params("verl.utils.tensordict_utils", "get_non_tensor_data") == ["data", "key", "default"]
    td = TensorDict({"x": torch.zeros(2, 1)}, batch_size=[2])
    tu.assign_non_tensor(td, calculate_entropy=True, use_remove_padding=False)
    assert tu.get_non_tensor_data(data=td, key="calculate_entropy", default=False) is True
    assert tu.get_non_tensor_data(data=td, key="use_remove_padding", default=True) is False
    assert tu.get_non_tensor_data(data=td, key="use_fused_kernels", default="absent") == "absent"


def test_distillation_loss_settings_say_which_losses_read_the_top_k():
    """What the driver's check of the safe vocabulary on a Megatron actor reads (composed._topk_distillation)."""
    from omegaconf import OmegaConf
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    from tim_plugins.integrations.verl.composed import _topk_distillation

    assert get_distillation_loss_settings("forward_kl_topk").use_topk is True
    assert get_distillation_loss_settings("k3").use_topk is False
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        get_distillation_loss_settings("no_such_loss")
    node = {"enabled": True, "distillation_loss": {"loss_mode": "forward_kl_topk"}}
    assert _topk_distillation(OmegaConf.create(node))
    node["distillation_loss"]["loss_mode"] = "no_such_loss"  # verl itself fails on it: counted as top-k here
    assert _topk_distillation(OmegaConf.create(node))
    node["enabled"] = False
    assert not _topk_distillation(OmegaConf.create(node)) and not _topk_distillation(None)


@pytest.mark.parametrize("layout", ["dense", "v1"])
def test_no_padding_2_padding_is_the_response_slice_shifted_by_one(layout):
    """Against a per-row slice written here: position t of a response is predicted at t - 1 of the sequence."""
    from verl.workers.utils.padding import no_padding_2_padding

    td, raw = H.make_batch(97, batch=4, seed=3)
    if layout == "v1":
        td = H.to_v1_layout(raw)
    offsets = td["input_ids"].offsets()
    values = torch.arange(int(offsets[-1]), dtype=torch.float32) + 1.0
    nested = torch.nested.nested_tensor_from_jagged(values, offsets)
    out = no_padding_2_padding(nested, td)
    width = raw["responses"].shape[1]
    prompt_width = raw["prompts"].shape[1]
    expected = torch.zeros(raw["input_ids"].shape[0], width)
    for i in range(expected.shape[0]):
        n_prompt = int(raw["attention_mask"][i, :prompt_width].sum())
        n_resp = int(raw["attention_mask"][i, prompt_width:].sum())
        row = values[int(offsets[i]): int(offsets[i + 1])]
        expected[i, :n_resp] = row[n_prompt - 1: n_prompt - 1 + n_resp]
    assert torch.equal(out[:, :width], expected)
    assert not out[:, width:].any()


def test_ppo_loss_reads_the_response_mask_the_wrapper_edits():
    src = _flat(_src("verl.workers.utils.losses", "ppo_loss"))
    assert _params("verl.workers.utils.losses", "ppo_loss") == ["config", "model_output", "data", "dp_group"]
    assert 'log_prob = no_padding_2_padding(model_output["log_probs"], data)' in src
    assert 'fields = ["response_mask", "old_log_probs", "advantages"]' in src
    assert "data = data.select(*fields).to_padded_tensor()" in src
    assert 'response_mask = data["response_mask"].to(bool)' in src
    assert 'config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]' in src


# ------------------------------------------------------------------------------------------------ registration
def test_import_verl_loads_the_plugin_entry_point():
    src = inspect.getsource(importlib.import_module("verl"))
    assert '_plugins_policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")' in src
    assert '_discovered = _entry_points(group="verl.plugins")' in src and "_ep.load()" in src
    assert 'logging.getLogger(__name__).debug("Failed to load plugin' in src  # why plugin.py prints itself
    names = {ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    assert "tim_plugins.integrations.verl.plugin" in names
    assert "tim_plugins.integrations.verl.plugin" in sys.modules  # loaded by `import verl` (conftest)


def test_engine_registry_prefers_the_vendor_key(monkeypatch):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from tim_plugins.integrations.verl.engine import TIMFSDPEngineWithLMHead

    assert _params("verl.workers.engine.base", "EngineRegistry.register") == \
        ["model_type", "backend", "device", "vendor"]
    reg = _src("verl.workers.engine.base", "EngineRegistry.register")
    assert "key = (current_device, current_vendor) if current_vendor else current_device" in reg
    assert "assert key not in cls._engines[model_type][current_backend]" in reg
    look = _src("verl.workers.engine.base", "EngineRegistry.get_engine_cls")
    assert 'os.getenv("VERL_ENGINE_DEVICE")' in look and 'os.getenv("VERL_ENGINE_VENDOR")' in look
    assert look.index("vendor_key = (device, vendor)") < look.index("if device in registry:")
    # behaviour, with the plugin registered: ours on (cuda, nvidia), verl's for another vendor
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    for backend in ("fsdp", "fsdp2"):
        monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
        assert EngineRegistry.get_engine_cls("language_model", backend) is TIMFSDPEngineWithLMHead
        monkeypatch.setenv("VERL_ENGINE_VENDOR", "amd")
        assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead


def test_cuda_platform_vendor_is_nvidia_and_rocm_is_not():
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_rocm import PlatformROCm

    assert PlatformCUDA.vendor_name.fget(None) == "nvidia" and PlatformCUDA.device_name.fget(None) == "cuda"
    assert PlatformROCm.vendor_name.fget(None) == "amd" and PlatformROCm.device_name.fget(None) == "cuda"


# ------------------------------------------------------------------------------------------------ driver
def test_trainer_registry_holds_verl_modes_and_ours():
    from verl.trainer.ppo.v1 import PPOTrainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    from tim_plugins.integrations.verl.trainer import TIMTrainerMixin, _UnreadTIMNodeGuard

    assert {"sync", "colocate_async", "separate_async"} <= set(TRAINER_REGISTRY)
    for name, cls in TRAINER_REGISTRY.items():
        if name.startswith("tim_"):
            base = name[len("tim_"):]
            # verl's own class behind both: ours, and the guard now registered under verl's name
            guard = TRAINER_REGISTRY[base]
            assert guard.__mro__[1] is _UnreadTIMNodeGuard and guard._tim_guarded_mode == base, base
            assert cls.__mro__[1] is TIMTrainerMixin and cls.__mro__[2] is guard.__mro__[2], name
            assert cls._tim_base_mode == base
    assert "get_trainer_cls(config.trainer.v1.trainer_mode)" in inspect.getsource(
        importlib.import_module("verl.trainer.main_ppo"))

    class Other(PPOTrainer):
        pass

    before = dict(TRAINER_REGISTRY)
    with pytest.raises(ValueError, match="already registered"):
        register_trainer("sync")(Other)
    with pytest.raises(TypeError):
        register_trainer("not_a_trainer")(object)
    assert TRAINER_REGISTRY == before


def test_a_tim_mode_runs_as_the_mode_it_extends():
    """verl's trainer branches on ``self.trainer_mode == "sync"``: tim_sync must read "sync" there (else it took
    the asynchronous replay buffer, prompt refill and TransferQueue paths)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    init = _src(TB, "PPOTrainer.__init__")
    assert "self.trainer_mode = self.config.trainer.v1.trainer_mode" in init
    assert "self.config.trainer.v1.get(self.trainer_mode, {})" in init
    base_src = inspect.getsource(importlib.import_module(TB))
    assert len(re.findall(r'self\.trainer_mode [!=]= "sync"', base_src)) >= 5
    for name in ("sync", "colocate_async", "separate_async"):
        trainer = object.__new__(get_trainer_cls("tim_" + name))
        trainer.trainer_mode = "tim_" + name  # what PPOTrainer.__init__ assigns
        assert trainer.trainer_mode == name
        with pytest.raises(ValueError, match="runs trainer mode"):
            trainer.trainer_mode = "sync" if name != "sync" else "colocate_async"
    # behaviour: the sync-only path of verl's trainer (no TransferQueue: it returns before touching it)
    trainer = object.__new__(get_trainer_cls("tim_sync"))
    trainer.trainer_mode = "tim_sync"
    assert trainer._reissue_inflight_prompts() == 0


def test_resource_pool_puts_verls_worker_behind_the_actor_roles():
    from verl.trainer.ppo.utils import Role

    for member in ("Actor", "ActorRollout", "ActorRolloutRef", "RefPolicy", "Critic"):
        assert hasattr(Role, member), member
    src = _src(TB, "PPOTrainer._init_resource_pool_mgr")
    assert "self.role_worker_mapping = {}" in src
    assert "self.role_worker_mapping[role] = ray.remote(ActorRolloutRefWorker)" in src
    assert "role = Role.ActorRolloutRef if need_reference_policy(config) and not ref_in_actor else " \
           "Role.ActorRollout" in _flat(src)
    assert "role = Role.Actor" in src
    assert "self.role_worker_mapping[Role.RefPolicy] = ray.remote(ActorRolloutRefWorker)" in src
    assert "self.role_worker_mapping[Role.Critic] = ray.remote(TrainingWorker)" in src
    setup = _src(TB, "PPOTrainer._setup")
    assert setup.index("self._init_resource_pool_mgr()") < setup.index("self.role_worker_mapping[actor_role]")


def test_the_tim_worker_goes_in_front_of_the_class_a_mode_chose():
    """separate_async puts its own subclass behind the actor role (``DetachActorWorker``: the CPU copies of the
    weights its old-log-prob pass restores); the tim worker goes in front of it, keeping its methods."""
    import ray
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.integrations.verl.trainer import use_tim_actor_worker
    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker, tim_worker_class

    src = _src("verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync._init_resource_pool_mgr")
    assert "super()._init_resource_pool_mgr()" in src
    assert "self.role_worker_mapping[Role.ActorRollout] = ray.remote(DetachActorWorker)" in src
    assert PPOTrainerSeparateAsync.__mro__[1].__name__ == "PPOTrainer"
    mapping = {Role.ActorRollout: ray.remote(DetachActorWorker), Role.RefPolicy: ray.remote(DetachActorWorker)}
    use_tim_actor_worker(mapping)
    made = mapping[Role.ActorRollout].__ray_actor_class__
    assert issubclass(made, TIMActorRolloutRefWorker) and issubclass(made, DetachActorWorker)
    assert made.update_weights is TIMActorRolloutRefWorker.update_weights  # the tim worker's first
    for name in ("save_model_to_cpu", "restore_model_from_cpu", "tim_read_replicas", "tim_pop_metrics"):
        assert hasattr(getattr(made, name), MAGIC_ATTR), name  # what verl's worker group binds
    assert mapping[Role.RefPolicy].__ray_actor_class__ is DetachActorWorker  # a separate reference keeps verl's
    assert tim_worker_class(DetachActorWorker) is made  # one class per chosen class
    assert tim_worker_class(ActorRolloutRefWorker) is TIMActorRolloutRefWorker
    assert tim_worker_class(None) is TIMActorRolloutRefWorker


def test_old_log_prob_pass_asks_for_entropy_and_the_reference_pass_does_not():
    old = _flat(_src(TB, "PPOTrainer._compute_old_log_prob"))
    assert _params(TB, "PPOTrainer._compute_old_log_prob") == ["self", "batch", "metrics"]
    assert '"calculate_entropy": True,' in old
    assert "output: KVBatchMeta = self.actor_rollout_wg.compute_log_prob(batch)" in old
    assert 'bypass_recomputing_logprobs = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)' \
        in old
    assert 'data["old_log_probs"] = data.pop("rollout_log_probs")' in old
    assert old.count("return batch") == 2
    ref = _flat(_src(TB, "PPOTrainer._compute_ref_log_prob"))
    assert '"calculate_entropy": False,' in ref and '"calculate_entropy": True' not in ref


def test_trajectories_carry_weight_versions_as_tags_and_transfer_queue_takes_per_sample_fields():
    """The asynchronous modes' lag (trainer.py ``_tim_put_lag``): verl tags each trajectory with the weight versions
    it was sampled across and reads its staleness from them as the driver does; the workers get fields, written with
    kv_batch_put, whose pass over a real TransferQueue round trip is checked in test_verl_async.py."""
    metrics = _flat(_src(TB, "PPOTrainer._compute_metrics"))
    assert 'np.array([tag["min_global_steps"] for tag in batch.tags], dtype=int)' in metrics
    assert "trajectory_staleness_worst = (global_steps - 1) - min_global_steps" in metrics
    assert _params("transfer_queue", "kv_batch_put")[:3] == ["keys", "partition_id", "fields"]


def test_verls_padding_samples_have_no_response_token():
    """The LR decay's length signal leaves verl's synthetic padding samples out as the rows without a response
    token (``engine_mixin._tim_end_step``): verl builds them with an all-zero response mask."""
    src = _flat(_src("verl.trainer.ppo.padding_utils", "construct_minimal_padding_template"))
    assert "response_mask = torch.zeros_like(responses)" in src and "response_mask=response_mask," in src
    assert "is_padding=True," in src
    assert "construct_minimal_padding_template(" in _src("verl.trainer.ppo.padding_utils",
                                                         "upsample_batch_to_divisible_size")


def test_verls_rejection_sampling_masks_the_batch_after_the_old_log_prob_pass():
    """The LR decay's length signal is read in the old-log-prob pass (``engine_mixin._tim_record_lengths``), before
    verl's rollout correction writes its rejection into ``response_mask``."""
    helper = _flat(_src("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch"))
    assert 'batch.batch["response_mask"] = modified_response_mask' in helper
    assert "compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)" in _flat(
        _src(TB, "PPOTrainer._compute_advantage"))
    step = _flat(_src(TB, "PPOTrainer._step_once"))
    order = [step.index(f"self.{name}(batch, metrics=metrics)")
             for name in ("_compute_old_log_prob", "_compute_advantage", "_update_actor")]
    assert order == sorted(order)


def test_a_global_step_runs_parameter_sync_step_actor_updates_and_names_each_one():
    """The driver tells the actor which update of the global step it runs (``trainer.py`` ``_compute_old_log_prob``:
    the step's window closes after the last): verl's step sets ``local_trigger_step`` before each of its
    ``parameter_sync_step`` updates, whose metrics its aggregator combines (a key of the last update alone keeps
    its value)."""
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    assert _params(TB, "PPOTrainer.step") == ["self", "metrics", "timing_raw"]
    src = _flat(_src(TB, "PPOTrainer.step"))
    loop = src.index("for trigger_idx in range(self.parameter_sync_step):")
    assert loop < src.index("self.local_trigger_step = trigger_idx") < src.index(
        "batch = self._step_once(iter_metrics, timing_raw, sample_batch_size)") < src.index(
        "metrics_aggregator.add_step_metrics(iter_metrics, sample_count=sample_count)")
    assert "self.parameter_sync_step = " in _flat(_src(TB, "PPOTrainer.__init__"))
    agg = MetricsAggregator()
    for last in (False, True):
        agg.add_step_metrics({"x/other": 1.0, **({"tim/tokens": 7.0, "tim/token/kl_k3": float("nan")} if last
                                                  else {})}, sample_count=3)
    out = agg.get_aggregated_metrics()
    assert out["tim/tokens"] == 7.0 and out["tim/token/kl_k3"] != out["tim/token/kl_k3"]


def test_update_actor_is_one_worker_call_per_step():
    assert _params(TB, "PPOTrainer._update_actor") == ["self", "batch", "metrics"]
    src = _src(TB, "PPOTrainer._update_actor")
    assert src.count("self.actor_rollout_wg.update_actor(batch)") == 1 and "return batch" in src


def test_compute_metrics_adds_the_data_metrics_in_place_before_the_step_is_logged():
    """The dump's log_history.jsonl is written from the trainer mode's _compute_metrics: verl must call it once per
    step before logger.log, with the metrics dict it then logs, and fill critic/score/mean into that dict."""
    assert _params(TB, "PPOTrainer._compute_metrics")[:3] == ["self", "batch", "metrics"]
    fit = _flat(_src(TB, "PPOTrainer.fit"))
    call = fit.index("self._compute_metrics(batch, metrics, self.timing_raw, global_steps=self.global_steps")
    assert fit.count("self._compute_metrics(") == 1 and call < fit.index("self.logger.log(data=metrics, step=self.global_steps)")
    assert "metrics.update(compute_data_metrics(" in _flat(_src(TB, "PPOTrainer._compute_metrics"))


def test_fit_saves_before_on_step_end_from_an_is_last_step_taken_before_the_step():
    src = _flat(_src(TB, "PPOTrainer.fit"))
    assert "while current_epoch < self.config.trainer.total_epochs and self.global_steps <= " \
           "self.total_training_steps:" in src
    last = src.index("is_last_step = self.global_steps >= self.total_training_steps")
    step = src.index("batch = self.step(metrics, self.timing_raw)")
    save_if = src.index("if self.config.trainer.save_freq > 0 and ( is_last_step or self.global_steps % "
                        "self.config.trainer.save_freq == 0 ):")
    save = src.index("self._save_checkpoint()")
    end = src.index("self.on_step_end()")
    assert last < step < save_if < save < end
    assert _params(TB, "PPOTrainer._save_checkpoint") == ["self"]


def test_on_train_begin_runs_once_before_the_first_step_with_global_steps_that_step():
    """The tim trainer moves an earlier attempt's dump of the steps from ``global_steps`` on aside in on_train_begin
    (``supersede_from``): fit must call it after the resume set global_steps (the checkpoint's step, + 1) and before
    the loop's first step."""
    assert _params(TB, "PPOTrainer.on_train_begin") == ["self"]
    assert "self.global_steps = int(global_step_folder.split(\"global_step_\")[-1])" in _src(
        TB, "PPOTrainer._load_checkpoint")
    setup = _flat(_src(TB, "PPOTrainer._setup"))
    assert "self._load_checkpoint()" in setup
    fit = _flat(_src(TB, "PPOTrainer.fit"))
    assert fit.count("self.on_train_begin()") == 1
    assert fit.index("self.global_steps += 1") < fit.index("self.on_train_begin()") < fit.index(
        "batch = self.step(metrics, self.timing_raw)")


# ------------------------------------------------------------------------------------------------ workers
def test_worker_builds_the_engine_through_the_registry():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker

    assert issubclass(TIMActorRolloutRefWorker, ActorRolloutRefWorker)
    assert "self.config = config" in _src("verl.workers.engine_workers", "ActorRolloutRefWorker.__init__")
    init_model = _src("verl.workers.engine_workers", "ActorRolloutRefWorker.init_model")
    assert "self.actor = self.actor_worker_cls(config=actor_training_config)" in init_model
    assert 'if "actor" in self.role:' in init_model
    assert "self.engine: BaseEngine = EngineRegistry.new(" in _src("verl.workers.engine_workers",
                                                                   "TrainingWorker.__init__")


def test_register_marks_the_methods_the_worker_group_binds():
    from verl.single_controller.base.decorator import (
        DISPATCH_MODE_FN_REGISTRY,
        MAGIC_ATTR,
        Dispatch,
        register,
    )
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe(self):
        return 7

    assert getattr(probe, MAGIC_ATTR) == {"dispatch_mode": Dispatch.ONE_TO_ALL, "execute_mode": getattr(
        probe, MAGIC_ATTR)["execute_mode"], "blocking": True}
    for name in ("init_model", "tim_pop_metrics", "tim_begin_step"):
        attrs = getattr(getattr(TIMActorRolloutRefWorker, name), MAGIC_ATTR)
        assert attrs["dispatch_mode"] is Dispatch.ONE_TO_ALL, name
    assert getattr(ActorRolloutRefWorker.init_model, MAGIC_ATTR)["dispatch_mode"] is Dispatch.ONE_TO_ALL
    collect = DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL]["collect_fn"]
    assert collect(None, [{"a": 1.0}, {}]) == [{"a": 1.0}, {}]  # one result per rank
    bind = _src("verl.single_controller.base.worker_group", "WorkerGroup._bind_worker_method")
    assert "for method_name in dir(user_defined_cls):" in bind and "if hasattr(method, MAGIC_ATTR):" in bind


# ------------------------------------------------------------------------------------------------ optimizer
def test_build_optimizer_resolves_the_tim_optimizer_with_torchs_arguments():
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    from tim_plugins.integrations.verl import optim
    from tim_plugins.integrations.verl.config import OPTIMIZER_IMPL

    src = _src("verl.workers.config.optimizer", "build_optimizer")
    assert "module = importlib.import_module(config.optimizer_impl)" in src
    assert "optimizer_cls = getattr(module, config.optimizer)" in src
    assert "return optimizer_cls(parameters, **optimizer_args)" in src
    model = torch.nn.Linear(3, 2)
    cfg = FSDPOptimizerConfig(lr=3e-4, weight_decay=0.05, betas=(0.8, 0.9), optimizer_impl=OPTIMIZER_IMPL,
                              optimizer="AdamW")
    opt = build_optimizer(model.parameters(), cfg)
    assert type(opt) is optim.AdamW and isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (3e-4, 0.05, (0.8, 0.9))


# ------------------------------------------------------------------------------------------------ vLLM rollout
def test_vllm_server_forwards_engine_kwargs_verbatim_after_its_own():
    src = _src("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.launch_server")
    assert ('engine_kwargs = self.config.get("engine_kwargs", {}).get(self._get_engine_kwargs_key(), {}) or {}'
            in src)
    assert "engine_kwargs = {key: val for key, val in engine_kwargs.items() if val is not None}" in src
    assert src.index('"logprobs_mode": self.config.logprobs_mode,') < src.index("**engine_kwargs,")
    key = _src("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer._get_engine_kwargs_key")
    assert 'return "vllm"' in key


def test_agent_loop_sends_no_min_p_and_a_fixed_repetition_penalty():
    src = _flat(_src("verl.trainer.ppo.v1.agent_loop_tq", "AgentLoopWorkerTQ.generate_sequences"))
    assert ("sampling_params = dict( temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, "
            "repetition_penalty=1.0, logprobs=config.calculate_log_probs, )") in src
    assert "min_p" not in src
    server = _src("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.generate")
    assert "sampling_params = SamplingParams(max_tokens=max_tokens, **sampling_params)" in server
    assert "min_p" not in server


# ------------------------------------------------------------------------------------------------ config keys
def test_config_keys_the_adapter_reads_exist_in_verls_defaults():
    from omegaconf import OmegaConf

    from tim_plugins.integrations.verl.parity_spec import compose_ppo_config

    cfg = compose_ppo_config([])
    absent = object()
    missing = [k for k in VERL_CONFIG_KEYS
               if OmegaConf.select(cfg, k, default=absent) is absent and not OmegaConf.is_missing(
                   OmegaConf.select(cfg, k.rpartition(".")[0]), k.rpartition(".")[2])]
    assert missing == [], f"verl's ppo_trainer config no longer has {missing}: revisit VERL_CONFIG_KEYS"
    present = [k for k in VERL_OPTIONAL_CONFIG_KEYS if OmegaConf.select(cfg, k, default=absent) is not absent]
    assert present == [], f"verl now defaults {present}: revisit the adapter's fallback for them"
    megatron = compose_ppo_config([], config_name="ppo_megatron_trainer")
    missing = [k for k in VERL_MEGATRON_CONFIG_KEYS if OmegaConf.select(megatron, k, default=absent) is absent]
    assert missing == [], f"verl's ppo_megatron_trainer config no longer has {missing}: revisit them"


# ------------------------------------------------------------------------------------------------ kept sets (rollout.py)
def test_the_engine_names_its_sequence_parallel_size():
    # engine.py recomputes the kept set under Ulysses SP (each rank holds a slice of the packed logits)
    assert "self.ulysses_sequence_parallel_size = self.engine_config.ulysses_sequence_parallel_size" in \
        _src(TI, "FSDPEngine._init_device_mesh")


def test_the_rollout_registry_replaces_a_loader_and_calls_it_on_get():
    from verl.workers.rollout.replica import RolloutReplicaRegistry, _load_vllm
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    assert _load_vllm() is vLLMReplica
    before = RolloutReplicaRegistry._registry.get("vllm")
    try:
        RolloutReplicaRegistry.register("vllm", lambda: "replaced")
        assert RolloutReplicaRegistry.get("vllm") == "replaced"
    finally:
        RolloutReplicaRegistry._registry["vllm"] = before


def test_verls_server_returns_its_own_extra_fields_dict():
    src = _src("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.generate")
    assert 'extra_fields = {"global_steps": self.global_steps}' in src
    assert src.count("extra_fields=extra_fields,") >= 2  # the aborted and the finished returns


# ------------------------------------------------------------------------------------------------ weight-sync check
def test_update_weights_streams_the_engines_params_into_the_rollout_and_our_worker_keeps_its_dispatch():
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tim_plugins.integrations.verl.worker import TIMActorRolloutRefWorker

    assert _params("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights") == [
        "self", "global_steps", "mode"]
    src = _flat(_src("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights"))
    assert ('effective_mode = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend' in src)
    assert 'if effective_mode != "naive":' in src  # everything else goes through the checkpoint engine
    assert "per_tensor_param, peft_config = self.actor.engine.get_per_tensor_param( layered_summon=" in src
    assert "await self.rollout.update_weights( per_tensor_param, peft_config=peft_config, base_sync_done=True" in src
    theirs, ours = (getattr(c.update_weights, MAGIC_ATTR) for c in (ActorRolloutRefWorker, TIMActorRolloutRefWorker))
    assert ours == theirs and theirs["dispatch_mode"] is Dispatch.ONE_TO_ALL and theirs["blocking"] is False
    assert inspect.iscoroutinefunction(TIMActorRolloutRefWorker.update_weights)
    # the colocated trainer modes force the naive backend (the sync check reads only there)
    assert 'checkpoint_engine_config.backend = "naive"' in _src(TB, "PPOTrainer._setup")


def test_get_per_tensor_param_returns_a_stream_and_the_peft_config():
    assert _params(TI, "FSDPEngine.get_per_tensor_param") == ["self", "layered_summon", "base_sync_done", "kwargs"]
    src = _src(TI, "FSDPEngine.get_per_tensor_param")
    assert "return per_tensor_param, peft_config_dict" in src


def test_the_rollout_adapter_holds_the_server_handle_on_its_server_rank():
    src = _src("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter._ensure_server_handle")
    assert "if not self._has_server:" in src and "return False" in src
    assert "self.server_handle = ray.get_actor(actor_name)" in src and "return True" in src
    update = _flat(_src("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter.update_weights"))
    assert "await sender.async_send_weights(weights)" in update and "await future" in update  # loaded on return


def test_the_vllm_server_names_its_worker_extension_and_drops_the_rpc_results():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from tim_plugins.integrations.verl.rollout import TIMvLLMHttpServer
    from tim_plugins.integrations.verl.worker_extension import EXTENSION, TIMWorkerExtension

    vs = "verl.workers.rollout.vllm_rollout.vllm_async_server"
    assert '"worker_extension_cls": self._get_worker_extension_cls(),' in _src(vs, "vLLMHttpServer.launch_server")
    theirs = _resolve(vs, "vLLMHttpServer._get_worker_extension_cls")(None)
    assert resolve_obj_by_qualname(theirs) is vLLMColocateWorkerExtension
    # ours: verl's extension plus the reads, resolved by name as vLLM's worker does
    assert resolve_obj_by_qualname(TIMvLLMHttpServer._get_worker_extension_cls(None)) is TIMWorkerExtension
    assert EXTENSION == "tim_plugins.integrations.verl.worker_extension.TIMWorkerExtension"
    assert issubclass(TIMWorkerExtension, vLLMColocateWorkerExtension)
    assert not set(vars(TIMWorkerExtension)) & set(dir(vLLMColocateWorkerExtension)) - {"__doc__", "__module__"}
    rpc = _src(vs, "vLLMHttpServer.collective_rpc")
    assert "await self.engine.collective_rpc(" in rpc and "return" not in rpc  # the workers' results are dropped
    assert "yield self.model_runner.model" in _src("verl.workers.rollout.vllm_rollout.utils",
                                                   "vLLMColocateWorkerExtension._iter_all_models")
    assert _params("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc") == ["self", "method", "timeout", "args",
                                                                              "kwargs"]
    assert "return await self.engine_core.collective_rpc_async(" in _src("vllm.v1.engine.async_llm",
                                                                          "AsyncLLM.collective_rpc")


def test_main_ppo_validates_the_composed_config_before_it_picks_the_trainer_and_starts_ray():
    """The legacy-trainer guard (plugin._guard_legacy_trainer) wraps verl.utils.config.validate_config: main_ppo must
    bind it by name at import (after `import verl` loaded the plugins) and call it before the use_v1 branch, whose
    legacy side then starts Ray; main_ppo_v0 imports it the same way."""
    main = _flat(_src("verl.trainer.main_ppo", "main"))
    assert main.index("validate_config(") < main.index("if config.trainer.use_v1:") \
        < main.index("from verl.trainer.main_ppo_v0 import TaskRunner")
    assert "ray.init(" not in main  # Ray starts in run_ppo, after main's validation
    for module in ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0"):
        assert "from verl.utils.config import validate_config" in inspect.getsource(importlib.import_module(module))
    assert _params("verl.utils.config", "validate_config")[0] == "config"
