"""The one min-p rule (the sampler's relative cut: keep tokens with p >= min_p * p_max), torch-free.

The truncation it bounds, the shared settings, the vLLM processor's settings and the command line all check min-p
with it; it imports nothing of the package so that each of them can (no import cycle, no torch on the command line).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MIN_P_RULE", "min_p_accepted"]

MIN_P_RULE = "must be a number in [0, 1) (0 = no min-p pruning; 1 would keep only the most likely token: greedy)"


def min_p_accepted(value: Any) -> bool:
    """Whether ``value`` is a min-p of ours (``MIN_P_RULE``): a real number, not a bool or a string."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and 0.0 <= value < 1.0)
