"""Start one documented program the way its reader would, in a ``torchrun`` rank (see ``_docs.py``).

``python _docs_launch.py [--megatron-cpu] SCRIPT.py`` runs SCRIPT as ``__main__``; with
``--megatron-cpu`` and no GPU, inside megatron-core's CPU harness (``hybridmem.testing.megatron_cpu``),
which maps the CUDA calls megatron-core makes to the CPU (as the project's Megatron tests do). With
``HYBRIDMEM_DOCS_CHECK`` set, the switch checker of ``_docs_check.py`` watches the program.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

import torch


def main(argv: list[str]) -> None:
    megatron_cpu = "--megatron-cpu" in argv
    script = [a for a in argv if a != "--megatron-cpu"][0]
    if os.environ.get("HYBRIDMEM_DOCS_CHECK"):
        from _docs_check import install

        install()
    harness = contextlib.nullcontext()
    if megatron_cpu and not torch.cuda.is_available():
        from hybridmem.testing.megatron_cpu import megatron_on_cpu

        harness = megatron_on_cpu()
    with harness:
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
