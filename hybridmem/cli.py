"""The ``hybridmem`` command.

``hybridmem demo`` runs the GRPO example on the embedded engine (CPU by default);
``hybridmem switch-loop`` the torch-only switch loop; ``hybridmem plan`` predicts a cluster's switches
(:mod:`hybridmem.planner.command`); ``hybridmem --version`` prints the version.
A mistake on the command line is reported in one line naming the option and what is allowed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridmem.config.arguments import OneLineErrorParser

__all__ = ["main", "OneLineErrorParser"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("hybridmem")
    except PackageNotFoundError:  # running from a source tree that was not installed
        from hybridmem import __version__  # noqa: PLC0415

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridmem`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrorParser(prog="hybridmem",
                                description="hybridmem: train and infer on the same devices")
    parser.add_argument("--version", action="version", version=f"hybridmem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,switch-loop,plan}",
                                parser_class=OneLineErrorParser)
    sub.add_parser("demo", help="the GRPO demo (pass --help after 'demo' for its options)", add_help=False)
    sub.add_parser("switch-loop", help="the torch-only switch loop (pass --help for its options)",
                   add_help=False)
    sub.add_parser("plan", help="predict a cluster's switches from a config (pass --help for its options)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from hybridmem.examples import grpo  # noqa: PLC0415 - loads only the subcommand run

        grpo.main(rest)
    elif args.command == "switch-loop":
        from hybridmem.examples import switch_loop  # noqa: PLC0415 - loads only the subcommand run

        switch_loop.main(rest)
    elif args.command == "plan":
        from hybridmem.planner import command as plan_command  # noqa: PLC0415

        return plan_command.main(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
