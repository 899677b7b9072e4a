"""``tim-plugins`` command line: one subcommand per capability, each in its own module.

Every subcommand module exposes ``register(subparsers)`` that adds its parser and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. Modules are imported only when listed here,
and each keeps its heavy imports inside ``func`` so ``tim-plugins --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMAND_MODULES"]

SUBCOMMAND_MODULES = (
    "tim_plugins.measure",  # measure
    "tim_plugins.report",  # report
    "tim_plugins.parity.cli",  # audit, check-batch-invariance
    "tim_plugins.lr_replay",  # lr-replay
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tim-plugins", description="Measure and mitigate training-inference mismatch in LLM RL."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the module: show it
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
