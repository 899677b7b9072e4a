"""Helpers shared by the configuration dataclasses of the library, the adapters and the applications."""

from __future__ import annotations

__all__ = ["field_help", "help_texts", "help_table"]


def field_help(text: str) -> dict:
    """``dataclasses.field`` metadata carrying a field's help text: the command line (``--option`` help) and the
    adapters' config readers show it."""
    return {"help": text}


def help_texts(cls) -> dict[str, str]:
    """{field name: help text} of the dataclass ``cls`` (for command lines and docs)."""
    from dataclasses import fields

    return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def help_table(cls, width: int = 100) -> str:
    """Every field of the dataclass ``cls`` as ``name = default`` and its help text, wrapped to ``width``: what a
    person reads to pick the fields to set."""
    import textwrap
    from dataclasses import MISSING, fields

    lines = [f"{cls.__name__} fields ({len(fields(cls))}; set the ones you need: {cls.__name__}(name=value, ...)):"]
    for f in fields(cls):
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else "(required)")
        lines.append(f"  {f.name} = {default!r}")
        lines += textwrap.wrap(f.metadata.get("help", ""), width, initial_indent="      ",
                               subsequent_indent="      ")
    return "\n".join(lines)
