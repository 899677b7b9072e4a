"""``tim-plugins report DIR``: the HTML report (``tim_plugins.report.build_report``) of a measure/demo output
folder or a per-token dump folder."""

from __future__ import annotations

import json
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


def _main(args) -> int:
    folder = Path(args.dir)
    if not folder.is_dir():
        raise UsageError(f"report {args.dir!r}: no such folder; pass the output folder of `tim-plugins measure` or "
                         "`tim-plugins demo`, or a per-token dump folder.")
    if not (folder / "summary.json").exists() and not has_dump(folder):
        raise UsageError(f"report {args.dir!r}: the folder holds neither summary.json nor dump files "
                         "(step_*-rank_*.parquet); point at a measure/demo output folder (e.g. tim-out/measure) or "
                         "the dump_dir the dumper wrote.")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise UsageError(f"--tokenizer {args.tokenizer!r}: no such local folder or file; pass the HF checkpoint "
                         "folder the run used (its tokenizer decodes the token ids).")
    tokenizer = args.tokenizer
    if tokenizer is None and (folder / "summary.json").exists():
        settings = json.loads((folder / "summary.json").read_text()).get("settings", {})
        # ``model`` is the checkpoint folder the run loaded; summaries written before it was named so carry
        # it as ``model_path`` (and ``model`` as typed: None or 'smollm2').
        tokenizer = next((p for p in (settings.get("model"), settings.get("model_path"))
                          if isinstance(p, str) and Path(p).exists()), None)
    path = build_report(folder, args.out, decode=token_decoder(tokenizer))
    print(f"report written to {path}")
    return 0
