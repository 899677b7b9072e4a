"""The tokens where rollout and trainer disagree most: the largest |log p_train − log p_rollout|, with their
position, both probabilities, the step and a few tokens of context, decoded to text.

Rows come from a dump folder (a top-n query over its files, ``report.query.Dump.largest_disagreements``, in
bounded memory) or from per-token columns built from a run's own [B, T] tensors (those of ``tim_plugins.dump``:
step, rank, sequence, position, token_id, rollout_logprob, train_logprob). The order is a stable sort by |Δ|
(descending) of the rows in (step, rank, sequence, position) order, so ties keep that order. Decoding needs the run's tokenizer, which only the applications have: they pass ``decode``.

Decoded text is untrusted: ``visible`` makes control and format characters visible, and every renderer here
escapes it for HTML.
"""

from __future__ import annotations

import html
import unicodedata
from typing import Callable, Sequence

import numpy as np

from tim_plugins.report.query import exp_or_inf

__all__ = ["DEFAULT_ROWS", "DEFAULT_CONTEXT", "columns_from_tensors", "largest_disagreements",
           "decode_rows", "dump_disagreements", "visible", "disagreements_html", "disagreements_text"]

# What a decoder gives for bytes that do not complete a UTF-8 character.
REPLACEMENT = "\ufffd"

DEFAULT_ROWS = 15
DEFAULT_CONTEXT = 4  # tokens of context on each side

_KEYS = ("step", "rank", "sequence", "position", "token_id", "rollout_logprob", "train_logprob")
_SHOWN = {"\n": "⏎", "\t": "⇥", "\r": "\\r"}


def visible(text: str) -> str:
    """``text`` with line breaks and tabs as ⏎ and ⇥, other control characters (C0, DEL, C1) as ``\\xNN`` and
    invisible format / separator characters (bidi overrides, zero-width, U+2028/9) as ``\\uNNNN``, so untrusted
    decoded text can neither break a table row or a console line nor reorder what is shown around it."""
    out = []
    for ch in text:
        if ch in _SHOWN:
            out.append(_SHOWN[ch])
            continue
        cat = unicodedata.category(ch)
        if cat == "Cc":
            out.append(f"\\x{ord(ch):02x}")
        elif cat in ("Cf", "Zl", "Zp", "Cs", "Co", "Cn") and not ch.isprintable():
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "".join(out)


def columns_from_tensors(rollout_logprobs, train_logprobs, scored_mask, token_ids, *, context_mask=None,
                         step: int = 0, rank: int = 0) -> dict[str, np.ndarray]:
    """Columns from [B, T] tensors of one run: a row per position of ``context_mask`` (default: the scored
    positions), ``scored`` marking the positions of ``scored_mask`` (the tokens a dump of the same tensors holds;
    the others only give context). Log-probs are rounded to float32, as the dump stores them."""
    import torch

    scored = scored_mask.bool()
    where = scored if context_mask is None else (context_mask.bool() | scored)
    seq, pos = torch.nonzero(where, as_tuple=True)
    return {
        "step": np.full(seq.numel(), step, dtype=np.int64),
        "rank": np.full(seq.numel(), rank, dtype=np.int32),
        "sequence": seq.numpy().astype(np.int64),
        "position": pos.numpy().astype(np.int32),
        "token_id": token_ids[seq, pos].numpy().astype(np.int64),
        "rollout_logprob": rollout_logprobs.detach().float()[seq, pos].numpy(),
        "train_logprob": train_logprobs.detach().float()[seq, pos].numpy(),
        "scored": scored[seq, pos].numpy(),
    }


def largest_disagreements(columns: dict[str, np.ndarray], n: int = DEFAULT_ROWS,
                          context: int = DEFAULT_CONTEXT) -> list[dict]:
    """The ``n`` scored rows with the largest |train − rollout| (finite log-probs above the invalid-placeholder
    threshold only), each with the token ids of up to ``context`` neighbouring rows of its sequence on each side.

    Each row: step, rank, sequence, position, token_id, rollout_logprob, train_logprob, diff (train − rollout),
    p_rollout, p_train, before / after (token ids), start (no earlier token of the completion) and end."""
    from tim_plugins.metrics import INVALID_LOGPROB_THRESHOLD

    order = np.lexsort((columns["position"], columns["sequence"], columns["rank"], columns["step"]))
    col = {k: np.asarray(v)[order] for k, v in columns.items()}
    rollout = col["rollout_logprob"].astype(np.float64)
    train = col["train_logprob"].astype(np.float64)
    ok = (np.isfinite(rollout) & np.isfinite(train) & (rollout > INVALID_LOGPROB_THRESHOLD)
          & (train > INVALID_LOGPROB_THRESHOLD))
    if "scored" in col:
        ok &= col["scored"].astype(bool)
    cand = np.nonzero(ok)[0]
    d = train - rollout
    picked = cand[np.argsort(-np.abs(d[cand]), kind="stable")][:n]
    # Rows are sorted by (step, rank, sequence, position): a sequence is one contiguous run of rows.
    key = np.stack([col["step"], col["rank"], col["sequence"]], axis=1).astype(np.int64)
    new = np.ones(len(key), dtype=bool)
    new[1:] = (key[1:] != key[:-1]).any(axis=1)
    starts = np.nonzero(new)[0]
    run_start = starts[np.searchsorted(starts, np.arange(len(key)), side="right") - 1]
    run_end = np.append(starts[1:], len(key))[np.searchsorted(starts, np.arange(len(key)), side="right") - 1]
    rows = []
    for i in picked:
        pos = int(col["position"][i])
        lo, hi = int(run_start[i]), int(run_end[i])
        near = lambda j: abs(int(col["position"][j]) - pos) <= context  # noqa: E731
        before = [j for j in range(max(lo, i - context), i) if near(j)]
        after = [j for j in range(i + 1, min(hi, i + 1 + context)) if near(j)]
        rows.append({
            "step": int(col["step"][i]), "rank": int(col["rank"][i]), "sequence": int(col["sequence"][i]),
            "position": pos, "token_id": int(col["token_id"][i]),
            "rollout_logprob": float(rollout[i]), "train_logprob": float(train[i]), "diff": float(d[i]),
            "p_rollout": exp_or_inf(rollout[i]), "p_train": exp_or_inf(train[i]),
            "before": [int(col["token_id"][j]) for j in before], "after": [int(col["token_id"][j]) for j in after],
            "start": i == lo, "end": i == hi - 1,
        })
    return rows


def decode_rows(rows: list[dict], decode: Callable[[Sequence[int]], str]) -> list[dict]:
    """``rows`` with ``text_before``, ``text`` and ``text_after``: ``decode`` of the context and the token, each
    passed through ``visible``. A byte-level tokenizer may split one character over several tokens; where the
    context window cuts such a character, its decoded edge is U+FFFD, which is dropped there (the ``…`` beside it
    already says the text goes on). The token's own text is shown as decoded."""
    def context(ids, strip):
        return visible(strip(_decoded(decode, ids), REPLACEMENT)) if ids else ""

    return [{**r, "text_before": context(r["before"], str.lstrip),
             "text": visible(_decoded(decode, [r["token_id"]]) if r["token_id"] is not None else NO_ID),
             "text_after": context(r["after"], str.rstrip)} for r in rows]


NO_ID = "⟨?⟩"  # a row whose file holds no token id there


def _decoded(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> str:
    """``decode(ids)``; where the tokenizer rejects an id (negative, past its vocabulary: a model whose embedding is
    padded beyond the tokenizer, a damaged file), each id alone, a rejected one shown as ``⟨id N⟩``: one such id
    costs its own text, not the report."""
    try:
        return decode(ids)
    except Exception:
        parts = []
        for i in ids:
            try:
                parts.append(decode([i]))
            except Exception:
                parts.append(f"⟨id {i}⟩")
        return "".join(parts)


def dump_disagreements(dump, decode: Callable[[Sequence[int]], str] | None = None, n: int = DEFAULT_ROWS,
                       context: int = DEFAULT_CONTEXT) -> list[dict]:
    """The largest disagreements of a dump (a folder, or a ``report.query.Dump``; the rows of
    ``largest_disagreements``), decoded when ``decode`` is given."""
    if not hasattr(dump, "largest_disagreements"):
        from tim_plugins.report.query import open_dump

        dump = open_dump(dump)
    rows = dump.largest_disagreements(n, context)
    return decode_rows(rows, decode) if decode is not None else rows


def _id(token_id) -> str:
    return "?" if token_id is None else str(token_id)


def _p(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 else f"{x:.2e}"


def disagreements_html(rows: list[dict], *, show_step: bool = True) -> str:
    """A table: rank, step, position, the token in its context (marked), p under each side, Δ log p."""
    if not rows:
        return "<p class='note'>No scored token in this run.</p>"
    head = ["#"] + (["step"] if show_step else []) + ["position", "token in context", "token id", "p rollout",
                                                     "p trainer", "Δ log p (trainer − rollout)"]
    body = []
    for k, r in enumerate(rows, 1):
        if "text" in r:
            ctx = ("<span class='edge'>⟨start⟩</span>" if r["start"] else "…") + html.escape(r["text_before"]) + \
                  f"<mark>{html.escape(r['text'])}</mark>" + html.escape(r["text_after"]) + \
                  ("<span class='edge'>⟨end⟩</span>" if r["end"] else "…")
        else:  # no tokenizer: token ids
            ids = lambda xs: " ".join(str(x) for x in xs)  # noqa: E731
            ctx = html.escape(ids(r["before"])) + f" <mark>{_id(r['token_id'])}</mark> " + html.escape(ids(r["after"]))
        cells = [str(k)] + ([str(r["step"])] if show_step else []) + [str(r["position"])]
        after = (_id(r["token_id"]), _p(r["p_rollout"]), _p(r["p_train"]), f"{r['diff']:+.4f}")
        body.append("<tr>" + "".join(f"<td class='num'>{c}</td>" for c in cells) + f"<td class='ctx'>{ctx}</td>"
                    + "".join(f"<td class='num'>{c}</td>" for c in after) + "</tr>")
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table class='disagree'><tr>{header}</tr>{''.join(body)}</table>"


def disagreements_text(rows: list[dict], *, show_step: bool = True) -> list[str]:
    """One console line per row: the token in its context (marked with ⟦ ⟧), p under each side, Δ log p."""
    lines = []
    wheres = [(f"step {r['step']} " if show_step else "") + f"pos {r['position']}" for r in rows]
    width = max(map(len, wheres), default=0)
    for r, where in zip(rows, wheres):
        if "text" in r:
            ctx = (("⟨start⟩" if r["start"] else "…") + r["text_before"] + f"⟦{r['text']}⟧" + r["text_after"]
                   + ("⟨end⟩" if r["end"] else "…"))
        else:
            ctx = " ".join(map(str, r["before"])) + f" ⟦{_id(r['token_id'])}⟧ " + " ".join(map(str, r["after"]))
        lines.append(f"{where:<{width}}  p {_p(r['p_rollout'])} → {_p(r['p_train'])}  Δ {r['diff']:+.3f}  {ctx}")
    return lines
