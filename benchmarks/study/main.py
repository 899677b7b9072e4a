"""``python -m benchmarks.study``: run every arm × seed, resumable, then report (from the repository's root).

    python -m benchmarks.study --out benchmarks/results/study            # default: 11 arms x 3 seeds
    python -m benchmarks.study --quick --out /tmp/study                  # 3 arms x 1 seed, a few steps
    python -m benchmarks.study --device cuda --steps 500 --model PATH    # a real run on a GPU

Layout of ``--out``: ``study.json`` (config, arms, calibration, environment), ``runs/<arm>/seed<k>.csv``
(one row per step: every key TRL + the TIM callback logged) and ``.json`` (run metadata), ``summary.csv``,
``summary.json`` and ``report.html``. A run's CSV is written last and atomically: a killed study redoes only
the unfinished arm/seed runs; finished runs with the same configuration fingerprint are skipped.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

__all__ = ["main", "add_arguments", "run_study", "QUICK"]

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "study"
QUICK_OUT = DEFAULT_OUT.with_name("study_quick")  # a smoke run never touches the default study's results
# --quick: the exact arm, the realistic arm and the strongest injected arm with every mitigation (exercises
# each code path), 1 seed, a few steps.
QUICK = {"steps": 4, "seeds": (0,), "arms": ("exact", "bf16", "inject_k3_1e-1+all"), "inject_targets": (1e-1,)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help=f"results folder (default: {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="3 arms x 1 seed x 4 steps (smoke run, < 3 min)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 80; quick 4)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds, 0..N-1 (default 3)")
    p.add_argument("--arms", default=None, help="comma list of arm names (default: all)")
    p.add_argument("--model", default=None, help="local HF model path instead of the toy sort model (its "
                   "tokenizer must encode the sort prompts; the reward stays exact-match sorting)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a StudyConfig field for every arm (JSON value), e.g. --set learning_rate=5e-3 "
                        "--set inject_targets=[0.1,1.0]; used for the collapse-knob runs")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")


def _config_from_args(args):
    from .arms import StudyConfig

    kw = dict(QUICK) if args.quick else {}
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.seeds is not None:
        kw["seeds"] = tuple(range(args.seeds))
    if args.arms:
        kw["arms"] = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    kw.update(_overrides(getattr(args, "set", None) or []))
    cfg = StudyConfig(device=args.device, model=args.model, **kw)
    if cfg.steps < 1:
        raise SystemExit(f"--steps {cfg.steps}: must be >= 1")
    if not cfg.seeds:
        raise SystemExit("--seeds 0: need at least one seed")
    return cfg


def _overrides(items: list[str]) -> dict:
    from dataclasses import fields

    from .arms import StudyConfig

    names = {f.name for f in fields(StudyConfig)}
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD among {sorted(names)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _fingerprint(cfg, arm, model_path: str, scales: dict) -> str:
    d = cfg.to_dict()
    d.pop("arms", None)
    d.pop("seeds", None)
    blob = json.dumps({"cfg": d, "arm": arm.__dict__, "model": model_path, "scales": scales}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _quiet() -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "tim_plugins", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    except ImportError:
        pass


def run_study(cfg, out: Path, *, report: bool = True, log=print) -> dict:
    import tempfile

    from tqdm.auto import tqdm

    from benchmarks._common import environment

    from . import analysis
    from .arms import build_arms, collapse_rule
    from .run import calibrate, finished, run_one, save_run
    from .task import TaskSpec, make_prompts, warm_start

    _quiet()
    out.mkdir(parents=True, exist_ok=True)
    arms = build_arms(cfg)
    spec = TaskSpec(sft_steps=150)
    if cfg.model:
        model_path = str(Path(cfg.model).resolve())
    else:
        from tim_plugins.toy_model import default_cache_dir

        model_path = str(warm_start(spec, default_cache_dir() / "study", log=log))
    study_file = out / "study.json"
    prev = json.loads(study_file.read_text()) if study_file.exists() else {}
    scales = prev.get("calibration") if prev.get("model_path") == model_path else None
    needed = {repr(float(a.target_k3)) for a in arms if a.target_k3 is not None}
    if needed and (scales is None or not needed <= set(scales)):
        scales = {**(scales or {}), **calibrate(model_path, cfg, make_prompts(32, spec, 999), log=log)}
    scales = scales or {}
    rule = collapse_rule()
    meta = {"config": cfg.to_dict(), "model_path": model_path, "calibration": scales, "collapse_rule": rule,
            "arms": [a.__dict__ for a in arms], "environment": environment()}
    study_file.write_text(json.dumps(meta, indent=1, default=str))

    jobs = [(a, s) for a in arms for s in cfg.seeds]
    todo = [(a, s) for a, s in jobs if not finished(out, a.name, s, _fingerprint(cfg, a, model_path, scales))]
    skipped = len(jobs) - len(todo)
    if skipped:
        log(f"resume: {skipped} of {len(jobs)} runs already finished, skipping them")
    with tempfile.TemporaryDirectory(prefix="tim-study-") as tmp:
        bar = tqdm(todo, desc="study", unit="run", disable=not todo)
        for arm, seed in bar:
            bar.set_postfix_str(f"{arm.name} seed {seed}")
            result = run_one(arm, seed, cfg, model_path, scales, Path(tmp) / f"{arm.name}-{seed}")
            save_run(out, arm.name, seed, result, _fingerprint(cfg, arm, model_path, scales))
    # Analysis of everything on disk for these arms/seeds.
    arm_runs, seconds = {}, {}
    for arm in arms:
        for seed in cfg.seeds:
            path = out / "runs" / arm.name / f"seed{seed}.csv"
            if path.exists():
                arm_runs.setdefault(arm.name, {})[seed] = analysis.load_run(path)
                info = json.loads((out / "runs" / arm.name / f"seed{seed}.json").read_text())
                seconds.setdefault(arm.name, []).append(info["seconds"])
    tim_arms = [a for a in arms if a.group == "tim"]
    reference = max(tim_arms, key=lambda a: a.target_k3 or 0.0).name if tim_arms else None
    table = analysis.summarize(arm_runs, seconds, rule, reference)
    with open(out / "summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    (out / "summary.json").write_text(json.dumps({"reference_arm": reference, "rows": table,
                                                  "collapse_rule": rule, "skipped_runs": skipped,
                                                  "ran_runs": len(todo)}, indent=1))
    if report:
        from .report import write_report

        write_report(out / "report.html", arm_runs=arm_runs, arms=arms, table=table, rule=rule,
                     config=cfg.to_dict(), reference=reference, env=meta["environment"], calibration=scales)
    return {"out": str(out), "rows": table, "skipped_runs": skipped, "ran_runs": len(todo),
            "reference_arm": reference}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_from_args(args)


def run_from_args(args) -> dict:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = _config_from_args(args)
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else (QUICK_OUT if args.quick else DEFAULT_OUT)
    res = run_study(cfg, out, report=not args.no_report)
    res["wall_seconds"] = time.perf_counter() - t0
    if not args.out:  # the default locations also land in the benchmarks index format
        from benchmarks._common import write_results

        name = "study_quick" if args.quick else "study"
        write_results(name, {"command": f"python -m benchmarks.study{' --quick' if args.quick else ''}",
                             "config": cfg.to_dict(), "folder": str(out), "reference_arm": res["reference_arm"],
                             "wall_seconds": res["wall_seconds"], "arms": res["rows"]})
    for row in res["rows"]:
        print(f"{row['arm']:<28} reward {row['final_reward_mean']:.3f}±{row['final_reward_std']:.3f}  "
              f"collapsed {row['collapsed_runs']}/{row['seeds']}  k3 {row['k3_start']:.3g} -> {row['k3_end']:.3g}  "
              f"cost x{row['cost_vs_reference']:.2f}")
    print(f"results in {res['out']} ({res['ran_runs']} runs, {res['skipped_runs']} skipped, "
          f"{res['wall_seconds']:.0f} s)")
    return res
