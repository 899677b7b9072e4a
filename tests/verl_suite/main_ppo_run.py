"""Test helper: run verl's own ``python -m verl.trainer.main_ppo`` on this CPU (GRPO, FSDP2 actor, vLLM CPU-build
rollout server, the toy model) and read each step's metrics from verl's own ``file`` logger (one JSON line per step;
the console's rows reach us through Ray's log monitor, which can cut a long row in two) and the console for the rest.

The CPU shims live in ``cpu_site/`` (loaded in every process of the run through PYTHONPATH); the tim overrides come
from the recipe (``integrations/verl/recipes/run_grpo_tim.sh``, ``TIM_PRINT_OVERRIDES=tim``), so the test runs what
the recipe documents.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bounded import run_bounded

__all__ = ["CPU_OVERRIDES", "Run", "base_overrides", "parse_console", "parse_file_log", "prepare", "recipe_tim_overrides",
           "run_main_ppo"]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "integrations" / "verl" / "recipes" / "run_grpo_tim.sh"
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"

CONSOLE_LOGGER = "trainer.logger=[console]"
FILE_LOGGER = "trainer.logger=[console,file]"  # run_main_ppo: Run.steps from verl's file logger

# Chat template that passes the message text through unchanged: the toy model was trained on raw text.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Toy reward: 1 if the response contains the expected answer, plus a small bonus per distinct word."""
    words = set(solution_str.split())
    return float(ground_truth in solution_str) + 0.01 * len(words)
'''

# What it takes to run main_ppo on a CPU with the vLLM CPU build (see cpu_site/cpu_shims.py for the code shims).
CPU_OVERRIDES = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "ray_kwargs.ray_init.num_cpus=16",
    "+ray_kwargs.ray_init.num_gpus=1",  # one logical GPU: verl's resource pool counts GPUs only
    "+ray_kwargs.ray_init.include_dashboard=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",  # vLLM's CPU build has no sleep mode
    "actor_rollout_ref.rollout.max_model_len=64",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    # Memory (the suite must fit a 24 GiB CI machine beside another job). verl's defaults start 8 reward-loop
    # actors and 8 TransferQueue storage actors, each a Python process with torch imported; one of each serves
    # these batches of 8 responses. The vLLM CPU build allocates (and zeroes) its whole KV cache up front: 64 MiB
    # holds ~2**17 tokens of the toy model and ~2,900 of SmolLM2-135M (23 KB a token in bf16), where a step's 8
    # sequences need at most 8 x 88. VLLM_CPU_KVCACHE_SPACE would override it (whole GiB only), so ENV leaves it
    # out and run_main_ppo drops it from the environment.
    "reward.num_workers=1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={64 * 2**20}",
]

ENV = {
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",  # verl's engine registry has no "cpu" key
    "VERL_ENGINE_VENDOR": "nvidia",
    "VLLM_TARGET_DEVICE": "cpu",
    "TIM_TEST_CPU_SHIMS": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "HYDRA_FULL_ERROR": "1",
    "RAY_DEDUP_LOGS": "0",
    "PYTHONUNBUFFERED": "1",
}


def prepare(workdir: Path, model_src: Path, n_prompts: int = 24, prompts: list[str] | None = None) -> dict[str, Path]:
    """The model (a copy of the toy model given a chat template; a model with its own template is used in place),
    train/val parquet files and the reward file.

    The toy prompts are ordered (``data.shuffle=false`` in ``base_overrides``) so that each step's batch holds one
    kind: arithmetic first (answers of ~5 tokens), then free text (~12 tokens, a length surge), then sorting.
    ``prompts`` replaces them, in the order given."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tim_plugins.toy_model import synthetic_prompts

    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "model"
    has_template = (model_src / "chat_template.jinja").exists() or \
        "chat_template" in json.loads((model_src / "tokenizer_config.json").read_text())
    if has_template:
        model = model_src
    elif not model.exists():
        shutil.copytree(model_src, model)
        cfg_path = model / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=1))
    if prompts is not None:
        ordered = list(prompts)
    else:
        toy = synthetic_prompts(3 * n_prompts)
        by_kind = [toy[k::3] for k in (0, 2, 1)]  # synthetic_prompts cycles arithmetic, sorting, free text
        ordered = [p for kind in by_kind for p in kind[:n_prompts // 3]]

    def rows(texts):
        return [{"data_source": "tim_toy", "prompt": [{"role": "user", "content": t}], "ability": "toy",
                 "reward_model": {"style": "rule", "ground_truth": "."}, "extra_info": {"index": i}}
                for i, t in enumerate(texts)]

    files = {"model": model, "train": workdir / "train.parquet", "val": workdir / "val.parquet",
             "reward": workdir / "reward.py"}
    pq.write_table(pa.Table.from_pylist(rows(ordered)), files["train"])
    pq.write_table(pa.Table.from_pylist(rows(ordered[:4])), files["val"])
    files["reward"].write_text(REWARD_SOURCE)
    return files


def base_overrides(files: dict[str, Path], out: Path, *, steps: int, batch: int = 4, n: int = 2,
                   response_length: int = 16, prompt_length: int = 32, lr: float = 1e-3,
                   mini_batch: int | None = None) -> list[str]:
    """A small GRPO run: ``batch`` prompts × ``n`` samples per step, in PPO mini-batches of ``mini_batch`` prompts
    (default ``batch``: one optimizer step per step)."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={files['train']}",
        f"data.val_files={files['val']}",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.shuffle=false",
        "+data.seed=0",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={files['model']}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch or batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"reward.custom_reward_function.path={files['reward']}",
        "reward.custom_reward_function.name=compute_score",
        CONSOLE_LOGGER,
        "trainer.project_name=tim_e2e",
        "trainer.experiment_name=cpu",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
    ]


def recipe_tim_overrides(min_p: str = "1e-4") -> list[str]:
    """The recipe's tim overrides, exactly as ``run_grpo_tim.sh`` passes them to main_ppo."""
    env = dict(os.environ, TIM_PRINT_OVERRIDES="tim", MIN_P=min_p)
    out = subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


# Ray's OOM monitor (the machine's memory above RAY_memory_usage_threshold, 0.95 by default, whoever uses it) killed
# a worker: verl's driver then waits for it until the run's timeout.
RAY_OOM_KILL = re.compile(r"killed due to memory pressure \(OOM\)")
# Ray's node start-up waits a fixed 30 s for its raylet to register with the GCS (ray/_private/node.py,
# ``raylet_start_wait_time_s = 30``, not configurable); on a loaded 2-core machine (two suites and an install side by
# side) it can miss that before verl has run a line: an infrastructure failure, retried once (RAY_START_RETRIES).
RAY_START_TIMEOUT = re.compile(r"The current node timed out during startup")
RAY_START_RETRIES = 1
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
_STEP_LINE = re.compile(r"^(?:\([^)]*\)\s*)?step:(\d+) - (.*)$")
_CAUSE_LINE = re.compile(r"tim-plugins cause \[([a-z0-9-]+)\] at step (\d+):")


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)
    console_steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def series(self, key: str) -> list[float]:
        return [self.steps[s][key] for s in sorted(self.steps)]

    def causes(self) -> list[tuple[str, int]]:
        """(code, step) of each cause console line (``tim-plugins cause [<code>] at step <n>: ...``), in order."""
        return [(m.group(1), int(m.group(2))) for m in _CAUSE_LINE.finditer(self.output)]

    def lag_staleness_steps(self) -> list[int]:
        """The steps an asynchronous mode's staleness rule should name, recomputed from each step's logged
        ``tim/by_lag/<lag>/count`` and ``/kl_k3`` (``CauseConfig``'s thresholds): the tokens trained at lag >= 1
        have a pooled k3 whose part above the lag-0 floor (the lag-0 tokens', else ``tim/token/kl_k3``, else the
        last step's that had one) is at least ``staleness_share`` of it and above ``staleness_k3``."""
        from tim_plugins.causes import CauseConfig, window_by_lag

        c, out, last = CauseConfig(), [], math.nan
        for step, m in sorted(self.steps.items()):
            lags = window_by_lag(m)
            stale = [(n, k3) for lag, (n, k3) in lags.items() if lag >= 1]
            floor = lags[0][1] if 0 in lags else m.get("tim/token/kl_k3")
            last = floor = float(floor) if floor is not None and math.isfinite(floor) else last
            if not stale or not math.isfinite(floor):
                continue
            k3 = sum(n * v for n, v in stale) / sum(n for n, _ in stale)
            if k3 - floor > c.staleness_k3 and k3 - floor >= c.staleness_share * k3:
                out.append(step)
        return out


def parse_console(output: str) -> dict[int, dict[str, float]]:
    """verl's console logger: ``step:N - key:value - key:value ...`` (values via pprint, floats exact; numpy scalars
    print as ``np.float64(1.0)``, e.g. ``training/off_policy/*``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in output.splitlines():
        m = _STEP_LINE.match(_ANSI.sub("", line).strip())
        if not m:
            continue
        values = {}
        for item in m.group(2).split(" - "):
            key, sep, value = item.rpartition(":")
            if not sep:
                continue
            numpy = _NUMPY_SCALAR.match(value)
            try:
                values[key] = float(numpy.group(1) if numpy else value)
            except ValueError:
                continue
        steps.setdefault(int(m.group(1)), {}).update(values)
    return steps


def parse_file_log(path: Path) -> dict[int, dict[str, float]]:
    """verl's ``file`` logger (``verl.utils.tracking.FileLogger``): one ``{"step": N, "data": {...}}`` line per
    ``Tracking.log``, the same dict the console logger prints; the console prints numbers only, and so does this.
    orjson writes NaN and infinities as ``null``: read back as NaN (a metric with no tokens, e.g. an empty bucket's
    mean, is NaN; an infinite metric would read NaN here where the console prints ``inf``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        values = {k: math.nan if v is None else float(v) for k, v in row["data"].items()
                  if v is None or isinstance(v, (int, float)) and not isinstance(v, bool)}
        steps.setdefault(int(row["step"]), {}).update(values)
    return steps


def run_main_ppo(overrides: list[str], *, cwd: Path, timeout: float = 600, extra_env: dict | None = None,
                 log_path: Path | None = None, log_detail: bool = True) -> Run:
    """Run main_ppo in its own process group; kill the whole group (Ray, vLLM) on timeout, when Ray's OOM monitor
    killed a worker, or when done. ``log_detail``: a run with the monitor logs every tim/* metric to verl's loggers,
    which the tests read (``+tim.monitor.log_detail=true`` added unless the overrides set it); False keeps the
    default compact log (test_verl_dump_report reads the rest from the dump's log_history.jsonl).

    ``Run.steps`` comes from verl's ``file`` logger, added beside the console (``trainer.logger=[console]`` becomes
    ``[console,file]``): the console's step rows are printed by verl's TaskRunner actor and reach this process
    through Ray's log monitor, which reads the actor's log with ``readline()`` and publishes what it has as a line,
    so a long row the actor is still writing when the monitor polls arrives cut in two (seen on a loaded machine:
    a last step's row without its later keys). ``Run.console_steps`` keeps the console's rows."""
    monitored = "+tim.monitor.enable=true" in overrides and any(
        o.startswith("trainer.v1.trainer_mode=tim_") for o in overrides)
    if log_detail and monitored and not any("tim.monitor.log_detail=" in o for o in overrides):
        overrides = [*overrides, "+tim.monitor.log_detail=true"]
    file_log = None
    if CONSOLE_LOGGER in overrides:
        file_log = cwd / f"metrics-{uuid.uuid4().hex[:12]}.jsonl"
        overrides = [FILE_LOGGER if o == CONSOLE_LOGGER else o for o in overrides]
    # VLLM_CPU_KVCACHE_SPACE from the caller's shell would replace the KV-cache size CPU_OVERRIDES sets.
    inherited = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env = dict(inherited, **ENV, **(extra_env or {}))
    if file_log is not None:
        env["VERL_FILE_LOGGER_PATH"] = str(file_log)
    env["PYTHONPATH"] = os.pathsep.join([str(CPU_SITE), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    start = time.monotonic()
    earlier = ""
    for attempt in range(RAY_START_RETRIES + 1):
        env["TIM_TEST_RUN_ID"] = uuid.uuid4().hex[:12]  # this run's own weight-transfer socket (cpu_shims, shim 9)
        proc, timed_out = run_bounded(cmd, timeout, cwd=cwd, env=env, abort_on=RAY_OOM_KILL)
        if timed_out or proc.returncode == 0 or not RAY_START_TIMEOUT.search(proc.stdout) \
                or attempt == RAY_START_RETRIES:
            break
        earlier += proc.stdout + "\n[test] Ray's node did not start within its 30 s; main_ppo started again\n\n"
    output, returncode = earlier + proc.stdout, proc.returncode
    if timed_out:
        output += f"\n[test] main_ppo killed after {timeout} s\n"
        returncode = -9
    elif RAY_OOM_KILL.search(output):
        output += ("\n[test] main_ppo stopped: Ray's OOM monitor killed a worker, the machine's memory was above "
                   "RAY_memory_usage_threshold (other jobs on this machine count too); verl would have waited for "
                   "the worker until the timeout\n")
    seconds = time.monotonic() - start
    if log_path is not None:
        log_path.write_text(" ".join(cmd) + "\n\n" + output)
    console = parse_console(output)
    steps = parse_file_log(file_log) if file_log is not None and file_log.exists() else console
    times = {s: v["timing_s/step"] for s, v in steps.items() if "timing_s/step" in v}
    return Run(returncode, output, seconds, steps, times, console)
