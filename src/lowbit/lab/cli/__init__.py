"""The ``lowbit`` command.

One module a command in this package (arguments and output only; the work is done by the library
layers below): each exposes ``register(subparsers)``, which adds its parser(s) and sets ``func`` (a
callable taking the parsed args and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import Any

from lowbit.codecs.base import defer_plugins
from lowbit.kernels.dispatch import check_environment as check_kernel_environment

# (module, what it provides) — imported lazily so `lowbit --help` stays fast.
_COMMAND_MODULES = [
    "lowbit.lab.cli.codecs",         # codecs
    "lowbit.lab.cli.bench",          # bench allreduce
    "lowbit.lab.cli.study",          # study, report, export
    "lowbit.lab.cli.predict",        # predict
    "lowbit.lab.cli.advise",         # advise
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowbit",
        description="Low-precision gradient communication for distributed PyTorch: "
        "codecs, collectives, benchmarks, studies and a speed model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    with defer_plugins():  # $LOWBIT_PLUGINS runs code: not for --help, only where codecs or algorithms resolve
        for modname in _COMMAND_MODULES:
            try:
                mod = importlib.import_module(modname)
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("lowbit"):
                    continue  # subcommand not built yet
                raise
            mod.register(sub)
    return parser


def _one_line_warnings(command: str) -> Any:
    """lowbit's own warnings (a category defined in lowbit) as one line on stderr, as errors are."""
    show = warnings.showwarning

    def showwarning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                    line: str | None = None) -> None:
        if category.__module__.startswith("lowbit"):
            print(f"lowbit {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv: list[str] | None = None) -> int:
    """Run one ``lowbit`` command; its exit code. Errors the user can fix are one line on stderr."""
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse's --help and usage errors: their output still has to get out
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:
        # `lowbit ... | head`: the reader left. The Python docs' recipe: point stdout at devnull so the
        # interpreter's own flush at exit does not raise again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
    except ValueError as exc:  # a $LOWBIT_PLUGINS module that does not import (the parsers list the algorithms)
        print(f"lowbit: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_kernel_environment()  # $LOWBIT_KERNELS: before any work, not at the first kernel call
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"lowbit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as exc:  # a path that cannot be read or written: name it, no traceback
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"lowbit {args.command}: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
