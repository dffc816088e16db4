"""What :meth:`VLLMServerEngine.connect` finds out about a ``vllm serve`` before it builds the engine.

[Note: vllm server contact]
``connect(url)`` (and ``launch``, which connects to the server it started) asks the server, in this order,
and stops at the first thing missing with an :class:`~hybridmem.errors.EngineSetupError` that names it,
before anything in the server changes (:func:`check_server`):

1. ``GET /health``: a refused connection, an unknown host or no connection within the deadline is
   "nobody listens at URL", told apart from an engine that died after it was reached (it answers 503,
   or its port stops answering: DEAD, [Note: vllm engine failures] in
   :mod:`hybridmem.adapters.vllm.server.engine`). A refused connection answers at once.
2. ``GET /v1/models``: what it serves. ``root`` is the ``--model`` it was given, as given, so a relative
   path is relative to the server's working directory, not the trainer's. Without ``hf_config=`` the
   model's config is read from that directory (:func:`served_config`): an absolute path as it is (the
   server runs on this host: the buckets are shared through ``/dev/shm`` or CUDA IPC); a relative one
   against the working directory of the process listening on the URL's port (the OS's process table; a
   server of this host), or against this process's where that process cannot be read; a hub id
   ``owner/name`` from the hub cache (the server filled it), then from the hub unless
   ``HF_HUB_OFFLINE`` is set. A path is never looked up on the hub: where no ``config.json`` is found,
   one line says to pass ``hf_config=``.
3. ``GET /get_world_size`` answers 404: vLLM mounts its RL routes (pause, sleep, the weight update) only
   with ``VLLM_SERVER_DEV_MODE=1`` in the server's environment. Without them the server cannot be asked
   about its weight-transfer backend, so the message names that flag too.
4. The engine's construction initialises the workers' weight-transfer backend. Where vLLM refuses,
   :func:`backend_problem` asks ``GET /server_info`` (a dev-mode route) which backend the server runs:
   none, or another than ``hybridmem``, is named with the flag to add. Asked only then: vLLM collects its
   environment for the first answer, seconds on a 2-core machine.

A server :meth:`VLLMServerEngine.launch` started has all of these by construction; its log file is named
in every error of the engine (the client's ``where``) and in each switch report (``engine_log``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from hybridmem.adapters.vllm.plugin import BACKEND_NAME
from hybridmem.adapters.vllm.source import hub_offline, is_hub_id
from hybridmem.errors import EngineFault, EngineProcessError, EngineSetupError

__all__ = ["check_server", "served_config", "backend_problem", "DEV_MODE", "BACKEND_FLAG"]

DEV_MODE = "VLLM_SERVER_DEV_MODE=1"
"""The server's environment variable that mounts vLLM's RL routes."""

BACKEND_FLAG = f"--weight-transfer-config '{json.dumps({'backend': BACKEND_NAME})}'"
"""The server flag that loads hybridmem's weight-transfer backend in vLLM's workers."""


def _get(client: Any, path: str, timeout_s: float | None = None) -> Any:
    """``GET path`` of the server, on a connection of its own; ``EngineProcessError`` where it does not
    answer (STALLED, or DEAD where its process is gone)."""
    import httpx  # noqa: PLC0415 - vLLM's own dependency

    timeout = client.timeout_s if timeout_s is None else timeout_s
    try:
        return httpx.get(client.url + path, timeout=timeout)
    except httpx.HTTPError as exc:
        raise client.failure(path.lstrip("/"), deadline_s=timeout, elapsed_s=timeout,
                             cause=f"{type(exc).__name__}: {exc}") from exc


def _reach(client: Any, timeout_s: float) -> None:
    """Step 1 of [Note: vllm server contact]."""
    import httpx  # noqa: PLC0415 - vLLM's own dependency

    try:
        response = httpx.get(client.url + "/health", timeout=timeout_s)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise EngineSetupError(
            f"nobody listens at {client.where} ({type(exc).__name__}: {exc}): no server runs there; start "
            f"it first (vllm serve, or VLLMServerEngine.launch), or check the URL's host and port",
            where=client.where) from None
    except httpx.HTTPError as exc:  # connected, but no answer: something is there
        raise client.failure("health", deadline_s=timeout_s, elapsed_s=timeout_s,
                             cause=f"{type(exc).__name__}: {exc}") from exc
    if response.status_code == 200:
        return
    if response.status_code == 404:
        raise _not_vllm(client, "/health", response)
    from hybridmem.adapters.vllm.server.client import error_text  # noqa: PLC0415

    dead = response.status_code == 503
    raise EngineProcessError("health", where=client.where, deadline_s=timeout_s, elapsed_s=0.0,
                             cause=error_text(response),
                             fault=EngineFault.DEAD if dead else EngineFault.REFUSED)


def _not_vllm(client: Any, path: str, response: Any) -> EngineSetupError:
    return EngineSetupError(
        f"the server at {client.where} answers GET {path} with HTTP {response.status_code}: it is not vLLM's "
        f"OpenAI server (vllm serve, python -m vllm.entrypoints.openai.api_server); check the URL's port",
        where=client.where)


def _served_model(client: Any) -> str:
    """Step 2 of [Note: vllm server contact]: the ``--model`` the server was given."""
    response = _get(client, "/v1/models")
    if response.status_code != 200:
        raise _not_vllm(client, "/v1/models", response)
    data = response.json()["data"][0]
    return str(data.get("root") or data["id"])


def _is_local(host: str | None) -> bool:
    """Whether ``host`` is this machine (a loopback or unspecified address, or one of its own)."""
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own: set[str] = set()
    with contextlib.suppress(OSError):
        own = set(socket.gethostbyname_ex(socket.gethostname())[2])
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_loopback or ip.is_unspecified or address in own:
            return True
    return False


def _server_directory(url: str) -> str | None:
    """The working directory of the process of this host listening on ``url``'s port, or ``None`` where it
    cannot be read (another host, another user's process, no psutil)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_local(parts.hostname):
        return None
    try:
        import psutil  # noqa: PLC0415 - a vLLM dependency
    except ImportError:
        return None
    try:
        listening = [c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid]
    except (psutil.Error, OSError):
        return None
    for pid in listening:
        with contextlib.suppress(psutil.Error, OSError):
            return str(psutil.Process(pid).cwd())
    return None


def served_config(client: Any, model: str | None = None) -> Any:
    """The transformers config of the model the server at ``client.url`` serves, found as step 2 of [Note:
    vllm server contact] says (``model``: its ``--model``, default: asked of the server).

    Raises:
        EngineSetupError: No ``config.json`` where the server's model is; the message says to pass
            ``hf_config=``.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    model = _served_model(client) if model is None else model
    path = Path(model).expanduser()
    looked: list[str] = []
    if path.is_absolute():
        candidates = [path]
    else:
        server_dir = _server_directory(client.url)
        candidates = [Path(server_dir) / path] if server_dir else [Path.cwd() / path]
        looked.append(f"relative to {'the server' if server_dir else 'this process'}'s working directory")
    for directory in candidates:
        if (directory / "config.json").is_file():
            return AutoConfig.from_pretrained(str(directory))
        looked.append(f"no {str(directory / 'config.json')!r}")
    if not path.is_absolute() and is_hub_id(model):
        try:
            return AutoConfig.from_pretrained(model, local_files_only=True)
        except OSError:
            looked.append("not in the hub cache")
        if not hub_offline():
            try:
                return AutoConfig.from_pretrained(model)
            except OSError as exc:
                looked.append(f"the hub: {str(exc).splitlines()[0][:200]}")
    raise EngineSetupError(
        f"the vLLM server at {client.where} serves {model!r} (its --model) and its config was not found "
        f"({'; '.join(looked)}): pass the model's config, VLLMServerEngine.connect({client.url!r}, "
        f"hf_config=transformers.AutoConfig.from_pretrained('<the model directory>'))",
        where=client.where, missing="hf_config=")


def _check_rl_routes(client: Any) -> None:
    """Step 3 of [Note: vllm server contact]."""
    response = _get(client, "/get_world_size")
    if response.status_code == 404:
        raise EngineSetupError(
            f"the vLLM server at {client.where} has no RL routes (GET /get_world_size: HTTP 404): it was "
            f"started without {DEV_MODE} in its environment, with which vLLM mounts pause, sleep and the "
            f"weight update; restart it with {DEV_MODE} and {BACKEND_FLAG} (which it cannot be asked about "
            f"without them)", where=client.where, missing=DEV_MODE)


def check_server(client: Any, *, hf_config: Any = None) -> Any:
    """Steps 1 to 3 of [Note: vllm server contact]; the served model's config (``hf_config`` where given).

    Raises:
        EngineSetupError: Nobody listens, the server is not vLLM's, the config was not found, or the
            server lacks its RL routes; the message names what to add.
        EngineProcessError: The server does not answer, or its engine is dead.
    """
    _reach(client, client.timeout_s)
    model = _served_model(client)
    config = served_config(client, model) if hf_config is None else hf_config
    _check_rl_routes(client)
    return config


def backend_problem(client: Any) -> EngineSetupError | None:
    """Step 4 of [Note: vllm server contact]: the error naming the weight-transfer backend the server was
    started with where it is not hybridmem's, ``None`` where it is (or the server cannot say)."""
    import httpx  # noqa: PLC0415 - vLLM's own dependency

    try:
        response = httpx.get(client.url + "/server_info", params={"config_format": "json"},
                             timeout=client.timeout_s)
        config = response.json()["vllm_config"].get("weight_transfer_config")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None
    backend = config.get("backend") if isinstance(config, dict) else None
    if backend == BACKEND_NAME:
        return None
    has = "no weight-transfer backend" if backend is None else f"the weight-transfer backend {backend!r}"
    return EngineSetupError(
        f"the vLLM server at {client.where} was started with {has}: restart it with {BACKEND_FLAG}, which "
        f"loads hybridmem's backend in its workers (the weights reach them through it)",
        where=client.where, missing=BACKEND_FLAG)
