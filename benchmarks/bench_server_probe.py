"""Cost of server mode's lag-0 probe (``integrations/trl/server_probe.py``) against the generation it follows, on a
0.5B-shaped model.

One probe is two scorings of its fixed batch (``Lag0ProbeConfig``'s defaults: 4 sequences of 64 tokens): the
engine's prompt log-probs of the batch (one request, ``max_tokens=1, prompt_logprobs=0``: what TRL's
``VLLMClient.get_sequence_logprobs`` asks the server for, here sent to an in-process vLLM ``LLM`` with no HTTP) and the
trainer's no-grad forward of it (``server_probe.trainer_logprobs``). The baselines are a GRPO step's two parts: its
generation batch on the same engine (8 completions of 128 tokens from one 64-token prompt, TRL's
``num_generations=8``) and the trainer's forward and backward over that batch (the loss pass; the optimizer's update
left out); the step is their sum. Trainer: a transformers
``Qwen2ForCausalLM`` of Qwen2.5-0.5B's shape with random fp32 weights; engine: vLLM's CPU build in bf16 with dummy
weights (``load_format="dummy"``). Rounds interleaved after warm-up; median and spread. A CPU measurement: the
ratio, not the seconds, is the figure (on a GPU the generation's decode dominates it further).

    python -m benchmarks.bench_server_probe [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks._common import RESULTS_DIR, spread, write_results
from benchmarks.bench_weight_sync import QUICK, QWEN2_05B, _config_dir


def run(shape: dict, rounds: int, warmup: int, *, completion: int, tokens: int | None = None) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from accelerate import Accelerator
    from transformers import Qwen2ForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tim_plugins.integrations.trl.server_probe import trainer_logprobs
    from tim_plugins.lag0_probe import Lag0ProbeConfig

    folder = _config_dir(shape)
    torch.manual_seed(0)
    trainer = Qwen2ForCausalLM(Qwen2ForCausalLM.config_class.from_pretrained(folder))
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=512, kv_cache_memory_bytes=256 * 2**20, seed=0, enable_prefix_caching=False)
    config = Lag0ProbeConfig()
    tokens = tokens or config.max_tokens
    g = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    batch = [torch.randint(vocab, (tokens,), generator=g).tolist() for _ in range(config.sequences)]
    prompt = torch.randint(vocab, (64,), generator=g).tolist()
    accelerator = Accelerator(cpu=True)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    sampling = SamplingParams(n=8, max_tokens=completion, min_tokens=completion, ignore_eos=True, detokenize=False,
                              seed=0)

    def engine_side():
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in batch], scoring, use_tqdm=False)
        if any(o.prompt_logprobs is None or len(o.prompt_logprobs) != tokens for o in outs):
            raise RuntimeError("the engine returned no prompt log-probs")

    def trainer_side():
        trainer_logprobs(trainer, batch, accelerator)

    def generation():
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)

    rows = torch.randint(vocab, (8, 64 + completion), generator=g)

    def train():
        trainer.zero_grad(set_to_none=True)
        logits = trainer(input_ids=rows).logits[:, 63:-1].float()
        torch.log_softmax(logits, -1).gather(-1, rows[:, 64:, None]).mean().backward()

    times = {"engine": [], "trainer": [], "generation": [], "train": []}
    for r in range(warmup + rounds):
        order = [("generation", generation), ("train", train), ("engine", engine_side), ("trainer", trainer_side)]
        if r % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    probe = [e + t for e, t in zip(times["engine"], times["trainer"])]
    step = [g_ + t for g_, t in zip(times["generation"], times["train"])]
    gen = statistics.median(times["generation"])
    return {
        "model_shape": shape, "parameters": sum(p.numel() for p in trainer.parameters()),
        "probe_batch": {"sequences": config.sequences, "tokens": tokens},
        "generation_batch": {"prompt_tokens": 64, "completions": 8, "completion_tokens": completion},
        "rounds": rounds, "engine_seconds": spread(times["engine"]), "trainer_seconds": spread(times["trainer"]),
        "probe_seconds": spread(probe), "generation_seconds": spread(times["generation"]),
        "train_seconds": spread(times["train"]), "step_seconds": spread(step), "raw": times,
        "probe_over_generation": statistics.median(probe) / gen,
        "probe_over_step": statistics.median(probe) / statistics.median(step),
        "probe_over_step_per_round": [p / s_ for p, s_ in zip(probe, step)],
        "probe_over_generation_per_round": [p / g_ for p, g_ in zip(probe, times["generation"])],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, short sequences, 2 rounds (the test)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        r = run(QUICK, 2, 1, completion=16, tokens=32)
    else:
        r = run(QWEN2_05B, args.rounds, args.warmup, completion=128)
    results = {
        "quick": args.quick, "ratios": {"probe_over_step": r["probe_over_step"],
                                        "probe_over_generation": r["probe_over_generation"]}, **r,
        "load_average_1_5_15_min": os.getloadavg(),
        "note": "CPU, 2 cores; in-process vLLM (no HTTP); ratios against the generation in the same process and "
                "round",
        "reading": (f"one probe (server side {r['engine_seconds']['median']:.2f} s + trainer side "
                    f"{r['trainer_seconds']['median']:.2f} s) = {r['probe_over_step']:.1%} of a step "
                    f"({r['step_seconds']['median']:.2f} s), {r['probe_over_generation']:.1%} of its generation "
                    f"({r['generation_seconds']['median']:.2f} s)"),
    }
    path = Path(args.output) if args.output else RESULTS_DIR / ("server_probe_quick.json" if args.quick else
                                                               "server_probe.json")
    write_results("server_probe", results, path)
    print(results["reading"])
    return results


if __name__ == "__main__":
    main()
