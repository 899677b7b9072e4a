"""TIMCallback in TRL's GRPOTrainer with two processes (CPU, gloo, ``torch.distributed.run``): every ``tim/``
statistic logged is the exact global value over both ranks, logged once per step.

Each configuration is one real ``GRPOTrainer.train()`` on two ranks (tests/trl_two_procs_run.py; all run one
after the other in one launch), bounded in time, its process group killed at the end (tests/bounded.py): the toy
model, TRL's transformers generation with a controlled mismatch (``rollout="inject"``), 3 steps of 2 micro-batches
of 4 completions (8 tokens at most) per rank, 16 completions per step in all. Each rank dumps every token it
measured (``sample_rate=1``, no cap). A third configuration has rank 1 meet a problem rank 0 does not (beam search,
which the monitor cannot measure): its count must reach the log too.

References, independent of the merge:
- the naive formulas below on BOTH ranks' dumps joined (``read_dump``), and on each rank's alone: the logged values
  must be the joined ones and differ from one rank's (else the check could not fail);
- the response tokens of the batches TRL built on each rank (a test-side wrapper of TRL's own method) and TRL's
  own ``completions/mean_length``, which TRL gathers over the ranks itself;
- for the statistics the dump does not carry (the safe set's pruned mass and size, the share of empty correction
  batches): each rank's own unmerged values (read just before the merge) combined by the merge's definition
  (token-weighted means, maxima).

Two more configurations train the ``monitor`` and ``mitigations`` ones under FSDP2 (accelerate's own sharding, through
``GRPOConfig(fsdp=True, fsdp_config={"version": 2})``; on a CPU launch accelerate drops the plugin and trains DDP
unless tests/cpu_fsdp2.py lets it apply it): every check above holds for them alike, and, against the DDP runs of the
same launch (the same data, seed and starting weights): the first step's loss and pre-clip grad norm are DDP's (a
gradient reduced wrongly across the ranks would change the norm), so are its sampled tokens and their log-probs, the
lm_head is a DTensor sharded by rows on the ranks, training changed it, and the safe-vocabulary head received the
whole lm_head weight. Four more train them under FSDP1 (``GRPOConfig(fsdp="full_shard auto_wrap", fsdp_config={
"version": 1, ...})``, ``FullyShardedDataParallel``), with ``use_orig_params`` True (transformers' default) and False
(accelerate's plugin default): the same checks, and accelerate really sharded (FSDP version 1, its units, half the
parameters on each rank, flat parameters alone with ``use_orig_params=False``), so a silent DDP fallback fails
(tests/cpu_fsdp2.py applies FSDP1 on the CPU as well).

Cost on the shared 2-core machine: the launch's start 7-15 s per rank, then each configuration a few seconds (its
trainer's set-up, training ~1 s; FSDP2 and FSDP1 ~1.5 s); ~0.85 GiB peak RSS per rank (the module's process tree:
1.8 GiB PSS).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from bounded import run_bounded  # noqa: E402

from tim_plugins.dump import read_dump  # noqa: E402
from tim_plugins.metrics import PROB_BUCKET_EDGES, abs_diff_bin_edges  # noqa: E402
from tim_plugins.by_key import KEYINGS  # noqa: E402
from tim_plugins.staleness import STALENESS_KEYS  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("trl_two_procs_run.py")
from trl_two_procs_run import CONFIG_MARK, CONFIGS, FSDP1, FSDP1_FLAT, FSDP2, ICEPOP_BAND  # noqa: E402

TIMEOUT_S = 400  # ~35 s idle; several times that under other load
STEPS = (1, 2, 3)
RANKS = (0, 1)
COMPLETIONS_PER_STEP = 16  # 2 ranks x 2 micro-batches x 4
RATIO_BAND = (0.5, 2.0)  # the monitor's default
# Means: float32 per-token values summed in float32 (the monitor) vs float64 (here), over ~100 tokens of |d| <= ~1:
# observed <= 3e-7 relative; one rank's mean differs from both ranks' by > 1e-3 relative.
MEAN_REL = 1e-5
# Counts, max |d|, and what the reference computes exactly as the monitor does: compared with ==.
EXACT = ("tim/tokens", "tim/invalid_tokens", "tim/token/abs_diff_max", "tim/token/abs_diff_p99",
         "tim/token/abs_diff_p999", "tim/seq/count")
# Written once, at the first log, by the parity audit (configuration findings, the same on every rank): not a
# statistic over tokens, so there is nothing to merge.
ONE_OFF = ("tim/parity/errors", "tim/parity/warnings", "tim/parity/infos")


def _no_cause(run: dict) -> set:
    """The tim/cause/* keys (merged over ranks like the rest: the same on both, _check_once_per_step): these runs have
    no fault, so no cause is named and no lag-0 token disagrees confidently at any step; no weight sync is checked
    (HF rollouts). Returns the keys."""
    from tim_plugins.causes import CAUSE_KEYS

    for step in STEPS:
        logged = _logged(run["ranks"][0], step)
        assert {k for k in logged if k.startswith("tim/cause/")} == set(CAUSE_KEYS), step
        assert logged["tim/cause/named"] == 0 and logged["tim/cause/confident_disagreements"] == 0, step
        assert math.isnan(logged["tim/cause/sync_checked_tensors"]), step
    return set(CAUSE_KEYS)


def _launch(model: Path, out: Path) -> dict[str, dict] | str:
    """Every configuration of CONFIGS, in one launch: config → its ranks' results, dump and its part of the
    launch's output; or why the launch failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUNNER),
           "--model", str(model), "--out", str(out), "--config", ",".join(CONFIGS)]
    t0 = time.time()
    proc, timed_out = run_bounded(cmd, TIMEOUT_S, cwd=ROOT)
    wall = time.time() - t0
    if timed_out:
        return f"ran past {TIMEOUT_S} s and was killed:\n{proc.stdout[-4000:]}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}:\n{proc.stdout[-6000:]}"
    print(f"\n[trl 2 procs] {wall:.0f} s wall")
    # The launch's output, cut where rank 0 starts each configuration: [before, name, lines, name, lines, ...].
    parts = re.split(rf"^{re.escape(CONFIG_MARK)}(\w+)\n", proc.stdout, flags=re.M)
    output = dict(zip(parts[1::2], parts[2::2]))
    if list(output) != list(CONFIGS):
        return f"the configurations' marks {list(output)} are not {list(CONFIGS)}:\n{proc.stdout[-6000:]}"
    results = {}
    for config in CONFIGS:
        ranks = [json.loads((out / config / f"rank_{r}.json").read_text()) for r in RANKS]
        print(f"[trl 2 procs {config}] set-up {ranks[0]['init_s']:.0f} s, train {ranks[0]['train_s']:.1f} s, "
              f"peak RSS per rank {max(r['peak_rss_mib'] for r in ranks):.0f} MiB")
        results[config] = {"ranks": ranks, "dump": read_dump(out / config / "dump").to_pydict(),
                           "stdout": output[config]}
    return results


@pytest.fixture(scope="module")
def runs(toy_model_path, tmp_path_factory):
    """``runs(config)`` → that configuration's results; the one launch runs at the first call (a failed launch fails
    every test)."""
    launched: list = []

    def get(config: str) -> dict:
        if not launched:
            launched.append(_launch(toy_model_path, tmp_path_factory.mktemp("trl2")))
        if isinstance(launched[0], str):
            pytest.fail(launched[0])
        return launched[0][config]

    return get


# ------------------------------------------------------------------------------------------- references
def _tokens(dump: dict, step: int, ranks=RANKS) -> dict:
    """The dumped tokens of ``step`` on ``ranks``: float32 log-probs as the trainer and the rollout gave them, and a
    sequence id unique over ranks."""
    col = {k: np.asarray(v) for k, v in dump.items()}
    sel = (col["step"] == step) & np.isin(col["rank"], ranks)
    return {"rollout": col["rollout_logprob"][sel].astype(np.float32),
            "train": col["train_logprob"][sel].astype(np.float32),
            "position": col["position"][sel].astype(np.int64),
            "seq": col["rank"][sel].astype(np.int64) * 1_000_000 + col["sequence"][sel]}


def naive_monitor(tok: dict) -> dict:
    """The monitor's statistics by their definitions. d is float32 (train − rollout, as the trainer's float32
    log-probs give it; the subtraction is exact in float64 and rounded once), everything after in float64."""
    d = (tok["train"] - tok["rollout"]).astype(np.float64)
    r = tok["rollout"].astype(np.float64)
    n, ad, rho = d.size, np.abs(d), np.exp(d)
    out = {"tim/tokens": float(n), "tim/invalid_tokens": 0.0,
           "tim/token/abs_diff_mean": ad.mean(), "tim/token/abs_diff_max": ad.max(),
           "tim/token/prob_abs_diff_mean": (np.exp(r) * np.abs(rho - 1)).mean(),
           "tim/token/prob_abs_diff_max": (np.exp(r) * np.abs(rho - 1)).max(),
           "tim/token/kl_k1": (-d).mean(), "tim/token/kl_k3": (rho - 1 - d).mean(),
           "tim/token/chi2": (rho * rho).mean() - 1, "tim/token/ratio_mean": rho.mean(),
           "tim/token/ratio_min": rho.min(), "tim/token/ratio_max": rho.max(),
           "tim/token/ratio_outside_frac": ((rho < RATIO_BAND[0]) | (rho > RATIO_BAND[1])).mean()}
    # Quantiles of |d| read from its log-spaced histogram: the upper edge of the bin (E_{i-1} <= |d| < E_i) that
    # holds the ceil(q n)-th smallest |d|, capped at the max.
    edges = abs_diff_bin_edges().numpy()
    for q, key in ((0.99, "p99"), (0.999, "p999")):
        v = np.sort(ad)[math.ceil(q * n) - 1]
        out[f"tim/token/abs_diff_{key}"] = min(edges[np.searchsorted(edges, v, side="right")], ad.max())
    seqs = np.unique(tok["seq"])
    seq_sum = np.array([d[tok["seq"] == s].sum() for s in seqs])
    out.update({"tim/seq/count": float(seqs.size), "tim/seq/log_ratio_mean": seq_sum.mean(),
                "tim/seq/log_ratio_abs_max": np.abs(seq_sum).max()})
    p = np.exp(r)
    for lo, hi in zip(PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:]):
        inside = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
        out[f"tim/by_prob/{lo:g}-{hi:g}/count"] = float(inside.sum())
        out[f"tim/by_prob/{lo:g}-{hi:g}/abs_diff_mean"] = ad[inside].mean() if inside.any() else math.nan
    return {k: float(v) for k, v in out.items()}


def naive_icepop(tok: dict) -> dict:
    """IcePop on the measured tokens (w = ρ inside [lo, hi], else 0): the correction's counts and the IS weights the
    monitor sees."""
    lo, hi = ICEPOP_BAND
    rho = np.exp((tok["train"] - tok["rollout"]).astype(np.float64))
    kept = (rho >= lo) & (rho <= hi)
    w = np.where(kept, rho, 0.0)
    seqs = np.unique(tok["seq"])
    rejected = sum(not kept[tok["seq"] == s].any() for s in seqs)
    n = w.size
    return {"tim/correction/kept_tokens": float(kept.sum()), "tim/correction/kept_frac": kept.mean(),
            "tim/correction/seq_rejected_frac": rejected / seqs.size, "tim/correction/invalid_tokens": 0.0,
            "tim/is/weight_mean": w.mean(), "tim/is/weight_min": w.min(), "tim/is/weight_max": w.max(),
            "tim/is/masked_frac": (w == 0).mean(), "tim/is/ess": w.sum() ** 2 / (n * (w * w).sum())}


def naive_split(tok: dict) -> dict:
    """The staleness / mismatch split of these runs by its definition: one optimizer step per generation batch, so
    every loss pass runs at the rollout's weights and the staleness part is exactly 0; the mismatch part is the
    monitor's d over the measured tokens."""
    d = (tok["train"] - tok["rollout"]).astype(np.float64)
    n = float(d.size)
    zero = {k: 0.0 for k in STALENESS_KEYS if k != "tim/staleness/tokens"}
    return {"tim/staleness/tokens": n, **zero, "tim/split/tokens": n, "tim/split/staleness_mean": 0.0,
            "tim/split/mismatch_mean": d.mean(), "tim/split/total_mean": d.mean(), "tim/split/total_var": d.var(),
            "tim/split/staleness_var_share": 0.0, "tim/split/mismatch_var_share": 1.0, "tim/split/cov_share": 0.0,
            # no token trained after an update since its rollout: none reused
            "tim/split/reused_tokens": 0.0, "tim/split/reused_staleness_var_share": math.nan,
            "tim/split/reused_staleness_kl_k3": math.nan}


def naive_by_key(tok: dict) -> dict:
    """tim/by_position/* (the measured tokens by response position, log-spaced buckets by their definition) and
    tim/by_lag/* (one optimizer step per generation batch: every token at lag 0, the whole log-ratio = d)."""
    d = (tok["train"] - tok["rollout"]).astype(np.float64)
    out = {}
    edges = KEYINGS["position"].edges
    bucket = np.array([max(i for i, lo in enumerate(edges) if lo <= p) for p in tok["position"]], dtype=np.int64)
    groups = [(f"tim/by_position/{KEYINGS['position'].labels[i]}", d[bucket == i]) for i in np.unique(bucket)]
    for prefix, x in groups + [("tim/by_lag/0", d)]:
        out.update({f"{prefix}/count": float(x.size), f"{prefix}/abs_diff_mean": np.abs(x).mean(),
                    f"{prefix}/mean": x.mean(), f"{prefix}/kl_k3": np.mean(np.expm1(x) - x),
                    f"{prefix}/abs_diff_max": np.abs(x).max()})
    return out


def _same(key: str, got: float, want: float) -> bool:
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    if key in EXACT or key.endswith(("/count", "tokens")):
        return got == want
    return got == pytest.approx(want, rel=MEAN_REL, abs=1e-12)


def _logged(rank: dict, step: int) -> dict:
    """The step's log entry; TRL's log() writes None for a metric whose values are all NaN (a statistic of an
    empty set, e.g. the mean |d| of an empty probability bucket): read back as NaN."""
    entry = next(h for h in rank["log_history"] if h.get("step") == step and "loss" in h)
    return {k: math.nan if v is None else v for k, v in entry.items()}


def _local(rank: dict, step: int) -> dict:
    (entry,) = [w["values"] for w in rank["local"] if w["step"] == step]
    return entry


def _check_merged(run: dict, naive) -> dict:
    """Every key of ``naive`` (a function of some tokens) as logged equals it on both ranks' tokens, per step; each
    rank's own unmerged value equals it on that rank's tokens. Returns {key: (steps where one rank's value differs
    from the logged one)} and prints the figures."""
    rank0, _ = run["ranks"]
    differs: dict[str, list] = {}
    for step in STEPS:
        logged = _logged(rank0, step)
        want = naive(_tokens(run["dump"], step))
        per_rank = [naive(_tokens(run["dump"], step, [r])) for r in RANKS]
        for key, value in want.items():
            assert _same(key, logged[key], value), (step, key, logged[key], value)
            for r in RANKS:  # the per-rank reference is what that rank held before the merge
                if key not in per_rank[r]:  # a bucket empty on this rank: absent from its own values too
                    assert key not in _local(run["ranks"][r], step), (step, r, key)
                    continue
                assert _same(key, _local(run["ranks"][r], step)[key], per_rank[r][key]), (step, r, key)
            if any(key not in per_rank[r] or not _same(key, logged[key], per_rank[r][key]) for r in RANKS):
                differs.setdefault(key, []).append(step)
        print(f"step {step}: " + "; ".join(
            f"{k.removeprefix('tim/')} rank0 {per_rank[0][k]:.6g} rank1 {per_rank[1][k]:.6g} merged {want[k]:.6g} "
            f"logged {logged[k]:.6g}" for k in ("tim/tokens", "tim/token/kl_k3", "tim/token/ratio_max")
            if k in want))
    return differs


def _check_discriminates(run: dict, differs: dict, keys) -> None:
    """A key that no rank's own value would have failed must be one where both ranks and the merge agree at every
    step (e.g. no invalid token anywhere): then there is nothing a missing merge could get wrong."""
    for key in keys:
        if key in differs:
            continue
        for step in STEPS:
            logged = _logged(run["ranks"][0], step)[key]
            assert all(_same(key, logged, _local(run["ranks"][r], step)[key]) for r in RANKS), (key, step)


def _check_once_per_step(run: dict) -> set:
    """tim/ keys reach log_history in one entry per step (the main process's), each from a window of exactly one
    pushed value (TRL's log() averages the list), and rank 1 logs the same merged values. Returns the keys."""
    rank0, rank1 = run["ranks"]
    for rank in (rank0, rank1):
        entries = [h for h in rank["log_history"] if "tim/tokens" in h]
        assert [h["step"] for h in entries] == list(STEPS)
        assert not any(k.startswith("tim/") for h in rank["log_history"] if "tim/tokens" not in h for k in h)
        windows = [w for w in rank["windows"] if w["tim_values"]]
        assert [w["step"] for w in windows] == list(STEPS)
        assert all(set(w["tim_values"].values()) == {1} for w in windows), windows
    for step in STEPS:  # transformers' log() runs on every rank; the merged statistics are the same there
        a, b = _logged(rank0, step), _logged(rank1, step)
        tim = {k for k in a if k.startswith("tim/")}
        assert tim == {k for k in b if k.startswith("tim/")}
        assert all(b[k] == a[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in tim), step
    # Only the main process prints the log (the console printer is rank-0 only): one line per step + the summary.
    assert run["stdout"].count("{'loss'") == len(STEPS)
    assert rank0["backend"] == "gloo" and rank0["world_size"] == 2 and rank1["rank"] == 1
    return {k for step in STEPS for k in _logged(rank0, step) if k.startswith("tim/")}


def _response_tokens(run: dict, step: int) -> int:
    return sum(b["tokens"] for rank in run["ranks"] for b in rank["batches"] if b["step"] == step)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("config", ["monitor", FSDP2 + "monitor", FSDP1 + "monitor", FSDP1_FLAT + "monitor"])
def test_monitor_statistics_are_the_global_values(runs, config):
    run = runs(config)
    assert {r["rollout_source"] for r in run["ranks"]} == {"inject"}
    assert not any(r["diag"] for r in run["ranks"])
    keys = _check_once_per_step(run)
    differs = _check_merged(run, lambda tok: {**naive_monitor(tok), **naive_split(tok), **naive_by_key(tok)})
    checked = set().union(*(f(_tokens(run["dump"], s)) for f in (naive_monitor, naive_split, naive_by_key)
                            for s in STEPS))
    # every tim/ key logged is checked (or a one-off audit count, or a cause's, checked by _no_cause)
    assert keys == checked | set(ONE_OFF) | _no_cause(run)
    # The key statistics could have failed: one rank's value differs from the logged one on some step.
    for key in ("tim/tokens", "tim/seq/count", "tim/token/abs_diff_max", "tim/token/abs_diff_mean",
                "tim/token/ratio_min", "tim/token/ratio_max", "tim/token/kl_k1", "tim/token/kl_k3",
                "tim/by_prob/0.1-0.5/count", "tim/by_prob/0.9-1/count", "tim/seq/log_ratio_abs_max"):
        assert key in differs, key
    _check_discriminates(run, differs, checked)
    print("not discriminated by one rank (same on both ranks at every step):", sorted(checked - set(differs)))
    for step in STEPS:
        logged = _logged(run["ranks"][0], step)
        # Every response token is measured here, so tim/tokens is also what TRL's own gathered metric counts.
        assert logged["tim/tokens"] == _response_tokens(run, step)
        assert logged["tim/tokens"] == pytest.approx(logged["completions/mean_length"] * COMPLETIONS_PER_STEP,
                                                     rel=1e-12)
        assert logged["tim/token/kl_k3"] > 1e-3  # the injected mismatch, far above float32 rounding


@pytest.mark.parametrize("config", ["mitigations", FSDP2 + "mitigations", FSDP1 + "mitigations",
                                    FSDP1_FLAT + "mitigations"])
def test_safe_vocab_and_icepop_statistics_are_the_global_values(runs, config):
    run = runs(config)
    assert not any(r["diag"] for r in run["ranks"])
    keys = _check_once_per_step(run)
    differs = _check_merged(run, lambda tok: {**naive_monitor(tok), **naive_icepop(tok), **naive_split(tok),
                                              **naive_by_key(tok)})
    boundary_total = dropped_total = 0
    for step in STEPS:
        logged = _logged(run["ranks"][0], step)
        local = [_local(rank, step) for rank in run["ranks"]]
        response = _response_tokens(run, step)
        measured = len(_tokens(run["dump"], step)["seq"])  # response tokens inside the trainer's safe set
        # Safe vocabulary: every response token of both ranks; boundary tokens are those the measurement left out.
        assert logged["tim/safe_vocab/tokens"] == response
        assert logged["tim/safe_vocab/tokens"] == pytest.approx(
            logged["completions/mean_length"] * COMPLETIONS_PER_STEP, rel=1e-12)
        assert logged["tim/safe_vocab/boundary_frac"] == pytest.approx((response - measured) / response, rel=1e-12)
        # What the dump does not carry: the ranks' own values, merged by definition (token-weighted, maxima).
        n = [v["tim/safe_vocab/tokens"] for v in local]
        for key in ("tim/safe_vocab/pruned_mass_mean", "tim/safe_vocab/size_mean"):
            assert logged[key] == pytest.approx(sum(v[key] * k for v, k in zip(local, n)) / sum(n), rel=1e-12), key
        assert logged["tim/safe_vocab/pruned_mass_max"] == max(v["tim/safe_vocab/pruned_mass_max"] for v in local)
        assert logged["tim/correction/empty"] == sum(v["tim/correction/empty"] for v in local) / 2  # 2 batches each
        # every logits row of the toy model is finite: no token without a distribution on either rank
        assert logged["tim/safe_vocab/invalid_tokens"] == 0 == sum(v["tim/safe_vocab/invalid_tokens"] for v in local)
        for key in ("tim/safe_vocab/tokens", "tim/safe_vocab/boundary_frac", "tim/safe_vocab/pruned_mass_mean",
                    "tim/safe_vocab/size_mean", "tim/safe_vocab/pruned_mass_max", "tim/correction/empty"):
            if any(not _same(key, logged[key], v[key]) for v in local):
                differs.setdefault(key, []).append(step)
        boundary_total += response - measured
        dropped_total += measured - logged["tim/correction/kept_tokens"]
        print(f"step {step}: safe_vocab/tokens rank0 {n[0]:.0f} rank1 {n[1]:.0f} logged "
              f"{logged['tim/safe_vocab/tokens']:.0f}; correction/kept_tokens rank0 "
              f"{local[0]['tim/correction/kept_tokens']:.0f} rank1 {local[1]['tim/correction/kept_tokens']:.0f} "
              f"logged {logged['tim/correction/kept_tokens']:.0f}; boundary {response - measured}")
    # Both mitigations acted: boundary tokens left the measurement, IcePop dropped tokens.
    assert boundary_total > 0 and dropped_total > 0
    checked = set().union(*(f(_tokens(run["dump"], s)) for f in (naive_monitor, naive_icepop, naive_split,
                                                                  naive_by_key) for s in STEPS)) | {
        "tim/safe_vocab/tokens", "tim/safe_vocab/boundary_frac", "tim/safe_vocab/pruned_mass_mean",
        "tim/safe_vocab/size_mean", "tim/safe_vocab/pruned_mass_max", "tim/correction/empty",
        "tim/safe_vocab/invalid_tokens"}
    assert keys == checked | set(ONE_OFF) | _no_cause(run)
    for key in ("tim/safe_vocab/tokens", "tim/safe_vocab/boundary_frac", "tim/safe_vocab/pruned_mass_mean",
                "tim/correction/kept_tokens", "tim/correction/kept_frac", "tim/is/weight_mean", "tim/is/masked_frac",
                "tim/tokens", "tim/token/kl_k3"):
        assert key in differs, key
    _check_discriminates(run, differs, checked)
    print("not discriminated by one rank (same on both ranks at every step):", sorted(checked - set(differs)))


def test_a_problem_met_on_one_rank_is_counted_in_the_log(runs):
    """Rank 1 generates by beam search, which the monitor cannot measure: it counts the problem and measures
    nothing. The log (rank 0's) counts rank 1's problem, and its statistics are rank 0's tokens alone."""
    run = runs("beam_on_rank1")
    rank0, rank1 = run["ranks"]
    assert rank0["diag"] == {} and rank1["diag"]["unsupported_generation_mode"] == len(STEPS)
    assert set(run["dump"]["rank"]) == {0}
    for step in STEPS:
        logged = _logged(rank0, step)
        (own0,) = [w["diag"] for w in rank0["local"] if w["step"] == step]
        (own1,) = [w["diag"] for w in rank1["local"] if w["step"] == step]
        assert own0 == {} and own1 == {"unsupported_generation_mode": float(step)}  # running totals
        assert logged["tim/diag/unsupported_generation_mode"] == step
        assert _logged(rank1, step)["tim/diag/unsupported_generation_mode"] == step
        want = naive_monitor(_tokens(run["dump"], step))
        for key, value in want.items():
            assert _same(key, logged[key], value), (step, key, logged[key], value)
        assert _local(rank1, step)["tim/tokens"] == 0 and logged["tim/tokens"] == _local(rank0, step)["tim/tokens"]


# The first step's loss and pre-clip grad norm under FSDP against DDP's. Observed: the loss equal, the norm within
# 1.1e-7 relative (FSDP2, FSDP1 with use_orig_params=False: another reduction order) or equal (FSDP1 with
# use_orig_params=True); an lm_head gradient left unreduced over the ranks (its shard trained on its own rank's tokens
# alone) moved the norm by 6.7e-4 here.
FIRST_STEP_REL = 1e-6
STEP1_LOGPROB_ABS = 1e-6
LM_HEAD_SHAPE = [383, 64]  # the toy model's vocabulary x hidden size


def _step_tokens(dump: dict, step: int) -> dict:
    """The dumped tokens of ``step`` in (rank, sequence, position) order: those keys with the token id, and the two
    log-probs."""
    col = {k: np.asarray(v) for k, v in dump.items()}
    sel = col["step"] == step
    key = np.stack([col[k][sel].astype(np.int64) for k in ("rank", "sequence", "position", "token_id")], axis=1)
    order = np.lexsort(key[:, :3].T[::-1])
    sides = ("rollout_logprob", "train_logprob")
    return {"key": key[order], **{k: col[k][sel][order].astype(np.float64) for k in sides}}


def _check_trains_as_ddp(ddp: dict, fsdp: dict, config: str) -> list[dict]:
    """What every FSDP run shares against its DDP run (same data, seed and starting weights): the first step's loss
    and grad norm are DDP's, and so are its tokens (sampled, and both log-probs of each), training changed the
    (gathered) lm_head the same on both ranks, no cause is named, and the safe-vocabulary head (``mitigations``)
    received the whole lm_head weight at every call, at the first step the starting weight itself (its checksums).
    Returns the head calls of both ranks."""
    for rank in ddp["ranks"]:
        assert rank["distributed_type"] == "MULTI_CPU" and not rank["is_fsdp_enabled"] and rank["fsdp_units"] == []
        assert rank["fsdp_version"] is None and rank["wrapped"] == "DistributedDataParallel"
        assert rank["lm_head"]["class"] == "Parameter"
        assert sum(numel for _, _, numel in rank["params"]) == rank["numel"]  # every parameter whole on each rank
    for run in (ddp, fsdp):
        changes = {rank["lm_head"]["max_change"] for rank in run["ranks"]}
        assert len(changes) == 1 and changes.pop() > 1e-4  # the same trained head on both ranks
        assert all(rank["named_causes"] == [] for rank in run["ranks"])
        assert all(rank["lm_head"]["shape"] == LM_HEAD_SHAPE for rank in run["ranks"])
    first = [_logged(run["ranks"][0], 1) for run in (ddp, fsdp)]
    for key in ("loss", "grad_norm"):
        assert first[1][key] == pytest.approx(first[0][key], rel=FIRST_STEP_REL), (key, first)
    assert first[1]["tim/tokens"] == first[0]["tim/tokens"]
    # The first step's tokens themselves (both ranks): the same sampled tokens, and the same log-probs of both sides
    # (observed: bitwise; the runs part at ~1e-6 from the second step on, their weights ~1e-7 apart)
    step1 = [_step_tokens(run["dump"], 1) for run in (ddp, fsdp)]
    assert step1[0]["key"].shape[0] > 0 and np.array_equal(step1[0]["key"], step1[1]["key"])
    for side in ("rollout_logprob", "train_logprob"):
        assert np.abs(step1[0][side] - step1[1][side]).max() <= STEP1_LOGPROB_ABS, side
    calls = [c for rank in fsdp["ranks"] for c in rank["head_calls"]]
    if config == "mitigations":
        assert calls and all(c["shape"] == LM_HEAD_SHAPE and c["weight"] != "DTensor" for c in calls), calls
        for rank in fsdp["ranks"]:  # two micro-batches per step: the first two calls run at the starting weights
            assert len(rank["head_calls"]) == 2 * len(STEPS)
            assert all(c["checksum"] == rank["lm_head"]["checksum_before"] for c in rank["head_calls"][:2]), rank
    else:
        assert calls == []
    return calls


@pytest.mark.parametrize("config", ["monitor", "mitigations"])
def test_fsdp2_shards_the_model_and_trains_as_ddp(runs, config):
    """The FSDP2 run of ``config`` against its DDP run in the same launch (same data, seed and starting weights):
    accelerate sharded the model (FSDP units, the lm_head a DTensor split by rows over the two ranks), the first
    step's loss and pre-clip grad norm equal DDP's, training changed the lm_head, no cause is named, and the
    safe-vocabulary head (``mitigations``) received the whole lm_head weight at every call."""
    ddp, fsdp = runs(config), runs(FSDP2 + config)
    for r, rank in enumerate(fsdp["ranks"]):
        assert rank["distributed_type"] == "FSDP" and rank["is_fsdp_enabled"] and rank["fsdp_version"] == 2
        # accelerate's fsdp2_prepare_model: each decoder layer, the input embedding, [final norm, lm_head], the root
        assert {"", "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"} <= set(rank["fsdp_units"])
        head = rank["lm_head"]
        assert head["class"] == "DTensor" and head["placements"] == "(Shard(dim=0),)", head
        assert head["local_shape"] == [(192, 191)[r], 64], head  # 383 rows split
    calls = _check_trains_as_ddp(ddp, fsdp, config)
    # TRL's fused lm_head runs inside the model's forward, after the final norm's: FSDP2 has gathered the
    # [final norm, lm_head] unit there, so the head gets the whole (unsharded) parameter, never a shard
    assert config != "mitigations" or {c["lm_head_param"] for c in calls} == {"Parameter"}, calls


@pytest.mark.parametrize("orig_params", [True, False], ids=["use_orig_params", "flat_params_only"])
@pytest.mark.parametrize("config", ["monitor", "mitigations"])
def test_fsdp1_shards_the_model_and_trains_as_ddp(runs, config, orig_params):
    """The FSDP1 run of ``config`` (``use_orig_params`` True, transformers' default, or False, accelerate's plugin
    default) against its DDP run in the same launch: accelerate wrapped the model in ``FullyShardedDataParallel``
    (FSDP version 1, the root and one unit per decoder layer), each rank holds half of the parameters (not a DDP
    replica), the lm_head outside forward is what FSDP1 leaves there (a 1-D piece of the root's flat shard, or a view
    of the freed whole), the first step's loss and pre-clip grad norm equal DDP's, training changed the lm_head, no
    cause is named, and the safe-vocabulary head received the whole lm_head weight (FSDP1 gathers the root's flat
    parameter, which holds the lm_head, before the root's forward, where TRL's fused head runs)."""
    ddp, fsdp = runs(config), runs((FSDP1 if orig_params else FSDP1_FLAT) + config)
    whole = {name: numel for name, _, numel in ddp["ranks"][0]["params"]}  # each parameter's size (DDP: whole)
    held = [{name: numel for name, _, numel in rank["params"]} for rank in fsdp["ranks"]]
    for rank in fsdp["ranks"]:
        assert rank["distributed_type"] == "FSDP" and rank["is_fsdp_enabled"], rank["distributed_type"]
        assert rank["fsdp_version"] == 1 and rank["use_orig_params"] is orig_params
        assert rank["wrapped"] == "FullyShardedDataParallel"
        # accelerate's FSDP1 transformer auto-wrap (the model's _no_split_modules): the decoder layers, and the root
        assert rank["fsdp_units"] == ["", "model.layers.0", "model.layers.1"]
        # Half the model on each rank (the flat parameters' sizes are even here: FSDP1 pads none to split it)
        assert sum(numel for _, _, numel in rank["params"]) * 2 == rank["numel"] == sum(whole.values())
        head = rank["lm_head"]
        if orig_params:  # each parameter a 1-D view of its piece of the rank's flat shard
            assert all(not flat for _, flat, _ in rank["params"]) and set(held[0]) == set(whole)
            assert head["class"] == "Parameter" and len(head["local_shape"]) == 1, head
        else:  # the module's parameters are the flat ones; lm_head.weight a view of the freed whole flat parameter
            assert [(name, flat) for name, flat, _ in rank["params"]] == [
                ("_flat_param", True), ("model.layers.0._flat_param", True), ("model.layers.1._flat_param", True)]
            assert head["class"] == "Tensor" and head["local_shape"] == LM_HEAD_SHAPE, head
            assert head["storage_bytes"] == 0, head
    if orig_params:  # the two ranks' pieces of each parameter make it whole
        assert {name: held[0][name] + held[1][name] for name in whole} == whole
        assert sum(rank["lm_head"]["local_shape"][0] for rank in fsdp["ranks"]) == math.prod(LM_HEAD_SHAPE)
    calls = _check_trains_as_ddp(ddp, fsdp, config)
    # Inside the forward FSDP1 sets the module's attributes to plain-tensor views of the gathered flat parameter
    assert all(c["lm_head_param"] == "Tensor" and c["lm_head_param_shape"] == LM_HEAD_SHAPE for c in calls), calls
