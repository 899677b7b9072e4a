"""Per-token Parquet dump: sampled rows of (step, rank, sequence, position, token, log-probs), one file per
step and rank, written atomically, so a crashed run never leaves a half-written file behind. A step measured in
several batches (verl's ``separate_async`` with ``parameter_sync_step`` > 1: one old-log-prob pass per actor update)
writes one file per batch, ``-part_<k>`` after the first, with sequence numbers that go on across the step's batches.

Whole sequences are sampled (not scattered tokens), so drift by position and the cumulative log-ratio along a
sequence can be read from the dump. Disk use is bounded by ``sample_rate`` and ``max_sequences_per_step``.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tim_plugins._optional import require

if TYPE_CHECKING:
    import torch

__all__ = ["TokenDumper", "DumpConfig", "read_dump", "DUMP_COLUMNS", "LOG_HISTORY", "LOG_HISTORY_CONTEXT",
           "SUMMARY", "CAUSES_LOG", "VERSIONED", "append_causes", "append_log_history", "complete_log_history",
           "last_row_per_step", "package_versions", "read_json_lines", "read_log_history", "write_summary",
           "dump_file_name", "dump_files", "SUPERSEDED", "supersede_from", "superseded_failure_line", "superseded_line"]

DUMP_COLUMNS = (
    "step", "rank", "sequence", "position", "token_id", "rollout_logprob", "train_logprob", "entropy",
)

# The names of complete dump files (the writer's temporary names, ``*.parquet.tmp<pid>``, do not match).
_DUMP_FILE_RE = re.compile(r"step_(\d+)-rank_(\d+)(?:-part_\d+)?\.parquet")


def dump_file_name(step: int, rank: int, part: int = 0) -> str:
    """The file of a step's ``part``-th measured batch on ``rank`` (part 0: ``step_<8 digits>-rank_<4 digits>``)."""
    base = f"step_{step:08d}-rank_{rank:04d}"
    return f"{base}.parquet" if part == 0 else f"{base}-part_{part:04d}.parquet"


def dump_files(folder: str | os.PathLike) -> list[Path]:
    """The complete dump files of ``folder`` (sorted by name); [] for a folder that does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _DUMP_FILE_RE.fullmatch(p.name) and p.is_file())


# Beside the dump files: one JSON object per logged step ({"step": N, "tim/...": value, ...}), appended as the run
# goes by both adapters, with every tim/* metric (the framework's own log keeps those of tim_plugins.log_keys unless
# asked for the detail). The report draws the per-step series and sections from it.
LOG_HISTORY = "log_history.jsonl"


# The framework's own keys a log_history.jsonl row keeps beside tim/*: the report's LR and reward panels read them
# (verl's actor/lr and critic/score/mean, TRL's reward).
LOG_HISTORY_CONTEXT = ("actor/lr", "critic/score/mean", "reward")


def _append_lines(path: Path, lines: list[str]) -> None:
    """Append ``lines`` (JSON objects) to ``path``, one a line, on a line of their own: after a torn last line (a run
    killed mid-append, then resumed) a newline first, so the resumed run's first row is not glued to it."""
    with open(path, "ab+") as f:  # appends go to the end whatever the position read from
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))


def read_json_lines(path: str | Path, first_key: str) -> list[dict]:
    """The JSON objects of ``path``, one a line, each written with ``first_key`` first. A torn line (a run killed
    mid-append) is skipped; where an older writer appended the next row to it, that row is read from where its
    ``{"first_key"`` begins."""
    marker = "{" + json.dumps(first_key)
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row, at = None, line.find(marker, 1)
            while at > 0 and row is None:
                try:
                    row = json.loads(line[at:])
                except json.JSONDecodeError:
                    at = line.find(marker, at + 1)
        if isinstance(row, dict):
            rows.append(row)
    return rows


def append_log_history(folder: str | Path, step: int, metrics: dict) -> None:
    """Append one step's numeric ``tim/*`` metrics (and ``LOG_HISTORY_CONTEXT``) to ``folder/log_history.jsonl``
    (a number of any real type: Python's or NumPy's scalars, as a framework's reduced metrics may be)."""
    row = {"step": int(step)}
    row.update({k: float(v) for k, v in metrics.items() if (k.startswith("tim/") or k in LOG_HISTORY_CONTEXT)
                and isinstance(v, numbers.Real) and not isinstance(v, bool)})
    _append_lines(Path(folder) / LOG_HISTORY, [json.dumps(row)])


# Beside the dump files: one JSON object per named cause (``tim_plugins.causes.Cause.to_dict``), appended by the
# pipeline as causes are named; the report's verdict names them.
CAUSES_LOG = "causes.jsonl"


def append_causes(folder: str | Path, causes: list, window: int | None = None) -> None:
    """Append ``causes`` (``Cause`` objects) to ``folder/causes.jsonl``; ``window``: the step whose window named them,
    kept in each row as ``"window"`` (a cause's own step can be earlier: a sync cause names the optimizer step before
    the sync, and is named in the next step's window), which ``supersede_from`` sorts a resumed run's rows by."""
    if not causes:
        return
    extra = {} if window is None else {"window": int(window)}
    _append_lines(Path(folder) / CAUSES_LOG, [json.dumps({**cause.to_dict(), **extra}) for cause in causes])


# Beside the dump files, written once by the adapter at the start of a run: what `tim-plugins report` needs to render a
# training run's dump in its framework's terms.
SUMMARY = "summary.json"


# The packages whose versions a run records (its summary's "versions"): a comparison page shows where they differ.
VERSIONED = ("tim-plugins", "torch", "transformers", "trl", "verl", "vllm")


def package_versions() -> dict[str, str]:
    """{distribution: installed version} of `VERSIONED` (those installed; importlib.metadata, nothing imported)."""
    from tim_plugins._optional import package_version

    return {dist: v for dist in VERSIONED if (v := package_version(dist))}


def write_summary(folder: str | Path, *, framework: str, title: str, settings: dict,
                  findings: list | None = None) -> Path:
    """``folder/SUMMARY``, written atomically: the run's ``framework`` (the report's fix column and verdict speak its
    adapter's words, ``tim_plugins.fixes``), the report's ``title``, the run's ``settings`` (``settings["model"]``:
    the checkpoint folder whose tokenizer decodes the largest disagreements) and the start-up audit's ``findings``
    (``Finding.to_dict`` rows; None: no audit ran); the installed versions (`package_versions`) with them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"framework": framework, "title": title, "settings": settings, "versions": package_versions()}
    if findings is not None:
        summary["findings"] = findings
    path = folder / SUMMARY
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)
    return path


def read_log_history(path: str | Path) -> list[dict]:
    """The rows of a ``log_history.jsonl`` (a torn line, from a run killed mid-write, skipped: ``read_json_lines``)."""
    return read_json_lines(path, "step")


def last_row_per_step(rows: list[dict]) -> list[dict]:
    """``log_history.jsonl`` rows, one per step: a run resumed from a checkpoint appends the rows of the steps after
    it again, and the last row of a step is the one training went on from (in step order; rows without a step
    after them, as they were)."""
    by_step = {int(r["step"]): r for r in rows if "step" in r}
    return [by_step[s] for s in sorted(by_step)] + [r for r in rows if "step" not in r]


# Beside the dump files: what earlier attempts of a resumed run wrote for the steps it redoes (``supersede_from``), one
# folder per resume, itself a dump folder (`tim-plugins report` renders it).
SUPERSEDED = "superseded"


def supersede_from(folder: str | Path, first_step: int) -> tuple[Path | None, dict[str, int]]:
    """Start an attempt of a run at ``first_step`` (a resume from the checkpoint of ``first_step - 1``; 1: a fresh
    start): what an earlier attempt wrote into ``folder`` for steps >= ``first_step`` is not the run's (it crashed
    or was stopped after that checkpoint; this attempt redoes those steps, or stops earlier), so it is moved to a new
    ``folder/superseded/<UTC time>-from-step-<first_step>/``: the dump files of every rank (a run resumed on fewer
    ranks writes no file that would replace the others'), the ``log_history.jsonl`` rows and the ``causes.jsonl``
    rows of those steps (a cause by the window that named it, ``"window"``; a row written before that field by its
    step), with a copy of ``summary.json``. Returns (that folder, or None when nothing was moved; {"files",
    "log_rows", "causes"}: how many were moved).

    The caller runs it before any process of the attempt writes into ``folder`` (it moves every rank's files).
    A crash midway leaves each file and row in one of the two folders (files are moved, the logs rewritten
    atomically after the moved rows were written); the next resume moves the rest."""
    folder = Path(folder)
    first_step = int(first_step)
    files = [p for p in dump_files(folder) if int(_DUMP_FILE_RE.fullmatch(p.name)[1]) >= first_step]
    logs = {}
    for name, first_key, step_of in ((LOG_HISTORY, "step", lambda r: r.get("step")),
                                     (CAUSES_LOG, "code", lambda r: r.get("window", r.get("step")))):
        path = folder / name
        rows = read_json_lines(path, first_key) if path.is_file() else []
        later = [isinstance(step_of(r), (int, float)) and step_of(r) >= first_step for r in rows]
        if any(later):
            logs[name] = ([r for r, x in zip(rows, later) if not x], [r for r, x in zip(rows, later) if x])
    moved = {"files": len(files), "log_rows": len(logs.get(LOG_HISTORY, ((), ()))[1]),
             "causes": len(logs.get(CAUSES_LOG, ((), ()))[1])}
    if not files and not logs:
        return None, moved
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1000):  # two resumes within a second: a folder each
        dest = folder / SUPERSEDED / f"{stamp}-from-step-{first_step}{f'-{n}' if n else ''}"
        try:
            dest.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free folder name under {folder / SUPERSEDED} for {stamp}-from-step-{first_step}")
    if (folder / SUMMARY).is_file():
        shutil.copy2(folder / SUMMARY, dest / SUMMARY)
    for path in files:
        os.replace(path, dest / path.name)
    for name, (kept, later) in logs.items():
        _append_lines(dest / name, [json.dumps(r) for r in later])
        tmp = folder / f"{name}.tmp{os.getpid()}"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, folder / name)
    return dest, moved



def superseded_line(first_step: int, moved_to: Path | None, moved: dict[str, int]) -> str | None:
    """The console line for ``supersede_from``'s result (None when nothing was moved): the adapters say it alike."""
    if moved_to is None:
        return None
    return (f"training starts at step {first_step}: what an earlier attempt wrote into the dump for steps >= "
            f"{first_step} ({moved['files']} dump files, {moved['log_rows']} log rows, {moved['causes']} causes) is "
            f"not this run's; moved to {moved_to}")


def superseded_failure_line(folder: str | Path, first_step: int, err: OSError) -> str:
    """The console line when ``supersede_from`` failed (the run goes on; its report mixes the attempts)."""
    return (f"could not move aside what an earlier attempt wrote into {folder} for steps >= {first_step} ({err!r}): "
            "the report mixes it with this run's")

@dataclass
class DumpConfig:
    out_dir: str = field(metadata={"help": "Folder for the step_<8 digits>-rank_<4 digits>.parquet files (a step "
                                           "measured in several batches: -part_<k> files after the first)."})
    sample_rate: float = field(
        default=0.05, metadata={"help": "Fraction of sequences written per step (whole sequences)."}
    )
    max_sequences_per_step: int = field(
        default=64, metadata={"help": "Cap on sequences written per step and rank, over all of the step's batches "
                                      "(bounds disk use)."}
    )
    every_n_steps: int = field(default=1, metadata={"help": "Write only on steps divisible by this."})
    seed: int = field(default=0, metadata={"help": "Seed of the sequence sampling (per step and rank)."})

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(
                f"sample_rate={self.sample_rate} is invalid: it must be in (0, 1], e.g. 0.05 for 5 % of sequences."
            )
        if self.max_sequences_per_step < 1:
            raise ValueError(f"max_sequences_per_step={self.max_sequences_per_step} is invalid: it must be >= 1.")
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps={self.every_n_steps} is invalid: it must be >= 1.")


class TokenDumper:
    """Writes sampled per-token rows to Parquet.

    Args:
        config: a ``DumpConfig`` (or pass its fields as keywords).
    """

    def __init__(self, config: DumpConfig | None = None, **kwargs) -> None:
        require("pyarrow", "the per-token Parquet dump")
        self.config = config if config is not None else DumpConfig(**kwargs)
        Path(self.config.out_dir).mkdir(parents=True, exist_ok=True)
        # the (step, rank) written last, and of its batches so far: how many, their sequences, the sequences picked
        self._key: tuple[int, int] | None = None
        # files an earlier attempt left in the folder, by (step, rank): read once, at the first write (a resumed run
        # redoes steps; other ranks' files of this run are under other keys)
        self._earlier: dict[tuple[int, int], list[Path]] | None = None
        self._batches = 0
        self._sequences = 0
        self._written = 0

    def wants(self, step: int) -> bool:
        return step % self.config.every_n_steps == 0

    def write(
        self,
        step: int,
        rollout_logprobs: torch.Tensor,
        train_logprobs: torch.Tensor,
        mask: torch.Tensor,
        token_ids: torch.Tensor,
        *,
        rank: int = 0,
        entropy: torch.Tensor | None = None,
    ) -> Path | None:
        """Write the sampled sequences of one batch ([B, T] tensors). Returns the file path, or None if this
        step is skipped or nothing was sampled. Host transfer happens here, only on dump steps.

        Another batch of the step just written (same ``step`` and ``rank``) goes to the step's next part file: its
        sequences are numbered after the earlier batches' and the cap counts the step's sequences so far. The first
        batch of a step removes that step's files of an earlier attempt (a resumed run redoes the step)."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        import torch  # here, not at the module's top: the report reads dumps without torch

        if not self.wants(step):
            return None
        cfg = self.config
        B = rollout_logprobs.shape[0]
        if self._key != (step, rank):
            self._key, self._batches, self._sequences, self._written = (step, rank), 0, 0, 0
            self._remove_earlier(step, rank)
        part, first = self._batches, self._sequences
        self._batches += 1
        self._sequences += B
        # part 0's draw is the one a step with a single batch always had
        g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step * 1_009 + rank + part * 7_919) % (2**63 - 1))
        keep = torch.rand(B, generator=g) < cfg.sample_rate
        rows = torch.nonzero(keep).flatten()[: max(cfg.max_sequences_per_step - self._written, 0)]
        self._written += rows.numel()
        if rows.numel() == 0:
            return None
        sel = lambda x: x.detach()[rows.to(x.device)].cpu()
        m = sel(mask).bool()
        seq_idx, pos_idx = torch.nonzero(m, as_tuple=True)
        if seq_idx.numel() == 0:
            return None
        columns = {
            "step": pa.array(torch.full_like(seq_idx, step).numpy()),
            "rank": pa.array(torch.full_like(seq_idx, rank).numpy().astype("int32")),
            "sequence": pa.array((rows[seq_idx] + first).numpy()),
            "position": pa.array(pos_idx.numpy().astype("int32")),
            "token_id": pa.array(sel(token_ids)[seq_idx, pos_idx].numpy().astype("int64")),
            "rollout_logprob": pa.array(sel(rollout_logprobs).float()[seq_idx, pos_idx].numpy()),
            "train_logprob": pa.array(sel(train_logprobs).float()[seq_idx, pos_idx].numpy()),
        }
        if entropy is not None:
            columns["entropy"] = pa.array(sel(entropy).float()[seq_idx, pos_idx].numpy())
        table = pa.table(columns)
        path = Path(cfg.out_dir) / dump_file_name(step, rank, part)
        tmp = path.with_suffix(f".parquet.tmp{os.getpid()}")
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one
        return path

    def _remove_earlier(self, step: int, rank: int) -> None:
        """The files of ``step`` on ``rank`` that an earlier attempt at the step wrote (the folder is listed once,
        not at every step)."""
        if self._earlier is None:
            self._earlier = {}
            for path in dump_files(self.config.out_dir):
                match = _DUMP_FILE_RE.fullmatch(path.name)
                self._earlier.setdefault((int(match[1]), int(match[2])), []).append(path)
        for path in self._earlier.pop((step, rank), ()):
            path.unlink(missing_ok=True)


def read_dump(directory: str | os.PathLike):
    """All dump files of a folder as one pyarrow Table (sorted by step, rank, sequence, position).

    It holds every row in memory, twice while it concatenates and sorts (the report's old in-memory path needed
    ~450 bytes of RAM per dumped token): a real run's dump (hundreds of millions of rows) does not fit. For a
    dump of any size, ``tim-plugins report`` (``tim_plugins.report.query``) streams queries over the files
    instead."""
    require("pyarrow", "reading a per-token dump")
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = dump_files(directory)
    if not files:
        raise FileNotFoundError(
            f"no dump files (step_*-rank_*.parquet) in {str(directory)!r}: point at the folder the dumper wrote."
        )
    tables = [pq.read_table(f) for f in files]
    # Files with and without an entropy column can be mixed: unify with nulls. Another writer's float64 (or int32
    # key) columns beside ours are widened, as the report's queries read them.
    table = pa.concat_tables(tables, promote_options="permissive")
    return table.sort_by([("step", "ascending"), ("rank", "ascending"), ("sequence", "ascending"),
                          ("position", "ascending")])


def complete_log_history(rows: list[dict], full: list[dict]) -> list[dict]:
    """``rows`` (a framework's log history, ``step`` in each logged row) with, in each row that logged ``tim/*``
    metrics, those of its step that the framework's compact log left out, from ``full`` (a ``log_history.jsonl``'s
    rows); a value the framework logged stays as logged."""
    by_step = {int(r["step"]): r for r in full if "step" in r}
    out = []
    for row in rows:
        extra = by_step.get(int(row["step"]), {}) if "step" in row and any(k.startswith("tim/") for k in row) else {}
        out.append({**row, **{k: v for k, v in extra.items() if k.startswith("tim/") and k not in row}})
    return out
