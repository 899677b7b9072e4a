"""``tim-plugins report DIR [DIR ...]``: the HTML report (``tim_plugins.report.build_report``) of a measure/demo
output folder or a per-token dump folder; with several folders, one page comparing the runs
(``tim_plugins.report.build_comparison``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tim_plugins.apps.cli import UsageError
from tim_plugins.dump import CAUSES_LOG, LOG_HISTORY
from tim_plugins.report import COMPARISON_FILE, build_comparison, build_report
from tim_plugins.report.tokens import has_dump

__all__ = ["register"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="Turn a measure/demo output folder or a per-token dump folder into an HTML report; several "
                       "folders: one page comparing the runs.")
    p.add_argument("dir", nargs="+", help="output folder of `tim-plugins measure` / `demo` (with summary.json), or a "
                                          "dump folder with step_*-rank_*.parquet files; several training runs or "
                                          "dumps (e.g. before / after a fix) are compared on one page")
    p.add_argument("--label", action="append", default=None,
                   help="a run's name on a comparison page, once per DIR in order (default: the folder names)")
    p.add_argument("--out", default=None, help="output HTML file (default: DIR/report.html; for several DIRs: "
                                               "report-comparison.html in the current folder)")
    p.add_argument("--memory-limit", default=None,
                   help="memory cap of DuckDB, which reads the largest disagreements' context (e.g. 1GB, 500MB; "
                        "at least 16MB; default: $TIM_REPORT_MEMORY_LIMIT or 1GB): beyond it DuckDB spills to a "
                        "temporary folder; the report's own memory is small and does not grow with the dump")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the passes over the dump and of DuckDB (default: every core)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (an HF checkpoint folder) to decode the largest disagreements of a dump; "
                        "default: the model in DIR/summary.json's settings when it exists, else token ids are shown")
    p.set_defaults(func=_main)


def token_decoder(path: str | None):
    """token ids -> text with the tokenizer at ``path`` (None when there is none to load)."""
    if not path or not Path(path).exists():
        return None
    from tim_plugins._optional import is_available

    if not is_available("transformers"):
        return None
    from transformers import AutoTokenizer

    kwargs = {}
    if path.endswith(".gguf"):
        kwargs["gguf_file"], path = Path(path).name, str(Path(path).parent)
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _run_tokenizer(folder: Path, given: str | None) -> str | None:
    """``given``, else the checkpoint folder in ``folder/summary.json``'s settings when it exists here."""
    if given is not None or not (folder / "summary.json").exists():
        return given
    settings = json.loads((folder / "summary.json").read_text()).get("settings", {})
    # ``model`` is the checkpoint folder the run loaded; summaries written before it was named so carry
    # it as ``model_path`` (and ``model`` as typed: None or 'smollm2').
    return next((p for p in (settings.get("model"), settings.get("model_path"))
                 if isinstance(p, str) and Path(p).exists()), None)


def _decoder(folder: Path, given: str | None):
    """``token_decoder`` of ``given`` (--tokenizer), else of the run's model folder (``_run_tokenizer``). A run's
    folder whose tokenizer does not load here (weights only; a sentencepiece tokenizer without sentencepiece) leaves
    token ids, with a line saying so; a --tokenizer that does not load is a usage error."""
    path = _run_tokenizer(folder, given)
    try:
        return token_decoder(path)
    except Exception as err:  # noqa: BLE001 - transformers raises ValueError, OSError, ... for what it cannot load
        why = " ".join(str(err).split())[:300]
        if given is not None:
            raise UsageError(f"--tokenizer {given!r}: no tokenizer loads from it ({why}); pass the HF checkpoint "
                             "folder the run used (its tokenizer decodes the token ids).") from None
        print(f"tim-plugins report: the run's model folder {path!r} (summary.json) has no tokenizer that loads here "
              f"({why}): the largest disagreements show token ids; pass --tokenizer PATH to decode them.",
              file=sys.stderr)
        return None


def _comparison(folder: Path) -> dict | None:
    """``folder/comparison.json`` (`tim-plugins demo`'s OUT: the page comparing its runs) with each run's folder
    resolved under ``folder``; None when the folder is no such comparison (it has its own summary.json, or no
    comparison.json)."""
    if (folder / "summary.json").exists() or not (folder / COMPARISON_FILE).exists():
        return None
    try:
        spec = json.loads((folder / COMPARISON_FILE).read_text())
        runs, labels, title = [folder / r for r in spec["runs"]], list(spec["labels"]), spec.get("title")
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"report {str(folder)!r}: {COMPARISON_FILE} does not read as the demo's comparison "
                         f"({err!r}); pass the run folders to compare instead: tim-plugins report "
                         f"{str(folder / 'RUN_A')} {str(folder / 'RUN_B')}.") from None
    for run in runs:
        if not (run / "summary.json").exists() and not has_dump(run):
            raise UsageError(f"report {str(folder)!r}: the comparison's run folder {str(run)!r} ({COMPARISON_FILE}) "
                             "is missing or holds neither summary.json nor dump files; rerun `tim-plugins demo "
                             f"--out {folder}`, or pass the run folders you have: tim-plugins report RUN_A RUN_B.")
    return {"runs": runs, "labels": labels, "title": title}


def _run_folders(folder: Path) -> list[Path]:
    """The subfolders of ``folder`` that a report reads (a summary.json or dump files), sorted."""
    return sorted(p for p in folder.iterdir()
                  if p.is_dir() and ((p / "summary.json").exists() or has_dump(p)))


def _kind(folder: Path) -> str | None:
    """The run kind its summary.json names ("measure", "training"), None for a bare dump or an unreadable one."""
    try:
        return json.loads((folder / "summary.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _main(args) -> int:
    for d in args.dir:
        folder = Path(d)
        if not folder.is_dir():
            raise UsageError(f"report {d!r}: no such folder; pass the output folder of `tim-plugins measure` or "
                             "`tim-plugins demo`, or a per-token dump folder.")
        comparison = _comparison(folder)
        if comparison is not None and len(args.dir) > 1:
            raise UsageError(f"report {d!r}: a demo's comparison folder is reported alone (tim-plugins report {d}); "
                             "to compare its runs with others, pass its run folders: "
                             f"{' '.join(str(r) for r in comparison['runs'])}.")
        # a run's logged rows or named causes alone (no summary, no token file) make a page too
        logged = any((folder / name).exists() for name in (LOG_HISTORY, CAUSES_LOG))
        if comparison is None and not (folder / "summary.json").exists() and not has_dump(folder) and not logged:
            found = _run_folders(folder)
            training = [r for r in found if _kind(r) != "measure"]  # a measure folder compares its own settings
            hint = (f"; its subfolders are runs: pass one (tim-plugins report {found[0]})" if found else "") + (
                f" or several to compare them on one page (tim-plugins report "
                f"{' '.join(str(r) for r in training[:4])})" if len(training) > 1 else "")
            raise UsageError(f"report {d!r}: the folder holds neither summary.json nor dump files "
                             f"(step_*-rank_*.parquet) nor a run's {LOG_HISTORY} or {CAUSES_LOG}{hint}; point at "
                             "a measure/demo output folder (e.g. tim-out/measure) or the dump_dir the dumper wrote.")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise UsageError(f"--tokenizer {args.tokenizer!r}: no such local folder or file; pass the HF checkpoint "
                         "folder the run used (its tokenizer decodes the token ids).")
    comparison = _comparison(Path(args.dir[0])) if len(args.dir) == 1 else None
    runs = comparison["runs"] if comparison is not None else args.dir
    if args.label is not None and (len(args.label) != len(runs) or len(set(args.label)) != len(args.label)):
        raise UsageError(f"--label {args.label!r}: give one distinct --label per {'run' if comparison else 'folder'}, "
                         f"in order ({len(runs)} {'runs' if comparison else 'folders'}), or none to name each run by "
                         f"{'its name in the demo' if comparison else 'its folder'}.")
    if args.out is not None:
        out, above = Path(args.out), next((p for p in Path(args.out).parents if p.exists()), None)
        if out.is_dir() or (above is not None and not above.is_dir()):
            what = "is a folder" if out.is_dir() else f"lies under {str(above)!r}, a file"
            raise UsageError(f"--out {args.out!r}: {what}; pass the HTML file to write, e.g. --out "
                             f"{str((out if out.is_dir() else Path.cwd()) / 'report.html')!r}.")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1 (or left out for every core).")
    from tim_plugins.report.query import parse_memory_limit

    try:
        memory_limit = parse_memory_limit(args.memory_limit)
    except ValueError as err:
        raise UsageError(f"--memory-limit {args.memory_limit!r}: {err}") from None
    settings = {"memory_limit": memory_limit, "threads": args.threads}
    if comparison is not None:  # the demo's OUT: its comparison page rebuilt, as the demo wrote it
        labels = args.label or comparison["labels"]
        decoders = {label: _decoder(run, args.tokenizer) for label, run in zip(labels, comparison["runs"])}
        path = build_comparison(comparison["runs"], args.out or Path(args.dir[0]) / "report.html", labels=labels,
                                title=comparison["title"], decode=decoders, **settings)
    elif len(args.dir) == 1:
        folder = Path(args.dir[0])
        path = build_report(folder, args.out, decode=_decoder(folder, args.tokenizer), **settings)
    else:
        from tim_plugins.report import run_labels

        labels = args.label or run_labels([Path(d) for d in args.dir])
        decoders = {label: _decoder(Path(d), args.tokenizer) for label, d in zip(labels, args.dir)}
        path = build_comparison(args.dir, args.out or "report-comparison.html", labels=labels, decode=decoders,
                                **settings)
    print(f"report written to {path}")
    return 0
