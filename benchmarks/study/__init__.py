"""The TIM study (issue 8): GRPO through TRL with the TIM callback on a toy verifiable task, every TIM arm and
mitigation side by side, >= 3 seeds, resumable, with an HTML report. Entry point: ``python -m benchmarks.study``
(from the repository's root); see `benchmarks.study.main`."""

from .main import main, run_study

__all__ = ["main", "run_study"]
