"""Bad logits in the safe vocabulary (``tim_plugins.safe_vocab``), against a naive float64 reference of the documented
rule: a -inf logit (a token masked by the model or a processor) is never in the kept set S, so |S| counts only
tokens that can be sampled; a row with a NaN or +inf logit, or without a finite one, has no distribution (NaN
log-prob, entropy and pruned mass, |S| = 0, ``in_safe`` True) and changes nothing in the other rows. The torch folds
(logits and hidden paths), the vocabulary-parallel path (two gloo ranks) and the Triton folds (Triton's interpreter,
in a subprocess) follow the same rule.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import spawn_ranks

from tim_plugins.safe_vocab import safe_logprobs_from_hidden, safe_logprobs_from_logits
from tim_plugins.truncation import Truncation

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_bad_logits_under_the_interpreter's subprocess")

V = 50
_MASKED = 10  # the -inf tail of the masked rows: 40 finite logits
TRUNCS = [
    Truncation(),  # nothing cut: S = the finite logits
    Truncation(min_p=1e-3, temperature=0.7),
    Truncation(top_k=45),  # past the masked rows' 40 finite logits: the k-th value is -inf there
    Truncation(top_k=5),
    Truncation(top_p=0.95, temperature=1.3),
    Truncation(min_p=1e-3, top_k=45, top_p=0.9),
]


def _naive_rows(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, kept) -> dict[str, torch.Tensor]:
    """The outputs row by row in float64, S of a row with a distribution from ``kept(i, row, p)`` ([V] bool; ``row``:
    the logits / T, ``p``: their softmax)."""
    nan = math.nan
    out = {k: [] for k in ("logprobs", "in_safe", "pruned_mass", "size", "entropy")}
    for i, (row, a) in enumerate(zip(logits.double() / temperature, tokens.tolist())):
        if bool(row.isnan().any() or (row == math.inf).any() or not torch.isfinite(row).any()):
            for k, v in zip(out, (nan, True, nan, 0, nan)):
                out[k].append(v)
            continue
        p = (row - row.logsumexp(-1)).exp()
        keep = kept(i, row, p)
        log_zs = row[keep].logsumexp(-1)
        q = (row[keep] - log_zs).exp()
        for k, v in zip(out, (float(row[a] - log_zs), bool(keep[a]), float(1 - p[keep].sum()), int(keep.sum()),
                              float(-(q * q.log()).sum()))):
            out[k].append(v)
    return {k: torch.tensor(v) for k, v in out.items()}


def _naive(logits: torch.Tensor, tokens: torch.Tensor, trunc: Truncation) -> dict[str, torch.Tensor]:
    """The rule row by row in float64 (vLLM order: min-p, top-k, top-p; ties at a cut kept whole)."""

    def kept(_i, row, p):
        keep = row > -math.inf
        if trunc.min_p > 0:
            keep &= p >= trunc.min_p * p.max()
        if trunc.k:
            vals = row[keep].sort(descending=True).values
            if trunc.k <= len(vals):
                keep &= row >= vals[trunc.k - 1]
        if trunc.top_p < 1:
            vals = row[keep].sort().values
            cum = (vals - vals.logsumexp(-1)).exp().cumsum(-1)
            drop = cum <= 1 - trunc.top_p
            drop[-1] = False
            keep &= row >= vals[~drop][0]
        return keep

    return _naive_rows(logits, tokens, trunc.temperature, kept)


def _logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows: clean, masked tail (token inside), NaN, masked tail (token at -inf), +inf, clean, all -inf, NaN and
    -inf, clean. Returns (logits [9, V], tokens, the clean rows: finite outputs expected)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(9, V, generator=g) * 3
    z[1, -_MASKED:] = -math.inf
    z[2, 7] = math.nan
    z[3, -_MASKED:] = -math.inf
    z[4, 30] = math.inf  # on the second shard of the vocabulary-parallel test; the NaNs on the first
    z[6] = -math.inf
    z[7, 3], z[7, -_MASKED:] = math.nan, -math.inf
    tokens = torch.randint(0, V - _MASKED, (9,), generator=g)
    tokens[3] = V - 1  # a masked token
    return z, tokens, [0, 1, 3, 5, 8]


def _check(out, ref, clean: list[int]) -> None:
    got = {k: getattr(out, k).detach() for k in ref}
    for k in ("in_safe", "size"):
        assert got[k].tolist() == ref[k].tolist(), k
    for k in ("logprobs", "pruned_mass", "entropy"):
        torch.testing.assert_close(got[k].double(), ref[k].double(), atol=2e-5, rtol=0, equal_nan=True, msg=k)
    bad = [i for i in range(len(ref["size"])) if i not in clean]
    assert bool(got["pruned_mass"][bad].isnan().all()) and bool(torch.isfinite(got["pruned_mass"][clean]).all())


def _same_rows(out, other, rows: list[int], other_rows) -> None:
    """The rows ``rows`` of ``out`` equal, bit for bit, the rows ``other_rows`` of a call without the bad rows."""
    for k in ("logprobs", "in_safe", "pruned_mass", "size", "entropy"):
        assert torch.equal(getattr(out, k).detach()[rows], getattr(other, k).detach()[other_rows]), k


@pytest.mark.parametrize("trunc", TRUNCS, ids=str)
def test_logits_path_against_the_float64_reference(trunc):
    z, tokens, clean = _logits()
    kw = dict(min_p=trunc.min_p, temperature=trunc.temperature, top_p=trunc.top_p, top_k=trunc.top_k,
              compute_entropy=True, backend="torch")
    out = safe_logprobs_from_logits(z, tokens, chunk_size=4, **kw)  # bad rows in every chunk
    _check(out, _naive(z, tokens, trunc), clean)
    _same_rows(out, safe_logprobs_from_logits(z[clean], tokens[clean], **kw), clean, slice(None))


def test_a_masked_token_is_outside_the_kept_set_whatever_the_truncation():
    z, tokens, _ = _logits()
    sizes = set()
    for trunc in (Truncation(), Truncation(min_p=1e-9), Truncation(top_k=V), Truncation(top_p=1.0 - 1e-7)):
        out = safe_logprobs_from_logits(z[3:4], tokens[3:4], min_p=trunc.min_p, top_k=trunc.top_k, top_p=trunc.top_p,
                                        backend="torch")
        assert out.in_safe.tolist() == [False] and out.logprobs.tolist() == [-math.inf]
        sizes.add(int(out.size))
    assert sizes == {V - _MASKED}  # the same |S| whether or not the rule cuts anything


def _naive_loss(z: torch.Tensor, tokens: torch.Tensor, trunc: Truncation, g: torch.Tensor) -> torch.Tensor:
    """Σ_rows g · (safe log-prob + entropy) in float64 on clean rows, S as in ``_naive`` (min-p / top-k): autograd
    of it gives 0 at every logit outside S, a -inf one included."""
    total = z.new_zeros((), dtype=torch.float64)
    for row, a, w in zip(z / trunc.temperature, tokens.tolist(), g):
        keep = row > -math.inf
        if trunc.min_p > 0:
            keep &= row >= row.max().detach() + math.log(trunc.min_p)
        if trunc.k and trunc.k <= int(keep.sum()):
            keep &= row >= row[keep].detach().sort(descending=True).values[trunc.k - 1]
        idx = keep.nonzero().squeeze(-1)
        lq = row[idx] - row[idx].logsumexp(-1)
        total = total + w * ((row[a] - row[idx].logsumexp(-1)) - (lq.exp() * lq).sum())
    return total


@pytest.mark.parametrize("trunc", [Truncation(), Truncation(min_p=1e-3, temperature=0.7), Truncation(top_k=45)],
                         ids=str)
def test_logits_gradient_against_the_float64_reference(trunc):
    # log-prob and entropy gradients on clean rows, masked (-inf) logits included: 0 there, not NaN
    z, tokens, clean = _logits()
    g = torch.randn(len(clean), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = z[clean].clone().requires_grad_(True)
    out = safe_logprobs_from_logits(x, tokens[clean], min_p=trunc.min_p, temperature=trunc.temperature,
                                    top_k=trunc.top_k, compute_entropy=True, backend="torch")
    (out.logprobs * g.float() + out.entropy * g.float()).sum().backward()
    ref = z[clean].double().requires_grad_(True)
    _naive_loss(ref, tokens[clean], trunc, g).backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-5, rtol=0)


def test_logits_gradient_of_clean_rows_is_unchanged():
    z, tokens, clean = _logits()
    g = torch.randn(len(tokens), generator=torch.Generator().manual_seed(1))
    g[[i for i in range(len(tokens)) if i not in clean]] = 0.0
    x = z.clone().requires_grad_(True)
    out = safe_logprobs_from_logits(x, tokens, min_p=1e-3, compute_entropy=True, chunk_size=4, backend="torch")
    (out.logprobs * g).nansum().backward()
    xa = z[clean].clone().requires_grad_(True)
    alone = safe_logprobs_from_logits(xa, tokens[clean], min_p=1e-3, compute_entropy=True, backend="torch")
    (alone.logprobs * g[clean]).sum().backward()
    assert torch.equal(x.grad[clean], xa.grad)


@pytest.mark.parametrize("trunc", [Truncation(), Truncation(min_p=1e-3, temperature=0.7), Truncation(top_k=5)], ids=str)
def test_hidden_path_voids_bad_rows_only(trunc):
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(7, 16, generator=g), torch.randn(V, 16, generator=g) * 0.3
    hidden[2, 3] = math.nan
    hidden[4] = 3e38  # overflows: +inf and -inf logits
    tokens = torch.randint(0, V, (7,), generator=g)
    clean = [0, 1, 3, 5, 6]
    kw = dict(min_p=trunc.min_p, temperature=trunc.temperature, top_k=trunc.top_k, compute_entropy=True,
              backend="torch")
    out = safe_logprobs_from_hidden(hidden, weight, tokens, chunk_size=3, **kw)
    _check(out, _naive(hidden @ weight.t(), tokens, trunc), clean)
    # the same GEMM shapes and chunks (a GEMM's rounding may depend on them), the bad rows replaced by clean ones
    fixed = hidden.clone()
    fixed[[2, 4]] = hidden[[0, 1]]
    _same_rows(out, safe_logprobs_from_hidden(fixed, weight, tokens, chunk_size=3, **kw), clean, clean)


# ----------------------------------------------------------------------------------- vocabulary-parallel path

_TP_WIDTHS = (23, 27)


def _tp_worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.safe_vocab_tp import safe_logprobs_vocab_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        z, tokens, _ = _logits()
        start = sum(_TP_WIDTHS[:rank])
        res = []
        for trunc in TRUNCS:
            out = safe_logprobs_vocab_parallel(z[:, start : start + _TP_WIDTHS[rank]], tokens, trunc,
                                               group=dist.group.WORLD, vocab_start=start, compute_entropy=True)
            res.append({k: getattr(out, k).detach().tolist() for k in
                        ("logprobs", "in_safe", "pruned_mass", "size", "entropy")})
        queue.put((rank, res))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_path_against_the_float64_reference():
    z, tokens, clean = _logits()
    for _rank, res in spawn_ranks(_tp_worker, world=2):
        for trunc, got in zip(TRUNCS, res):
            got["size"] = [int(v) for v in got["size"]]  # fp32 sums on this path
            _check(SimpleNamespace(**{k: torch.tensor(v) for k, v in got.items()}), _naive(z, tokens, trunc), clean)


# ------------------------------------------------------------------------------- replay of the engine's sets


def _replay_case():
    """``_logits``' rows with the engine's kept sets: recorded sets that hold -inf logits (row 3: the token among
    them; row 8: a -inf tail of its own, the token finite), rows without a set (whole vocabulary: row 1 with its -inf
    tail, row 5 clean), and sets on the bad rows. Returns (logits, tokens, sets, the rows with a finite loss)."""
    z, tokens, _ = _logits()
    z[8, -5:] = -math.inf
    g = torch.Generator().manual_seed(7)
    sets = [sorted(set(torch.randperm(V, generator=g)[:12].tolist()) | {int(tokens[i])}) for i in range(9)]
    sets[1] = sets[5] = sets[6] = []
    sets[3] = sorted(set(sets[3]) | {V - 1, V - 2, V - 3})
    sets[8] = sorted(set(sets[8]) | {V - 1, V - 4})
    return z, tokens, sets, [0, 1, 5, 8]


def _naive_replay(logits: torch.Tensor, tokens: torch.Tensor, sets: list, temperature: float) -> dict:
    """The replay rule row by row in float64: S = the recorded ids (all ids without a record) less the -inf logits."""

    def kept(i, row, _p):
        keep = torch.zeros(V, dtype=torch.bool)
        keep[sets[i] if sets[i] else slice(None)] = True
        return keep & (row > -math.inf)

    return _naive_rows(logits, tokens, temperature, kept)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_replay_leaves_minus_inf_logits_out_of_the_engines_set(temperature):
    from tim_plugins.replay import KeptSets, replay_logprobs_from_logits

    z, tokens, sets, _ = _replay_case()
    out = replay_logprobs_from_logits(z, tokens, KeptSets.from_lists(sets), temperature=temperature,
                                      compute_entropy=True, chunk_size=4)
    ref = _naive_replay(z, tokens, sets, temperature)
    _check(out, ref, [0, 1, 3, 5, 8])
    finite = [V - _MASKED, sum(i < V - _MASKED for i in sets[3]), sum(i < V - 5 for i in sets[8])]
    assert out.size[[1, 3, 8]].tolist() == finite and finite[1] < len(sets[3]) and finite[2] < len(sets[8])
    assert out.in_safe[3].item() is False and out.logprobs[3].item() == -math.inf  # the token the trainer masks


def test_replay_gradient_against_the_float64_reference():
    from tim_plugins.replay import KeptSets, replay_logprobs_from_logits

    z, tokens, sets, rows = _replay_case()
    g = torch.randn(len(rows), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kept = KeptSets.from_lists([sets[i] for i in rows])
    x = z[rows].clone().requires_grad_(True)
    out = replay_logprobs_from_logits(x, tokens[rows], kept, temperature=0.7, compute_entropy=True)
    (out.logprobs * g.float() + out.entropy * g.float()).sum().backward()
    ref = z[rows].double().requires_grad_(True)
    total = ref.new_zeros(())
    for row, a, ids, w in zip(ref / 0.7, tokens[rows].tolist(), [sets[i] for i in rows], g):
        keep = torch.zeros(V, dtype=torch.bool)
        keep[ids if ids else slice(None)] = True
        idx = (keep & (row > -math.inf)).nonzero().squeeze(-1)
        lq = row[idx] - row[idx].logsumexp(-1)
        total = total + w * ((row[a] - row[idx].logsumexp(-1)) - (lq.exp() * lq).sum())
    total.backward()
    assert bool(torch.isfinite(x.grad).all())
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-5, rtol=0)


def _tp_replay_worker(rank: int, world: int, port: int, queue) -> None:
    from tim_plugins.replay import KeptSets
    from tim_plugins.safe_vocab_tp import replay_logprobs_vocab_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        z, tokens, sets, _ = _replay_case()
        start = sum(_TP_WIDTHS[:rank])
        out = replay_logprobs_vocab_parallel(z[:, start : start + _TP_WIDTHS[rank]], tokens, KeptSets.from_lists(sets),
                                             group=dist.group.WORLD, vocab_start=start, temperature=0.7,
                                             compute_entropy=True)
        queue.put((rank, {k: getattr(out, k).detach().tolist() for k in
                          ("logprobs", "in_safe", "pruned_mass", "size", "entropy")}))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_replay_against_the_float64_reference():
    z, tokens, sets, _ = _replay_case()
    ref = _naive_replay(z, tokens, sets, 0.7)
    for _rank, got in spawn_ranks(_tp_replay_worker, world=2):
        got["size"] = [int(v) for v in got["size"]]
        _check(SimpleNamespace(**{k: torch.tensor(v) for k, v in got.items()}), ref, [0, 1, 3, 5, 8])


# ------------------------------------------------------------------------------- Triton folds (interpreter)


def _rows(out, rows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(**{k: getattr(out, k).detach()[rows] for k in
                              ("logprobs", "in_safe", "pruned_mass", "size", "entropy")})


@interpreted
@pytest.mark.parametrize("min_p,temperature", [(0.0, 1.0), (1e-3, 0.7)])
def test_interpreted_logits_folds_void_bad_rows_as_the_torch_folds(min_p, temperature):
    z, tokens, clean = _logits()
    rows = list(range(len(tokens)))
    for dtype in (torch.float32, torch.bfloat16):
        x = z.to(dtype)
        out = safe_logprobs_from_logits(x, tokens, min_p=min_p, temperature=temperature, compute_entropy=True,
                                        backend="triton")
        ref = _naive(x, tokens, Truncation(min_p=min_p, temperature=temperature))
        _check(_rows(out, rows), {k: v[rows] for k, v in ref.items()}, [rows.index(i) for i in clean if i in rows])


@interpreted
@pytest.mark.parametrize("trunc", [Truncation(), Truncation(min_p=1e-3, temperature=0.7)], ids=str)
def test_interpreted_logits_gradient_against_the_float64_reference(trunc):
    z, tokens, clean = _logits()
    g = torch.randn(len(clean), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = z[clean].clone().requires_grad_(True)
    out = safe_logprobs_from_logits(x, tokens[clean], min_p=trunc.min_p, temperature=trunc.temperature,
                                    compute_entropy=True, backend="triton")
    (out.logprobs * g.float() + out.entropy * g.float()).sum().backward()
    ref = z[clean].double().requires_grad_(True)
    _naive_loss(ref, tokens[clean], trunc, g).backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-5, rtol=0)


@interpreted
def test_interpreted_hidden_folds_void_bad_rows_as_the_torch_folds():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(7, 16, generator=g), torch.randn(V, 16, generator=g) * 0.3
    hidden[2, 3] = math.nan
    hidden[4] = 3e38
    tokens = torch.randint(0, V, (7,), generator=g)
    for min_p in (0.0, 1e-3):
        out = safe_logprobs_from_hidden(hidden, weight, tokens, min_p=min_p, compute_entropy=True, chunk_size=3,
                                        backend="triton")
        _check(out, _naive(hidden @ weight.t(), tokens, Truncation(min_p=min_p)), [0, 1, 3, 5, 6])


def test_bad_logits_under_the_interpreter():
    pytest.importorskip("triton")
    from test_metrics_triton import run_interpreted

    run_interpreted(__file__, 2 + 2 + 1)


# ----------------------------------------------------------------------------------------------- statistics


def test_statistics_count_rows_without_a_distribution_apart():
    from tim_plugins.safe_vocab import SafeVocabStats, safe_vocab_metrics

    z, tokens, clean = _logits()
    trunc = Truncation(min_p=1e-3, temperature=0.7)
    out = safe_logprobs_from_logits(z, tokens, min_p=trunc.min_p, temperature=trunc.temperature, backend="torch")
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[[0, 6]] = False  # a clean and a bad row outside the measured tokens
    ref = _naive(z, tokens, trunc)
    rows = [i for i in clean if mask[i]]
    got = safe_vocab_metrics(out, mask)
    assert got["tim/safe_vocab/invalid_tokens"] == 3  # rows 2, 4, 7
    assert got["tim/safe_vocab/pruned_mass_mean"] == pytest.approx(float(ref["pruned_mass"][rows].mean()), abs=1e-6)
    assert got["tim/safe_vocab/pruned_mass_max"] == pytest.approx(float(ref["pruned_mass"][rows].max()), abs=1e-6)
    assert got["tim/safe_vocab/size_mean"] == pytest.approx(float(ref["size"][rows].double().mean()), rel=1e-12)
    assert got["tim/safe_vocab/boundary_frac"] == pytest.approx(float((~ref["in_safe"][rows]).double().mean()))
    # merged over two micro-batches as over one
    stats = SafeVocabStats()
    for part in (slice(0, 4), slice(4, None)):
        stats.update(mask[part], out.in_safe[part], out.pruned_mass[part], out.size[part])
    merged = stats.compute(sync=False)
    assert merged["tim/safe_vocab/tokens"] == len(rows)
    assert {k: merged[k] for k in got} == pytest.approx(got, rel=1e-12)
    # a state written before invalid_tokens existed still loads
    old = SafeVocabStats()
    old.load_state_dict({"sums": [2.0, 0.1, 80.0, 1.0], "maxes": [0.08]})
    assert old.compute(sync=False)["tim/safe_vocab/invalid_tokens"] == 0
