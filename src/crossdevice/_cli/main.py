"""`crossdevice <command>`: a registry of subcommands (mpi4py's `bench.py` pattern).

Each command lives in its own module with `register(subparsers)` (adds its parser and
`set_defaults(func=run)`) and `run(args) -> int`. Modules are imported only when the
command line is built, never by `import crossdevice`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

import crossdevice

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand modules, in the order `--help` lists them.
COMMANDS: Final = ("demo", "bench", "devices", "trace")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="crossdevice",
        description="TensorFlow's tf.distribute API for NumPy and PyTorch.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {crossdevice.__version__}"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"crossdevice._cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
