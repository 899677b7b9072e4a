"""Weight parity at the sync: after a weight sync, does the engine hold what the trainer sent?

A sync that does not apply (a no-op, a layer skipped, a tensor written in another precision) leaves the engine
sampling from other weights than the trainer scores. The parity audit cannot see it (it reads the configuration);
the monitor sees a grown k3 and cannot say why. This check compares, per tensor, a fixed sample of elements: the
engine's values against the trainer's cast to the engine's dtype (a quantized engine: its dequantized values within
the quantizer's own bound, which its reader states), exactly, every ``every_n_syncs`` syncs. What it finds are named
causes (``tim_plugins.causes``: ``sync-noop``, ``sync-tensors-stale``, ``sync-precision``, ``sync-tensors-missing``,
``sync-tensors-differ``), with the tensors' names.

Why a sample and not a digest of every element: a digest reads both copies whole (on a 0.5B model about as much
memory traffic as the sync itself); ``elements_per_tensor`` elements on a grid of ``columns_per_tensor`` columns,
read with one ``torch.take`` per tensor on each side, cost a fixed few tens of microseconds per tensor whatever its
size (docs/benchmarks.md, ``benchmarks/results/weight_sync.json``) and catch any fault that touches a tensor as a
whole. A stale tensor shows once the trainer's update moves one sampled element in the engine's precision; until
then the engine holds the trainer's weights as far as its dtype can tell.

The API an adapter uses (framework-neutral; the engine side is a reader the adapter supplies)::

    from tim_plugins.weight_sync import SyncCheck, SyncCheckConfig

    check = SyncCheck(SyncCheckConfig(every_n_syncs=1))
    record = check.begin(step)                 # None when this sync is not checked
    if record is not None:
        record.expect(names)                   # optional: every name the trainer holds (a tensor never sent is
                                               # then compared from ``local`` below, or named missing)
        weights = record.observing(weights)    # wraps the (name, tensor) iterator the sync streams to the engine
    engine.load_weights(weights)               # the framework's own sync, unchanged
    report = check.finish(record, reader, local=trainer_tensor,   # -> SyncReport
                          prefix=CachedPrefix(blocks, block_size))  # optional: the engine's prefix cache now
    pipeline.sync_checked(report)              # tim/cause/*, the console line, the probe's warn / raise / stop

``reader`` is an `EngineWeights`: its ``dtype`` (the engine's configured dtype) and ``read(name, shape, index)``
returning the engine's values of the trainer's tensor ``name`` at the [K, ndim] element ``index`` (in the trainer's
coordinates; the reader maps names, merged and padded tensors, shards) as an `EngineRead`, ``EngineRead(missing=True)``
when the engine holds no such tensor, or None when it cannot read that tensor (counted, never named); an optional
``fresh_read()`` is called before each check's reads (a reader that caches reads within one check drops them), an
optional ``plan_reads({name: shape})`` with every tensor the check will read, before the first. A read that raises
is counted unread, like None.
vLLM's reader is ``tim_plugins.integrations.vllm.weights.VLLMWeights``. ``local`` (optional) gives the trainer's own
tensor of a name that was expected and not streamed (a plain, unsharded parameter), so a sync that sends nothing is
still compared. ``prefix`` (optional) is what the engine's prefix cache can still serve, read after the sync: blocks
left there hold keys and values of the previous weights (``sync-prefix-cache``), whatever the weights compare to.

Classification of a tensor whose sampled values differ from the trainer's (in this order): ``stale`` when they equal
the engine's values at the previous check; ``precision`` when they equal the trainer's rounded through a coarser
dtype (bf16, fp16, fp8) and that rounding shows (the held values are not one constant, and it differs from the cast
to the engine's dtype on at least ``INFORMATIVE_ROUNDING_SHARE`` of them: a stale norm at 1.0 or a zero bias equals
the trainer's values in fp8 too); ``differs`` otherwise (at a check with no previous one to compare with, such as the
first after a resume, a tensor the sync left out is ``differs``, and the message says there was none). A value
that is not finite in the engine where the trainer's unrounded value is (an fp16 cast that overflows) disagrees.
A tensor stored in a dtype coarser than the engine's configured one is
``precision`` too. When every checked tensor whose trainer value moved since the previous check is stale, the sync
was a no-op (``sync-noop``, the tensors listed once); moved as the engine holds it: in the configured dtype for a
finer copy of it, beyond the quantizer's bound of the previous values for a quantized tensor. Without an expectation
(sharded parameters: no ``expect``), a sync after an optimizer step that sends nothing at all, where the previous
checked sync sent tensors, is a no-op too.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol

import numpy as np
import torch

from tim_plugins.causes import Cause, summarize_names

__all__ = ["CachedPrefix", "EngineRead", "EngineWeights", "SyncCheck", "SyncCheckConfig", "SyncRecord", "SyncReport",
           "STATUSES", "sample_index", "ravel", "coarser_dtypes"]

# What a checked tensor can be found to be (SyncReport.statuses).
STATUSES = ("ok", "stale", "precision", "differs", "missing", "unread")
REPORTS_KEPT = 64  # SyncCheck.reports' length: a report holds every checked tensor's status (kB per sync)

# Float dtypes by precision (mantissa bits): a value rounded through a coarser one and stored in a finer one is what
# "written in another precision" leaves behind.
_FLOAT_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
for _name, _bits in (("float8_e4m3fn", 3), ("float8_e5m2", 2)):
    if hasattr(torch, _name):
        _FLOAT_BITS[getattr(torch, _name)] = _bits


def _finer_than(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    bits = _FLOAT_BITS.get(dtype)
    return () if bits is None else tuple(d for d, b in _FLOAT_BITS.items() if b > bits)


def coarser_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The float dtypes with fewer mantissa bits than ``dtype``, finest first (what a value stored in ``dtype`` may
    have been rounded through)."""
    bits = _FLOAT_BITS.get(dtype)
    if bits is None:
        return ()
    return tuple(d for d, b in sorted(_FLOAT_BITS.items(), key=lambda x: -x[1]) if b < bits)


@dataclass
class SyncCheckConfig:
    """How often and how much the sync check compares."""

    every_n_syncs: int = field(default=1, metadata={"help": "check every Nth weight sync (the first one included)"})
    elements_per_tensor: int = field(default=64, metadata={"help": (
        "sampled elements compared per tensor (a fixed grid, the same at every sync)")})
    columns_per_tensor: int = field(default=4, metadata={"help": (
        "columns the grid of a matrix spans (an engine that reads a packed matrix through its own forward pays one "
        "one-hot row per column; each column is drawn in its own band of the width, so a tensor-parallel engine of "
        "up to this many ranks holds some in each row-parallel shard)")})
    seed: int = field(default=0, metadata={"help": "seed of the sampled elements (with each tensor's name)"})

    def __post_init__(self) -> None:
        for name in ("every_n_syncs", "elements_per_tensor", "columns_per_tensor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SyncCheckConfig.{name}={v!r} is invalid: must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"SyncCheckConfig.seed={self.seed!r} is invalid: must be an integer")

    def for_tensor_parallel(self, size: int) -> "SyncCheckConfig":
        """This configuration for an engine of ``size`` tensor-parallel ranks whose every rank checks its own shards
        (TRL colocate): columns and rows per matrix each a multiple of ``size`` (``sample_index`` draws each in its
        own band of an equal split, so every shard, an equal split too, holds whole bands of both), the fewest
        elements that take. Itself for the default at 1, 2 and 4 ranks (the packed reader's cost grows with the
        columns)."""
        size = int(size)
        if size <= 1:
            return self

        def up(n: int) -> int:  # the smallest multiple of size >= n
            return size * -(-n // size)

        columns = up(self.columns_per_tensor)
        elements = columns * up(-(-self.elements_per_tensor // columns))  # rows: ceil(K / columns), rounded up
        if (columns, elements) == (self.columns_per_tensor, self.elements_per_tensor):
            return self
        return dataclasses.replace(self, columns_per_tensor=columns, elements_per_tensor=elements)


def sample_index(name: str, shape: tuple, elements: int, columns: int, seed: int = 0) -> torch.Tensor:
    """The fixed [K, ndim] element indices compared for tensor ``name`` of ``shape`` (int64, CPU): a vector's K
    distinct positions; a matrix's (or a higher tensor's, viewed as [shape[0], rest]) grid of up to ``columns``
    distinct columns times ceil(K / columns) distinct rows. Deterministic in (name, shape, seed); the columns depend
    on the input width and the seed only, so the parts an engine merges into one matrix (q / k / v, gate / up) share
    them and a reader that reads columns through the layer's forward pays once per merged matrix.

    Each position, row and column is drawn in its own equal band of the length it spans (``_spread``), so that every
    tensor-parallel shard of up to ``columns`` column shards (row-parallel layers) or ceil(K / columns) row shards
    (column-parallel and vocabulary-parallel ones) holds some of the elements: a rank that checks its own shard
    (TRL colocate with ``vllm_tensor_parallel_size`` > 1) always has some to compare."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(0, len(shape), dtype=torch.long)
    if not shape:  # a 0-d tensor: its one element
        return torch.zeros(1, 0, dtype=torch.long)
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1_000_003 + seed) % (2**63 - 1))
    if len(shape) <= 1:
        return _spread(numel, elements, g).view(-1, 1)
    rows, rest = shape[0], numel // shape[0]
    by_width = torch.Generator().manual_seed((rest * 1_000_003 + seed) % (2**63 - 1))
    cols = _spread(rest, columns, by_width)
    picked = _spread(rows, max(1, -(-elements // cols.numel())), g)
    r = picked.repeat_interleave(cols.numel())
    c = cols.repeat(picked.numel())
    tail = torch.stack(torch.unravel_index(c, shape[1:]), dim=1) if len(shape) > 2 else c.view(-1, 1)
    return torch.cat([r.view(-1, 1), tail], dim=1)


def _spread(length: int, count: int, g: torch.Generator) -> torch.Tensor:
    """min(count, length) distinct positions in [0, length), ascending: one drawn at random in each of as many equal
    bands (band i: [i * length // n, (i + 1) * length // n))."""
    n = min(count, length)
    edges = torch.arange(n + 1) * length // n
    return edges[:-1] + (torch.rand(n, generator=g, dtype=torch.float64) * (edges[1:] - edges[:-1])).long()


def ravel(index: torch.Tensor, shape: tuple) -> torch.Tensor:
    """[K, ndim] element indices of a tensor of ``shape`` as [K] flat row-major positions (int64): what
    ``torch.take`` reads. A 0-d tensor's one element is position 0."""
    if index.shape[1] == 0:
        return torch.zeros(index.shape[0], dtype=torch.long)
    strides = torch.tensor([math.prod(shape[d + 1:]) for d in range(len(shape))], dtype=torch.long)
    return (index.long() * strides).sum(dim=1)


@dataclass
class EngineRead:
    """The engine's values of one sent tensor at the requested elements.

    ``values``: [K], in the engine's stored dtype or float64 (every read is converted to float64 once, all
    tensors at a time). ``held``: [K] bool (CPU), the elements this rank's engine holds (a shard elsewhere holds the
    rest, whose ``values`` are not read: any number, NaN by convention); None = every element. A held value that is
    NaN or infinite is the engine's own, compared like any other.
    ``dtype``: the dtype the engine stores the tensor in; the trainer's values are cast to it before comparing.
    ``atol``: the quantizer's own error bound ([K] or a number; 0 = exact); ``quantized``: the values are the
    dequantized weight, compared with the trainer's unrounded values within ``atol``.
    ``missing``: the engine holds no tensor under this name (then nothing else is read)."""

    values: Optional[torch.Tensor] = None
    dtype: Optional[torch.dtype] = None
    held: Optional[torch.Tensor] = None
    atol: object = 0.0
    quantized: bool = False
    missing: bool = False

    def held_mask(self) -> torch.Tensor:
        """[K] bool on the CPU: the elements this read holds (every one without a ``held`` mask)."""
        if self.held is None:
            return torch.ones(self.values.shape[0], dtype=torch.bool)
        return self.held.reshape(-1).cpu()


class EngineWeights(Protocol):
    """What an adapter supplies to read the engine's weights (see the module docstring)."""

    dtype: torch.dtype

    def read(self, name: str, shape: tuple, index: torch.Tensor) -> Optional[EngineRead]: ...


@dataclass
class _Sent:
    shape: tuple
    values: torch.Tensor  # the trainer's values at the sampled elements, in its own dtype (float64 when scaled)
    streamed: bool  # False: taken from the trainer's own tensor (expected, never streamed)


class SyncRecord:
    """What the trainer sent at one sync, sampled as it streams (no tensor is copied or kept)."""

    def __init__(self, check: "SyncCheck", step: int, sync_index: int) -> None:
        self.check, self.step, self.sync_index = check, int(step), int(sync_index)
        self.sent: dict[str, _Sent] = {}
        self.expected: list[str] = []
        self.seconds = 0.0
        self.failed: Optional[str] = None  # the first error sampling a sent tensor (the check is then not made)

    def observe(self, name: str, tensor: torch.Tensor, *, streamed: bool = True, scale: Optional[float] = None
                ) -> None:
        """Sample the trainer's ``tensor`` sent under ``name`` (the engine's loader's name, e.g. HF names); a name
        sent twice keeps its first tensor. ``scale``: the engine holds the tensor times this factor (vLLM folds a
        LoRA adapter's scaling into its ``lora_B``): the sample is kept multiplied by it, in float64, for a reader
        whose read of that tensor is compared unrounded within its bound (``EngineRead.quantized``)."""
        if name in self.sent or self.failed is not None:
            return
        t0 = time.perf_counter()
        try:  # it runs inside the framework's sync: a tensor it cannot sample costs the check, never the sync
            t = tensor.detach()
            shape = tuple(t.shape)
            values = torch.take(t, self.check.flat_index(name, shape, t.device))
            if scale is not None:
                values = values.to(torch.float64) * float(scale)
        except Exception as err:
            self.failed = f"{name}: {err!r}"
            return
        self.sent[name] = _Sent(shape, values, streamed)
        self.seconds += time.perf_counter() - t0

    def observing(self, weights: Iterable) -> Iterator:
        """``weights`` ((name, tensor) pairs), each observed as it passes."""
        for name, tensor in weights:
            self.observe(name, tensor)
            yield name, tensor

    def expect(self, names: Iterable[str]) -> None:
        """Every name the trainer holds: those never streamed are compared from ``finish``'s ``local``."""
        self.expected = list(names)


@dataclass(frozen=True)
class CachedPrefix:
    """What an engine's prefix cache can still serve right after a weight sync: ``blocks`` blocks of KV, of
    ``block_size`` tokens each, computed before it. After a sync that resets the cache (vLLM's
    ``reset_prefix_cache``, which TRL and verl call once the weights are written) there are none; any left serve the
    prompts that share their prefix (the same prompt, a shared system prompt or chat template) from the previous
    weights' keys and values: ``sync-prefix-cache``."""

    blocks: int
    block_size: int

    def causes(self, step: int) -> list[Cause]:
        if self.blocks <= 0:
            return []
        tokens = self.blocks * self.block_size
        return [Cause("sync-prefix-cache", step, f"at the weight sync after optimizer step {step}, the engine's "
                                                 f"prefix cache still holds {self.blocks} block"
                                                 f"{'s' if self.blocks != 1 else ''} ({tokens} tokens) of keys and "
                                                 f"values computed before it, with older weights: a prompt sharing "
                                                 f"their prefix is served from them",
                      evidence={"blocks": self.blocks, "block_size": self.block_size})]


@dataclass
class SyncReport:
    """One checked sync: per-tensor statuses, the counts logged as ``tim/cause/sync_*`` and the named causes."""

    step: int
    sync_index: int
    statuses: dict = field(default_factory=dict)  # name -> one of STATUSES
    detail: dict = field(default_factory=dict)  # name -> e.g. the dtype a precision problem went through
    not_sent: list = field(default_factory=list)  # expected names never streamed
    causes: list = field(default_factory=list)
    seconds: float = 0.0  # time spent sampling the sent tensors and reading the engine
    prefix_blocks: Optional[int] = None  # prefix-cache blocks the engine could still serve after the sync (None: unread)

    @property
    def checked_tensors(self) -> int:
        return sum(s not in ("unread",) for s in self.statuses.values())

    @property
    def bad_tensors(self) -> int:
        return sum(s not in ("ok", "unread") for s in self.statuses.values())

    def names(self, status: str) -> list[str]:
        return [n for n, s in self.statuses.items() if s == status]

    def to_dict(self) -> dict:
        return {"step": self.step, "sync_index": self.sync_index, "checked_tensors": self.checked_tensors,
                "bad_tensors": self.bad_tensors, "statuses": dict(self.statuses), "detail": dict(self.detail),
                "not_sent": list(self.not_sent), "causes": [c.to_dict() for c in self.causes],
                "seconds": self.seconds, "prefix_blocks": self.prefix_blocks}


class SyncCheck:
    """Weight parity at every ``every_n_syncs``-th sync (module docstring). Holds, per tensor, its sampled indices
    and the engine's values at the last check (to tell a stale tensor from a differing one)."""

    def __init__(self, config: SyncCheckConfig | None = None) -> None:
        self.config = config if config is not None else SyncCheckConfig()
        self.syncs = 0  # syncs seen (checked or not)
        self._index: dict[tuple, torch.Tensor] = {}
        self._flat_index: dict[tuple, torch.Tensor] = {}
        # the previous check's values, per (stored dtype, quantized) group: (names, sizes, engine values, expected)
        self._last: dict[tuple, tuple] = {}
        self.reports: list[SyncReport] = []  # the last REPORTS_KEPT checks' reports
        self._last_sent: SyncReport | None = None  # the last report of a check that compared tensors

    def index(self, name: str, shape: tuple) -> torch.Tensor:
        key = (name, shape)
        idx = self._index.get(key)
        if idx is None:
            c = self.config
            idx = self._index[key] = sample_index(name, shape, c.elements_per_tensor, c.columns_per_tensor, c.seed)
        return idx

    def flat_index(self, name: str, shape: tuple, device) -> torch.Tensor:
        """``index(name, shape)`` as flat (row-major) element positions on ``device``: one ``torch.take`` reads the
        sampled elements of any tensor of ``shape``, contiguous or not. Built once per tensor and device."""
        key = (name, shape, device)
        flat = self._flat_index.get(key)
        if flat is None:
            flat = self._flat_index[key] = ravel(self.index(name, shape), shape).to(device)
        return flat

    def begin(self, step: int) -> Optional[SyncRecord]:
        """A record for the sync about to run at optimizer step ``step``, or None when this sync is not checked."""
        i = self.syncs
        self.syncs += 1
        return SyncRecord(self, step, i) if i % self.config.every_n_syncs == 0 else None

    def finish(self, record: SyncRecord, engine: EngineWeights,
               local: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
               prefix: Optional[CachedPrefix] = None) -> SyncReport:
        """Compare the engine (after the sync) with ``record``; ``local(name)``: the trainer's own tensor of an
        expected name that was not streamed (None when it has no plain tensor of it); ``prefix``: what the engine's
        prefix cache can still serve, read after the sync (None: not read)."""
        if record.failed is not None:  # the adapters count it (sync_check_failed)
            raise RuntimeError(f"the sync check could not sample a sent tensor: {record.failed}")
        t0 = time.perf_counter()
        report = SyncReport(record.step, record.sync_index)
        fresh = getattr(engine, "fresh_read", None)  # optional: the engine's weights changed, drop any cached read
        if fresh is not None:
            fresh()
        never: list[str] = []  # expected, not sent, and no trainer value to compare (a shard)
        for name in record.expected:
            if name not in record.sent:
                report.not_sent.append(name)
                tensor = local(name) if local is not None else None
                if tensor is not None:
                    record.observe(name, tensor, streamed=False)
                else:
                    never.append(name)
        plan = getattr(engine, "plan_reads", None)  # optional: every tensor's shape before the first read
        if plan is not None:
            try:
                plan({name: sent.shape for name, sent in record.sent.items()})
            except Exception:  # a reader that cannot plan still reads tensor by tensor, each failure counted
                pass
        reads = []
        for name, sent in record.sent.items():
            try:
                read = engine.read(name, sent.shape, self.index(name, sent.shape))
            except Exception as err:  # one unreadable layout costs that tensor's comparison, not the check
                report.statuses[name] = "unread"
                report.detail[name] = f"read failed: {err!r}"
                continue
            if read is None or read.missing:
                report.statuses[name] = "unread" if read is None else "missing"
            else:
                reads.append((name, sent, read))
        fresh_values, groups = self._compare(reads, engine.dtype)
        changed: list[str] = []
        first_seen: list[str] = []  # differing tensors with no previous check to tell stale from corrupted
        too_coarse = coarser_dtypes(engine.dtype)
        for name, sent, read in reads:
            agrees, held, moved = fresh_values[name]
            coarser = not read.quantized and read.dtype in too_coarse
            if not held:  # a tensor without elements holds nothing to disagree on
                status = "ok" if math.prod(sent.shape) == 0 else "unread"
            elif agrees and not coarser:
                status = "ok"
            else:  # the rare case: what went wrong, tensor by tensor
                status = self._classify(name, sent, read, engine.dtype, coarser, groups, report)
                previous = self._previous(name)
                if status == "differs" and (previous is None or previous[0].numel() != read.values.numel()):
                    first_seen.append(name)
            report.statuses[name] = status
            if moved:
                changed.append(name)
        self._remember(groups)
        if record.step > 0:  # after an optimizer step, an unsent tensor's engine values are the previous ones
            report.statuses.update((name, "stale") for name in never)
        streamed = any(sent.streamed for sent in record.sent.values())
        report.causes = (self._causes(report, changed, engine.dtype, streamed=streamed, first_seen=first_seen)
                         + self._nothing_sent(record))
        if prefix is not None:
            report.prefix_blocks = int(prefix.blocks)
            report.causes += prefix.causes(record.step)
        report.seconds = record.seconds + time.perf_counter() - t0
        self.reports.append(report)
        del self.reports[:-REPORTS_KEPT]
        if report.statuses:
            self._last_sent = report
        return report

    def _compare(self, reads: list, configured: torch.dtype) -> tuple[dict, dict]:
        """({name: (agrees, any element held, moved since the previous check)}, this check's groups), computed over
        every read tensor at once per (stored dtype, quantized) group: a few tensor operations per check, not a
        dozen per tensor. A group: (names, sizes, engine values, expected values), flat, float64."""
        out: dict = {}
        groups: dict[tuple, tuple] = {}
        by_key: dict[tuple, list] = {}
        for item in reads:
            by_key.setdefault((item[2].dtype, item[2].quantized), []).append(item)
        for key, items in by_key.items():
            dtype, quantized = key
            names = tuple(name for name, _, _ in items)
            sizes = [int(read.values.numel()) for _, _, read in items]
            v = _flat([read.values for _, _, read in items])
            t = _flat([sent.values for _, sent, _ in items])
            held = _held([read for _, _, read in items], sizes)
            if quantized:
                expected = t
                atol = torch.cat([torch.as_tensor(read.atol, dtype=torch.float64).expand(n).reshape(-1)
                                  for (_, _, read), n in zip(items, sizes)])
                same = (v - expected).abs() <= atol
            else:
                expected = t.to(dtype).double()  # t holds the trainer's values exactly: one rounding, as a cast
                same = v == expected
                if dtype in _finer_than(configured):
                    # an engine that loads in its configured dtype and then keeps a finer copy (vLLM's CPU kernels
                    # hold some biases in fp32) holds the values rounded through the configured dtype: as good
                    same |= v == t.to(configured).to(dtype).double()
            if not bool(same.all()):  # a NaN the trainer holds and sent as NaN was carried over: it agrees
                same |= torch.isnan(v) & torch.isnan(expected)
            # an engine value that is not finite where the trainer's unrounded value is (a cast that overflows the
            # engine's dtype: fp16 beyond 65504) computes with inf, whatever the cast of the trainer's value gives
            same &= torch.isfinite(v) | ~torch.isfinite(t)
            seg = torch.from_numpy(np.repeat(np.arange(len(items)), sizes))  # torch's repeat_interleave: ~100x slower
            bad = torch.zeros(len(items), dtype=torch.float64).index_add_(0, seg, (~same & held).double())
            n_held = torch.zeros(len(items), dtype=torch.float64).index_add_(0, seg, held.double())
            # moved: the trainer's values (in the engine's precision) changed since the previous check
            if quantized:
                # a quantized engine shows a move only where its values at the previous check are no longer
                # within the quantizer's bound of the trainer's: one within it (most steps, with fp8's coarse
                # grid) leaves the same quantized values, and must not keep a no-op from its name either
                then = self._previous_flat(key, names, sizes, engine=True)
                diff = ((then - expected).abs() > atol) & held & ~torch.isnan(then) & ~torch.isnan(expected)
            else:
                now, before = expected, self._previous_flat(key, names, sizes)
                if dtype in _finer_than(configured):
                    # a finer copy of the configured rounding holds the trainer's values to the configured dtype's
                    # precision only: a move below it does not show there, and must not keep a no-op from its name
                    now, before = expected.to(configured).double(), before.to(configured).double()
                diff = (now != before) & held & ~torch.isnan(before) & ~torch.isnan(now)
            moved = torch.zeros(len(items), dtype=torch.float64).index_add_(0, seg, diff.double()) > 0
            for name, b, h, m in zip(names, bad.tolist(), n_held.tolist(), moved.tolist()):
                out[name] = (b == 0, h > 0, m)
            groups[key] = (names, sizes, v, expected)
        return out, groups

    def _previous_flat(self, key: tuple, names: tuple, sizes: list, engine: bool = False) -> torch.Tensor:
        """The expected values (``engine``: the engine's values) at the previous check, flat in the order of
        ``names`` (NaN where unknown): the stored group itself when the same tensors are checked again (every sync
        but the first), else tensor by tensor."""
        stored = self._last.get(key)
        if stored is not None and stored[0] == names and stored[1] == sizes:
            return stored[2 if engine else 3]
        parts = []
        for name, n in zip(names, sizes):
            prev = self._previous(name)
            prev = None if prev is None else prev[0 if engine else 1]
            parts.append(prev if prev is not None and prev.numel() == n else
                         torch.full((n,), math.nan, dtype=torch.float64))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def _previous(self, name: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(engine values, expected values) of tensor ``name`` at the previous check that read it, or None."""
        for names, sizes, v, expected in self._last.values():
            if name in names:
                i = names.index(name)
                start = sum(sizes[:i])
                return v[start:start + sizes[i]], expected[start:start + sizes[i]]
        return None

    def _remember(self, groups: dict) -> None:
        """Keep this check's groups as the previous values of their tensors: a tensor read now leaves any older
        group it was in; one not read now (a partial stream) keeps its older values, in its group of the same key
        too."""
        read = {name for names, *_ in groups.values() for name in names}
        out = dict(groups)
        for key, (names, sizes, v, expected) in self._last.items():
            keep = [i for i, n in enumerate(names) if n not in read]
            if len(keep) == len(names) and key not in groups:  # none of them read now
                out[key] = self._last[key]
                continue
            if not keep:  # every one read now
                continue
            offsets = np.cumsum([0, *sizes])
            rows = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in keep]))
            old = (tuple(names[i] for i in keep), [sizes[i] for i in keep], v[rows], expected[rows])
            if key in groups:  # the unread tensors' older values beside this check's
                new = groups[key]
                old = (new[0] + old[0], new[1] + old[1], torch.cat([new[2], old[2]]), torch.cat([new[3], old[3]]))
            out[key] = old
        self._last = out

    def _classify(self, name: str, sent: _Sent, read: EngineRead, configured: torch.dtype, coarser: bool,
                  groups: dict, report: SyncReport) -> str:
        """The status of a tensor that does not hold the trainer's values (or is stored coarser than configured)."""
        names, sizes, v_all, e_all = groups[(read.dtype, read.quantized)]
        i = names.index(name)
        start = sum(sizes[:i])
        v, expected = v_all[start:start + sizes[i]], e_all[start:start + sizes[i]]
        held = read.held_mask()
        if coarser:
            report.detail[name] = f"stored as {_dtype_name(read.dtype)} (engine: {_dtype_name(configured)})"
            return "precision"
        previous = self._previous(name)
        unchanged = previous is not None and previous[0].numel() == v.numel() and bool(
            (v == previous[0])[held].all())
        # the trainer's values moved and the engine's did not: stale, whatever else they match
        if unchanged and bool(((expected != previous[1]) & held & ~torch.isnan(previous[1])
                               & ~torch.isnan(expected)).any()):
            return "stale"
        t = sent.values.detach().to("cpu")
        for d in coarser_dtypes(read.dtype):  # a tensor the trainer left alone (frozen, lr 0) keeps this name
            rounded = t.to(d).to(read.dtype).double().reshape(-1)
            if bool((v == rounded)[held].all()) and _informative(rounded, expected, v, held):
                report.detail[name] = f"values rounded through {_dtype_name(d)} (engine: {_dtype_name(read.dtype)})"
                return "precision"
        if unchanged:  # neither moved, and the engine still holds what it held: left out of the syncs
            return "stale"
        t = t.double().reshape(-1)
        odd = held & ~torch.isfinite(v) & torch.isfinite(t)
        if bool(odd.any()):  # a corrupted load (a NaN scale, an overflowing cast) gives no distance worth printing
            report.detail[name] = (f"{int(odd.sum())} of {int(held.sum())} sampled values NaN or infinite in the "
                                   "engine, finite in the trainer")
            if read.dtype.is_floating_point and bool((t[odd].abs() > torch.finfo(read.dtype).max).all()):
                report.detail[name] += f" (beyond {_dtype_name(read.dtype)}'s range: the cast overflows)"
            return "differs"
        worst = float((v - expected).abs()[held].max())
        report.detail[name] = f"max |engine - trainer| {worst:.3g}"
        return "differs"

    def _causes(self, report: SyncReport, changed: list[str], configured: torch.dtype, *, streamed: bool = True,
                first_seen: tuple = ()) -> list[Cause]:
        step, out = report.step, []
        stale = report.names("stale")
        at = f"at the weight sync after optimizer step {step}"
        not_sent = set(report.not_sent)
        if stale:
            moved_ok = [n for n in changed if report.statuses[n] == "ok"]
            unsent = [n for n in stale if n in not_sent]
            why = (f" ({len(unsent)} of them never sent)" if unsent else "")
            if changed and not moved_ok and set(changed) <= set(stale):
                out.append(Cause("sync-noop", step, f"{at}, none of the {len(changed)} checked tensors the trainer "
                                                    f"changed was updated in the engine{why}: "
                                                    f"{summarize_names(stale)}", tensors=tuple(stale),
                                 evidence={"stale": len(stale), "changed": len(changed)}))
            elif not streamed and not moved_ok:  # nothing reached the engine, and no trainer value was compared
                # (shards); a tensor the trainer moved and the engine holds shows it did change: no no-op
                out.append(Cause("sync-noop", step, f"{at}, nothing was sent: the engine still holds the previous "
                                                    f"values of {_n(stale)}: {summarize_names(stale)}",
                                 tensors=tuple(stale), evidence={"sent": 0, "stale": len(stale)}))
            else:
                held = _n(stale, "still holds its", "still hold their")
                out.append(Cause("sync-tensors-stale", step, f"{at}, {held} previous values{why}: "
                                                             f"{summarize_names(stale)}",
                                 tensors=tuple(stale), evidence={"stale": len(stale), "changed": len(changed)}))
        precision = report.names("precision")
        if precision:
            kinds = sorted({report.detail[n] for n in precision})
            out.append(Cause("sync-precision", step, f"{at}, {_n(precision, 'holds', 'hold')} another precision than "
                                                     f"the engine's {_dtype_name(configured)} ({'; '.join(kinds)}): "
                                                     f"{summarize_names(precision)}", tensors=tuple(precision),
                             evidence={n: report.detail[n] for n in precision}))
        missing = report.names("missing")
        if missing:
            out.append(Cause("sync-tensors-missing", step, f"{at}, the engine holds none of {_n(missing)} "
                                                           f"sent: {summarize_names(missing)}", tensors=tuple(missing)))
        differs = report.names("differs")
        if differs:
            # between two checks the engine may have stopped at an unchecked sync: then it holds neither
            every = self.config.every_n_syncs
            previous = (("its" if len(differs) == 1 else "their") + " previous ones" if every == 1 else
                        f"those at the last check, {every} syncs ago (an engine that stopped following at a sync in "
                        "between holds neither)")
            first_seen = set(first_seen)
            unknown = [n for n in differs if n in first_seen]
            if not unknown:
                what = f"values that are neither the trainer's nor {previous}"
            else:
                # no previous check of them (the run's first, or the first after a resume, whose engine may have
                # restarted from other weights): a tensor the sync left out cannot be told from a corrupted one
                some = "them" if len(unknown) == len(differs) else f"{len(unknown)} of them"
                what = (f"values that are not the trainer's nor a rounding of them, and there is no previous check "
                        f"of {some} to compare with (the first check, or the first after a resume): a tensor this "
                        f"sync left out looks the same")
                if len(unknown) < len(differs):
                    what += f"; the others' are not {previous} either"
            out.append(Cause("sync-tensors-differ", step, f"{at}, {_n(differs, 'holds', 'hold')} {what}: "
                                                          f"{summarize_names(differs)}", tensors=tuple(differs),
                             evidence={n: report.detail[n] for n in differs}))
        return out

    def _nothing_sent(self, record: SyncRecord) -> list[Cause]:
        """``sync-noop`` for a sync that sent nothing and had no expectation to compare from, after an optimizer step
        and a checked sync that did send (its tensors are the ones named)."""
        if record.sent or record.expected:
            return []
        previous = self._last_sent
        if previous is None or record.step <= previous.step:
            return []
        names = list(previous.statuses)
        return [Cause("sync-noop", record.step, f"at the weight sync after optimizer step {record.step}, nothing was "
                                                f"sent; the checked sync after step {previous.step} sent {_n(names)}: "
                                                f"{summarize_names(names)}", tensors=tuple(names),
                      evidence={"sent": 0, "previously_sent": len(names)})]

    def state_dict(self) -> dict:
        return {"syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = int(state.get("syncs", 0))


# "Rounded through a coarser dtype" is told from the values only where that rounding is visible: where it differs
# from the rounding to the engine's own dtype on at least this share of the held elements (values away from zero and
# from the coarser dtype's grid: any trained weight). A stale tensor still at its init (a norm at 1.0, a zero bias or
# LoRA B) equals the trainer's values in fp8 as well, and is no precision fault.
INFORMATIVE_ROUNDING_SHARE = 0.5


def _informative(rounded: torch.Tensor, expected: torch.Tensor, engine: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether engine values equal to ``rounded`` (the trainer's values rounded through a coarser dtype) show that
    rounding: the held values are not all one constant, and ``rounded`` differs from ``expected`` (the trainer's cast
    to the engine's dtype) on at least INFORMATIVE_ROUNDING_SHARE of the held elements whose value is known."""
    known = held & ~torch.isnan(expected)
    values = engine[known]
    if values.numel() < 2 or bool((values == values[0]).all()):
        return False
    return float((rounded != expected)[known].double().mean()) >= INFORMATIVE_ROUNDING_SHARE


def _held(reads: list, sizes: list) -> torch.Tensor:
    """The elements held, flat over ``reads`` (every element when no read carries a ``held`` mask)."""
    if all(read.held is None for read in reads):
        return torch.ones(sum(sizes), dtype=torch.bool)
    return torch.cat([read.held_mask() for read in reads])


def _flat(parts: list) -> torch.Tensor:
    """``parts`` (1-D or 0-d tensors) as one float64 CPU vector: concatenated where they are (one copy to the host
    for a device's), then converted once."""
    parts = [p if p.dim() == 1 else p.reshape(-1) for p in parts]  # reads and samples: 1-D, no autograd
    try:
        flat = torch.cat(parts)
    except RuntimeError:  # on several devices
        flat = torch.cat([p.cpu() for p in parts])
    return flat.to("cpu", torch.float64)


def _n(names: list, one: str = "", many: str = "") -> str:
    """"3 tensors hold", "1 tensor holds": the count, then the verb phrase that agrees with it (if any)."""
    words = (f"{len(names)} tensor", one) if len(names) == 1 else (f"{len(names)} tensors", many)
    return " ".join(w for w in words if w)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
