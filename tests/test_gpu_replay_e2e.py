"""The analysis of ``benchmarks/gpu_replay_e2e.py`` (the end-to-end replay run for a device whose vLLM returns its kept
sets), on known inputs: an engine that samples from exactly the given sets and reports the float64 log-prob over them,
one of its tokens outside the trainer's recomputed cut. Replay then matches the engine to float32 rounding with no
boundary token; recompute loses that token; the full vocabulary reads the kept mass."""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_replay_e2e import analyze
from tim_plugins.replay import KeptSets
from tim_plugins.truncation import Truncation, truncation_threshold

T = 0.9
TRUNC = Truncation(top_k=12, top_p=0.8, temperature=T)


def _samples():
    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (5, 9):
        rows = torch.randn(n, 257, generator=g) * 3
        z = rows.double() / T
        keep = z >= truncation_threshold(z, TRUNC)[:, None]
        lists, tokens = [], []
        for i in range(n):
            ids = torch.nonzero(keep[i]).reshape(-1)
            if i == 1:  # the engine kept (and sampled) the most likely token the trainer's cut drops
                tok = int(torch.where(keep[i], -math.inf, z[i]).argmax())
                ids = torch.sort(torch.cat([ids, torch.tensor([tok])])).values
            else:
                tok = int(ids[torch.multinomial(torch.softmax(z[i, ids], 0), 1, generator=g)])
            lists.append(ids.tolist())
            tokens.append(tok)
        tokens = torch.tensor(tokens)
        engine = torch.stack([z[i, tokens[i]] - torch.logsumexp(z[i, lists[i]], 0) for i in range(n)])
        samples.append({"rows": rows, "tokens": tokens, "engine_logprobs": engine, "kept": KeptSets.from_lists(lists)})
    return samples


def test_replay_matches_the_engine_and_recompute_loses_the_boundary_token():
    samples = _samples()
    result = analyze(samples, TRUNC, T)
    n = sum(len(s["tokens"]) for s in samples)
    rep, rec, full = result["replay"], result["recompute"], result["full"]
    assert rep["tokens"] == rec["tokens"] == full["tokens"] == n
    assert rep["boundary_frac"] == 0.0 and rep["measured"] == n
    assert abs(rep["ratio_mean"] - 1) < 1e-6 and rep["abs_diff_max"] < 1e-5 and rep["kl_k3"] < 1e-11
    assert rec["boundary_frac"] == 2 / n and rec["measured"] == n - 2  # row 1 of each sample
    # elsewhere the recomputed set is the engine's: the same values on the tokens it keeps
    assert rec["abs_diff_max"] < 1e-5
    # the full vocabulary reads the kept mass: well below 1
    assert full["ratio_mean"] < 0.95 and full["kl_k3"] > 100 * rep["kl_k3"]
    want = sum(len(x) for s in samples for x in s["kept"].to_lists()) / n
    assert rep["size_mean"] == want
