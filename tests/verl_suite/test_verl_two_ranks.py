"""Exact merge over data-parallel ranks: two gloo processes run verl's FSDP2 engine (world size 2, parameters
sharded) on half a batch each; the monitor metrics merged inside the workers equal a single process on the
whole batch."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

VOCAB = 383
TIM = {"monitor": {"enable": True}, "safe_vocab": {"min_p": 0.05}}


def _rank(rank: int, model_path: str, out_dir: str) -> None:
    # the CPU shims came in at start-up (cpu_site/sitecustomize.py, see the test), before this module imported verl
    sys.path.insert(0, os.path.dirname(__file__))
    import harness as H

    from tim_plugins.integrations.verl.config import TIMVerlConfig

    H.init_dist(rank=rank, world=2, port=29583)
    eng = H.build_engine(model_path)
    eng.tim_configure(TIMVerlConfig.from_node(TIM))
    td, _ = H.make_batch(VOCAB, batch=8, seed=5, rows=slice(4 * rank, 4 * rank + 4))
    H.infer(eng, td)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(eng.tim_pop_metrics(), f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_rank_merge_equals_single_process(toy_model_path, tmp_path, monkeypatch):
    import harness as H

    from tim_plugins.integrations.verl.config import TIMVerlConfig

    cpu_site = os.path.join(os.path.dirname(__file__), "cpu_site")  # the spawned ranks install the shims at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [cpu_site, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TIM_TEST_CPU_SHIMS", "1")
    mp.start_processes(_rank, args=(str(toy_model_path), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    merged = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert merged[0] == merged[1]  # every rank holds the merged values

    H.init_dist(port=29584)
    eng = H.build_engine(toy_model_path)
    eng.tim_configure(TIMVerlConfig.from_node(TIM))
    td, _ = H.make_batch(VOCAB, batch=8, seed=5)
    H.infer(eng, td)
    single = eng.tim_pop_metrics()
    assert set(single) == set(merged[0])
    assert single["tim/tokens"] > 0 and single["tim/safe_vocab/boundary_frac"] > 0
    for key, want in single.items():
        got = merged[0][key]
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), key
        elif key.endswith(("_max", "/tokens", "/count", "invalid_tokens")) or "ratio_min" in key:
            assert got == want, key  # counts and maxima merge bit-exactly
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), key  # sums: order differs (fp32 forward)
