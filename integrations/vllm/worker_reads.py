"""The weight-sync check's engine reads across processes: a trainer whose vLLM engine runs in other processes (verl's
rollout server: its model lives in vLLM's worker processes, one per tensor-parallel rank) asks each worker for the
sampled elements of the tensors it sent, and gets plain data back.

The request and the answer are plain Python (names, lists of ints and floats, dtype names), so they cross vLLM's
``collective_rpc`` (msgpack between the engine-core and its workers, without pickled objects) and a Ray call
unchanged:

- ``sync_requests(record)``: ``[[name, shape, index], ...]`` for every tensor a ``weight_sync.SyncRecord`` holds
  (``index``: the check's fixed [K, ndim] sample, as nested lists);
- ``read_requests(reader, requests)`` runs in the worker, ``reader`` a ``weights.VLLMWeights`` of its model:
  ``{"dtype": <the engine's configured dtype>, "reads": [<one read per request>]}``, each read an ``EngineRead`` as
  a dict (``encode_read``) or None (cannot be read);
- ``WorkerReads(answers)`` on the trainer's side is the ``weight_sync.EngineWeights`` over one engine's answers, one
  per worker: a tensor-parallel rank's read says which elements it holds (``held``; another rank holds the rest), so
  the answers merge element by element.

Importing this module imports no vLLM (the trainer's side needs none).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from tim_plugins.weight_sync import EngineRead, SyncRecord

__all__ = ["WorkerReads", "decode_read", "encode_read", "read_requests", "sync_requests"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def sync_requests(record: SyncRecord) -> list:
    """What to read after the sync ``record`` observed: ``[[name, shape, index], ...]`` (plain lists)."""
    out = []
    for name, sent in record.sent.items():
        index = record.check.index(name, sent.shape)
        out.append([name, list(sent.shape), index.tolist()])
    return out


def encode_read(read: Optional[EngineRead]) -> Optional[dict]:
    """An ``EngineRead`` as plain data (None stays None)."""
    if read is None:
        return None
    if read.missing:
        return {"missing": True}
    atol = read.atol
    atol = atol.double().reshape(-1).tolist() if isinstance(atol, torch.Tensor) else float(atol)
    held = None if read.held is None else read.held.reshape(-1).tolist()
    return {"values": read.values.double().reshape(-1).tolist(), "dtype": _dtype_name(read.dtype), "atol": atol,
            "quantized": bool(read.quantized), "missing": False, "held": held}


def decode_read(data: Optional[dict]) -> Optional[EngineRead]:
    """``encode_read``'s inverse."""
    if data is None:
        return None
    if data.get("missing"):
        return EngineRead(missing=True)
    atol = data.get("atol", 0.0)
    held = data.get("held")
    return EngineRead(values=torch.tensor(data["values"], dtype=torch.float64), dtype=_dtype(data["dtype"]),
                      atol=torch.tensor(atol, dtype=torch.float64) if isinstance(atol, list) else float(atol),
                      quantized=bool(data.get("quantized", False)),
                      held=None if held is None else torch.tensor(held, dtype=torch.bool))


def read_requests(reader, requests: Iterable) -> dict:
    """In the engine's worker: ``reader`` (a ``weights.VLLMWeights`` of this worker's model) answers ``requests``
    (``sync_requests``' lists). A tensor whose read fails is None (not compared, counted), never an error."""
    reads, requests = [], list(requests)
    fresh = getattr(reader, "fresh_read", None)
    if fresh is not None:  # a worker keeps its reader across syncs: nothing read at an earlier sync may answer now
        fresh()
    plan = getattr(reader, "plan_reads", None)
    if plan is not None:  # every tensor mapped before the first read (a transposed weight decides the square ones)
        try:
            plan({name: tuple(shape) for name, shape, _index in requests})
        except Exception:  # a reader that cannot plan still reads tensor by tensor, each failure counted
            pass
    for name, shape, index in requests:
        idx = torch.tensor(index, dtype=torch.long).reshape(len(index), len(shape))
        try:
            reads.append(encode_read(reader.read(name, tuple(shape), idx)))
        except Exception:  # one unreadable layout costs that tensor's comparison, not the sync
            reads.append(None)
    return {"dtype": _dtype_name(reader.dtype), "reads": reads}


def _merge(parts: list[EngineRead]) -> Optional[EngineRead]:
    """One tensor's reads from every tensor-parallel worker of an engine -> one read (``held``: the elements some
    worker holds; the first worker that holds an element gives its value). None (unread, counted) where a worker
    could not read its part and the others do not hold every element: a fault in that worker's shard would go
    unseen."""
    held = [p for p in parts if p is not None and not p.missing]
    if not held:
        return EngineRead(missing=True) if any(p is not None for p in parts) else None
    values = held[0].values.clone()
    atol = held[0].atol.clone() if isinstance(held[0].atol, torch.Tensor) else held[0].atol
    mask = held[0].held_mask().clone()
    for p in held[1:]:
        fill = ~mask & p.held_mask()
        values[fill] = p.values[fill]
        mask |= fill
        if isinstance(atol, torch.Tensor) and isinstance(p.atol, torch.Tensor) and p.atol.shape == atol.shape:
            atol[fill] = p.atol[fill]
        elif not isinstance(atol, torch.Tensor):
            atol = max(float(atol), float(p.atol.max() if isinstance(p.atol, torch.Tensor) else p.atol))
    whole = bool(mask.all())
    if not whole and any(p is None for p in parts):
        return None
    return EngineRead(values=values, dtype=held[0].dtype, atol=atol, quantized=any(p.quantized for p in held),
                      held=None if whole else mask)


class WorkerReads:
    """``weight_sync.EngineWeights`` over one engine's answers to ``sync_requests`` (one ``read_requests`` result per
    worker, in any order)."""

    def __init__(self, requests: list, answers: list[dict]) -> None:
        if not answers:
            raise ValueError("WorkerReads needs at least one worker's answer")
        self.dtype = _dtype(answers[0]["dtype"])
        self._reads: dict[str, Optional[EngineRead]] = {}
        for i, (name, _shape, _index) in enumerate(requests):
            self._reads[name] = _merge([decode_read(a["reads"][i]) for a in answers])

    def read(self, name: str, shape: tuple, index: torch.Tensor) -> Optional[EngineRead]:
        return self._reads.get(name)
