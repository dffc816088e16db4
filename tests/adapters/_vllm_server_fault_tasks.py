"""Faults across the process boundary of VLLMServerEngine, each scenario in a process of its own, run by
test_vllm_server_faults.py: ``python _vllm_server_fault_tasks.py SCENARIO OUT.json`` writes one record per
fault as JSON; the test asserts on them.

A point is one call of the client (the RL control plane, :class:`VLLMClient`) in a switch, found by a dry
run that counts them as tests/_faults.py counts torch calls. The fault done there is one of:

- ``refused``: an :class:`EngineProcessError` (fault REFUSED) instead of the call (the engine's error
  answer, stood in for);
- ``lost``: the call is made, then an :class:`EngineProcessError` (fault STALLED) is raised (its answer came
  too late: the engine acted, the trainer gave up);
- ``engine-refuses``: the real engine refuses the call (a second ``start_weight_update`` while one is open,
  a ``finish_weight_update`` without one, an update named for a previous run, refused when vLLM parses it);
- ``exception`` / ``keyboard-interrupt``: an ``Injected`` exception or ``KeyboardInterrupt`` (full runs);
- ``stop`` / ``kill`` (signal scenarios): SIGSTOP or SIGKILL to the engine's process right before the call;
  or (``kills``) SIGKILL to its vLLM worker once the trainer handed it a bucket of the call's stream.

Each record says what was raised, how long the switch took, the phase, whether the training state is
bitwise what it was, whether the engine was left paused, what ``generate`` answered (tokens or a
refusal), and what the next switch to INFER served: greedy tokens against transformers' on the trained
weights (computed here, before the switch, on the trainer's own model), and the engine's weight version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]

from _faults import FULL, FaultInjector, Injected  # noqa: E402 - found through the sys.path set above
from _vllm_server_tasks import (  # noqa: E402 - found through the sys.path set above
    ENGINE_ARGS,
    PROMPTS,
    VLLM_ENV,
    hf_greedy,
    lm_step,
    save_policy,
)

DEADLINE_S = float(os.environ.get("HYBRIDMEM_VLLM_FAULTS_DEADLINE_S", "12"))
"""The client's deadline for a control call. A fault-free call of this tiny model takes milliseconds on an
idle machine and stays under a second at load average 8; a stalled call waits all of it."""
CALLS = ("pause", "sleep", "wake_up", "start_weight_update", "update_weights", "finish_weight_update",
         "reset_prefix_cache", "resume_generation")
"""Every control call a switch makes, by the client's method name."""
CALL_NAME = {"resume_generation": "resume"}
"""The name an error gives a call, where it differs from the method's."""
TRANSACTION = ("start_weight_update", "update_weights", "finish_weight_update")
MAX_TOKENS = 8


def call_name(label: str) -> str:
    return CALL_NAME.get(label, label)


# Faults ---------------------------------------------------------------------------------------------------
def _refused(label, original, client, args, kwargs):
    from hybridmem.errors import EngineFault, EngineProcessError

    raise EngineProcessError(call_name(label), where=client.where, deadline_s=client.timeout_s, elapsed_s=0.0,
                             cause="injected: the engine answered with an error", fault=EngineFault.REFUSED)


def _lost(label, original, client, args, kwargs):
    from hybridmem.errors import EngineFault, EngineProcessError

    original(client, *args, **kwargs)
    raise EngineProcessError(call_name(label), where=client.where, deadline_s=client.timeout_s, elapsed_s=0.0,
                             cause="injected: the answer came after the deadline", fault=EngineFault.STALLED)


def _stale_run(info: Any) -> Any:
    """The update named for a previous run of the engine: the workers refuse it when vLLM parses it."""
    info = json.loads(json.dumps(info))
    for one in info if isinstance(info, list) else [info]:
        one["run"] = "hybridmem-0123456789ab"
    return info


def _engine_refuses(label, original, client, args, kwargs):
    if label == "start_weight_update":
        original(client)  # opens a transaction: vLLM refuses the switch's own start
    elif label == "finish_weight_update":
        original(client, None)  # closes it: vLLM refuses the switch's own finish
    elif label == "update_weights":
        args = (_stale_run(args[0]),)
    else:
        raise AssertionError(f"no real refusal for {label}")
    return original(client, *args, **kwargs)


def _exception(label, original, client, args, kwargs):
    raise Injected(f"injected before {label}")


def _keyboard_interrupt(label, original, client, args, kwargs):
    raise KeyboardInterrupt


FAULTS: dict[str, Callable[..., Any]] = {
    "refused": _refused, "lost": _lost, "engine-refuses": _engine_refuses, "exception": _exception,
    "keyboard-interrupt": _keyboard_interrupt,
}


class ClientFaults(FaultInjector):
    """Counts the client's control calls (:data:`CALLS`) and does a fault at the target calls."""

    def __init__(self) -> None:
        from hybridmem.adapters.vllm.server.client import VLLMClient

        super().__init__([(VLLMClient, name, name) for name in CALLS])
        self.fault: Callable[..., Any] = _refused

    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(client: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            self.labels.append(label)
            if self.count not in self.targets:
                return original(client, *args, **kwargs)
            self.fired = label if self.fired is None else self.fired
            self.fired_at.append(self.count)
            return self.fault(label, original, client, args, kwargs)

        return wrapper


def signal_fault(pid_of: Callable[[], int], signum: int, *,
                 kill_after_s: float | None = None) -> Callable[..., Any]:
    """A fault that sends ``signum`` to the engine's process right before the call (and, with
    ``kill_after_s``, SIGKILL that long after, while the call waits)."""

    def fault(label, original, client, args, kwargs):
        pid = pid_of()
        os.kill(pid, signum)
        if kill_after_s is not None:
            threading.Timer(kill_after_s, lambda: _signal(pid, signal.SIGKILL)).start()
        return original(client, *args, **kwargs)

    return fault


def worker_kill_fault(pid_of: Callable[[], int], seen: dict) -> Callable[..., Any]:
    """A fault at ``update_weights`` that lets the call through and has the trainer's first bucket hand-over
    kill the vLLM worker (``pid_of()``) once the bucket's message is sent: the worker is stopped first, so
    it holds the bucket unacknowledged when it dies. ``seen`` gets the worker's pid and the buckets the
    trainer had with it."""

    def fault(label, original, client, args, kwargs):
        from hybridmem.adapters.vllm.server.packing import BucketWriter

        real = BucketWriter._hand_over

        def hand_over(writer: Any) -> None:
            BucketWriter._hand_over = real  # once
            pid = pid_of()
            seen["worker_pid"] = pid
            os.kill(pid, signal.SIGSTOP)
            try:
                real(writer)  # the bucket's message is sent; the worker cannot take it
            finally:
                seen["holding"] = writer.holding()
                os.kill(pid, signal.SIGKILL)

        BucketWriter._hand_over = hand_over
        try:
            return original(client, *args, **kwargs)
        finally:
            if "worker_pid" not in seen:  # the stream never got to a hand-over
                BucketWriter._hand_over = real

    return fault


def worker_pid(engine_pid: int) -> int:
    """The pid of the vLLM worker under the engine core ``engine_pid`` (vLLM's CPU build runs one process
    per worker, ``VLLM::Worker``, its child)."""
    import psutil

    workers = [p.pid for p in psutil.Process(engine_pid).children(recursive=True)
               if p.name().startswith("VLLM::Worker")]
    if len(workers) != 1:
        raise RuntimeError(f"expected one VLLM::Worker under the engine core {engine_pid}, found {workers}")
    return workers[0]


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


# The actor ------------------------------------------------------------------------------------------------
class Actor:
    """The user's side: a ``from_pretrained`` model, AdamW, a manager with defaults on ``engine``."""

    def __init__(self, engine: Any, model: Any = None, opt: Any = None, model_dir: str | None = None):
        import torch
        import transformers

        from hybridmem import ShardingManager

        if model is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            lm_step(model, opt, 0, model.config.vocab_size)  # grads and AdamW state exist from here on
        self.model, self.opt, self.engine = model, opt, engine
        self.manager = ShardingManager(model, engine, optimizer=opt)
        self.steps = 1
        self.injector = ClientFaults()
        self.served: list[list[int]] | None = None
        """transformers' greedy tokens on the weights the engine last committed (``None``: none yet)."""

    def generate(self) -> list[list[int]]:
        from hybridmem.engines import SamplingParams

        return [o.token_ids for o in self.engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                   temperature=0.0))]

    def answer(self) -> Any:
        """What ``generate`` answers now: tokens, or the refusal's class and message."""
        try:
            return self.generate()
        except Exception as exc:  # recorded, the test checks the class
            return {"refused": type(exc).__name__, "message": str(exc)[:300]}

    def train(self) -> None:
        lm_step(self.model, self.opt, self.steps, self.model.config.vocab_size)
        self.steps += 1

    def cycle(self) -> dict:
        """One uninjected round trip: TRAIN->INFER, greedy tokens and version, INFER->TRAIN, a step."""
        expected = hf_greedy(self.model)
        self.manager.to_infer()
        self.served = expected
        got, version = self.generate(), self.engine.weight_version()
        self.manager.to_train()
        self.train()
        return {"got": got, "expected": expected, "version": version, "committed": self.engine.version}

    def paused(self) -> bool | None:
        """Whether the engine's scheduler is paused, asked of the engine itself (None: it does not answer)."""
        client = self.engine.client
        try:
            if hasattr(client, "llm"):
                return bool(client._run(client.llm.is_paused(), "is_paused", 10.0))
            return bool(client._http.get("/is_paused", timeout=10.0).json()["is_paused"])
        except Exception:
            return None

    def dry_run(self, direction: str) -> list[str]:
        """The labels of the control calls of one uninjected switch in ``direction`` (ends in TRAIN)."""
        if direction == "to_infer":
            labels = self.injector.count_calls(self.manager.to_infer)
            self.manager.to_train()
        else:
            self.manager.to_infer()
            labels = self.injector.count_calls(self.manager.to_train)
        self.train()
        return labels

    def calls_with_fault(self, point: int, kind: str) -> int:
        """How many control calls a TRAIN->INFER switch failed at ``point`` makes, its rollback's included."""
        self.injector.fault = FAULTS[kind]
        with self.injector.active(target=point) as inj, contextlib.suppress(Exception):
            self.manager.to_infer()
        if self.manager.phase.name == "FAILED":
            self.manager.recover()
        self.cycle()  # a complete update: the next switch makes the dry run's calls again
        return inj.count


def error_record(exc: BaseException | None) -> dict:
    """What a switch raised: classes, the call, step and fault it names, and the engine calls in its
    causes."""
    if exc is None:
        return {"type": None}
    chain, seen, cur = [], set(), exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    engine_errors = [e for e in chain if hasattr(e, "fault") and hasattr(e, "call")]
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc)[:2000],
        "step": getattr(exc, "step", None),
        "call": getattr(exc, "call", None),
        "fault": getattr(getattr(exc, "fault", None), "value", None),
        "chain_calls": [e.call for e in engine_errors],
        "chain_faults": [e.fault.value for e in engine_errors],
        "chain_types": [type(e).__name__ for e in chain],
    }


def run_point(actor: Actor, direction: str, fault: Callable[..., Any], targets: int | tuple[int, ...], *,
              kind: str, after: Callable[[dict], None] | None = None) -> dict:
    """One injected switch in ``direction`` with ``fault`` at ``targets``, then everything the test checks.

    ``after(record)`` runs once the switch has raised (a signal scenario resumes or kills the engine there,
    and may call ``recover()`` itself)."""
    from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

    mgr = actor.manager
    rec: dict[str, Any] = {"direction": direction, "kind": kind, "targets": targets}
    expected = hf_greedy(actor.model)  # what the weights being switched in give
    before = snapshot(actor.model, actor.opt)  # a round trip changes none of it
    version_before = actor.engine.weight_version()
    committed_before = actor.engine.version
    if direction == "to_train":
        mgr.to_infer()
        actor.served = expected
        rec["served_before"] = actor.generate() == expected
        version_before = actor.engine.weight_version()
        committed_before = actor.engine.version
    switch = mgr.to_infer if direction == "to_infer" else mgr.to_train
    actor.injector.fault = fault
    raised: BaseException | None = None
    start = time.monotonic()
    with actor.injector.active(target=targets) as inj:
        try:
            switch()
        except (Exception, KeyboardInterrupt) as exc:  # every kind is checked by the test
            raised = exc
    rec["elapsed_s"] = time.monotonic() - start
    rec["fired"] = [inj.labels[i - 1] for i in inj.fired_at]
    rec["fired_at"] = list(inj.fired_at)
    rec["labels"] = list(inj.labels)
    rec["error"] = error_record(raised)
    rec["phase"] = mgr.phase.name
    rec["generate_after"] = actor.answer()
    rec["version_before"] = version_before
    rec["expected_before"] = actor.served  # what the weights committed before the switch give
    if after is not None:
        after(rec)
    rec["paused"] = actor.paused()
    rec["version_after"] = _version(actor)
    if mgr.phase.name == "FAILED":
        start = time.monotonic()
        try:
            mgr.recover()
            rec["recover"] = {"ok": True}
        except Exception as exc:
            rec["recover"] = {"ok": False, "error": error_record(exc)}
        rec["recover"]["elapsed_s"] = time.monotonic() - start
    rec["phase_final"] = mgr.phase.name
    rec["paused_final"] = actor.paused()
    if rec["phase_final"] == "TRAIN":
        try:
            assert_bitwise_equal(before, snapshot(actor.model, actor.opt))
            rec["state_equal"] = True
        except AssertionError as exc:
            rec["state_equal"] = str(exc)
    rec["committed_before"] = committed_before
    return rec


def _version(actor: Actor) -> str | None:
    try:
        return actor.engine.weight_version()
    except Exception:
        return None


def next_round(actor: Actor, rec: dict) -> None:
    """The next uninjected round trip after a fault: what the engine serves, then a training step."""
    from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

    if actor.manager.phase.name != "TRAIN":  # FAILED: the training state is in host arenas, not to be read
        rec["next"] = {"phase": actor.manager.phase.name, "state_equal": "not in TRAIN (recover() failed)"}
        return
    before = snapshot(actor.model, actor.opt)
    expected = hf_greedy(actor.model)
    try:
        actor.manager.to_infer()
    except Exception as exc:  # a dead engine: the test checks the error
        rec["next"] = {"error": error_record(exc), "phase": actor.manager.phase.name}
    else:
        actor.served = expected
        got, version = actor.answer(), actor.engine.weight_version()
        paused = actor.paused()
        actor.manager.to_train()
        rec["next"] = {"got": got, "expected": expected, "version": version,
                       "committed": f"hybridmem-{actor.engine.version}", "phase": actor.manager.phase.name,
                       "paused_in_infer": paused}
    try:
        assert_bitwise_equal(before, snapshot(actor.model, actor.opt))
        rec["next"]["state_equal"] = True
    except AssertionError as exc:
        rec["next"]["state_equal"] = str(exc)
    if actor.manager.phase.name == "TRAIN":
        actor.train()


# Scenarios ------------------------------------------------------------------------------------------------
def _start_async(model_dir: str, **kwargs: Any) -> Any:
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    return VLLMServerEngine.start_async(model_dir, timeout_s=DEADLINE_S, **ENGINE_ARGS, **kwargs)


def injections(out: str, transport: str = "async") -> dict:
    """Every control call of both switches, each fault kind, on one engine: with vLLM's CPU build's call
    sequence (no sleep mode), then with the sleep / wake-up calls a GPU build makes (``frees_memory=True``
    on the same engine: vLLM's CPU build accepts them and frees nothing), then pairs of faults: one in
    TRAIN->INFER and one in the rollback's calls (CI: the sequence with sleep only, see
    :data:`INJECTED_CONFIGS` and :data:`PAIRED_CI`)."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    server = None
    if transport == "async":
        engine = _start_async(model_dir)
    else:
        server = Server(model_dir)
        engine = VLLMServerEngine.connect(server.url, timeout_s=DEADLINE_S)
    res: dict[str, Any] = {"configs": {}, "records": [], "deadline_s": DEADLINE_S, "full": FULL}
    extra: list = []
    try:
        first = Actor(engine, model_dir=model_dir)
        res["warm"] = first.cycle()
        kinds = ["refused", "lost", "engine-refuses"] + (["exception", "keyboard-interrupt"] if FULL else [])
        for config, act in configs_of(first, engine, extra):
            labels = {d: act.dry_run(d) for d in ("to_infer", "to_train")}
            res["configs"][config] = labels
            if config not in INJECTED_CONFIGS:
                continue
            for direction, seq in labels.items():
                for point, label in enumerate(seq, start=1):
                    for kind in kinds:
                        if kind == "engine-refuses" and label not in TRANSACTION:
                            continue
                        if kind == "lost" and label in ("wake_up", "sleep") and not FULL:
                            continue  # a late answer to a wake-up or sleep changes nothing a refusal does not
                        rec = run_point(act, direction, FAULTS[kind], point, kind=kind)
                        rec.update(config=config, point=point, label=label, dry_run=seq)
                        next_round(act, rec)
                        res["records"].append(rec)
            # Pairs: a TRAIN->INFER call fails, then a call of its rollback fails too.
            seq = labels["to_infer"]
            firsts = range(1, len(seq) + 1) if FULL else [seq.index(c) + 1 for c in PAIRED_CI]
            for first in firsts:
                total = act.calls_with_fault(first, "refused")
                undo = list(range(first + 1, total + 1))
                for second in undo if FULL else undo[:1]:
                    rec = run_point(act, "to_infer", _refused, (first, second), kind="refused-twice")
                    rec.update(config=config, point=[first, second], label=rec["fired"], dry_run=seq)
                    next_round(act, rec)
                    res["records"].append(rec)
            res["final"] = act.cycle()
    finally:
        for other in extra:  # its buckets and channel; the client is the first engine's
            other._close_transport()
            shutil.rmtree(other.directory, ignore_errors=True)
        engine.close()
        if server is not None:
            server.stop()
    return res


INJECTED_CONFIGS = ("no-sleep", "sleep") if FULL else ("sleep",)
"""The call sequences injected at every call: CI takes the one with sleep and wake-up, which makes every
call the other makes and more (the other, vLLM's CPU build's own, is what the signal scenarios run)."""
PAIRED_CI = ("update_weights", "resume_generation")
"""The TRAIN->INFER calls whose failure CI pairs with a failure of the rollback's first call (all in full
runs, with every call of the rollback)."""


def configs_of(actor: Actor, engine: Any, extra: list):
    """The two call sequences: the engine as built (vLLM's CPU build: no sleep mode), then a second
    VLLMServerEngine on the same client that sleeps and wakes (the calls a GPU build makes; appended to
    ``extra``, for the caller to close)."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    yield "no-sleep", actor
    actor.manager.close()
    sleeping = VLLMServerEngine(engine.client, hf_config=engine.hf_config, frees_memory=True)
    extra.append(sleeping)
    yield "sleep", Actor(sleeping, model=actor.model, opt=actor.opt)


def stalls(out: str) -> dict:
    """SIGSTOP of the AsyncLLM's engine core at calls of both switches; then SIGCONT, or SIGKILL."""
    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    engine = _start_async(model_dir)
    res: dict[str, Any] = {"records": [], "deadline_s": DEADLINE_S}
    try:
        actor = Actor(engine, model_dir=model_dir)
        res["warm"] = actor.cycle()
        pid = engine.client.engine_pids()[0]
        res["engine_pid"] = pid
        stop = signal_fault(lambda: pid, signal.SIGSTOP)

        def cont(rec: dict) -> None:
            _signal(pid, signal.SIGCONT)

        def recover_stalled_then_cont(rec: dict) -> None:
            # recover() while the engine still stalls: it fails again, within the deadline, phase FAILED
            start = time.monotonic()
            try:
                actor.manager.recover()
                rec["recover_while_stalled"] = {"ok": True}
            except Exception as exc:
                rec["recover_while_stalled"] = {"ok": False, "error": error_record(exc),
                                                "phase": actor.manager.phase.name}
            rec["recover_while_stalled"]["elapsed_s"] = time.monotonic() - start
            _signal(pid, signal.SIGCONT)

        def kill(rec: dict) -> None:
            _signal(pid, signal.SIGKILL)
            rec["engine_exit"] = _wait_gone(engine)

        plan = [("to_infer", "update_weights", cont), ("to_train", "pause", recover_stalled_then_cont),
                ("to_infer", "resume_generation", cont), ("to_train", "pause", kill)]
        labels = {d: actor.dry_run(d) for d in ("to_infer", "to_train")}
        res["labels"] = labels
        for direction, label, after in plan:
            point = labels[direction].index(label) + 1
            rec = run_point(actor, direction, stop, point, kind="stop", after=after)
            rec.update(point=point, label=label, then=after.__name__, dry_run=labels[direction])
            next_round(actor, rec)
            res["records"].append(rec)
    finally:
        if "engine_pid" in res:
            _signal(res["engine_pid"], signal.SIGCONT)
        engine.close()
    return res


def kills(out: str) -> dict:
    """SIGKILL on an engine each: of the AsyncLLM's engine core while ``update_weights`` waits (TRAIN->INFER);
    of its vLLM worker while it holds the trainer's first bucket of that update (TRAIN->INFER); of its
    engine core while ``pause`` waits (INFER->TRAIN). An engine core is stopped first so the call is surely
    pending when it dies, a worker so it has not taken the bucket. CI kills the first two (``http`` kills
    an engine core in INFER->TRAIN, ``stalls`` a stopped one)."""
    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    res: dict[str, Any] = {"records": [], "deadline_s": DEADLINE_S}
    model = opt = None
    cases = (("to_infer", "update_weights", "engine core"), ("to_infer", "update_weights", "worker"),
             ("to_train", "pause", "engine core"))
    for direction, label, victim in cases[:None if FULL else 2]:
        engine = _start_async(model_dir)
        try:
            actor = Actor(engine, model=model, opt=opt, model_dir=model_dir)
            model, opt = actor.model, actor.opt
            res.setdefault("warm", []).append(actor.cycle())
            pid = engine.client.engine_pids()[0]
            labels = actor.dry_run(direction)
            point = labels.index(label) + 1
            seen: dict[str, Any] = {}
            if victim == "worker":
                fault = worker_kill_fault(lambda pid=pid: worker_pid(pid), seen)
            else:
                fault = signal_fault(lambda pid=pid: pid, signal.SIGSTOP, kill_after_s=2.0)
            rec = run_point(actor, direction, fault, point, kind="kill")
            rec.update(point=point, label=label, victim=victim, engine_exit=_wait_gone(engine),
                       dry_run=labels, **seen)
            if "worker_pid" in seen:
                rec["worker_exists"] = _exists(seen["worker_pid"])
            next_round(actor, rec)
            rec["generate_dead"] = actor.answer()
            res["records"].append(rec)
            actor.manager.close()
        finally:
            engine.close()
    return res


def _exists(pid: int) -> bool:
    """Whether process ``pid`` is there and not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(engine: Any, timeout_s: float = 30.0) -> Any:
    """The engine core's exit code once it is gone (None: still there after ``timeout_s``)."""
    manager = (engine.client.llm.engine_core.resources.engine_manager if hasattr(engine.client, "llm")
               else None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in manager.processes] if manager is not None else []
        if codes and all(c is not None for c in codes):
            return codes
        time.sleep(0.2)
    return None


# vllm serve -----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` (the OpenAI server with its RL routes) for ``model_dir``, in a session of its own."""

    def __init__(self, model_dir: str, *, startup_timeout_s: float = 1500.0):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tempfile.mktemp(prefix="vllm-serve-", suffix=".log")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--skip-tokenizer-init", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--max-num-seqs",
                str(ENGINE_ARGS["max_num_seqs"]), "--enforce-eager", "--seed", "0",
                "--weight-transfer-config", '{"backend": "hybridmem"}']
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer /health in {startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def engine_core_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.name().startswith("VLLM::EngineCore"):
                return child.pid
        raise RuntimeError(f"no VLLM::EngineCore under the server {self.proc.pid}")

    def stop(self) -> None:
        """SIGTERM the server's process group (vLLM stops its engine core and workers), SIGKILL what is
        left."""
        for signum, wait_s in ((signal.SIGCONT, 0.0), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
            if signum != signal.SIGCONT and not _group_alive(self.proc.pid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def http(out: str) -> dict:
    """``vllm serve``: the server process stopped (SIGSTOP) right before ``update_weights``, then resumed;
    the real refusals of the update transaction; the engine core killed right before ``pause``."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    server = Server(model_dir)
    res: dict[str, Any] = {"records": [], "deadline_s": DEADLINE_S, "url": server.url}
    try:
        engine = VLLMServerEngine.connect(server.url, timeout_s=DEADLINE_S)
        actor = Actor(engine, model_dir=model_dir)
        res["warm"] = actor.cycle()
        labels = {d: actor.dry_run(d) for d in ("to_infer", "to_train")}
        res["labels"] = labels
        for label in TRANSACTION:
            point = labels["to_infer"].index(label) + 1
            rec = run_point(actor, "to_infer", _engine_refuses, point, kind="engine-refuses")
            rec.update(point=point, label=label, dry_run=labels["to_infer"])
            next_round(actor, rec)
            res["records"].append(rec)
        point = labels["to_infer"].index("update_weights") + 1
        rec = run_point(actor, "to_infer", signal_fault(lambda: server.proc.pid, signal.SIGSTOP), point,
                        kind="stop", after=lambda r: _signal(server.proc.pid, signal.SIGCONT))
        rec.update(point=point, label="update_weights", then="cont", dry_run=labels["to_infer"])
        next_round(actor, rec)
        res["records"].append(rec)
        point = labels["to_train"].index("pause") + 1
        core = server.engine_core_pid()
        rec = run_point(actor, "to_train", signal_fault(lambda: core, signal.SIGKILL), point, kind="kill")
        rec.update(point=point, label="pause", dry_run=labels["to_train"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            # vLLM 0.32's server stays up, waiting on the call its engine core took
            server.proc.wait(timeout=15)
        rec["server_exit"] = server.proc.poll()
        next_round(actor, rec)
        rec["generate_dead"] = actor.answer()
        res["records"].append(rec)
        actor.manager.close()
        engine.close()
    finally:
        server.stop()
    return res


SCENARIOS = {"injections": injections, "stalls": stalls, "kills": kills, "http": http}

if __name__ == "__main__":
    os.environ.update(VLLM_ENV)
    name, out_path, *rest = sys.argv[1:]
    result = SCENARIOS[name](out_path, *rest)
    with open(out_path, "w") as f:
        json.dump(result, f, default=str)
