"""Helpers shared by the configuration dataclasses of the library, the adapters and the applications."""

from __future__ import annotations

__all__ = ["field_help", "help_texts", "help_table", "core_field", "coerce_options", "unknown_names", "field_default"]


def field_help(text: str, options: type | None = None) -> dict:
    """``dataclasses.field`` metadata carrying a field's help text: the command line (``--option`` help) and the
    adapters' config readers show it. ``options``: the core dataclass the field holds (``help_table`` lists its
    fields under it)."""
    return {"help": text} if options is None else {"help": text, "options": options}


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
    def add(f, name: str, indent: str) -> None:
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else "(required)")
        options = f.metadata.get("options")
        lines.append(f"{indent}{name}: {options.__name__}, by field:" if options else f"{indent}{name} = {default!r}")
        # hyphenated words stay whole: a help text's "tensor-parallel" never reads "tensor-" + a line break
        lines.extend(textwrap.wrap(f.metadata.get("help", ""), width, initial_indent=indent + "    ",
                                   subsequent_indent=indent + "    ", break_on_hyphens=False))

    for f in fields(cls):
        add(f, f.name, "  ")
        for sub in fields(f.metadata["options"]) if "options" in f.metadata else ():
            add(sub, f"{f.name}.{sub.name}", "      ")
    return "\n".join(lines)


def core_field(core: type, name: str, **kwargs):
    """A ``dataclasses.field`` with the help text (and, unless ``default`` is given, the default) of the core
    dataclass ``core``'s field ``name``: an adapter's spelling of a core option shares its text and default."""
    from dataclasses import MISSING, field, fields

    f = next(f for f in fields(core) if f.name == name)
    if "default" in kwargs:
        return field(default=kwargs["default"], metadata=field_help(f.metadata["help"]))
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=field_help(f.metadata["help"]))
    return field(default=f.default, metadata=field_help(f.metadata["help"]))


def unknown_names(given, names) -> str:
    """The names in ``given`` that are not in ``names``, each quoted with the nearest valid one where a name is a
    likely misspelling (``'min_pp' (did you mean 'min_p'?)``), comma-separated: what a refused key's message
    names, in every adapter."""
    import difflib

    names = list(names)
    out = []
    for name in sorted(set(given) - set(names)):
        near = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
        out.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return ", ".join(out)


def coerce_options(cls, value, path: str, *, fix: str | None = None, option_fix=None, **fixed):
    """``value`` (an instance of the core dataclass ``cls``, a mapping of its field names, or None = defaults) as
    an instance of ``cls``, with the fields in ``fixed`` set by the caller. A name that is not a field, or a value
    the dataclass's own checks refuse, is a ValueError that starts with ``path``, quotes the value and ends with
    ``fix`` (default: the valid names). Where one option's value is what the checks refuse, the fix is
    ``option_fix(name, default)`` (the caller's spelling of that option at its default) when given."""
    import dataclasses
    from collections.abc import Mapping

    names = sorted(f.name for f in dataclasses.fields(cls) if f.name not in fixed)
    fix = fix or f"use {cls.__module__}.{cls.__name__}'s fields {names}"
    if isinstance(value, cls):
        return dataclasses.replace(value, **fixed) if fixed else value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}={value!r} is invalid: must be a {cls.__name__} or a dict of its fields. Fix: {fix}")
    if set(value) - set(names):
        raise ValueError(f"{path}={dict(value)!r} is invalid: unknown option(s) {unknown_names(value, names)}; the "
                         f"options are {names}. Fix: {fix}")
    try:
        return cls(**{**value, **fixed})
    except (TypeError, ValueError) as err:
        culprit = _refused_option(cls, value, fixed) if option_fix is not None else None
        if culprit is not None:
            fix = option_fix(culprit, field_default(cls, culprit))
        text = str(err).rstrip()
        raise ValueError(f"{path}={dict(value)!r} is invalid: {text}{'' if text.endswith('.') else '.'} Fix: {fix}"
                         ) from None


def _refused_option(cls, value, fixed: dict):
    """The first option of ``value`` that ``cls``'s checks refuse on its own (the others at their defaults), or None
    when each passes alone (a rule over several options)."""
    for name, v in value.items():
        try:
            cls(**{name: v, **fixed})
        except (TypeError, ValueError):
            return name
    return None


def field_default(cls, name: str):
    """The default of dataclass ``cls``'s field ``name`` (its factory's value for a factory default)."""
    from dataclasses import MISSING, fields

    f = next(f for f in fields(cls) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()
