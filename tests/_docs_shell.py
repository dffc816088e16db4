"""Shell blocks of the docs, run as a reader runs them in a terminal (``_docs.py`` evaluates them).

- ```` ```bash ````: the commands, in one ``bash`` with ``set -e`` (a command that fails fails the block);
- ```` ```console ````: a transcript. Each ``$ `` line is a command (continued on the lines after a
  trailing ``\\``), the lines under it what it prints (standard output and error, as a terminal shows
  them); a ``...`` line stands for any number of lines. The commands run in one ``bash`` in turn (so
  ``$ echo $?`` shows the exit status of the one before), and each one's output must equal the
  transcript's, ``...`` aside, line for line (trailing spaces ignored);
- ```` ```bash server ````: a command that serves until Ctrl-C, as a reader leaves one running in a
  second terminal: started in its own process group, its output in ``serverN.log``, ready once it prints
  :data:`READY` (the line the text tells the reader to wait for). :func:`stop_servers`, at the end of
  the file, sends it SIGINT (what Ctrl-C sends the terminal's foreground group) and fails unless every
  process of the group has exited within :data:`STOP_S` seconds and the command exited 0.

Every block runs in the current directory, with the directory of the interpreter running the docs first
on ``PATH`` (``python``, ``hybridmem``: what an activated virtual environment gives the reader).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY = "Application startup complete."
"""What a server prints once it answers requests (uvicorn's line, which vLLM's OpenAI server prints)."""
START_S = 900
"""How long a server may take to print :data:`READY` (a loaded 2-core machine)."""
STOP_S = 60
"""How long a server's process group may take to exit after SIGINT."""
TIMEOUT_S = 900
"""How long a ``bash`` or ``console`` block may run."""
_MARK = "<<hybridmem-docs: command {}>>"


def shell_env() -> dict[str, str]:
    """The environment of a shell block: this one, with this interpreter's directory first on ``PATH``."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def run_bash(source: str, line: int) -> str | None:
    """Run a ``bash`` block; ``None``, or why it failed."""
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", source], capture_output=True, text=True,
                          env=shell_env(), timeout=TIMEOUT_S)
    sys.stdout.write(proc.stdout[-4000:])
    if proc.returncode != 0:
        return (f"bash block at line {line} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                f"{proc.stderr[-5000:]}")
    return None


@dataclass(frozen=True)
class Command:
    """One command of a transcript and the lines the transcript says it prints."""

    text: str
    printed: tuple[str, ...]


def transcript(source: str) -> list[Command]:
    """The commands of a ``console`` block, each with the lines printed under it."""
    commands: list[Command] = []
    text: list[str] = []
    printed: list[str] = []
    continued = False
    for raw in source.splitlines():
        if continued or raw.startswith("$ "):
            if not continued:
                if text:
                    commands.append(Command("\n".join(text), tuple(printed)))
                text, printed = [], []
            text.append(raw[2:] if not continued else raw)
            continued = raw.endswith("\\")
        elif text:
            printed.append(raw.rstrip())
        elif raw.strip():
            raise ValueError(f"console block: output before the first '$ ' command: {raw!r}")
    if text:
        commands.append(Command("\n".join(text), tuple(printed)))
    return commands


def matches(printed: tuple[str, ...], got: list[str]) -> bool:
    """Whether ``got`` is what ``printed`` shows, each ``...`` line standing for any number of lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in printed)
    return re.fullmatch(pattern, "".join(line.rstrip() + "\n" for line in got)) is not None


def run_console(source: str, line: int) -> str | None:
    """Run a ``console`` block's commands in one ``bash`` and compare what each prints; ``None``, or why
    it failed."""
    commands = transcript(source)
    # Each command's output follows a marker line; $? is put back after the marker, so that `echo $?`
    # shows the exit status of the command before it.
    script = "status=0\n" + "".join(
        f"printf '\\n%s\\n' '{_MARK.format(i)}'\n(exit $status)\n{c.text}\nstatus=$?\n"
        for i, c in enumerate(commands))
    proc = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=shell_env(), timeout=TIMEOUT_S)
    sys.stdout.write(proc.stdout[-4000:])
    chunks = re.split("\n" + re.escape(_MARK).replace(r"\{\}", r"\d+") + "\n", proc.stdout)[1:]
    for command, chunk in zip(commands, chunks, strict=True):
        got = chunk.split("\n")
        if got and got[-1] == "":
            got.pop()  # the newline that ends the command's last line
        if not matches(command.printed, got):
            return (f"console block at line {line}: `{command.text}` printed\n" + "\n".join(got[-40:])
                    + "\n\ninstead of\n" + "\n".join(command.printed))
    return None


@dataclass
class Server:
    """A ``bash server`` block's command, running."""

    line: int
    proc: subprocess.Popen
    log: Path


SERVERS: list[Server] = []
"""The servers the file's blocks started, stopped by :func:`stop_servers`."""


def start_server(source: str, line: int) -> str | None:
    """Start a ``bash server`` block's command and wait until it prints :data:`READY`; ``None``, or why it
    failed (the server stopped then)."""
    log = Path(f"server{len(SERVERS)}.log").resolve()
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", source], stdout=out, stderr=subprocess.STDOUT,
                                env=shell_env(), start_new_session=True)
    SERVERS.append(Server(line, proc, log))
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if READY in log.read_text(errors="replace"):
            return None
        if proc.poll() is not None:
            SERVERS.pop()
            with contextlib.suppress(ProcessLookupError):  # what it started and left behind
                os.killpg(proc.pid, signal.SIGKILL)
            return f"server block at line {line} exited {proc.returncode} before it was ready:\n{_tail(log)}"
        time.sleep(0.5)
    return f"server block at line {line} did not print {READY!r} within {START_S} s:\n{_tail(log)}"


def stop_servers() -> list[str]:
    """Ctrl-C every server (SIGINT to its process group); why each that did not stop cleanly failed."""
    failed = []
    for server in SERVERS:
        pgid = server.proc.pid
        with contextlib.suppress(ProcessLookupError):  # the group has exited already
            os.killpg(pgid, signal.SIGINT)
        deadline = time.monotonic() + STOP_S
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        left = _group_alive(pgid)
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        code = server.proc.wait(timeout=STOP_S)
        if left or code != 0:
            failed.append(f"server block at line {server.line}: after Ctrl-C it exited {code}"
                          + (f" and left processes {left} running {STOP_S} s later" if left else "")
                          + f":\n{_tail(server.log)}")
    SERVERS.clear()
    return failed


def _group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still running (zombies aside)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
