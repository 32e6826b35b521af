"""The ``lowbit`` command.

Subcommands live in the modules that own them; each such module exposes ``register(subparsers)``,
which adds its parser(s) and sets ``func`` (a callable taking the parsed args and returning an exit
code). A module whose optional dependencies are missing only disables its own subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it provides) — imported lazily so `lowbit --help` stays fast.
_COMMAND_MODULES = [
    "lowbit.codecs.report",      # codecs
    "lowbit.comm.bench",         # bench allreduce
    "lowbit.study.cli",          # study, report
    "lowbit.perfmodel.cli",      # predict, advise
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowbit",
        description="Low-precision gradient communication for distributed PyTorch: "
        "codecs, collectives, benchmarks, studies and a speed model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("lowbit"):
                continue  # subcommand not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"lowbit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
