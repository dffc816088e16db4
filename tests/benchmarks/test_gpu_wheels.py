"""``benchmarks/gpu_wheels.sh`` checks its arguments before it creates ``.whl/`` or downloads anything.

Each case runs a copy of the script inside a temporary repository root, so a ``.whl/`` it wrongly
creates lands there, and with a stand-in ``python3`` first on ``PATH`` that records its arguments and
downloads nothing, so no case reaches the network even if the checks break.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_wheels.sh"

FAKE_PYTHON3 = """#!/usr/bin/env bash
# Stand-in for python3: record the arguments, download nothing.
printf '%s\\n' "$@" > "$(dirname "$0")/python3.args"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A temporary repository root holding ``benchmarks/gpu_wheels.sh`` and a ``bin/`` with a fake python3."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "gpu_wheels.sh")
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON3)
    fake.chmod(0o755)
    return tmp_path


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{repo / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    # cwd is the temporary root too: the script changes to its own parent's parent, and either way a
    # stray .whl/ would land in the temporary root, never in the repository
    return subprocess.run(["bash", "benchmarks/gpu_wheels.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def _pip_args(repo: Path) -> list[str] | None:
    record = repo / "bin" / "python3.args"
    return record.read_text().splitlines() if record.exists() else None


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_creates_nothing(repo, flag):
    proc = _run(repo, flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: bash benchmarks/gpu_wheels.sh"), proc.stdout
    assert "PYTHON_VERSION" in proc.stdout
    assert proc.stderr == ""
    assert not (repo / ".whl").exists(), f"{flag} created .whl/"
    assert _pip_args(repo) is None, f"{flag} ran python3"


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "unknown option '--bogus'"),
    (["-x", "3.12"], "unknown option '-x'"),
    (["3"], "malformed PYTHON_VERSION '3'"),
    (["3.12.1"], "malformed PYTHON_VERSION '3.12.1'"),
    (["py3.12"], "malformed PYTHON_VERSION 'py3.12'"),
    (["3.12", "3.11"], "unexpected argument '3.11'"),
])
def test_bad_argument_is_one_line_error_and_creates_nothing(repo, args, message):
    proc = _run(repo, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (repo / ".whl").exists(), f"{args} created .whl/"
    assert _pip_args(repo) is None, f"{args} ran python3"


@pytest.mark.parametrize(("args", "pyver"), [([], "3.12"), (["3.11"], "3.11"), (["--", "3.10"], "3.10")])
def test_valid_version_downloads_into_whl(repo, args, pyver):
    proc = _run(repo, *args)
    assert proc.returncode == 0, proc.stderr
    assert (repo / ".whl").is_dir()
    pip = _pip_args(repo)
    assert pip is not None and pip[:3] == ["-m", "pip", "download"], pip
    assert pip[pip.index("--python-version") + 1] == pyver
    assert pip[pip.index("-d") + 1] == ".whl"
    assert {"transitions==0.9.3", "megatron-core==0.16.1", "torch_memory_saver==0.0.10"} <= set(pip)
