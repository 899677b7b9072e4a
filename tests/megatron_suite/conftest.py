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
def tiny_qwen2_vpp(tmp_path_factory):
    """Directory of the tiny Qwen2 with 4 layers: two pipeline stages of two virtual stages each."""
    from tiny_qwen2 import build_tiny_qwen2

    return str(build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_vpp"), layers=4))


@pytest.fixture(scope="session")
def one_rank():
    """torch.distributed in this process: world size 1 (gloo), so Megatron's parallel state here is TP1."""
    import harness as H

    H.init_dist(port=29611)
    yield


# two processes: ~70 s on an idle 2-core machine
RANKS_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def two_ranks(tiny_qwen2, tiny_qwen2_vpp, tmp_path_factory):
    """``ranks.py`` on two processes, once per session: {rank: {"tp2": stock_vs_tim(tp=2), "tp2_lr": lr_decay(tp=2),
    "tp2_fused": fused_safe_vocab(tp=2), "tp2_fused_sp": fused_safe_vocab(tp=2, sequence_parallel=True),
    "tp2_replay": replay(tp=2), "dp2": dp_monitor(world=2), "pp2": stock_vs_tim(tp=1, pp=2), "pp2_lr":
    lr_decay(tp=1, pp=2), "pp2_fused": fused_safe_vocab(tp=1, pp=2), "pp2_replay": replay(tp=1, pp=2), "vpp":
    stock_vs_tim(tp=1, pp=2, vpp=2), "vpp_fused": fused_safe_vocab(tp=1, pp=2, vpp=2)}, "dump_dir": the TP2 run's
    dump, "dump_dir_pp2": the PP2 run's, "dump_dir_vpp": the VPP run's}."""
    import subprocess

    import torch

    out = tmp_path_factory.mktemp("megatron_ranks")
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29621",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "ranks.py"), "--model", tiny_qwen2,
                               "--model-vpp", tiny_qwen2_vpp, "--out", str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(2)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=RANKS_TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return {**{r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)}, "dump_dir": out / "dump_tp2",
            "dump_dir_pp2": out / "dump_pp2", "dump_dir_vpp": out / "dump_vpp"}
