"""The argument parser of the ``hybridmem`` command and its examples: one line per usage error.

It lives below :mod:`hybridmem.cli` (which runs the examples) so that the imports run one way.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``prog: error: ... (see prog --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
