"""Replay of the rollout engine's kept set: the trainer's log-probs renormalised over exactly the tokens the
engine's sampler kept, per generated token.

Recomputing the sampler's truncation on the trainer's logits (``tim_plugins.truncation``) reproduces the
engine's kept set S only where both sides' logits agree at the cut: a token near the boundary can be kept by one
and cut by the other ("boundary tokens", ``tim/safe_vocab/boundary_frac``). An engine that hands out its own S
per token (vLLM's ``return_sampling_mask``: ``SamplingMask.token_ids``, one id list per generated token; SGLang's
``output_token_sampling_mask``) removes the question: the trainer takes

    replay log p(a) = z_a/T − logsumexp_{b∈S_engine}(z_b/T)

on its own logits z, so every sampled token is in S and the boundary fraction is 0 by construction.

Layout: the sets travel packed (``KeptSets``: ids [total kept] + offsets [N + 1], CSR, the form vLLM's
``SamplingMaskLists`` uses on the wire); the folds expand one row chunk at a time into a reused [rows, V] bool
buffer, so no dense [N, V] mask exists. The folds, the autograd Functions and the hidden-state path are the
safe-vocab ones (``tim_plugins.safe_vocab``), with the engine's set in place of the recomputed threshold; the
results are a ``SafeLogprobs`` with the same fields (log-prob of the label, label ∈ S, pruned mass 1 − Σ_S p_T,
|S|, entropy over S). Gradients: d log p(a)/dz_j = (1[j = a] − q_j)/T with q = p_T restricted to S_engine.

A row with an empty id list has no recorded set (a prompt or padding position): it keeps the whole vocabulary.
A -inf logit of the trainer's is never in S (``safe_vocab``'s rule): |S| does not count it, and a sampled token
the trainer masks so is out of S (``in_safe`` False, log-prob -inf), not a NaN loss; a row whose every kept id the
trainer masks has no distribution over S (log-prob -inf, out of S, entropy 0, no gradient). The engine's S need not
hold the trainer's largest logit: the sum over S is shifted by S's own maximum, so a set far under it (the
disagreement replay is for) does not underflow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .safe_vocab import SafeLogprobs, _check_hidden, _check_rows, _fold_hidden, _fold_logits

__all__ = ["KeptSets", "replay_logprobs_from_hidden", "replay_logprobs_from_logits"]


@dataclass(frozen=True)
class KeptSets:
    """Per-token kept sets, packed: row i's token ids are ``ids[offsets[i]:offsets[i + 1]]``.

    Attributes:
        ids: [total kept] int32 token ids.
        offsets: [N + 1] int64, non-decreasing, ``offsets[0] = 0``, ``offsets[-1] = len(ids)``.
    """

    ids: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError(f"KeptSets: ids {tuple(self.ids.shape)} and offsets {tuple(self.offsets.shape)} must "
                             "be 1-D, offsets with N + 1 >= 1 entries (CSR)")
        if self.ids.dtype.is_floating_point or self.ids.dtype == torch.bool:
            raise ValueError(f"KeptSets: ids dtype {self.ids.dtype}: expected integer token ids")
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        if first != 0 or last != self.ids.numel() or bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError(f"KeptSets: offsets must rise from 0 to len(ids) = {self.ids.numel()}; got "
                             f"{first} … {last}" + (" (decreasing somewhere)" if first == 0 and
                                                     last == self.ids.numel() else ""))

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]], device=None) -> KeptSets:
        """From one id list per token (vLLM's ``SamplingMask.token_ids``)."""
        sizes = torch.tensor([len(x) for x in lists], dtype=torch.int64)
        offsets = torch.zeros(len(lists) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        flat = [int(t) for x in lists for t in x]
        ids = torch.tensor(flat, dtype=torch.int32)
        return cls(ids.to(device), offsets.to(device))

    @classmethod
    def from_csr(cls, ids, offsets, device=None) -> KeptSets:
        """From a CSR pair (tensors or numpy arrays, as vLLM's ``SamplingMaskLists``)."""
        ids_t = torch.as_tensor(ids).to(device=device, dtype=torch.int32)
        return cls(ids_t, torch.as_tensor(offsets).to(device=device, dtype=torch.int64))

    @classmethod
    def concat(cls, parts: Sequence[KeptSets]) -> KeptSets:
        """The rows of ``parts`` one after another (sequences of a batch, in the order of their tokens)."""
        if not parts:
            return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
        shifts = torch.tensor([0] + [int(p.offsets[-1]) for p in parts[:-1]], dtype=torch.int64).cumsum(0)
        offsets = [parts[0].offsets[:1]] + [p.offsets[1:] + s.to(p.offsets.device) for p, s in zip(parts, shifts)]
        return cls(torch.cat([p.ids for p in parts]), torch.cat(offsets))

    def placed(self, n_rows: int, rows: torch.Tensor | Sequence[int]) -> KeptSets:
        """These sets at rows ``rows`` (strictly increasing) of an ``n_rows``-row layout, every other row empty (no
        recorded set: the whole vocabulary). E.g. a packed micro-batch whose response tokens sit at
        ``response_mask.reshape(-1).nonzero()`` among prompt and padding positions."""
        rows_t = torch.as_tensor(rows, dtype=torch.int64, device=self.offsets.device).reshape(-1)
        if rows_t.numel() != len(self):
            raise ValueError(f"placed: {rows_t.numel()} rows given for {len(self)} kept sets")
        if rows_t.numel() and (bool((rows_t[1:] <= rows_t[:-1]).any()) or int(rows_t[0]) < 0
                               or int(rows_t[-1]) >= n_rows):
            raise ValueError(f"placed: rows must be strictly increasing within [0, {n_rows}) (the sets' order)")
        sizes = torch.zeros(n_rows, dtype=torch.int64, device=self.offsets.device)
        sizes[rows_t] = self.sizes
        offsets = torch.zeros(n_rows + 1, dtype=torch.int64, device=self.offsets.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        return KeptSets(self.ids, offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def sizes(self) -> torch.Tensor:
        """[N] int64 |S| per row (0: no recorded set)."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device) -> KeptSets:
        return KeptSets(self.ids.to(device), self.offsets.to(device))

    def to_lists(self) -> list[list[int]]:
        ids, off = self.ids.tolist(), self.offsets.tolist()
        return [ids[off[i] : off[i + 1]] for i in range(len(off) - 1)]


class _Replay:
    """The engine's S for the safe-vocab folds (``safe_vocab._Threshold``'s interface): each chunk's rows are
    expanded from the packed ids into the folds' reused [rows, V] bool buffer, in forward and again in backward."""

    masks = True
    keeps_max = False  # the engine's S need not hold the trainer's largest logit

    def __init__(self, kept: KeptSets, temperature: float, device) -> None:
        self.temperature = float(temperature)
        self.ids = kept.ids.to(device)
        self.sizes = kept.sizes.to(device)
        self.bounds = kept.offsets.tolist()  # one host copy per call: slicing a chunk's ids needs no device sync

    def _fill(self, z: torch.Tensor, start: int, buf: torch.Tensor) -> torch.Tensor:
        """S of the chunk's rows (``z``: their logits / T, unmodified): the recorded ids, or the whole vocabulary for
        a row without a set, less the -inf logits (never in S, as in ``safe_vocab``: the trainer gives them no
        mass, and |S| does not count them). Read at the recorded ids and the unrecorded rows only."""
        n = z.shape[0]
        keep = buf[:n]
        keep.zero_()
        a, b = self.bounds[start], self.bounds[start + n]
        rows = torch.repeat_interleave(torch.arange(n, device=buf.device), self.sizes[start : start + n],
                                       output_size=b - a)
        ids = self.ids[a:b].long()
        keep[rows, ids] = z[rows, ids] > -math.inf
        bounds = self.bounds
        empty = [i - start for i in range(start, start + n) if bounds[i + 1] == bounds[i]]
        if empty:  # no recorded set: the whole vocabulary (found on the host: no pass over the chunk)
            keep[empty] = z[empty] > -math.inf
        return keep

    def select(self, z: torch.Tensor, start: int, m: torch.Tensor, buf: torch.Tensor):
        # no threshold: the saved per-row "tau" is a placeholder the backward passes back to reselect unread
        return self._fill(z, start, buf), torch.full_like(m, -math.inf)

    def reselect(self, z: torch.Tensor, start: int, tau: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        return self._fill(z, start, buf)

    @staticmethod
    def contains(keep, z_tok, tau, tok: torch.Tensor) -> torch.Tensor:
        return keep.gather(-1, tok[:, None]).squeeze(-1)


def _check_kept(kept: KeptSets, n_rows: int, vocab: int | None, temperature: float) -> None:
    """The sets against the rows they are for: one per row, ids in [0, vocab) (>= 0 only for ``vocab=None``)."""
    if not isinstance(kept, KeptSets):
        raise ValueError(f"kept is a {type(kept).__name__}: expected a tim_plugins.replay.KeptSets "
                         "(KeptSets.from_lists(sampling_mask.token_ids))")
    if len(kept) != n_rows:
        raise ValueError(f"kept has {len(kept)} rows, the tokens {n_rows}: one kept set per scored token, in the "
                         "same order (an empty list for a position without one)")
    if kept.ids.numel() and (int(kept.ids.min()) < 0 or (vocab is not None and int(kept.ids.max()) >= vocab)):
        raise ValueError(f"kept ids must lie in [0, {vocab}); got range [{int(kept.ids.min())}, "
                         f"{int(kept.ids.max())}]: the engine's vocabulary is larger than the trainer's head?")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0.0):
        raise ValueError(f"temperature={temperature!r}: must be a finite number > 0 (the engine's sampling "
                         "temperature; vLLM refuses replay at temperature 0)")


def replay_logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, kept: KeptSets, *, temperature: float = 1.0,
    compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """Log-probs of ``tokens`` renormalised over the engine's kept sets, from full logits.

    Args:
        logits: [N, V] raw logits (any float dtype; computed in fp32), not yet divided by the temperature.
        tokens: [N] int token ids.
        kept: the engine's kept set of each row (``KeptSets``, N rows).
        temperature: the engine's sampling temperature.
        compute_entropy: also return the entropy of the renormalised distribution over S.
        chunk_size: rows per chunk (default: ``safe_vocab.default_chunk_rows``).
    Returns:
        ``SafeLogprobs`` with [N] tensors (``in_safe``: the token is in the engine's set).
    """
    _check_rows("logits", logits, tokens, logits.shape[-1] if logits.dim() else 0)
    _check_kept(kept, logits.shape[0], logits.shape[1], temperature)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: must be >= 1 rows")
    return _fold_logits(logits, tokens.long(), _Replay(kept, temperature, logits.device), chunk_size,
                        compute_entropy)


def replay_logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kept: KeptSets, *, temperature: float = 1.0,
    compute_entropy: bool = False, chunk_size: int | None = None,
) -> SafeLogprobs:
    """``replay_logprobs_from_logits`` from hidden states and the lm_head weight in row chunks, never holding the
    [N, V] logits (the contract of ``safe_vocab.safe_linear_logprobs``: plain tensors, the whole weight).

    Args:
        hidden: [..., H] final hidden states; weight: [V, H]; labels: [...] token ids (``hidden``'s leading shape).
        kept: one kept set per label, in ``labels.reshape(-1)`` order.
        temperature, compute_entropy, chunk_size: as for ``replay_logprobs_from_logits``.
    Returns:
        ``SafeLogprobs`` with tensors of ``labels``' shape; gradients flow to ``hidden`` and ``weight``.
    """
    if hidden.dim() < 1 or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels has shape {tuple(labels.shape)}: expected hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})")
    shape = labels.shape
    h, tok = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    _check_hidden(h, weight, tok, chunk_size)
    _check_kept(kept, h.shape[0], weight.shape[0], temperature)
    res = _fold_hidden(h, weight, tok.long(), _Replay(kept, temperature, h.device), chunk_size, compute_entropy)
    return SafeLogprobs(logprobs=res.logprobs.view(shape), in_safe=res.in_safe.view(shape),
                        pruned_mass=res.pruned_mass.view(shape), size=res.size.view(shape),
                        entropy=None if res.entropy is None else res.entropy.view(shape))
