"""The ``dsdmerge`` command line.

Subcommands:

* ``dsdmerge demo``: the resume story on a built-in tiny model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from dsdmerge.demo import run_demo

    for line in run_demo(steps=args.steps):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dsdmerge`` command."""
    parser = argparse.ArgumentParser(
        prog="dsdmerge",
        description="Inspect, diff and merge PyTorch checkpoint state dicts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run the resume story on a built-in tiny model",
        description="Train a tiny model whose indexer never gets gradients, save its flattened "
        "optimizer state, show torch failing to resume from it and dsdmerge making it load.",
        epilog="example:\n  dsdmerge demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsdmerge`` command; return its exit status.

    Example:
        >>> from dsdmerge.cli import main
        >>> main(["--help"])  # doctest: +SKIP
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    status: int = args.func(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
