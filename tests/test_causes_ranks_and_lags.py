"""The named causes where several ranks check their own engines (gloo on CPU, real processes) and the staleness rule
by lag's message: each against an independent reference (one process fed every cause, the lags written in the
test)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from spawn_ranks import spawn_ranks

from tim_plugins.cause_registry import Cause
from tim_plugins.causes import CauseTracker

WORLD = 3


def _found_on(rank: int) -> list[Cause]:
    """What each rank's sync checks found in one window of two syncs (after optimizer steps 3 and 4): rank 0
    nothing, ranks 1 and 2 a stale layer at both syncs, each its own tensors, and rank 2 a stale prefix cache."""
    if rank == 0:
        return []
    out = [Cause("sync-tensors-stale", step, f"at the weight sync after optimizer step {step}, rank {rank}'s layer",
                 tensors=(f"model.layers.{rank}.q.weight", f"model.layers.{rank}.k.weight"), evidence={"bad": 2})
           for step in (3, 4)]
    if rank == 2:
        out.append(Cause("sync-prefix-cache", 4, "3 blocks kept", evidence={"blocks": 3}))
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tracker = CauseTracker(framework="trl")
        tracker.add_found(_found_on(rank))
        values, found = tracker.evaluate(5, {})
        queue.put((rank, values, [c.to_dict() for c in found], tracker.tally, tracker.summary_lines()))
    finally:
        dist.destroy_process_group()


def test_every_cause_the_lowest_rank_found_in_a_window_reaches_the_other_ranks():
    """A window holding two syncs: rank 0's engine is fine, ranks 1 and 2 each kept a layer stale at both syncs.
    Rank 0 (whose console, causes.jsonl and closing line the user reads) names the code as rank 1 did, both syncs
    with their steps and tensors, and the code only rank 2 found as rank 2 did; every rank's closing lines count the
    window once. Reference: one process fed the causes of the lowest rank that found each code; the tally, counted
    here from what the ranks were fed."""
    results = spawn_ranks(_worker, WORLD, timeout=180)
    reference = CauseTracker(framework="trl")
    lowest = {}
    for rank in range(1, WORLD):
        for cause in _found_on(rank):
            if lowest.setdefault(cause.code, rank) == rank:
                reference.add_found([cause])
    want_values, want_found = reference.evaluate(5, {}, sync=False)
    rank_of = {c.code: lowest[c.code] for c in want_found}

    _, values0, found0, _, lines0 = results[0]
    assert values0["tim/cause/named"] == want_values["tim/cause/named"] == 2
    assert [(c["code"], c["step"], c["tensors"], c["evidence"], c["message"]) for c in found0] == [
        (c.code, c.step, list(c.tensors), c.evidence, f"{c.message} (on rank {rank_of[c.code]})") for c in want_found]
    assert [(c["step"], c["tensors"][0]) for c in found0 if c["code"] == "sync-tensors-stale"] == [
        (3, "model.layers.1.q.weight"), (4, "model.layers.1.q.weight")]
    # the run's closing line, counted here from what the ranks were fed: one window (every rank's causes of it count
    # once), each code's lowest and highest step among the causes found in it
    fed = [c for rank in range(WORLD) for c in _found_on(rank)]
    want_tally = {code: {"first": min(c.step for c in fed if c.code == code),
                         "last": max(c.step for c in fed if c.code == code), "windows": 1}
                  for code in dict.fromkeys(c.code for c in fed)}
    assert want_tally == {"sync-tensors-stale": {"first": 3, "last": 4, "windows": 1},
                          "sync-prefix-cache": {"first": 4, "last": 4, "windows": 1}}
    strip = lambda t: {k: {f: v for f, v in x.items() if f != "message"} for k, x in t.items()}  # noqa: E731
    for rank in range(WORLD):
        assert strip(results[rank][3]) == want_tally, rank
    assert [line.split(" (first: ")[0] for line in lines0] == [
        "tim-plugins: this run named [sync-tensors-stale] in 1 window, steps 3 to 4",
        "tim-plugins: this run named [sync-prefix-cache] at step 4"]
    # ranks 1 and 2 keep their own causes of the code they found, and rank 1 takes rank 2's other code
    for rank in (1, 2):
        _, values, found, _, _ = results[rank]
        assert values["tim/cause/named"] == 2
        own = [c for c in found if c["code"] == "sync-tensors-stale"]
        assert [(c["step"], c["tensors"][0]) for c in own] == [(3, f"model.layers.{rank}.q.weight"),
                                                                (4, f"model.layers.{rank}.q.weight")]
    assert [c["message"] for c in results[1][2] if c["code"] == "sync-prefix-cache"] == ["3 blocks kept (on rank 2)"]


def _lag_metrics(lags: dict) -> dict:
    """tim/by_lag/* of a window: {label: (tokens, k3)}."""
    out = {}
    for label, (n, k3) in lags.items():
        out[f"tim/by_lag/{label}/count"], out[f"tim/by_lag/{label}/kl_k3"] = float(n), float(k3)
    return out


@pytest.mark.parametrize("lags, said", [
    ({"0": (100, 1e-4), "1": (30, 0.2), "3": (20, 0.3)}, "1 to 3 optimizer steps"),
    ({"0": (100, 1e-4), "2": (30, 0.2), "3": (20, 0.3)}, "2 to 3 optimizer steps"),
    ({"0": (100, 1e-4), "1": (30, 0.2)}, "1 optimizer step"),
    ({"0": (100, 1e-4), "2": (30, 0.2)}, "2 optimizer steps"),
    ({"0": (100, 1e-4), "2": (30, 0.2), "8+": (5, 0.9)}, "2 to 8 or more optimizer steps"),
    ({"0": (100, 1e-4), "8+": (5, 0.9)}, "8 or more optimizer steps"),
])
def test_the_staleness_cause_by_lag_says_how_old_the_stale_tokens_are(lags, said):
    """The message of the staleness rule by lag gives the lags the stale tokens were trained at, the youngest to the
    oldest (the last bucket, ``8+``, open-ended), and their count and pooled k3: the lags as written here."""
    tracker = CauseTracker()
    _, found = tracker.evaluate(1, _lag_metrics(lags), sync=False)
    (cause,) = found
    stale = [(n, k3) for label, (n, k3) in lags.items() if label != "0"]
    tokens = sum(n for n, _ in stale)
    assert f"the {tokens} tokens trained {said} after the weights" in cause.message, cause.message
    assert cause.evidence["stale_tokens"] == tokens
    assert cause.evidence["stale_k3"] == pytest.approx(sum(n * k3 for n, k3 in stale) / tokens)
