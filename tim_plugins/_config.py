"""Helpers shared by the configuration dataclasses of the library, the adapters and the applications."""

from __future__ import annotations

__all__ = ["field_help"]


def field_help(text: str) -> dict:
    """``dataclasses.field`` metadata carrying a field's help text: the command line (``--option`` help) and the
    adapters' config readers show it."""
    return {"help": text}
