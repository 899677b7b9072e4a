"""Batch-invariance check: does a sequence's log-prob depend on what else is in the batch?

For each dtype, the log-probs of each target sequence computed alone (batch of 1, no padding, full forward)
are the reference; they are recomputed

- ``batch``:     inside batches of other sizes (the other rows are random filler sequences),
- ``pad_right``: right-padded by p masked tokens next to a longer filler row,
- ``pad_left``:  left-padded by p masked tokens (position ids from the mask) next to a longer filler row,
- ``kv_cache``:  by incremental decoding (prefill half, then one token at a time with the KV cache),

and the max |Δ log p| over the real tokens is reported per case. Nothing is assumed: fp32 CPU matmul is not
batch invariant either (GEMM blocking depends on the row count), and the report says what was measured.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

__all__ = ["check_batch_invariance", "BatchInvarianceReport", "InvarianceCase", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("batch", "pad_right", "pad_left", "kv_cache")


@dataclass
class InvarianceCase:
    dtype: str
    kind: str  # batch | pad_right | pad_left | kv_cache
    param: int  # batch size, padding length, or prefill length
    max_abs_diff: float
    bitwise: bool
    tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BatchInvarianceReport:
    cases: list = field(default_factory=list)

    def summary(self) -> dict:
        """{dtype: {kind: max |Δ log p| over that kind's cases, "max": overall, "bitwise": all bitwise}}."""
        out: dict[str, dict] = {}
        for c in self.cases:
            row = out.setdefault(c.dtype, {"max": 0.0, "bitwise": True})
            row[c.kind] = max(row.get(c.kind, 0.0), c.max_abs_diff)
            row["max"] = max(row["max"], c.max_abs_diff)
            row["bitwise"] = row["bitwise"] and c.bitwise
        return out

    def to_dict(self) -> dict:
        return {"cases": [c.to_dict() for c in self.cases], "summary": self.summary()}

    def to_table(self) -> str:
        from tim_plugins.parity.table import format_table

        rows = []
        for dtype, s in self.summary().items():
            rows.append([dtype] + [f"{s[k]:.3g}" if k in s else "-" for k in KINDS] +
                        [f"{s['max']:.3g}", "yes" if s["bitwise"] else "no"])
        return format_table(["dtype", *(f"{k} max|Δlogp|" for k in KINDS), "max", "bitwise"], rows)


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # log p(x_{t+1} | x_<=t) for t = 0..L-2, in fp32: [B, L-1]
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _cache_keyword(model: Any) -> str:
    """The forward's KV-cache keyword: ``cache`` where the model's forward names it (transformers >= 5.25 renamed
    ``past_key_values``, which warns there and is to go in 5.40, when it would be swallowed by ``**kwargs`` and each
    step would decode without its cache), else ``past_key_values``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no readable signature: the name every transformers 5.x still takes
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: Any) -> Any:
    """The KV cache a forward returned, read where its output class keeps it (``cache`` from transformers 5.25, whose
    ``past_key_values`` property warns; ``past_key_values`` before)."""
    cache = getattr(out, "cache", None) if "cache" in getattr(type(out), "__dataclass_fields__", {}) else None
    return cache if cache is not None else out.past_key_values


def _forward(model: Any, ids: torch.Tensor, mask: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    kwargs: dict[str, Any] = {"use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    return model(input_ids=ids, **kwargs).logits


def _case(dtype: str, kind: str, param: int, got: torch.Tensor, ref: torch.Tensor) -> InvarianceCase:
    diff = (got - ref).abs()
    return InvarianceCase(dtype, kind, int(param), float(diff.max()) if diff.numel() else 0.0,
                          bool(torch.equal(got, ref)), int(diff.numel()))


@torch.no_grad()
def check_batch_invariance(
    model: Any,
    input_ids: torch.Tensor,
    *,
    batch_sizes: Sequence[int] = (2, 4, 16),
    paddings: Sequence[int] = (1, 7),
    dtypes: Optional[Sequence[Any]] = None,
    kv_cache: bool = True,
    pad_token_id: Optional[int] = None,
    seed: int = 0,
) -> BatchInvarianceReport:
    """Measure how much each target sequence's log-probs move with batch composition, padding and KV cache.

    Args:
        model: HF causal LM (not modified; a copy is cast for each dtype other than its own).
        input_ids: [L] or [N, L] target sequences (all tokens real, L >= 3).
        batch_sizes: batch sizes to embed the targets in (targets fill the first rows, random filler the rest).
        paddings: padding lengths for the left/right padding cases.
        dtypes: e.g. ("float32", "bfloat16"); default: the model's own dtype.
        kv_cache: also compare incremental decoding with the KV cache against the full forward.
        pad_token_id: token placed at padded positions (default: config pad id, else 0).
        seed: filler sequences are drawn from a generator with this seed.
    Returns:
        `BatchInvarianceReport` with one case per (dtype, kind, parameter).
    """
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[1] < 3:
        raise ValueError(f"check_batch_invariance: input_ids must be [L] or [N, L] with L >= 3, got {tuple(input_ids.shape)}")
    if any(int(b) < 1 for b in batch_sizes) or any(int(p) < 1 for p in paddings):
        raise ValueError(f"batch_sizes {list(batch_sizes)} and paddings {list(paddings)} must be >= 1")
    n, length = ids.shape
    base_dtype = next(model.parameters()).dtype
    names = [str(base_dtype).replace("torch.", "")] if dtypes is None else [str(d).replace("torch.", "") for d in dtypes]
    for name in names:
        if name not in DTYPES:
            raise ValueError(f"check_batch_invariance: dtype {name!r} not supported; use one of {sorted(DTYPES)}")
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
        pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(int(seed))
    device = ids.device

    def filler(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, cols), generator=gen).to(device)

    report = BatchInvarianceReport()
    for name in names:
        m = model if DTYPES[name] == base_dtype else copy.deepcopy(model).to(DTYPES[name])
        m.eval()
        ref = torch.cat([_token_logprobs(_forward(m, ids[i:i + 1]), ids[i:i + 1]) for i in range(n)])
        for b in batch_sizes:
            b = int(b)
            got = []
            for start in range(0, n, b):
                chunk = ids[start:start + b]
                batch = torch.cat([chunk, filler(b - chunk.shape[0], length)]) if chunk.shape[0] < b else chunk
                got.append(_token_logprobs(_forward(m, batch), batch)[: chunk.shape[0]])
            report.cases.append(_case(name, "batch", b, torch.cat(got), ref))
        for p in paddings:
            p = int(p)
            pad = torch.full((n, p), pad_token_id, dtype=ids.dtype, device=device)
            other = filler(1, length + p)
            # right: targets then p masked pads, next to a full-length filler row
            batch = torch.cat([torch.cat([ids, pad], 1), other])
            mask = torch.ones_like(batch)
            mask[:n, length:] = 0
            got = _token_logprobs(_forward(m, batch, mask), batch)[:n, : length - 1]
            report.cases.append(_case(name, "pad_right", p, got, ref))
            # left: p masked pads then targets; positions counted from the first real token
            batch = torch.cat([torch.cat([pad, ids], 1), other])
            mask = torch.ones_like(batch)
            mask[:n, :p] = 0
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            got = _token_logprobs(_forward(m, batch, mask, pos), batch)[:n, p:]
            report.cases.append(_case(name, "pad_left", p, got, ref))
        if kv_cache:
            k = max(1, length // 2)
            cache_kw = _cache_keyword(m)
            out = m(input_ids=ids[:, :k], use_cache=True)
            step_logits = [out.logits[:, -1:]]
            for t in range(k, length - 1):
                out = m(input_ids=ids[:, t:t + 1], use_cache=True, **{cache_kw: _returned_cache(out)})
                step_logits.append(out.logits)
            logits = torch.cat(step_logits, 1)  # predictions for tokens k..L-1
            got = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, k:].unsqueeze(-1)).squeeze(-1)
            report.cases.append(_case(name, "kv_cache", k, got, ref[:, k - 1:]))
        if m is not model:
            del m
    return report
