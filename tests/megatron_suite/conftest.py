"""The Megatron suite runs in its own Python 3.12 environment (.venv-megatron, scripts/megatron_env) and pytest
process: verl 0.9.1's Megatron engine (megatron-core 0.19.2, mbridge 0.15.1) on CPU with gloo, behind the test-only
shims of ``cpu_site/megatron_shims.py``, installed here before anything imports verl. Two-process runs (TP2, DP2)
start ``ranks.py``, which installs the same shims first.
"""

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("megatron") is None:  # not this suite's environment (e.g. `pytest tests` in .venv)
    collect_ignore_glob = ["*"]
else:
    HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [HERE, os.path.join(HERE, "cpu_site")]

    import megatron_shims

    megatron_shims.install()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Directory of the tiny Qwen2 (``cpu_site/tiny_qwen2.py``)."""
    from tiny_qwen2 import build_tiny_qwen2

    return str(build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def one_rank():
    """torch.distributed in this process: world size 1 (gloo), so Megatron's parallel state here is TP1."""
    import harness as H

    H.init_dist(port=29611)
    yield
