"""Talking to a vLLM engine in its own process through vLLM's RL API: over HTTP (``vllm serve``) or AsyncLLM.

[Note: vllm engine process]
vLLM ships the control plane an RL trainer needs for an engine in another process: pause and resume of
generation, sleep and wake-up by tag, and a weight update as a transaction (``init_weight_transfer_engine``
once; then ``start_weight_update``, ``update_weights``, ``finish_weight_update`` with a version), on
``AsyncLLM`` and as endpoints of its OpenAI server (mounted with ``VLLM_SERVER_DEV_MODE=1``). The two
clients here speak it, one over HTTP and one through an ``AsyncLLM`` whose engine core is a separate
process, behind one interface (:class:`VLLMClient`) that :class:`~hybridmem.adapters.vllm.server.
VLLMServerEngine` drives. Every call is bounded by a deadline: an engine process that died, stalls or
answers with an error is a :class:`~hybridmem.errors.EngineProcessError` naming the call, where the
engine is and how long it was waited for, never a hang. The error says which :class:`~hybridmem.errors.
EngineFault` it was: the engine answered with an error (``REFUSED``), did not answer in time while its
process is still there (``STALLED``), or its process is gone (``DEAD``); [Note: vllm engine failures] in
:mod:`hybridmem.adapters.vllm.server.engine` says what the switch does with each. A client tells them apart
without being told the engine's process id: over HTTP by asking ``/health`` once a call failed (refused
connection or 503: gone; no answer: stalled); an AsyncLLM by its own record of its engine core's death and
the engine core's exit code, looked at every :data:`POLL_S` while a call waits, so a death is reported
at once rather than at the deadline (vLLM never answers a call that was pending when its engine core
died). The tensors themselves never cross these calls (see [Note: vllm buckets] in
:mod:`hybridmem.adapters.vllm.server.buckets`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Sequence
from typing import Any

from hybridmem.adapters.vllm.outputs import to_vllm_sampling_kwargs
from hybridmem.contract.generation import GenerationOutput
from hybridmem.errors import EngineFault, EngineProcessError

__all__ = ["VLLMClient", "HTTPClient", "AsyncLLMClient", "PAUSE_MODES"]

PAUSE_MODES = ("wait", "abort", "keep")
"""vLLM's ways to pause generation: let running requests finish, abort them, or freeze them."""

POLL_S = 0.25
"""How often a waiting AsyncLLM call looks whether the engine core died (see [Note: vllm engine process])."""

PROBE_S = 5.0
"""The deadline of the ``/health`` probe that tells a dead server from a stalled one."""


class VLLMClient(ABC):
    """The RL control plane of one vLLM engine in another process (see [Note: vllm engine process]).

    Attributes:
        where: Where the engine is, for messages (a URL, or ``AsyncLLM pid=...``).
        timeout_s: The deadline of each control call (longer ones are passed per call, see [Note: vllm
            engine deadlines] in :mod:`hybridmem.adapters.vllm.server.engine`).
        generate_timeout_s: The deadline of one generation request.
        dead: The error that found the engine's process gone (``None`` while it is not known to be).
    """

    where: str
    timeout_s: float
    generate_timeout_s: float
    dead: EngineProcessError | None = None

    def _failure(self, name: str, *, start: float, deadline_s: float, cause: str,
                 fault: EngineFault) -> EngineProcessError:
        """The error for call ``name``; remembers a dead engine (:attr:`dead`)."""
        error = EngineProcessError(name, where=self.where, deadline_s=deadline_s,
                                   elapsed_s=time.monotonic() - start, cause=cause, fault=fault)
        if error.dead and self.dead is None:
            self.dead = error
        return error

    @abstractmethod
    def _call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run control call ``name``; raise :class:`EngineProcessError` on a failure or past the deadline."""

    def pause(self, mode: str = "wait", *, timeout_s: float | None = None) -> None:
        """Stop scheduling new work; ``mode`` (:data:`PAUSE_MODES`) says what happens to running requests."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode={mode!r}; expected one of {PAUSE_MODES}")
        self._call("pause", mode, timeout_s=timeout_s)

    def resume_generation(self) -> None:
        self._call("resume")

    def sleep(self, level: int) -> None:
        self._call("sleep", int(level))

    def wake_up(self, tags: Sequence[str]) -> None:
        self._call("wake_up", list(tags))

    # vLLM's VLLMWeightSyncClient (vllm/distributed/weight_transfer/base.py) ---------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialise the workers' weight-transfer backend with ``init_info`` (once per trainer engine)."""
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        """Open vLLM's update transaction (refused while one is open)."""
        self._call("start_weight_update")

    def update_weights(self, update_info: list[dict[str, Any]] | dict[str, Any]) -> None:
        """One update of the open transaction: one info per worker rank, or one for all. It has no deadline
        of its own: the workers take a stream the trainer sends meanwhile, which bounds it (see [Note: vllm
        engine deadlines] in :mod:`hybridmem.adapters.vllm.server.engine`); a dead engine still ends it."""
        self._call("update_weights", update_info, timeout_s=float("inf"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update transaction; ``weight_version``: the version the engine reports from now on
        (``None``: keep the one it has)."""
        self._call("finish_weight_update", None if weight_version is None else str(weight_version))

    # Faults -----------------------------------------------------------------------------------------
    def gone(self) -> bool:
        """Whether the engine's process is gone now (asked once a call or a stream failed)."""
        return self._gone()

    def failure(self, call: str, *, deadline_s: float, elapsed_s: float, cause: str) -> EngineProcessError:
        """The error for ``call`` past its deadline: DEAD where the engine's process is gone, else STALLED."""
        return self._failure(call, start=time.monotonic() - elapsed_s, deadline_s=deadline_s, cause=cause,
                             fault=EngineFault.DEAD if self._gone() else EngineFault.STALLED)

    @abstractmethod
    def _gone(self) -> bool:
        """Whether the engine's process is gone (see [Note: vllm engine process])."""

    def weight_version(self) -> str:
        return str(self._call("weight_version"))

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def world_size(self) -> int:
        return int(self._call("world_size"))

    @abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any) -> list[GenerationOutput]:
        """Generate for every prompt (concurrently in the engine); outputs in prompt order."""

    @abstractmethod
    async def agenerate(self, prompt_ids: Sequence[int], params: Any, *, index: int = 0) -> GenerationOutput:
        """One request, awaitable from any event loop; ``index`` offsets the seed as in a batch."""

    def close(self) -> None:  # noqa: B027 - optional: a client holding no connection keeps it
        """Drop the connection (the engine process is not stopped)."""


def _output(prompt: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float] | None,
            finish_reason: str | None = None) -> GenerationOutput:
    return GenerationOutput(prompt_ids=[int(t) for t in prompt], token_ids=[int(t) for t in token_ids],
                            logprobs=None if logprobs is None else [float(x) for x in logprobs],
                            finish_reason=finish_reason)


ERROR_TEXT_CHARS = 2000
"""How much of a response body that is not vLLM's JSON error an error quotes."""


def error_text(response: Any) -> str:
    """``HTTP <status>: <what the server said>`` for a failed response: the message of vLLM's JSON error
    (``{"error": {"message": ...}}``, or FastAPI's ``{"detail": ...}``) whole, else the body's first
    :data:`ERROR_TEXT_CHARS` characters."""
    said = None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        said = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        if said is None and "detail" in body:
            said = body["detail"] if isinstance(body["detail"], str) else str(body["detail"])
    if not said:
        said = response.text[:ERROR_TEXT_CHARS] + ("..." if len(response.text) > ERROR_TEXT_CHARS else "")
    return f"HTTP {response.status_code}: {said}"


_OWN_CONNECTION = frozenset({"update_weights"})
"""Calls an HTTP client makes on a connection of their own (they run on a thread beside other calls)."""


class HTTPClient(VLLMClient):
    """A ``vllm serve`` (OpenAI server) with its RL endpoints (``VLLM_SERVER_DEV_MODE=1``).

    Generation goes through ``/inference/v1/generate`` (token ids in and out, log-probs, weight versions;
    needs ``--enable-scale-out``) where the server has it, else ``/v1/completions`` with token-id prompts
    (no log-probs without a tokenizer).

    Args:
        base_url: E.g. ``http://127.0.0.1:8000``.
        timeout_s: Deadline of each control call.
        generate_timeout_s: Deadline of one generation request.
        log_path: The server's log file, named in every error (:attr:`where`).

    Attributes:
        url: ``base_url`` without a trailing ``/``.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, generate_timeout_s: float = 600.0,
                 log_path: str | None = None):
        import httpx  # noqa: PLC0415 - vLLM's own dependency

        self.url = base_url.rstrip("/")
        self.log_path = log_path
        self.where = self.url + (f" (server log {log_path})" if log_path else "")
        self.timeout_s = float(timeout_s)
        self.generate_timeout_s = float(generate_timeout_s)
        self._httpx = httpx
        self._http = httpx.Client(base_url=self.url, timeout=self.timeout_s)
        self._model: str | None = None
        self._token_endpoint: bool | None = None

    _ROUTES = {
        "pause": ("POST", "/pause", lambda mode: ({"mode": mode}, None)),
        "resume": ("POST", "/resume", lambda: (None, None)),
        "sleep": ("POST", "/sleep", lambda level: ({"level": level}, None)),
        "wake_up": ("POST", "/wake_up", lambda tags: ([("tags", t) for t in tags], None)),
        "init_weight_transfer_engine": ("POST", "/init_weight_transfer_engine",
                                        lambda info: (None, {"init_info": info})),
        "start_weight_update": ("POST", "/start_weight_update", lambda: (None, {})),
        "update_weights": ("POST", "/update_weights", lambda info: (None, {"update_info": info})),
        "finish_weight_update": ("POST", "/finish_weight_update", lambda v: (None, {"weight_version": v})),
        "weight_version": ("GET", "/weight_info", lambda: (None, None)),
        "reset_prefix_cache": ("POST", "/reset_prefix_cache", lambda: (None, None)),
        "world_size": ("GET", "/get_world_size", lambda: (None, None)),
        "health": ("GET", "/health", lambda: (None, None)),
        "models": ("GET", "/v1/models", lambda: (None, None)),
    }

    def _call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        method, path, make = self._ROUTES[name]
        params, body = make(*args)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        # update_weights waits on a thread of its own while other calls may go on: its own connection
        own = name in _OWN_CONNECTION
        http = self._httpx.Client(base_url=self.url) if own else self._http
        start = time.monotonic()
        try:
            response = http.request(method, path, params=params, json=body,
                                    timeout=None if math.isinf(timeout) else timeout)
        except self._httpx.HTTPError as exc:
            fault = EngineFault.DEAD if self._gone() else EngineFault.STALLED
            raise self._failure(name, start=start, deadline_s=timeout, cause=f"{type(exc).__name__}: {exc}",
                                fault=fault) from exc
        finally:
            if own:
                http.close()
        if response.status_code != 200:
            if not own:
                self._reconnect()  # the server may have closed it after the error (see _reconnect)
            gone = response.status_code == 503 or "EngineDeadError" in response.text or self._gone()
            raise self._failure(name, start=start, deadline_s=timeout, cause=error_text(response),
                                fault=EngineFault.DEAD if gone else EngineFault.REFUSED)
        data = response.json() if response.content else {}
        if name == "weight_version":
            return data.get("weight_version")
        if name == "world_size":
            return data.get("world_size")
        if name == "models":
            return data
        return data

    def health(self, timeout_s: float = 5.0) -> None:
        """Whether the server answers (raises :class:`EngineProcessError` otherwise)."""
        self._call("health", timeout_s=timeout_s)

    def _reconnect(self) -> None:
        """New connections from here on: where a route raises after vLLM sent its error answer, uvicorn
        closes the connection (``httptools_impl.run_asgi``, uvicorn 0.54), and the next request on it (the
        ``/health`` probe, the next call) would fail with ``RemoteProtocolError`` and read as a dead
        server."""
        self._http.close()
        self._http = self._httpx.Client(base_url=self.url, timeout=self.timeout_s)

    def _gone(self) -> bool:
        """Whether the server is gone, asked after a call failed: its port refuses or drops connections, or
        ``/health`` says its engine is dead (503); a server that does not answer within :data:`PROBE_S`
        is there but stalled (see [Note: vllm engine process])."""
        try:  # a connection of its own: it may run beside a call on another thread
            response = self._httpx.get(self.url + "/health", timeout=PROBE_S)
        except self._httpx.TimeoutException:
            return False
        except self._httpx.HTTPError:
            return True
        return response.status_code == 503

    def _model_name(self) -> str:
        if self._model is None:
            self._model = str(self._call("models")["data"][0]["id"])
        return self._model

    def _request(self, prompt: Sequence[int], params: Any, index: int) -> tuple[str, dict[str, Any]]:
        kwargs = to_vllm_sampling_kwargs(params, index)
        logprobs = kwargs.pop("logprobs")
        if self._token_endpoint is None:
            self._token_endpoint = self._has_token_endpoint()
        if self._token_endpoint:
            sampling = {k: v for k, v in kwargs.items() if v is not None}
            if logprobs is not None:
                sampling["logprobs"] = 1
            return "/inference/v1/generate", {"token_ids": [int(t) for t in prompt],
                                              "sampling_params": sampling, "stream": False}
        if logprobs is not None:
            raise ValueError(f"log-probs without a tokenizer need the server's token endpoint: start "
                             f"{self.url} with --enable-scale-out (or serve a model with a tokenizer)")
        body = {"model": self._model_name(), "prompt": [int(t) for t in prompt], "return_token_ids": True,
                **{k: v for k, v in kwargs.items() if v is not None}}
        return "/v1/completions", body

    def _has_token_endpoint(self) -> bool:
        try:
            response = self._http.post("/inference/v1/generate", json={}, timeout=self.timeout_s)
        except self._httpx.HTTPError as exc:
            raise EngineProcessError("generate", where=self.where, deadline_s=self.timeout_s, elapsed_s=0.0,
                                     cause=f"{type(exc).__name__}: {exc}") from exc
        return response.status_code not in (403, 404)

    def _parse(self, path: str, prompt: Sequence[int], data: dict[str, Any],
               want_logprobs: bool) -> GenerationOutput:
        choice = data["choices"][0]
        tokens = choice.get("token_ids") or []
        logprobs = None
        if want_logprobs and path == "/inference/v1/generate":
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
        return _output(prompt, tokens, logprobs, choice.get("finish_reason"))

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any) -> list[GenerationOutput]:
        async def everything() -> list[GenerationOutput]:
            requests = (self.agenerate(p, params, index=i) for i, p in enumerate(prompt_ids))
            return list(await asyncio.gather(*requests))

        return asyncio.run(everything())

    async def agenerate(self, prompt_ids: Sequence[int], params: Any, *, index: int = 0) -> GenerationOutput:
        path, body = self._request(prompt_ids, params, index)
        start = time.monotonic()
        try:
            async with self._httpx.AsyncClient(base_url=self.url, timeout=self.generate_timeout_s) as http:
                response = await http.post(path, json=body)
        except self._httpx.HTTPError as exc:
            raise EngineProcessError("generate", where=self.where, deadline_s=self.generate_timeout_s,
                                     elapsed_s=time.monotonic() - start,
                                     cause=f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EngineProcessError("generate", where=self.where, deadline_s=self.generate_timeout_s,
                                     elapsed_s=time.monotonic() - start,
                                     cause=error_text(response))
        return self._parse(path, prompt_ids, response.json(), bool(params.logprobs))

    def close(self) -> None:
        self._http.close()


class AsyncLLMClient(VLLMClient):
    """An ``AsyncLLM`` made in this process (its engine core and workers are other processes), run on an
    event loop of its own in a background thread so that synchronous callers (the switch) and any
    user's event loop can both use it.

    Args:
        engine_args: ``vllm.AsyncEngineArgs``.
        timeout_s: Deadline of each control call.
        generate_timeout_s: Deadline of one generation request.
    """

    def __init__(self, engine_args: Any, *, timeout_s: float = 60.0, generate_timeout_s: float = 600.0):
        self.timeout_s = float(timeout_s)
        self.generate_timeout_s = float(generate_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hybridmem-asyncllm", daemon=True)
        self._thread.start()
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        async def build() -> Any:
            return AsyncLLM.from_engine_args(engine_args)

        self.llm = self._run(build(), "start AsyncLLM", timeout_s=None)
        self.where = f"AsyncLLM of model {getattr(engine_args, 'model', '?')}"
        self._next_id = 0

    def _run(self, coro: Coroutine[Any, Any, Any], name: str, timeout_s: float | None) -> Any:
        """Run ``coro`` on the loop; past ``timeout_s``, or once the engine core is gone, raise (see [Note:
        vllm engine process])."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        start = time.monotonic()
        deadline = float("inf") if timeout_s is None else start + timeout_s
        if not hasattr(self, "where"):  # starting: vLLM reports its own start-up failures
            self.where = "AsyncLLM"
        try:
            while True:
                try:
                    return future.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                except concurrent.futures.TimeoutError:
                    if getattr(self, "llm", False) is None:  # closed meanwhile: its loop is stopped
                        raise self._failure(name, start=start, deadline_s=timeout_s or float("inf"),
                                            cause="the client was closed", fault=EngineFault.DEAD) from None
                    if self._gone():
                        raise self._failure(name, start=start, deadline_s=timeout_s or float("inf"),
                                            cause="the engine core exited", fault=EngineFault.DEAD) from None
                    if time.monotonic() >= deadline:
                        raise self._failure(name, start=start, deadline_s=timeout_s or float("inf"),
                                            cause="no answer", fault=EngineFault.STALLED) from None
        except EngineProcessError:
            future.cancel()
            raise
        except Exception as exc:
            fault = EngineFault.DEAD if self._gone() else EngineFault.REFUSED
            raise self._failure(name, start=start, deadline_s=timeout_s or float("inf"), fault=fault,
                                cause=f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from exc

    def _gone(self) -> bool:
        """Whether the engine core is gone: the AsyncLLM says it errored, or its process has exited."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return False
        if llm.errored:
            return True
        manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
        return any(p.exitcode is not None for p in getattr(manager, "processes", ()))

    def engine_pids(self) -> list[int]:
        """The engine core processes' ids (vLLM's workers are their children)."""
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        return [int(p.pid) for p in getattr(manager, "processes", ())]

    def _call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        llm = self.llm
        calls = {
            "pause": lambda mode: llm.pause_generation(mode=mode),
            "resume": lambda: llm.resume_generation(),
            "sleep": lambda level: llm.sleep(level=level),
            "wake_up": lambda tags: llm.wake_up(tags=tags),
            "init_weight_transfer_engine": lambda info: llm.init_weight_transfer_engine(_init_request(info)),
            "start_weight_update": lambda: llm.start_weight_update(),
            "update_weights": lambda info: llm.update_weights(_update_request(info)),
            "finish_weight_update": lambda v: llm.finish_weight_update(weight_version=v),
            "weight_version": lambda: llm.get_weight_version(),
            "reset_prefix_cache": lambda: llm.reset_prefix_cache(),
            "world_size": lambda: _world_size(llm),
        }
        return self._run(calls[name](*args), name, self.timeout_s if timeout_s is None else timeout_s)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any) -> list[GenerationOutput]:
        async def everything() -> list[GenerationOutput]:
            requests = (self._generate(p, params, i) for i, p in enumerate(prompt_ids))
            return list(await asyncio.gather(*requests))

        return self._run(everything(), "generate", self.generate_timeout_s)

    async def agenerate(self, prompt_ids: Sequence[int], params: Any, *, index: int = 0) -> GenerationOutput:
        future = asyncio.run_coroutine_threadsafe(self._generate(prompt_ids, params, index), self._loop)
        start = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.generate_timeout_s)
        except asyncio.TimeoutError as exc:
            future.cancel()
            raise EngineProcessError("generate", where=self.where, deadline_s=self.generate_timeout_s,
                                     elapsed_s=time.monotonic() - start, cause="no answer") from exc

    async def _generate(self, prompt_ids: Sequence[int], params: Any, index: int) -> GenerationOutput:
        from vllm import SamplingParams  # noqa: PLC0415

        from hybridmem.adapters.vllm.outputs import from_request_output  # noqa: PLC0415

        self._next_id += 1
        request_id = f"hybridmem-{self._next_id}"
        final = None
        prompt = {"prompt_token_ids": [int(t) for t in prompt_ids]}
        sampling = SamplingParams(**to_vllm_sampling_kwargs(params, index))
        async for out in self.llm.generate(prompt, sampling, request_id):
            final = out
        if final is None:
            raise RuntimeError(f"AsyncLLM returned nothing for request {request_id}")
        return from_request_output(prompt_ids, final, want_logprobs=bool(params.logprobs))

    def close(self) -> None:
        """Shut the AsyncLLM (its engine core and workers) down and stop the loop."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            self._loop.call_soon_threadsafe(llm.shutdown)
            self.llm = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def _init_request(info: dict[str, Any]) -> Any:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest  # noqa: PLC0415

    return WeightTransferInitRequest(init_info=info)


def _update_request(info: Any) -> Any:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest  # noqa: PLC0415

    return WeightTransferUpdateRequest(update_info=info)


async def _world_size(llm: Any) -> int:
    parallel = llm.vllm_config.parallel_config
    return int(parallel.world_size)
