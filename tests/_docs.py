"""Run the code blocks of one markdown file, in order, as a reader would (test_docs.py runs one per file).

``python _docs.py FILE.md SUMMARY.json`` parses FILE.md with Sybil and evaluates, in the current directory:

- a ```` ```python ```` block: in one namespace shared by the file's blocks (a later block sees what an
  earlier one defined, as a reader running them in turn would);
- a ```` ```python torchrun N ```` block: as a program of its own, started by ``torchrun --standalone
  --nproc-per-node N`` (its first line says how readers start it); ``torchrun N megatron`` runs it under
  megatron-core's CPU harness (``hybridmem.testing.megatron_cpu``) when there is no GPU, the way the
  project's Megatron tests run;
- a ```` ```python process ```` block: as a program of its own (``python prog.py``, its first line says
  so), for a program that must not share the process of the file's other blocks (its own engine, or
  switches the checker counts per process);
- a ```` ```yaml title=NAME ```` block: written to NAME, as the text asks the reader to save it;
- a ```` ```bash ````, ```` ```console ```` (a transcript: commands and what they print) or ```` ```bash
  server ```` block (a server left running while the blocks after it talk to it, stopped with Ctrl-C at
  the end of the file): as shell commands (``_docs_shell.py``).

``<!-- skip: next if(condition, reason="...") -->`` (Sybil's skip directive) skips the next block where
it cannot run (a GPU-only block on a CPU machine). The summary lists the line of every block run and
every block skipped, with the reason. With ``HYBRIDMEM_DOCS_CHECK`` set to a directory, every process
running a block also records its switches and greedy generations there (see ``_docs_check.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from _docs_shell import run_bash, run_console, start_server, stop_servers
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.codeblock import CodeBlockParser

HERE = Path(__file__).resolve().parent
TORCHRUN_TIMEOUT_S = 900


class _InfoParser(CodeBlockParser):
    """Fenced blocks whose info string matches ``pattern`` (``python torchrun 2``, ``yaml title=x``)."""

    pattern: re.Pattern[str]
    language = "-"

    def __call__(self, document):
        for region in self.lexers(document):
            match = self.pattern.fullmatch(region.lexemes["arguments"].strip())
            if match is not None:
                region.parsed = (match, region.lexemes["source"])
                region.evaluator = self.evaluate
                yield region


class TorchrunBlockParser(_InfoParser):
    pattern = re.compile(r"python\s+torchrun\s+(?P<nproc>\d+)(?P<megatron>\s+megatron)?")

    def evaluate(self, example) -> str | None:
        match, source = example.parsed
        script = Path(tempfile.mkdtemp(prefix="hybridmem-docs-", dir=".")) / f"line{example.line}.py"
        script.write_text(str(source))
        launch = [str(HERE / "_docs_launch.py")] + (["--megatron-cpu"] if match["megatron"] else [])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={match['nproc']}", *launch, str(script)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
        sys.stdout.write(proc.stdout[-4000:])
        if proc.returncode != 0:
            return f"torchrun block at line {example.line} exited {proc.returncode}:\n{proc.stderr[-8000:]}"
        return None


class ProcessBlockParser(_InfoParser):
    pattern = re.compile(r"python\s+process")

    def evaluate(self, example) -> str | None:
        _, source = example.parsed
        script = Path(tempfile.mkdtemp(prefix="hybridmem-docs-", dir=".")) / f"line{example.line}.py"
        script.write_text(str(source))
        proc = subprocess.run([sys.executable, str(HERE / "_docs_launch.py"), str(script)],
                              capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
        sys.stdout.write(proc.stdout[-4000:])
        if proc.returncode != 0:
            return f"program at line {example.line} exited {proc.returncode}:\n{proc.stderr[-8000:]}"
        return None


class YamlFileParser(_InfoParser):
    pattern = re.compile(r"yaml\s+title=(?P<name>[\w.\-/]+)")

    def evaluate(self, example) -> None:
        match, source = example.parsed
        Path(match["name"]).write_text(str(source))


class BashBlockParser(_InfoParser):
    pattern = re.compile(r"bash")

    def evaluate(self, example) -> str | None:
        return run_bash(str(example.parsed[1]), example.line)


class ConsoleBlockParser(_InfoParser):
    pattern = re.compile(r"console")

    def evaluate(self, example) -> str | None:
        return run_console(str(example.parsed[1]), example.line)


class ServerBlockParser(_InfoParser):
    pattern = re.compile(r"bash\s+server")

    def evaluate(self, example) -> str | None:
        return start_server(str(example.parsed[1]), example.line)


def sybil() -> Sybil:
    return Sybil(parsers=[PythonCodeBlockParser(), TorchrunBlockParser(), ProcessBlockParser(),
                          YamlFileParser(), BashBlockParser(), ConsoleBlockParser(), ServerBlockParser(),
                          SkipParser()])


def main(path: str, summary_path: str) -> int:
    if os.environ.get("HYBRIDMEM_DOCS_CHECK"):
        from _docs_check import install

        install()
    document = sybil().parse(Path(path).resolve())
    summary: dict[str, list] = {"ran": [], "skipped": [], "failed": []}
    try:
        for example in document:
            kind = type(example.region.evaluator).__name__
            try:
                example.evaluate()
            except unittest.SkipTest as skip:
                summary["skipped"].append([example.line, str(skip)])
                continue
            except BaseException as exc:  # reported with the block's line, then the run stops
                summary["failed"].append([example.line, f"{type(exc).__name__}: {exc}"])
                raise
            if kind != "Skipper":  # the skip directives themselves are examples too
                summary["ran"].append(example.line)
    finally:
        for failure in stop_servers():  # Ctrl-C, as the reader ends a server: it must stop cleanly
            summary["failed"].append([None, failure])
        Path(summary_path).write_text(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
