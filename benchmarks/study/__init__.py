"""The TIM study (issue 8): GRPO through TRL with the TIM callback on a toy verifiable task, every TIM arm and
mitigation side by side, >= 3 seeds, resumable, with an HTML report. Entry points: ``tim-plugins study`` and
``python -m benchmarks.study``; see `benchmarks.study.main`."""

from .main import main, run_study

__all__ = ["main", "run_study"]
