"""``python -m benchmarks.study``: run every arm × seed (resumable, in parallel processes), then analyse.

    python -m benchmarks.study                                   # the CPU study (main, length, update, surge)
    python -m benchmarks.study --scenarios mitigation --set mitigation_cell=profile_x30@lr5x
    python -m benchmarks.study --quick --out /tmp/study          # every code path, a few steps (the test)
    python -m benchmarks.study --device cuda                     # the GPU-scale preset (bigger model, 400 steps)

Layout of ``--out``: ``study.json`` (config, arms, rules, measured profile, environment),
``runs/<arm>/seed<k>.csv`` (one row per step: every key TRL + the TIM callback logged), ``seed<k>.eval.csv``
(the trained policy's held-out evaluations) and ``seed<k>.json`` (run metadata), then ``summary.csv``,
``summary.json`` (per-arm rows, paired comparisons, degradation verdicts, harm curve), ``summary.md`` (its tables
in Markdown) and ``report.html``.
A run's CSV is written last and atomically: a killed study redoes only the unfinished arm/seed runs; finished
runs with the same configuration fingerprint are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

__all__ = ["main", "add_arguments", "run_study", "QUICK", "GPU"]

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "study"
QUICK_OUT = DEFAULT_OUT.with_name("study_quick")  # a smoke run never touches the default study's results
# --quick: one seed, a few steps, short budgets and a short warm start; every code path once: exact sampler,
# the control, bf16 and fp16 engines, the profiled injector, the length-surge task with LR decay, and a
# mitigation (IS correction) and the safe vocabulary.
QUICK = {"steps": 3, "seeds": (0,), "budget": 12, "lengths": (), "magnitudes": (30.0,), "curve_magnitudes": (),
         "eval_every": 2, "eval_prompts": 16, "surge_budget": 16, "surge_after": 1, "warm_start_steps": 30,
         "scenarios": ("main", "surge", "mitigation"), "mitigation_cell": "profile_x30",
         "arms": ("exact", "control", "bf16", "fp16", "profile_x30", "control@surge", "control+lr_decay@surge",
                  "profile_x30+token_tis", "profile_x30+safe_vocab"),
         "mitigations": ("token_tis", "safe_vocab"), "lr_decay_options": {"warmup_steps": 1, "cooldown": 1,
                                                                          "window": 1, "patience": 1}}
# --device cuda: a bigger model, a larger batch, hundreds of steps, longer completions (not run on CPU).
GPU = {"steps": 400, "seeds": (0, 1, 2), "budget": 256, "lengths": (64, 512), "hidden_size": 256,
       "num_layers": 4, "prompts_per_step": 8, "num_generations": 8, "eval_prompts": 256, "eval_every": 20,
       "warm_start_steps": 3000, "surge_budget": 512, "surge_after": 60, "learning_rate": 1e-4,
       "lr_decay_options": {"warmup_steps": 20, "cooldown": 20}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help=f"results folder (default: {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="every code path, 1 seed x 3 steps (smoke run, ~2 min)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 100; quick 3; GPU 400)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds, 0..N-1 (default 3)")
    p.add_argument("--scenarios", default=None, help="comma list among main,length,update,surge,mitigation")
    p.add_argument("--arms", default=None, help="comma list of arm names (default: every arm of the scenarios)")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (processes; 1 torch thread each)")
    p.add_argument("--model", default=None, help="local HF model path instead of the chain task's warm start")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda selects the GPU-scale preset (see GPU in this module) unless --scale cpu")
    p.add_argument("--scale", default=None, choices=("cpu", "gpu"), help="preset (default: by --device)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of a single-process study")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a StudyConfig field (JSON value), e.g. --set learning_rate=1e-3 "
                        "--set 'magnitudes=[3,30]'")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")


def _config_from_args(args):
    from .arms import StudyConfig

    kw = dict(QUICK) if args.quick else {}
    scale = args.scale or ("gpu" if args.device == "cuda" else "cpu")
    if scale == "gpu" and not args.quick:
        kw.update(GPU)
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.seeds is not None:
        kw["seeds"] = tuple(range(args.seeds))
    if args.scenarios:
        kw["scenarios"] = tuple(a.strip() for a in args.scenarios.split(",") if a.strip())
    if args.arms:
        kw["arms"] = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    kw.update(_overrides(getattr(args, "set", None) or []))
    try:
        cfg = StudyConfig(device=args.device, model=args.model, **kw)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"study configuration: {err}") from err
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


# The StudyConfig fields a single run depends on (an arm carries its own budget, LR, clipping, magnitude).
_RUN_FIELDS = ("steps", "prompts_per_step", "num_generations", "temperature", "loss_type", "eval_every",
               "eval_prompts", "device", "profile_setting")


def _fingerprint(cfg, arm, model_path: str, profile) -> str:
    d = {k: getattr(cfg, k) for k in _RUN_FIELDS}
    if arm.task == "chain_stop":
        d["surge_after"] = cfg.surge_after
    if arm.lr_decay:
        d["lr_decay_options"] = cfg.lr_decay_options
    if arm.safe_vocab:
        d["min_p"] = cfg.min_p
    blob = json.dumps({"cfg": d, "arm": arm.__dict__, "model": model_path,
                       "profile": profile if arm.magnitude > 0 else None}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _quiet():
    """The libraries' chatter and warnings off for the study's runs, restored after: a study run in-process (the
    tests, ``--workers 1``) must leave the caller's logging as it found it (a ``tim_plugins`` logger left at ERROR
    silenced the console lines of every later test in the same process)."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = ("transformers", "trl", "tim_plugins", "accelerate", "datasets")
    levels = {name: logging.getLogger(name).level for name in names}
    restore = []
    try:
        import datasets
        import transformers

        hf = transformers.utils.logging
        verbosity, bars = hf.get_verbosity(), hf.is_progress_bar_enabled()
        ds_bars = datasets.is_progress_bar_enabled()
        hf.set_verbosity_error()
        hf.disable_progress_bar()
        datasets.disable_progress_bars()
        restore.append(lambda: hf.set_verbosity(verbosity))
        restore.append(hf.enable_progress_bar if bars else hf.disable_progress_bar)
        restore.append(datasets.enable_progress_bars if ds_bars else datasets.disable_progress_bars)
    except ImportError:
        pass
    for name in names:  # after transformers' own set_verbosity_error, which sets its logger's level too
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            yield
    finally:
        for undo in restore:
            undo()
        for name, level in levels.items():  # last: exactly the levels found, NOTSET included
            logging.getLogger(name).setLevel(level)


def load_profile(cfg) -> dict:
    """The injector's measured profile (``measured_profile_smollm2.json``, setting ``cfg.profile_setting``)."""
    from tim_plugins.rollout.inject import InjectionProfile

    from .arms import PROFILE_FILE

    path = Path(__file__).resolve().parent / PROFILE_FILE
    return InjectionProfile.from_measure_summary(json.loads(path.read_text()), cfg.profile_setting).to_dict()


def _job(payload: dict) -> tuple[str, int, float]:
    """One arm × seed in a worker process (spawned: a fresh interpreter, one torch thread)."""
    import tempfile

    import torch

    from .arms import Arm
    from .run import run_one, save_run

    with _quiet():
        if payload.get("threads"):
            torch.set_num_threads(payload["threads"])
        arm = Arm(**payload["arm"])
        with tempfile.TemporaryDirectory(prefix="tim-study-") as tmp:
            result = run_one(arm, payload["seed"], payload["cfg"], payload["model_path"], payload["profile"], Path(tmp))
        save_run(Path(payload["out"]), arm.name, payload["seed"], result, payload["fingerprint"])
        return arm.name, payload["seed"], result["seconds"]


def _run_jobs(jobs: list[dict], workers: int, log) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc="study", unit="run", disable=not jobs)
    if workers <= 1:
        for job in jobs:
            bar.set_postfix_str(f"{job['arm']['name']} seed {job['seed']}")
            _job(job)
            bar.update()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_job, {**job, "threads": 1}) for job in jobs]
            for fut in as_completed(futures):
                name, seed, seconds = fut.result()
                bar.set_postfix_str(f"{name} seed {seed}: {seconds:.0f} s")
                bar.update()
    bar.close()


def run_study(cfg, out: Path, *, report: bool = True, workers: int = 1, log=print) -> dict:
    with _quiet():
        return _run_study(cfg, out, report=report, workers=workers, log=log)


def _run_study(cfg, out: Path, *, report: bool, workers: int, log) -> dict:
    from benchmarks._common import environment

    from . import analysis
    from .arms import build_arms, collapse_rule, degradation_rule
    from .task import task_spec, warm_start

    out.mkdir(parents=True, exist_ok=True)
    arms = build_arms(cfg)
    profile = load_profile(cfg)
    model_paths = {}
    for variant in sorted({a.task for a in arms}):
        if cfg.model:
            model_paths[variant] = str(Path(cfg.model).resolve())
        else:
            from tim_plugins.toy_model import default_cache_dir

            model_paths[variant] = str(warm_start(task_spec(variant, cfg), default_cache_dir() / "study", log=log))
    rule, crule = degradation_rule(), collapse_rule()
    meta = {"config": cfg.to_dict(), "model_paths": model_paths, "degradation_rule": rule, "collapse_rule": crule,
            "profile": profile, "arms": [a.__dict__ for a in arms], "environment": environment()}
    (out / "study.json").write_text(json.dumps(meta, indent=1, default=str))

    from .run import finished

    jobs, skipped = [], 0
    for arm in sorted(arms, key=lambda a: -a.budget):  # longest runs first: better packing on the workers
        for seed in cfg.seeds:
            fp = _fingerprint(cfg, arm, model_paths[arm.task], profile)
            if finished(out, arm.name, seed, fp):
                skipped += 1
                continue
            jobs.append({"arm": dict(arm.__dict__), "seed": seed, "cfg": cfg, "model_path": model_paths[arm.task],
                         "profile": profile, "out": str(out), "fingerprint": fp})
    if skipped:
        log(f"resume: {skipped} of {skipped + len(jobs)} runs already finished, skipping them")
    _run_jobs(jobs, workers, log)

    runs, evals, seconds = {}, {}, {}
    for arm in arms:
        for seed in cfg.seeds:
            d = out / "runs" / arm.name
            if (d / f"seed{seed}.csv").exists():
                runs.setdefault(arm.name, {})[seed] = analysis.load_run(d / f"seed{seed}.csv")
                evals.setdefault(arm.name, {})[seed] = analysis.load_run(d / f"seed{seed}.eval.csv")
                seconds.setdefault(arm.name, []).append(json.loads((d / f"seed{seed}.json").read_text())["seconds"])
    table = analysis.summarize(arms, runs, evals, seconds, rule, crule)
    comparisons = []
    for arm in arms:
        for vs in dict.fromkeys(v for v in (arm.control, analysis.zero_control(arm)) if v and v != arm.name):
            comp = analysis.paired(table, arm.name, vs, rule)
            if comp is not None:
                comparisons.append(comp)
    curve = analysis.harm_curve(table, comparisons)
    with open(out / "summary.csv", "w", newline="") as fh:
        cols = [k for k in table[0] if k != "endpoint_by_seed"] if table else []
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    summary = {"degradation_rule": rule, "collapse_rule": crule, "rows": table, "comparisons": comparisons,
               "harm_curve": curve, "skipped_runs": skipped, "ran_runs": len(jobs)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    from .report import markdown_tables, write_report

    (out / "summary.md").write_text(markdown_tables(summary))
    if report:
        write_report(out / "report.html", arms=arms, runs=runs, evals=evals, summary=summary, config=cfg.to_dict(),
                     env=meta["environment"])
    return {"out": str(out), "rows": table, "comparisons": comparisons, "harm_curve": curve,
            "skipped_runs": skipped, "ran_runs": len(jobs)}


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
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: must be >= 1")
    t0 = time.perf_counter()
    out = Path(args.out) if args.out else (QUICK_OUT if args.quick else DEFAULT_OUT)
    res = run_study(cfg, out, report=not args.no_report, workers=args.workers)
    res["wall_seconds"] = time.perf_counter() - t0
    if not args.out:  # the default locations also land in the benchmarks index format
        from benchmarks._common import write_results

        name = "study_quick" if args.quick else "study"
        degraded = [c["arm"] for c in res["comparisons"] if c["degraded"] and c["vs"].startswith("control")]
        write_results(name, {"command": f"python -m benchmarks.study{' --quick' if args.quick else ''}",
                             "config": cfg.to_dict(), "folder": str(out), "reference_arm": "control",
                             "wall_seconds": res["wall_seconds"], "degraded_arms": degraded,
                             "harm_onset": {c["cell"]: c["onset_arm"] for c in res["harm_curve"]}})
    by_arm = {c["arm"]: c for c in res["comparisons"] if c["vs"].startswith("control")}
    for row in res["rows"]:
        c = by_arm.get(row["arm"])
        delta = (f"Δ {c['delta_mean']:+.3f} [{c['ci95_low']:+.3f}, {c['ci95_high']:+.3f}]"
                 f"{' DEGRADED' if c['degraded'] else ''}" if c else "")
        print(f"{row['arm']:<30} eval {row['eval_sample_reward']:.3f}±{row['eval_sample_reward_std']:.3f} "
              f"greedy {row['eval_greedy_reward']:.3f}  k3 {row['k3_mean']:.3g}  {delta}")
    print(f"results in {res['out']} ({res['ran_runs']} runs, {res['skipped_runs']} skipped, "
          f"{res['wall_seconds']:.0f} s)")
    return res
