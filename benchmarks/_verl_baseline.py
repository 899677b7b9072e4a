"""verl 0.9.1's own mismatch-metric functions, the baseline of ``bench_metrics``.

Normally imported from the installed verl. On a machine where verl cannot be installed (the GPU machine has
no package index, and ``import verl`` pulls in ray, tensordict, hydra, ...), ``--verl-source DIR`` loads the
same function definitions, unmodified, from a copy of verl's source files: the ``def`` nodes are taken from
the files with ``ast`` and executed with the few names they use. ``tests/verl_suite/test_bench_baseline.py``
checks that both ways give identical results.
"""

from __future__ import annotations

import ast
import logging
import math
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["VerlBaseline", "load_verl_baseline", "VERL_SOURCE_FILES"]

# The functions the baseline calls, by the file (relative to the verl package) that defines them.
VERL_SOURCE_FILES: dict[str, tuple[str, ...]] = {
    "utils/torch_functional.py": ("masked_sum", "masked_mean"),
    "utils/debug/metrics.py": ("pearson_correlation_coefficient", "calculate_log_prob_diff", "calculate_debug_metrics"),
    "trainer/ppo/rollout_corr_helper.py": (
        "SAFETY_BOUND", "compute_offpolicy_metrics", "compute_rollout_corr_metrics_from_logprobs",
    ),
}


class _BatchOnly:
    """What ``calculate_debug_metrics`` reads of a ``DataProto``: its ``batch`` mapping."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.batch = dict(tensors)


class VerlBaseline:
    """``run(rollout, train, mask)`` calls verl's debug metrics and rollout-correction metrics once."""

    def __init__(self, debug_metrics: Callable, rollout_corr_metrics: Callable, make_data: Callable, origin: str):
        self.debug_metrics = debug_metrics
        self.rollout_corr_metrics = rollout_corr_metrics
        self.make_data = make_data
        self.origin = origin

    def run(self, rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        data = self.make_data({
            "rollout_log_probs": rollout, "old_log_probs": train, "response_mask": mask,
            "responses": torch.zeros_like(mask),
        })
        return {**self.debug_metrics(data), **self.rollout_corr_metrics(train, rollout, mask)}


def _definitions(path: Path, names: tuple[str, ...]) -> list[ast.stmt]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"{path} does not define {missing}: is it verl 0.9.x?")
    return [found[n] for n in names]


def load_verl_baseline(source_dir: str | Path | None = None) -> VerlBaseline:
    """The installed verl's functions, or (``source_dir`` = a verl package folder) the same definitions
    executed from its source files."""
    if source_dir is None:
        from verl import DataProto
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs
        from verl.utils.debug.metrics import calculate_debug_metrics

        return VerlBaseline(
            calculate_debug_metrics, compute_rollout_corr_metrics_from_logprobs,
            lambda tensors: DataProto.from_dict(tensors=tensors), "installed verl",
        )
    root = Path(source_dir)
    namespace: dict[str, Any] = {
        "torch": torch, "math": math, "logging": logging, "logger": logging.getLogger("verl_baseline"),
        "Any": Any, "Optional": Optional, "DataProto": _BatchOnly, "__name__": "verl_baseline",
    }
    functional = types.SimpleNamespace()
    for rel, names in VERL_SOURCE_FILES.items():
        module = ast.Module(body=_definitions(root / rel, names), type_ignores=[])
        exec(compile(module, str(root / rel), "exec"), namespace)  # verl's own definitions, unmodified
        if rel == "utils/torch_functional.py":
            for name in names:
                setattr(functional, name, namespace[name])
            namespace["verl_F"] = functional
    return VerlBaseline(
        namespace["calculate_debug_metrics"], namespace["compute_rollout_corr_metrics_from_logprobs"],
        _BatchOnly, f"verl source files in {root}",
    )
