"""``tim-plugins demo``, the command: by default two runs of `tim_plugins.apps.demo.run_demo`, the problem and then the
same run with its fix (`comparison_runs`), and the page comparing them (`run_comparison`); ``--compare none`` runs
once. Prints each run's verdict, one line with both runs' ρ and k3, and the report's path.
"""

from __future__ import annotations

import json
from pathlib import Path

from tim_plugins.apps.cli import add_config_options, config_from_args
from tim_plugins.apps.demo import COMPARISONS, REAL_MODEL_DEFAULTS, ROLLOUT_DTYPES, DemoConfig, run_demo

__all__ = ["comparison_runs", "run_comparison", "register"]


def comparison_runs(cfg: DemoConfig) -> list[tuple[str, DemoConfig]]:
    """The two runs of ``cfg.compare`` as (label, the run's DemoConfig, writing to OUT/<folder>): the problem, then
    the same run with its fix."""
    import dataclasses

    out = Path(cfg.out)
    if cfg.compare == "safe_vocab":
        pairs = [("full vocabulary", {"safe_vocab": False}), ("safe vocabulary", {"safe_vocab": True})]
    elif cfg.compare == "rollout_dtype":
        pairs = [(f"{cfg.rollout_dtype} rollouts", {}), ("float32 rollouts", {"rollout_dtype": "float32"})]
    else:
        raise ValueError(f"comparison_runs: --compare {cfg.compare!r} runs once")
    return [(label, dataclasses.replace(cfg, **change, compare="none", out=str(out / label.replace(" ", "-"))))
            for label, change in pairs]


def run_comparison(cfg: DemoConfig) -> dict:
    """``cfg.compare``'s two runs (`run_demo` each, into OUT/<label>/) and the page comparing them, OUT/report.html:
    {"runs": {label: summary}, "report": path}."""
    from tim_plugins.apps.report import token_decoder
    from tim_plugins.apps.startup import model_label, model_status, say
    from tim_plugins.report import COMPARISON_FILE, build_comparison

    runs = comparison_runs(cfg)
    summaries = {}
    # the first run's audit error is the problem the comparison shows: marked deliberate there, as the bf16 copy is
    shown = {"safe_vocab": {"sampler-truncation-unmatched": (
        "the full-vocabulary trainer under a truncated sampler is the problem this comparison shows (its second run "
        "has the safe vocabulary)")}}.get(cfg.compare, {})
    # what it does and which model, before the heavy imports (each run then says its own settings)
    say(f"tim-plugins demo: {len(runs)} runs, {' then '.join(label for label, _ in runs)}, on one page; "
        f"report: {Path(cfg.out) / 'report.html'}")
    say(model_status(cfg.model))
    for i, (label, run) in enumerate(runs, 1):
        say(f"\n[{i}/{len(runs)}] {label}")
        summaries[label] = run_demo(run, deliberate=shown if i == 1 else None)
    title = {"safe_vocab": f"Truncated sampling against a full-vocabulary trainer, and the fix: the safe vocabulary "
                           f"({model_label(cfg.model)})",
             "rollout_dtype": f"{cfg.rollout_dtype} rollouts against a float32 trainer, and the fix: float32 "
                              f"rollouts ({model_label(cfg.model)})"}[cfg.compare]
    decoders = {label: token_decoder(summaries[label]["settings"]["model"]) for label, _ in runs}
    # what `tim-plugins report OUT` reads to rebuild this page: the run folders (relative to OUT), labels and title
    (Path(cfg.out) / COMPARISON_FILE).write_text(json.dumps(
        {"kind": "comparison", "runs": [Path(run.out).name for _, run in runs],
         "labels": [label for label, _ in runs], "title": title}, indent=2) + "\n")
    path = build_comparison([run.out for _, run in runs], Path(cfg.out) / "report.html",
                            labels=[label for label, _ in runs], title=title, decode=decoders)
    return {"runs": summaries, "report": str(path)}


# What a run costs, for the command's help: the measured figures and their conditions are docs/demo.md's.
DEMO_COST = ("toy model: 30 s on 2 idle cores, 1.5 min at load 4; --model smollm2: 1.5 min idle, about 10 min at "
             "load 4")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help=f"A mismatch and its fix inside a real GRPO run (TRL GRPOTrainer + TIMCallback on CPU): top-p "
             f"rollouts against a full-vocabulary trainer, then with the safe vocabulary, on one page ({DEMO_COST}).",
        description="Short TRL GRPOTrainer runs on CPU with TIMCallback attached, bf16 rollouts against an fp32 "
                    "trainer. By default two runs: rollouts sampled with top-p against a full-vocabulary trainer "
                    "(every token's ratio reads the kept mass), then the same with the safe vocabulary "
                    "(TIMConfig(safe_vocab=True): the ratio back to 1), each in OUT/<run>/ (report.html, "
                    "summary.json, dump/), and OUT/report.html comparing them. --compare none runs once with the "
                    "switches given (--safe-vocab, --is-correction, --lr-decay, --top-p, ...). --model smollm2 runs "
                    f"on SmolLM2-135M-Instruct (short runs by default: {REAL_MODEL_DEFAULTS['steps']} steps of "
                    f"{REAL_MODEL_DEFAULTS['prompts_per_step']} prompts x {REAL_MODEL_DEFAULTS['num_generations']} "
                    f"completions). Time: {DEMO_COST}.")
    add_config_options(p, DemoConfig, {"rollout_dtype": ROLLOUT_DTYPES, "compare": COMPARISONS})
    p.set_defaults(func=_main)


def _print_verdict(summary: dict, indent: str = "") -> None:
    v = summary["verdict"]
    print(f"{indent}{v['headline']}")
    for status, text, _ in v["lines"]:
        print(f"{indent}  [{status.upper():5}] {text}")
    for line in v.get("extra", []):
        print(f"{indent}  {line}")


def _main(args) -> int:
    cfg = config_from_args(args, DemoConfig)
    if cfg.compare != "none":
        result = run_comparison(cfg)
        for label, summary in result["runs"].items():
            print(f"\n{label} ({Path(summary['report']).parent}):")
            _print_verdict(summary, "  ")
        print(f"\n{_comparison_line(result['runs'])}")
        print(f"\nreport comparing the runs: {result['report']}")
        return 0
    summary = run_demo(cfg)
    print()
    _print_verdict(summary)
    rows = summary.get("disagreements")
    if rows:
        from tim_plugins.report.disagreements import disagreements_text

        print("\nLargest disagreements (p rollout → p trainer, Δ log p, the token in ⟦ ⟧; the report lists more):")
        for line in disagreements_text(rows[:5]):
            print(f"  {line}")
    print(f"\nreport: {summary['report']}\nsummary: {Path(summary['report']).parent / 'summary.json'}")
    return 0


def _comparison_line(runs: dict[str, dict]) -> str:
    """The two runs side by side in one line: each one's mean ρ and k3 over its logged steps (token-weighted)."""
    parts = []
    for label, summary in runs.items():
        rows = [h for h in summary["log_history"] if h.get("tim/tokens")]
        n = sum(h["tim/tokens"] for h in rows)
        rho = sum(h["tim/tokens"] * h["tim/token/ratio_mean"] for h in rows) / n if n else float("nan")
        k3 = sum(h["tim/tokens"] * h["tim/token/kl_k3"] for h in rows) / n if n else float("nan")
        parts.append(f"{label}: ρ mean {rho:.4f}, k3 {k3:.2e} nats/token")
    return "Side by side: " + "; ".join(parts) + "."
