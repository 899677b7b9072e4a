"""``tim-plugins report DIR``: the HTML report (``tim_plugins.report.build_report``) of a measure/demo output
folder or a per-token dump folder."""

from __future__ import annotations

from pathlib import Path

from tim_plugins.apps.cli import UsageError
from tim_plugins.report import build_report
from tim_plugins.report.tokens import has_dump

__all__ = ["register"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="Turn a measure/demo output folder or a per-token dump folder into an HTML report.")
    p.add_argument("dir", help="output folder of `tim-plugins measure` / `demo` (with summary.json), or a dump "
                               "folder with step_*-rank_*.parquet files")
    p.add_argument("--out", default=None, help="output HTML file (default: DIR/report.html)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    folder = Path(args.dir)
    if not folder.is_dir():
        raise UsageError(f"report {args.dir!r}: no such folder; pass the output folder of `tim-plugins measure` or "
                         "`tim-plugins demo`, or a per-token dump folder.")
    if not (folder / "summary.json").exists() and not has_dump(folder):
        raise UsageError(f"report {args.dir!r}: the folder holds neither summary.json nor dump files "
                         "(step_*-rank_*.parquet); point at a measure/demo output folder (e.g. tim-out/measure) or "
                         "the dump_dir the dumper wrote.")
    path = build_report(folder, args.out)
    print(f"report written to {path}")
    return 0
