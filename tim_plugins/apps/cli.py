"""``tim-plugins`` command line: one subcommand per capability, each in its own module.

Every subcommand module exposes ``register(subparsers)`` that adds its parser and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. Modules are imported only when listed here,
and each keeps its heavy imports inside ``func`` so ``tim-plugins --help`` stays fast.

Errors a person can act on are handled here, once: a bad argument (argparse), a `UsageError`, and the
``ValueError`` / ``FileNotFoundError`` / ``ImportError`` that configuration checks raise print one line
(``tim-plugins COMMAND: error: ...``, naming the bad value, the rule and the fix) and exit with status 2,
without a traceback. ``--debug`` (anywhere on the command line) re-raises them with the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMAND_MODULES", "UsageError", "USAGE_EXIT_CODE", "add_config_options", "config_from_args"]

SUBCOMMAND_MODULES = (
    "tim_plugins.apps.demo_command",  # demo
    "tim_plugins.apps.measure",  # measure
    "tim_plugins.apps.report",  # report
    "tim_plugins.apps.audit",  # audit, check-batch-invariance
    "tim_plugins.apps.lr_replay",  # lr-replay
    "tim_plugins.apps.doctor",  # doctor
)

USAGE_EXIT_CODE = 2
# Exceptions whose message is the user-facing explanation (configuration checks raise these with the bad
# value, the rule and the fix); anything else is a bug or a runtime failure and keeps its traceback.
_USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError)


class UsageError(ValueError):
    """A wrong input: the message names the bad value, the rule and the fix (printed as one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse errors as one line (the bad value and the rule come from argparse), exit status 2."""

    def error(self, message: str):
        self.exit(USAGE_EXIT_CODE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def add_config_options(parser: argparse.ArgumentParser, config_cls, choices: dict[str, tuple] | None = None) -> None:
    """One ``--option-name`` per field of the dataclass ``config_cls``: its default, its help metadata, int/float
    types from the annotation (a bool: ``--name`` / ``--no-name``), and ``choices`` by field name (the dataclass's
    ``__post_init__`` checks the rest).

    The help ends with the default unless it states it itself ("default: ..."): a field whose default depends on
    other options is None, and "(default: None)" would contradict its help."""
    choices = choices or {}
    for f in config_cls.__dataclass_fields__.values():
        text = f.metadata.get("help", "")
        if f.default is not None and "default:" not in text.lower():
            text += " (default: %(default)s)"
        kwargs = {"default": f.default, "help": text}
        if f.name in choices:
            kwargs["choices"] = tuple(choices[f.name])
        elif f.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction  # --name / --no-name
        elif f.type in ("int", int, "int | None"):
            kwargs["type"] = int
        elif f.type in ("float", float, "float | None"):
            kwargs["type"] = float
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def config_from_args(args: argparse.Namespace, config_cls):
    """The ``config_cls`` instance of the options ``add_config_options`` added."""
    return config_cls(**{name: getattr(args, name) for name in config_cls.__dataclass_fields__})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tim-plugins", description="Measure and mitigate training-inference mismatch in LLM RL."
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (may be given anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the module: show it
                raise
            continue
        module.register(sub)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _install_hint(err: BaseException) -> str:
    """'. Install it with: ...' for a missing package one of tim-plugins' extras brings (a plain import inside a
    command, e.g. the report's matplotlib or pyarrow), else ''."""
    from tim_plugins._optional import missing_module_fix

    fix = missing_module_fix(err)
    return f". Install it with: {fix}" if fix else ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return USAGE_EXIT_CODE
    try:
        return int(args.func(args) or 0)
    except _USAGE_ERRORS as err:
        if debug:
            raise
        print(f"tim-plugins {args.command}: error: {_one_line(err)}{_install_hint(err)} (--debug shows the traceback)",
              file=sys.stderr)
        return USAGE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
