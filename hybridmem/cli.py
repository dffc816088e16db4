"""The ``hybridmem`` command.

``hybridmem demo`` runs the GRPO example on the embedded engine (CPU by default);
``hybridmem switch-loop`` the torch-only switch loop.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridmem`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hybridmem", description="hybridmem: train and infer on the same devices")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the GRPO demo (pass --help after 'demo' for its options)", add_help=False)
    sub.add_parser("switch-loop", help="the torch-only switch loop (pass --help for its options)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from hybridmem.examples import grpo

        grpo.main(rest)
    elif args.command == "switch-loop":
        from hybridmem.examples import switch_loop

        switch_loop.main(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
