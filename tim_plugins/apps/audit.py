"""`tim-plugins audit` and `tim-plugins check-batch-invariance`.

audit sources (one of): ``--verl "<hydra overrides>"`` (composed against verl's ppo_trainer; needs verl),
``--trl-config FILE`` (YAML/JSON of GRPOConfig fields; needs trl), ``--vllm-args "<engine args>"`` or JSON
(with ``--sampling`` JSON and the trainer described by ``--trainer-*`` flags or ``--trainer-spec`` JSON).
Prints a findings table; exit code 1 when an error-level finding remains (after ``--enforce`` if given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run_audit", "run_check_batch_invariance"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("audit", help="static rollout-vs-trainer parity audit (finding codes + fixes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--verl", metavar="OVERRIDES", help='Hydra overrides, e.g. "actor_rollout_ref.rollout.top_p=0.9"')
    src.add_argument("--trl-config", metavar="FILE", help="YAML or JSON file of GRPOConfig fields")
    src.add_argument("--vllm-args", metavar="ARGS", help='vLLM engine args: "--dtype bfloat16 ..." or a JSON object')
    p.add_argument("--model", help="model path (checkpoint dtype for vLLM dtype=auto; TRL: the policy)")
    p.add_argument("--sampling", help="vLLM SamplingParams fields as JSON (with --vllm-args)")
    p.add_argument("--trainer-spec", help="trainer PipelineSpec fields as JSON (with --vllm-args)")
    p.add_argument("--trainer-dtype", help="trainer compute dtype (with --vllm-args)")
    p.add_argument("--trainer-temperature", type=float, help="temperature the trainer divides by (with --vllm-args)")
    p.add_argument("--trainer-attn", help="trainer attn_implementation (with --vllm-args)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the rollout engine runs")
    p.add_argument("--enforce", action="store_true", help="apply the default fixes and show what changed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_audit)

    b = subparsers.add_parser("check-batch-invariance", help="measure log-prob changes with batch size / padding / KV cache")
    b.add_argument("--model", required=True, help="path of an HF causal LM")
    b.add_argument("--dtypes", default="float32,bfloat16", help="comma list (float32,bfloat16,float16)")
    b.add_argument("--batch-sizes", default="2,4,16")
    b.add_argument("--paddings", default="1,7")
    b.add_argument("--num-sequences", type=int, default=2)
    b.add_argument("--seq-len", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-kv-cache", action="store_true")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=run_check_batch_invariance)


def _fail(message: str) -> int:
    print(f"tim-plugins audit: {message}", file=sys.stderr)
    return 2


def _json_object(flag: str, text: str) -> dict:
    """The JSON object a flag holds; a ValueError naming the flag and its value otherwise (the parser's message
    alone does not say which flag it read)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} {text!r} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{flag} {text!r} must be a JSON object of fields, e.g. '{{\"top_p\": 0.9}}'")
    return value


def _engine_fixes_unreachable(rollout: Any, trainer: Any, fix: Any) -> dict:
    """{finding code: why} for the default fixes that only an engine argument applies (``EnforceResult.
    vllm_engine_args``), which TRL's colocate mode cannot pass: TRL builds LLM() itself with a fixed argument list
    that no GRPOConfig field reaches (the TRL fix texts say so, ``integrations.trl.fixes``). Sampling params and the
    trainer's settings stay reachable (GRPOConfig, generation_kwargs)."""
    from tim_plugins.parity.audit import enforce

    why = ("TRL colocate mode builds LLM() itself: no GRPOConfig field reaches the engine argument {args} "
           "(server mode sets it: the finding's fix)")
    out = {}
    for code in sorted(fix):
        engine = enforce(rollout, trainer, fix={code}).vllm_engine_args
        if engine:
            out[code] = why.format(args=", ".join(f"{k}={v!r}" for k, v in engine.items()))
    return out


def _vllm_specs(args: argparse.Namespace):
    from tim_plugins.parity.spec import PipelineSpec
    from tim_plugins.parity.vllm_spec import parse_engine_args, spec_from_engine_args

    engine = parse_engine_args(args.vllm_args)
    if args.model and "model" not in engine:
        engine["model"] = args.model
    sampling = _json_object("--sampling", args.sampling) if args.sampling else None
    rollout = spec_from_engine_args(engine, sampling=sampling, device=args.device)
    fields = _json_object("--trainer-spec", args.trainer_spec) if args.trainer_spec else {}
    fields.setdefault("side", "trainer")
    fields.setdefault("framework", "trainer")
    fields.setdefault("source", "--trainer-* flags")
    for key, value in (("dtype", args.trainer_dtype), ("temperature", args.trainer_temperature),
                       ("attention_backend", args.trainer_attn)):
        if value is not None:
            fields[key] = value
    # A plain trainer forward: no truncation, no penalties, no caches, eager.
    for key, value in dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                           frequency_penalty=0.0, logit_bias=False, bad_words=False, custom_logits_processors=(),
                           weight_quantization="none", kv_cache_dtype="auto", prefix_caching=False,
                           chunked_prefill=False, cudagraph=False, compile=False, batch_invariant=False).items():
        fields.setdefault(key, value)
    return rollout, PipelineSpec.from_dict(fields)


def run_audit(args: argparse.Namespace) -> int:
    from tim_plugins._optional import package_version
    from tim_plugins.parity.audit import DEFAULT_FIXES, enforce
    from tim_plugins.parity.report import audit_and_report, counts_line
    from tim_plugins.parity.table import format_table

    framework, colocate = None, False
    try:
        if args.verl is not None:
            # distribution metadata, not find_spec: an importable folder named verl is not an installation
            if package_version("verl") is None:
                return _fail("--verl needs verl installed: pip install 'tim-plugins[verl]'")
            from tim_plugins.integrations.verl.parity_spec import specs_from_overrides

            rollout, trainer = specs_from_overrides(args.verl, device=args.device)
            framework = "verl"
        elif args.trl_config is not None:
            if package_version("trl") is None:
                return _fail("--trl-config needs trl installed (pip install 'tim-plugins[trl]')")
            from tim_plugins.integrations.trl.parity_spec import load_grpo_config, specs_from_grpo_config

            config = load_grpo_config(args.trl_config)
            rollout, trainer = specs_from_grpo_config(config, args.model, device=args.device)
            framework = "trl"
            colocate = bool(getattr(config, "use_vllm", False)) and getattr(config, "vllm_mode", None) == "colocate"
        else:
            rollout, trainer = _vllm_specs(args)
            framework = "vllm"
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as err:
        return _fail(str(err))
    changes, enforced, unreachable = [], None, {}
    if args.enforce:
        fix = set(DEFAULT_FIXES)
        if colocate:
            # a change TRL cannot make is not a change: its finding stays, marked why
            unreachable = _engine_fixes_unreachable(rollout, trainer, fix)
            fix -= set(unreachable)
        result = enforce(rollout, trainer, fix=fix)
        changes, enforced = result.changes, result.findings
    report = audit_and_report(rollout, trainer, framework=framework, findings=enforced,
                              title=f"tim-plugins audit ({rollout.source} vs {trainer.source})")
    if args.json:
        print(json.dumps({"rollout": rollout.to_dict(), "trainer": trainer.to_dict(),
                          "changes": [c.__dict__ for c in changes],
                          "not_applied": [{"code": code, "why": why} for code, why in unreachable.items()],
                          "findings": [f.to_dict() for f in report.findings]}, indent=2, default=str))
    else:
        print(f"rollout: {rollout.framework} ({rollout.source})\ntrainer: {trainer.framework} ({trainer.source})\n")
        if changes:
            print("enforce() changed:")
            print(format_table(["side", "field", "old", "new", "knob"],
                               [[c.side, c.field, c.old, c.new, c.knob] for c in changes]))
            print()
        if unreachable:
            print("enforce() did not apply (not reachable from GRPOConfig; the findings stay below):")
            print(format_table(["code", "why"], [[code, why] for code, why in unreachable.items()]))
            print()
        print(report.table)
        print(f"\n{counts_line(report.counts)}")
    return 1 if report.has_errors else 0


def run_check_batch_invariance(args: argparse.Namespace) -> int:
    if not Path(args.model).exists():  # before the imports: a wrong path is one line at once
        print(f"tim-plugins check-batch-invariance: --model {args.model!r} does not exist", file=sys.stderr)
        return 2
    import torch

    from tim_plugins._optional import require
    from tim_plugins.parity.batch_invariance import check_batch_invariance

    require("transformers", "tim-plugins check-batch-invariance")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (args.num_sequences, args.seq_len), generator=gen)
    report = check_batch_invariance(
        model, ids, batch_sizes=[int(x) for x in args.batch_sizes.split(",") if x],
        paddings=[int(x) for x in args.paddings.split(",") if x],
        dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()], kv_cache=not args.no_kv_cache,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"max |Δ log p| of {args.num_sequences} random sequences of {args.seq_len} tokens vs the same "
              "sequence alone (0 = bitwise)\n")
        print(report.to_table())
    return 0
