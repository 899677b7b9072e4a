"""``tim-plugins lr-replay FILE``: run the length-triggered LR controller over a logged run, offline.

Reads per-step metrics as logged by the trainers or exported from wandb, feeds them to
:class:`~tim_plugins.lr_control.LengthTriggeredLRDecay` step by step, and reports where it would have fired and
the LR scale it would have produced — to tune thresholds on past collapses before a new run.

Accepted files:
- JSONL: one JSON object per line. Flat rows (wandb history export, TRL ``log_history``) or verl's file logger
  rows ``{"step": n, "data": {...}}``.
- JSON: a list of row objects, or a transformers ``trainer_state.json`` (its ``log_history``).
- CSV: a header row; wandb UI exports (``Step``, ``<run> - <metric>``, ``__MIN`` / ``__MAX`` columns) work.
Rows sharing a step are merged (later values win); rows are replayed in step order. Empty cells, ``null``,
``NaN`` and non-numbers are gaps: the controller skips and counts them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from tim_plugins.lr_control import SIGNAL_ALIASES, LengthTriggeredLRDecay, LRDecayConfig

__all__ = [
    "register",
    "run_replay",
    "load_rows",
    "detect_column",
    "replay",
    "LENGTH_COLUMNS",
    "K3_COLUMNS",
    "GRAD_NORM_COLUMNS",
    "STEP_COLUMNS",
]

# Candidate names, in priority order; a column matches a candidate when equal to it, or ending with
# "/<candidate>" (logger prefixes such as train/ or actor/) or " - <candidate>" (wandb CSV export).
LENGTH_COLUMNS = (
    "completions/mean_length",  # TRL GRPOTrainer
    "response_length/mean",  # verl
    "response_length",
    "mean_response_length",
    "completion_length",  # older TRL
)
# The extra signals' columns are lr_control's spellings of them: metric keys first, then bare names.
K3_COLUMNS, GRAD_NORM_COLUMNS = (
    tuple(sorted((a for a, name in SIGNAL_ALIASES.items() if name == signal), key=lambda a: "/" not in a))
    for signal in ("kl_k3", "grad_norm"))
STEP_COLUMNS = ("step", "Step", "_step", "global_step", "trainer/global_step", "train/global_step")
_SIGNAL_COLUMNS = {"kl_k3": K3_COLUMNS, "grad_norm": GRAD_NORM_COLUMNS}


def _flatten(row: dict[str, Any]) -> dict[str, Any]:
    if isinstance(row.get("data"), dict):  # verl FileLogger: {"step": n, "data": {...}}
        flat = {k: v for k, v in row.items() if k != "data"}
        flat.update(row["data"])
        return flat
    return row


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics file into a list of flat row dicts (values as parsed: numbers, strings, None)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        return [{k: (v if v != "" else None) for k, v in r.items() if k is not None} for r in rows]
    if suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict) and isinstance(data.get("log_history"), list):
            data = data["log_history"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json file must hold a list of rows or a trainer_state.json.")
        return [_flatten(r) for r in data if isinstance(r, dict)]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not a JSON object ({err.msg}); expected one JSON object per line.")
        if isinstance(obj, dict):
            rows.append(_flatten(obj))
    return rows


def _num(value: Any) -> float:
    """A float (NaN for gaps: None, empty, non-numeric)."""
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def detect_column(columns: list[str], candidates: tuple[str, ...]) -> str | None:
    """The first column matching a candidate (exact, ``.../cand`` or ``... - cand``), ignoring wandb's
    ``__MIN`` / ``__MAX`` companions."""
    usable = [c for c in columns if not c.endswith(("__MIN", "__MAX"))]
    for cand in candidates:
        for col in usable:
            if col == cand or col.endswith("/" + cand) or col.endswith(" - " + cand):
                return col
    return None


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def replay(steps: list[int], lengths: list[float], config: LRDecayConfig,
           extras: dict[str, list[float]] | None = None) -> list[dict[str, Any]]:
    """Feed the series to a fresh controller; one record per step: step, length, the controller's
    ``tim/lr/*`` metrics after that step, and the extra signals given."""
    extras = extras or {}
    ctrl = LengthTriggeredLRDecay(config)
    out = []
    for i, step in enumerate(steps):
        kw = {name: values[i] for name, values in extras.items()}
        ctrl.observe(step, lengths[i], **kw)
        rec: dict[str, Any] = {"step": step, "length": lengths[i]}
        rec.update({name: values[i] for name, values in extras.items()})
        rec.update(ctrl.metrics())
        out.append(rec)
    return out


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per LRDecayConfig field (``--warmup-steps``...), help and defaults from the dataclass."""
    group = parser.add_argument_group("controller options (defaults: LRDecayConfig)")
    for f in dataclasses.fields(LRDecayConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        conv: Any = str
        if kind.startswith("int"):
            conv = int
        elif kind.startswith("float"):
            conv = float
        group.add_argument(flag, dest=f"cfg_{f.name}", type=conv, default=None, metavar=conv.__name__.upper(),
                           help=f"{f.metadata.get('help', '')} (default: {f.default!r})".replace("%", "%%"))


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "lr-replay", help="Replay the length-triggered LR controller on a logged run (JSONL / JSON / CSV).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="per-step metrics: .jsonl, .json (list or trainer_state.json) or .csv")
    p.add_argument("--length-col", help=f"response-length column (default: first of {LENGTH_COLUMNS})")
    p.add_argument("--k3-col", help=f"k3 column for --signals kl_k3 (default: first of {K3_COLUMNS})")
    p.add_argument("--grad-norm-col", help="grad-norm column for --signals grad_norm (default: *grad_norm)")
    p.add_argument("--step-col", help=f"step column (default: first of {STEP_COLUMNS}; else the row index)")
    p.add_argument("--out", help="write the per-step trajectory to this .csv or .json file")
    p.add_argument("--plot", help="write a PNG plot (length, window, baseline, fires, LR scale) to this path")
    _config_arguments(p)
    p.set_defaults(func=run_replay)


def _fail(msg: str) -> int:
    print(f"tim-plugins lr-replay: error: {msg}", file=sys.stderr)
    return 2


def run_replay(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f"cfg_{f.name}") for f in dataclasses.fields(LRDecayConfig)
                 if getattr(args, f"cfg_{f.name}", None) is not None}
    try:
        config = LRDecayConfig(**overrides)
    except ValueError as err:
        return _fail(str(err))
    path = Path(args.file)
    accepted = ("pass a per-step metrics file: .jsonl (wandb history export, TRL log_history rows), .json (a list "
                "of rows or a trainer_state.json) or .csv (wandb UI export)")
    if not path.is_file():
        return _fail(f"{args.file!r}: {'a folder, not a file' if path.is_dir() else 'no such file'}; {accepted}.")
    try:
        rows = load_rows(path)
    except OSError as err:
        return _fail(f"{args.file!r} cannot be read ({err.strerror or err}); check its permissions, or {accepted}.")
    except ValueError as err:
        return _fail(str(err))
    if not rows:
        return _fail(f"{args.file}: no rows.")
    columns = _columns(rows)

    def pick(explicit: str | None, candidates: tuple[str, ...], what: str) -> str | None:
        if explicit:
            if explicit not in columns:
                raise LookupError(f"column {explicit!r} ({what}) is not in {args.file}; columns: {columns}")
            return explicit
        return detect_column(columns, candidates)

    try:
        length_col = pick(args.length_col, LENGTH_COLUMNS, "response length")
        step_col = pick(args.step_col, STEP_COLUMNS, "step")
        signal_cols = {
            "kl_k3": pick(args.k3_col, K3_COLUMNS, "k3"),
            "grad_norm": pick(args.grad_norm_col, GRAD_NORM_COLUMNS, "grad norm"),
        }
    except LookupError as err:
        return _fail(str(err))
    if length_col is None:
        from tim_plugins.dump import LOG_HISTORY, LOG_HISTORY_CONTEXT

        if all(c.startswith("tim/") or c in LOG_HISTORY_CONTEXT or c == "step" for c in columns):
            # tim-plugins' own log beside a dump: no column of it is a length, so --length-col cannot help
            return _fail(f"{args.file} holds the tim/* metrics only (tim-plugins' {LOG_HISTORY} beside a per-token "
                         "dump), no response length; pass the trainer's own log of the run: TRL's "
                         "OUTPUT_DIR/checkpoint-*/trainer_state.json (or trainer.state.log_history saved as JSON), "
                         "`tim-plugins demo`'s RUN/summary.json, a wandb history export, or verl's file-logger JSONL "
                         "(response_length/mean).")
        return _fail(f"no response-length column in {args.file} (looked for {LENGTH_COLUMNS}); name it with "
                     f"--length-col. Columns: {columns}")
    for name in config.signals:
        if signal_cols[name] is None:
            return _fail(f"--signals includes {name!r} but {args.file} has no such column (looked for "
                         f"{_SIGNAL_COLUMNS[name]}); name it with --{'k3' if name == 'kl_k3' else 'grad-norm'}-col.")

    # Merge rows by step (several log calls per step are common), then order by step.
    merged: dict[int, dict[str, Any]] = {}
    for i, r in enumerate(rows):
        s = _num(r.get(step_col)) if step_col else float(i)
        if not math.isfinite(s):
            continue
        merged.setdefault(int(s), {}).update({k: v for k, v in r.items() if v is not None})
    steps = sorted(merged)
    if not steps:
        return _fail(f"no row of {args.file} has a numeric step in column {step_col!r} (its values: "
                     f"{sorted({repr(r.get(step_col)) for r in rows})[:5]}); name the step column with --step-col.")
    lengths = [_num(merged[s].get(length_col)) for s in steps]
    extras = {name: [_num(merged[s].get(signal_cols[name])) for s in steps] for name in config.signals}
    records = replay(steps, lengths, config, extras)

    used = {"length": length_col, "step": step_col or "(row index)"}
    used.update({k: v for k, v in signal_cols.items() if k in config.signals})
    _print_report(args.file, used, config, records)
    if args.out:
        _write_out(Path(args.out), used, config, records)
        print(f"trajectory written to {args.out}")
    if args.plot:
        _plot(Path(args.plot), records, config, args.file)
        print(f"plot written to {args.plot}")
    return 0


def _fmt(v: float) -> str:
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def _print_report(path: str, used: dict[str, str], config: LRDecayConfig, records: list[dict[str, Any]]) -> None:
    fires = [r for r in records if r["tim/lr/triggered"] == 1.0]
    print(f"lr-replay {path}: {len(records)} steps; columns " + ", ".join(f"{k}={v!r}" for k, v in used.items()))
    defaults = LRDecayConfig().to_dict()
    changed = {k: v for k, v in config.to_dict().items() if v != defaults[k]}
    print("options: " + (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "defaults"))
    if not fires:
        print("the controller never fires on this run")
    else:
        print(f"{'step':>8} {'length':>10} {'window':>10} {'baseline':>10} {'window/base':>11} {'scale':>8}")
        for r in fires:
            b, w = r["tim/lr/baseline_length"], r["tim/lr/window_length"]
            ratio = w / b if b and not math.isnan(b) else math.nan
            print(f"{r['step']:>8} {_fmt(r['length']):>10} {_fmt(w):>10} {_fmt(b):>10} {_fmt(ratio):>11} "
                  f"{_fmt(r['tim/lr/scale']):>8}")
    last = records[-1]
    print(f"triggers: {len(fires)}; final LR scale: {_fmt(last['tim/lr/scale'])}; skipped steps "
          f"(missing/NaN length): {int(last['tim/lr/skipped'])}")


def _jsonable(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _write_out(path: Path, used: dict[str, str], config: LRDecayConfig, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {
            "columns": used,
            "config": config.to_dict(),
            "fires": [r["step"] for r in records if r["tim/lr/triggered"] == 1.0],
            "steps": [{k: _jsonable(v) for k, v in r.items()} for r in records],
        }
        path.write_text(json.dumps(doc, indent=1, allow_nan=False), encoding="utf-8")
        return
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]))
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})


def _plot(path: Path, records: list[dict[str, Any]], config: LRDecayConfig, title: str) -> None:
    from tim_plugins._optional import require

    require("matplotlib", "lr-replay --plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fires = [r["step"] for r in records if r["tim/lr/triggered"] == 1.0]
    panels = [("length", "tim/lr/window_length", "tim/lr/baseline_length", "response length")]
    panels += [(n, f"tim/lr/window_{n}", f"tim/lr/baseline_{n}", n) for n in config.signals]
    fig, axes = plt.subplots(len(panels) + 1, 1, sharex=True, figsize=(9, 2.6 * (len(panels) + 1)))
    for ax, (raw, win, base, label) in zip(axes, panels):
        ax.plot(steps, [r[raw] for r in records], lw=0.8, color="0.6", label=label)
        ax.plot(steps, [r[win] for r in records], lw=1.4, label=f"window median ({config.window})")
        ax.plot(steps, [r[base] for r in records], lw=1.4, ls="--", label="baseline")
        if raw == "length":
            ax.plot(steps, [r[base] * (1 + config.margin) for r in records], lw=0.8, ls=":",
                    label=f"baseline × {1 + config.margin:g}")
        for f in fires:
            ax.axvline(f, color="red", lw=0.8, alpha=0.7)
        if raw == "kl_k3" and all(r[raw] > 0 for r in records if math.isfinite(r[raw])):
            ax.set_yscale("log")  # k3 spans orders of magnitude
        ax.set_ylabel(label)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].step(steps, [r["tim/lr/scale"] for r in records], where="post", color="black")
    for f in fires:
        axes[-1].axvline(f, color="red", lw=0.8, alpha=0.7)
    axes[-1].set_ylabel("LR scale")
    axes[-1].set_ylim(0, 1.05)
    axes[-1].set_xlabel("step")
    axes[0].set_title(f"lr-replay: {Path(title).name} ({len(fires)} trigger(s))", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
