"""verl's micro-batches in the core's terms, for the actor engines (``engine_mixin.TIMEngineMixin``, ``engine.py``,
``megatron_engine.py``): where a micro-batch's response tokens are, found on the device (``ResponseLayout``,
``padded_response``), a pass's micro-batches laid out as one batch (``PassCells``), and the engine's kept sets the
rollout carried, laid over the rows a head computes (``kept_sets_of_micro_batch``, ``MicroBatchKeptSets``,
``place_kept``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tim_plugins.replay import KeptSets

from .config import EXTRA_FIELDS, KEPT_SETS_KEY

__all__ = ["MicroBatchKeptSets", "PassCells", "ResponseLayout", "kept_sets_of_micro_batch", "padded_response",
           "place_kept"]


def padded_response(x: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """A response-shaped field ([B, R] dense or nested jagged [B, j]) as a dense [B, width] tensor."""
    if x.is_nested:
        return torch.nested.to_padded_tensor(x, fill, output_size=(x.size(0), width))
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)


@dataclasses.dataclass(frozen=True)
class MicroBatchKeptSets:
    """The engine's kept sets of a micro-batch's response tokens, in cell order (sample by sample, token by token),
    and where each token's log-prob is computed: ``packed`` is the position in verl's no-padding layout of the logits
    row that predicts it (the row before the token), ``seq`` its sample. ``placed`` lays them out over a head's rows;
    every other row (prompt, padding) gets an empty set: the whole vocabulary."""

    kept: KeptSets
    packed: torch.Tensor
    seq: torch.Tensor
    seq_offsets: torch.Tensor

    def placed(self, labels_shape, *, packed: bool, starts: torch.Tensor | None = None) -> KeptSets:
        """Over the rows of a head whose labels have ``labels_shape``: ``packed`` ([N + pad] or [1, N + pad]: verl's
        no-padding layout, the padding at the tail) or padded ([B, L]: each sample's tokens at the start of its
        row); ``starts`` ([B], with ``packed=False``): each sample's first row in a layout that pads every sample
        (Megatron's thd packing: ``cu_seqlens_q_padded[:-1]``)."""
        shape = tuple(labels_shape)
        n_rows = math.prod(int(d) for d in shape)
        if packed:
            return self.kept.placed(n_rows, self.packed)
        first = self.seq * int(shape[-1]) if starts is None else starts.to(self.seq.device, torch.int64)[self.seq]
        return self.kept.placed(n_rows, first + (self.packed - self.seq_offsets[self.seq]))


def place_kept(kept: MicroBatchKeptSets | None, pipeline, **where) -> KeptSets | None:
    """``kept`` laid out over a head's rows (``MicroBatchKeptSets.placed(**where)``), or None (recompute) when they do
    not fit the rows, counted under ``tim/diag/kept_sets_fallback``: a layout the engine did not expect never stops
    training."""
    if kept is None:
        return None
    try:
        return kept.placed(**where)
    except ValueError as err:
        if pipeline is not None:
            pipeline.count("kept_sets_fallback", detail=f"the kept sets do not fit the head's rows ({err})")
        return None


def kept_sets_of_micro_batch(micro_batch) -> tuple[MicroBatchKeptSets | None, str | None]:
    """The engine's kept sets of every response token of ``micro_batch`` (``None, None``: no sample carries any, the
    usual case; ``None, reason``: some do but they cannot be used for the whole micro-batch, which then recomputes).

    A sample carries them in its ``extra_fields`` dict under ``KEPT_SETS_KEY`` (``rollout.TIMvLLMHttpServer``), one set
    per generated token; they are used only where every sample has one set per response token (a multi-turn response
    holds tool tokens the engine never sampled; a V1 padding row copies sample 0's extras with a 1-token response)."""
    # VERL_SOURCES verl.workers.rollout.replica:TokenOutput (extra_fields, one dict per sample in the batch)
    if EXTRA_FIELDS not in micro_batch.keys():
        return None, None
    value = micro_batch[EXTRA_FIELDS]
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    items = [getattr(x, "data", x) for x in items]
    packs = [x.get(KEPT_SETS_KEY) if isinstance(x, dict) else None for x in items]
    if all(p is None for p in packs):
        return None, None
    if any(p is None for p in packs):
        return None, f"{sum(p is None for p in packs)} of {len(packs)} samples carry no kept sets"
    layout = ResponseLayout(micro_batch)
    lens = layout.response_lens.tolist()  # one host read, only where kept sets arrived
    if len(lens) != len(packs):
        return None, f"{len(packs)} extra_fields for {len(lens)} samples"
    parts = []
    for i, (pack, n) in enumerate(zip(packs, lens)):
        kept = KeptSets.from_csr(pack["ids"], pack["offsets"])
        if len(kept) != n:
            return None, (f"sample {i}: {len(kept)} kept sets for {n} response tokens (a multi-turn response, a "
                          "padding sample or a truncated response)")
        parts.append(kept)
    device = layout.rows.device
    valid = layout.valid
    input_ids = micro_batch["input_ids"]
    if input_ids.is_nested:
        seq_offsets = input_ids.offsets()
    else:  # the dense layout's per-sample lengths, as ResponseLayout reads them
        seq_offsets = torch.nn.functional.pad(micro_batch["attention_mask"].sum(dim=1).cumsum(0), (1, 0))
    kept = KeptSets.concat(parts).to(device)
    return MicroBatchKeptSets(kept, layout.packed[valid], layout.rows[valid], seq_offsets.to(device)), None


class ResponseLayout:
    """Where a micro-batch's response tokens are, found on the device (no host read): one cell per position of
    the micro-batch's response fields (dense [b, R]: every cell, ``valid`` where the response has a token; nested
    jagged [b, j]: every value), with its row, its column in the response and its position in the packed
    per-token outputs (verl's no-padding layout, where a token's log-prob sits one position before the token: what
    ``no_padding_2_padding`` reads, one host read per row).

    ``cells(x)`` gives a response field, ``gather(x)`` a packed per-token output, each as [cells]; ``like(x, v)`` puts
    cell values back into the layout of the response field ``x``."""

    def __init__(self, data) -> None:
        # VERL_SOURCES verl.workers.utils.padding:no_padding_2_padding (the layout it slices: prompts / responses
        # lengths, from their offsets when nested, else from the attention mask's prompt and response parts)
        prompts, responses = data["prompts"], data["responses"]
        if prompts.is_nested:
            prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
        else:
            attention = data["attention_mask"]
            prompt_lens = attention[:, : prompts.shape[1]].sum(dim=1)
            response_lens = attention[:, prompts.shape[1]:].sum(dim=1)
        self.response_lens = response_lens
        first = (prompt_lens + response_lens).cumsum(0) - response_lens - 1  # packed position of column 0
        device, b = response_lens.device, response_lens.numel()
        self.batch = b
        if responses.is_nested:
            total = responses.values().shape[0]  # a shape: no host read
            self.rows = torch.repeat_interleave(torch.arange(b, device=device), response_lens, output_size=total)
            self.cols = torch.arange(total, device=device) - responses.offsets()[:-1][self.rows]
            self.valid = torch.ones(total, dtype=torch.bool, device=device)
            self.width = None
        else:
            self.width = responses.shape[1]
            self.rows = torch.arange(b, device=device).repeat_interleave(self.width)
            self.cols = torch.arange(self.width, device=device).repeat(b)
            self.valid = self.cols < response_lens[self.rows]
        self.packed = first[self.rows] + self.cols

    def cells(self, x: torch.Tensor) -> torch.Tensor:
        """A response-shaped field (dense [b, R'] or nested [b, j]) as [cells]."""
        if x.is_nested:
            return x.values()
        return padded_response(x, self.width).reshape(-1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """A packed per-token output (nested on the input ids, or flat [N]) as [cells]: 0 on invalid cells."""
        values = x.values() if x.is_nested else x
        picked = values[self.packed.clamp(0, values.shape[0] - 1)]
        return torch.where(self.valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    def like(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[cells] values in the layout of the response field ``x``. The nested result is built on ``x``'s offsets,
        so ``x * like(x, v)`` keeps ``x``'s row-length metadata (``TensorDict.to_padded_tensor()``, what verl's
        ``ppo_loss`` calls, pads by it)."""
        if x.is_nested:
            return torch.nested.nested_tensor_from_jagged(values.to(x.dtype), x.offsets())
        return padded_response(values.view(self.batch, self.width).to(x.dtype), x.shape[1])


class PassCells:
    """The cells of one pass's micro-batches, kept on the device and laid out as one [B, W] batch at the end of the
    pass (``batch``: one host read, the width), so the pipeline sees the pass as one batch."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        self.rows = 0

    def add(self, layout: ResponseLayout, **fields: torch.Tensor) -> None:
        self.parts.append((layout.rows + self.rows, layout.cols, fields))
        self.rows += layout.batch

    def batch(self) -> dict[str, torch.Tensor] | None:
        if not self.parts:
            return None
        rows = torch.cat([p[0] for p in self.parts])
        cols = torch.cat([p[1] for p in self.parts])
        width = int(cols.max()) + 1 if cols.numel() else 1  # the one host read of the pass
        out = {}
        for name in self.parts[0][2]:
            values = torch.cat([p[2][name] for p in self.parts])
            grid = torch.zeros((self.rows, width), dtype=values.dtype, device=values.device)
            grid[rows, cols] = values
            out[name] = grid
        self.parts, self.rows = [], 0
        return out
