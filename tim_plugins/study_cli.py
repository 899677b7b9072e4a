"""``tim-plugins study``: the TIM study (GRPO via TRL + TIMCallback, every arm and mitigation, >= 3 seeds).

The study's code lives in the source tree's ``benchmarks/study`` (not in the wheel); it is imported only when
the subcommand runs, from the current directory or the repository this package was installed from (editable).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["register"]


def _import_study():
    import importlib

    root = Path(__file__).resolve().parents[1]  # editable install: <repo>/tim_plugins/study_cli.py
    for candidate in (Path.cwd(), root):
        if (candidate / "benchmarks" / "study" / "main.py").is_file():
            if str(candidate) not in sys.path:
                sys.path.insert(0, str(candidate))
            return importlib.import_module("benchmarks.study.main")
    return None


def _run(args) -> int:
    study_main = _import_study()
    if study_main is None:
        print("tim-plugins study: the study's code (benchmarks/study/) is part of the source tree, not the "
              "installed package. Clone the tim-plugins repository and run `tim-plugins study` from its root "
              "(or `python -m benchmarks.study`) with the [trl] extra installed.", file=sys.stderr)
        return 2
    try:
        study_main.run_from_args(args)
    except ImportError as err:
        print(f"tim-plugins study: missing dependency ({err}); install tim-plugins[trl].", file=sys.stderr)
        return 2
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study", help="GRPO study of training-inference mismatch and its mitigations (TRL, toy task)",
        description="Run every arm (exact, bf16, injected k3 targets, each mitigation, all together) x seeds "
                    "with TRL's GRPOTrainer and the TIM callback; write per-run CSVs, a summary and an HTML "
                    "report. Resumable: finished arm/seed runs are skipped.")
    # Mirrors benchmarks.study.main.add_arguments (kept here so `--help` needs no source tree); None = its default.
    p.add_argument("--out", default=None, help="results folder (default: <repo>/benchmarks/results/study)")
    p.add_argument("--quick", action="store_true", help="3 arms x 1 seed x 4 steps (smoke run, < 3 min)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 80; quick 4)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds, 0..N-1 (default 3)")
    p.add_argument("--arms", default=None, help="comma list of arm names (default: all)")
    p.add_argument("--model", default=None, help="local HF model path instead of the toy sort model")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a study config field for every arm (JSON value), e.g. --set learning_rate=5e-3")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.set_defaults(func=_run)
