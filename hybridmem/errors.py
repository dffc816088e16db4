"""The exceptions hybridmem raises.

User mistakes (a bad config value, a call in the wrong phase) raise subclasses of the builtin
``ValueError``/``RuntimeError`` so generic handlers still catch them; every message names the bad
value and what was expected. A failed switch raises :class:`SwitchError`, which says which step failed
and where the training state is now; when the step's own error is one hybridmem documents
(:class:`HostMemoryBudgetError`, :class:`WeightSyncError`, :class:`KVResumeError`), the raised error is
also an instance of that class (:func:`switch_error`), so ``except HostMemoryBudgetError`` catches a
budget overflow whether it happens in a direct call or inside a switch.

[Note: errors cross processes]
A hybridmem error raised in a worker process (a Ray actor, a multiprocessing pool, a spawned test worker) is
pickled to reach the caller. ``Exception`` pickles as ``cls(*self.args)``, which fails for errors whose
constructors take other or keyword-only arguments (``SwitchError(message, direction=..., ...)``): the caller
would get a deserialization failure instead of the named error. So every hybridmem error class's
``__init__`` records the arguments the outermost call got, and the error is rebuilt from them, then given
the attributes it had when pickled (tests/test_error_pickling.py round-trips every class).
"""

from __future__ import annotations

import difflib
import functools
import math
import os
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

__all__ = [
    "HybridMemError",
    "ConfigError",
    "PhaseError",
    "OffloadedTensorError",
    "SwitchError",
    "RollbackError",
    "MemoryPlanError",
    "HostMemoryPlanError",
    "HostMemoryBudgetError",
    "WeightSyncError",
    "WeightCoverageError",
    "KVStateError",
    "KVResumeError",
    "UnsupportedLibraryError",
    "PeerAbortError",
    "EngineProcessError",
    "EngineFault",
    "EngineSetupError",
    "SwitchHostMemoryBudgetError",
    "SwitchWeightSyncError",
    "SwitchKVResumeError",
    "SwitchPeerAbortError",
    "SwitchEngineProcessError",
    "switch_error",
    "add_note",
    "did_you_mean_path",
]


_INIT = "_hybridmem_init"
"""Where an error keeps the arguments it was built with (see [Note: errors cross processes])."""


def _rebuild(cls: type, args: tuple, kwargs: dict, state: dict) -> BaseException:
    error = cls(*args, **kwargs)
    error.__dict__.update(state)
    return error


def _recording(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807 - it replaces the class's __init__
        self.__dict__.setdefault(_INIT, (args, kwargs))  # the outermost call's: a subclass's comes first
        init(self, *args, **kwargs)

    return __init__


class HybridMemError(Exception):
    """Base class of every error hybridmem raises on purpose."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording(cls.__dict__["__init__"])

    def __reduce__(self):
        args, kwargs = self.__dict__.get(_INIT, (self.args, {}))
        state = {k: v for k, v in self.__dict__.items() if k != _INIT}
        return _rebuild, (type(self), args, kwargs, state)


class ConfigError(HybridMemError, ValueError):
    """A configuration key holds a value outside what is allowed.

    Attributes:
        key: The offending key (e.g. ``"infer_tensor_parallel_size"``).
        value: The value that was given (``None`` for an unknown key).
        suggestions: For an unknown key, the closest known names (empty otherwise).
    """

    suggestions: tuple[str, ...] = ()

    def __init__(self, key: str, value: object, allowed: str, *, source: str | None = None,
                 message: str | None = None):
        self.key = key
        self.value = value
        self.allowed = allowed
        where = f" in {source}" if source else ""
        super().__init__(message or f"{key}={value!r}{where} is not allowed: expected {allowed}")

    @classmethod
    def unknown(
        cls, key: str, known: Sequence[str], *, where: str, source: str | None = None, kind: str = "key"
    ) -> ConfigError:
        """The error for a ``kind`` (key or section) that is not in ``known``, with "did you mean" hints.

        The message names ``key``, ``where`` it was found and ``source``, the closest known names
        (``difflib``), and all known names when there are few.
        """
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "no known name is close"
        listing = f" (allowed: {', '.join(sorted(known))})" if len(known) <= 20 else ""
        in_source = f" of {source}" if source else ""
        message = f"unknown {kind} {key!r} in {where}{in_source}: {hint}{listing}"
        err = cls(key, None, f"a known {kind}", source=source, message=message)
        err.suggestions = tuple(close)
        return err


class PhaseError(HybridMemError, RuntimeError):
    """An operation was asked for in a phase that does not allow it.

    Attributes:
        current: The phase the manager is in.
        operation: What was asked for.
    """

    def __init__(self, operation: str, current: object, hint: str = ""):
        self.operation = operation
        self.current = current
        name = getattr(current, "name", current)
        msg = f"cannot {operation}: the manager is in phase {name}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


class OffloadedTensorError(PhaseError):
    """A tensor whose bytes hybridmem moved to host memory was read or written (see [Note: offloaded
    tensors refuse reads] in :mod:`hybridmem.offload.guard`).

    Attributes:
        kind: What the tensor is (``"params"``, ``"grads"``, ``"optimizer"``).
    """

    def __init__(self, operation: str, *, kind: str, shape: tuple[int, ...], dtype: object):
        self.kind = kind
        self.operation = operation
        self.current = "offloaded"
        HybridMemError.__init__(
            self,
            f"cannot {operation} a tensor of the training state ({kind}, shape {list(shape)}, {dtype}): "
            f"hybridmem moved its bytes to host memory (the manager is in INFER, or FAILED after a switch "
            f"failed); read it in TRAIN, after `with manager.inference()` ends or after manager.to_train() / "
            f"manager.recover()",
        )


class SwitchError(HybridMemError, RuntimeError):
    """A step of a switch raised.

    Attributes:
        direction: ``"to_infer"`` or ``"to_train"``.
        step: Name of the step that raised.
        phase_after: The phase the manager is in after handling the failure.
    """

    def __init__(self, message: str, *, direction: str, step: str, phase_after: object):
        self.direction = direction
        self.step = step
        self.phase_after = phase_after
        super().__init__(message)


class RollbackError(SwitchError):
    """Undoing a failed TRAIN->INFER switch failed too; the manager is in FAILED.

    No training state is lost: every offloaded tensor still has its host copy. Call
    ``ShardingManager.recover()`` once the cause (usually device memory) is fixed.
    """


class MemoryPlanError(HybridMemError, MemoryError):
    """A switch was refused before it started because its predicted peak exceeds the device budget, or
    the host buffer pool's would exceed ``host_memory_budget_bytes``.

    ``MemoryPlanError(plan)`` of a plan that fits the device and not the host is a
    :class:`HostMemoryPlanError` (so every raise site gets the host class without knowing of it).

    Attributes:
        plan: The :class:`hybridmem.switch.memplan.MemoryPlan` that did not fit; ``str(plan)`` is a table.
    """

    def __new__(cls, plan: object, *args: object, **kwargs: object):
        host_only = getattr(plan, "device_fits", True) and not getattr(plan, "host_fits", True)
        if cls is MemoryPlanError and host_only:
            cls = HostMemoryPlanError
        return HybridMemError.__new__(cls, plan, *args, **kwargs)

    def __init__(self, plan: object):
        self.plan = plan
        budgets = (("the device budget", getattr(plan, "device_fits", False)),
                   ("host_memory_budget_bytes", getattr(plan, "host_fits", True)))
        over = [what for what, fits in budgets if not fits]
        # Not super(): a HostMemoryPlanError's next base is HostMemoryBudgetError, whose arguments differ.
        HybridMemError.__init__(self, f"switch refused, predicted peak exceeds "
                                      f"{' and '.join(over)}:\n{plan}")


class HostMemoryBudgetError(HybridMemError, MemoryError):
    """The host buffer pool would exceed its configured budget."""

    def __init__(self, *, key: str, requested_nbytes: int, held_nbytes: int, budget_nbytes: int):
        self.key = key
        self.requested_nbytes = requested_nbytes
        self.held_nbytes = held_nbytes
        self.budget_nbytes = budget_nbytes
        super().__init__(
            f"host buffer pool: arena {key!r} needs {requested_nbytes} bytes, "
            f"{held_nbytes} bytes are held by other arenas, and host_memory_budget_bytes="
            f"{budget_nbytes}; raise the budget or offload less"
        )


class HostMemoryPlanError(MemoryPlanError, HostMemoryBudgetError):
    """A switch was refused before it started because its offloads would grow the host buffer pool past
    ``host_memory_budget_bytes`` (see [Note: host memory plan] in :mod:`hybridmem.switch.memplan`); nothing
    was moved. Catch it as either base: ``except HostMemoryBudgetError`` catches a host budget overflow
    whether it is foreseen by the plan or met inside a switch.

    Attributes:
        plan: The plan (its host curve in ``str(plan)``).
        key: The first step over the budget.
        requested_nbytes: Host bytes that step adds.
        held_nbytes: Host bytes the pool holds before that step.
        budget_nbytes: ``host_memory_budget_bytes``.
    """

    def __init__(self, plan: object):
        MemoryPlanError.__init__(self, plan)
        held = plan.host_start_nbytes
        for step in plan.steps:
            if step.host_nbytes > plan.host_budget_nbytes:
                self.key, self.held_nbytes = step.name, held
                self.requested_nbytes = step.estimate.host_alloc_nbytes
                break
            held = step.host_nbytes
        else:  # the pool starts over its budget (not reachable through the pool, which refuses that)
            self.key, self.requested_nbytes, self.held_nbytes = "(start)", 0, held
        self.budget_nbytes = plan.host_budget_nbytes


class WeightSyncError(HybridMemError, RuntimeError):
    """The inference engine's weights do not match what training sent (checksum mismatch)."""


class WeightCoverageError(WeightSyncError):
    """A weight sync left engine tensors (partly) unwritten; see [Note: weight coverage] in
    :mod:`hybridmem.weight_sync`.

    Attributes:
        unwritten: The engine tensors of this rank not entirely written.
    """

    def __init__(self, unwritten: list[str] | tuple[str, ...], *, engine: str = "engine"):
        self.unwritten = tuple(unwritten)
        more = f", ... ({len(self.unwritten)} in all)" if len(self.unwritten) > 8 else ""
        shown = ", ".join(self.unwritten[:8]) + more
        lora = any(".lora_A." in n or ".lora_B." in n for n in self.unwritten)
        why = ("the engine's LoRA slots do not hold these adapter tensors as the trainer has them (vLLM did "
               "not take the module, or took other values)" if lora else
               "the training model has no weights for them (is the engine built for another architecture?)")
        super().__init__(
            f"the weight sync did not write every byte of {len(self.unwritten)} {engine} tensor(s): {shown}; "
            f"{why}"
        )


class CollectiveTimeoutError(HybridMemError, TimeoutError):
    """A collective of a multi-rank weight sync did not complete by the switch's deadline, or a peer left it
    (see [Note: collective deadlines] in :mod:`hybridmem.reshard.execute`).

    Attributes:
        peers: Ranks (of the sync's group) this rank was waiting for.
        deadline_s: The deadline, in seconds from the sync's start.
        group_usable: Whether the process group can still be used (False after a timeout or a lost peer:
            gloo and NCCL close the connection).
    """

    def __init__(self, what: str, *, peers: tuple[int, ...], deadline_s: float, elapsed_s: float, cause: str):
        self.peers = tuple(peers)
        self.deadline_s = deadline_s
        self.group_usable = False
        super().__init__(
            f"{what}: rank(s) {list(self.peers)} did not complete within the {deadline_s:.1f} s deadline "
            f"(waited {elapsed_s:.1f} s: {cause}); the process group is no longer usable (its connections "
            f"are closed): destroy and re-create it, or restart the job"
        )


class EngineFault(Enum):
    """How a call into an inference engine in its own process failed, and so where its memory is now (see
    [Note: vllm engine failures] in :mod:`hybridmem.adapters.vllm.server.engine`)."""

    REFUSED = "refused"
    """The engine answered with an error: its process is alive and holds its memory."""
    STALLED = "stalled"
    """No answer within the deadline, yet its process is still there, holding its memory: stopped, hung or
    overloaded. It may answer later, and then still act on the call."""
    DEAD = "dead"
    """Its process is gone (killed, crashed, shut down), and its memory went with it."""


class EngineProcessError(HybridMemError, RuntimeError):
    """An inference engine in its own process did not answer a call in time, answered with an error, or is
    gone (see [Note: vllm engine process] in :mod:`hybridmem.adapters.vllm.server.client`).

    Attributes:
        call: The call (``"update_weights"``, ``"wake_up"``, ...).
        where: Where the engine is (a URL, an AsyncLLM).
        deadline_s: The call's deadline.
        fault: Which of :class:`EngineFault` it was.
    """

    def __init__(self, call: str, *, where: str, deadline_s: float, elapsed_s: float, cause: str,
                 fault: EngineFault = EngineFault.REFUSED):
        self.call = call
        self.where = where
        self.deadline_s = deadline_s
        self.fault = EngineFault(fault)
        advice = {
            EngineFault.REFUSED: "the engine answered with this error",
            EngineFault.STALLED: "its process is still there but does not answer: stopped, hung or "
                                 "overloaded",
            EngineFault.DEAD: "its process is gone, and its memory with it (its log says why it stopped)",
        }[self.fault]
        waited = f"{elapsed_s:.1f} s"
        if math.isfinite(deadline_s):
            waited += f" of {deadline_s:.1f} s"
        super().__init__(
            f"the vLLM engine at {where} did not complete {call!r} (waited {waited}: {cause}); "
            f"{self.fault.value}: {advice}"
        )

    @property
    def dead(self) -> bool:
        """Whether the engine's process is gone."""
        return self.fault is EngineFault.DEAD


class EngineSetupError(HybridMemError, RuntimeError):
    """An inference engine in its own process cannot be used as it was started, found before anything
    changed: nobody listens at its address, or it lacks something hybridmem needs (an environment
    variable, a flag), or its model's config cannot be found (see [Note: vllm server contact] in
    :mod:`hybridmem.adapters.vllm.server.contact`). The message names what is missing and how to add it.

    Attributes:
        where: Where the engine was looked for (a URL).
        missing: The variable, flag or argument to add (``""`` where nothing is to be added: nobody
            listens).
    """

    def __init__(self, message: str, *, where: str, missing: str = ""):
        self.where = where
        self.missing = missing
        super().__init__(message)


class PeerAbortError(HybridMemError, RuntimeError):
    """Other ranks of a multi-rank switch could not finish it and voted to roll back; this rank rolled back
    too (see [Note: switch agreement] in :mod:`hybridmem.switch.agreement`). The process group stays usable.

    Attributes:
        ranks: The ranks (of the weight sync's group) that voted no.
    """

    def __init__(self, ranks: tuple[int, ...], *, rank: int):
        self.ranks = tuple(ranks)
        self.group_usable = True
        super().__init__(
            f"rank(s) {list(self.ranks)} could not finish the switch and voted to roll back, so rank {rank} "
            f"rolls back too (their errors name the cause); the process group is still usable"
        )


class KVStateError(HybridMemError, RuntimeError):
    """A KV-cache allocator was asked for an operation its state does not allow.

    Attributes:
        operation: What was asked for (``"release"``, ``"view"``, ...).
        state: The allocator's :class:`hybridmem.kv.KVState` at the time.
    """

    def __init__(self, operation: str, state: object, *, allocator: str, hint: str = ""):
        self.operation = operation
        self.state = state
        name = getattr(state, "name", state)
        msg = f"{allocator} KV-cache allocator cannot {operation} in state {name}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


class KVResumeError(HybridMemError, MemoryError):
    """Re-creating a released KV pool failed; whatever it had mapped was undone, nothing is resident.

    Attributes:
        requested_nbytes: Bytes the resume needed.
        mapped_nbytes: Bytes it had mapped when the step failed (all of them unmapped again).
        step: The call that failed (e.g. ``"cuMemCreate"``).
    """

    def __init__(self, message: str, *, requested_nbytes: int, mapped_nbytes: int, step: str):
        self.requested_nbytes = requested_nbytes
        self.mapped_nbytes = mapped_nbytes
        self.step = step
        super().__init__(message)


class UnsupportedLibraryError(HybridMemError, ImportError):
    """An integration refuses the installed version of a library whose internals it patches: outside the
    tested range, or without a hook it relies on (raised at import).

    Attributes:
        library: The library's distribution name (``"trl"``).
        installed: Its installed version.
        tested: The versions the integration accepts (a PEP 440 specifier).
        read_from: The release the integration's hooks were read from.
        missing: Each missing hook, named with where the library was expected to have it.
    """

    def __init__(self, library: str, installed: str, tested: str, *, read_from: str, in_range: bool = True,
                 missing: Sequence[str] = ()):
        self.library = library
        self.installed = installed
        self.tested = tested
        self.read_from = read_from
        self.missing = tuple(missing)
        problems = []
        if not in_range:
            problems.append(f"{library} {installed} is outside the tested range {library}{tested}")
        if self.missing:
            problems.append(f"{library} {installed} lacks {len(self.missing)} hook(s) the integration "
                            f"patches or relies on: {'; '.join(self.missing)}")
        super().__init__(f"hybridmem's {library} integration refuses the installed {library}: "
                         f"{', and '.join(problems)} (hooks read from {library} {read_from}); install the "
                         f'tested release: pip install "{library}=={read_from}"')


class _SwitchFailedWith(SwitchError):  # noqa: N818 - a private base; the classes raised end in Error
    """A :class:`SwitchError` that is also the documented class of the step's error (second base).

    It carries the cause's attributes too (``requested_nbytes``, ``budget_nbytes``, ... for a budget
    overflow), and the cause stays in ``__cause__``.
    """

    def __init__(self, message: str, *, direction: str, step: str, phase_after: object, cause: BaseException):
        # The bases' constructors take different arguments; set both sides' attributes directly.
        Exception.__init__(self, message)
        self.__dict__.update({k: v for k, v in vars(cause).items() if k != _INIT})
        self.direction = direction
        self.step = step
        self.phase_after = phase_after


class SwitchHostMemoryBudgetError(_SwitchFailedWith, HostMemoryBudgetError):
    """A switch step would have exceeded ``host_memory_budget_bytes``; catch it as either base."""


class SwitchWeightSyncError(_SwitchFailedWith, WeightSyncError):
    """A switch's weight sync failed its checksum comparison; catch it as either base."""


class SwitchKVResumeError(_SwitchFailedWith, KVResumeError):
    """A switch could not re-create the KV pool; catch it as either base."""


class SwitchCollectiveTimeoutError(_SwitchFailedWith, CollectiveTimeoutError):
    """A switch's weight sync waited past its deadline for a peer (stuck or dead); catch it as either base."""


class SwitchEngineProcessError(_SwitchFailedWith, EngineProcessError):
    """A switch's call into an engine in its own process failed or timed out; catch it as either base."""


class SwitchPeerAbortError(_SwitchFailedWith, PeerAbortError):
    """Other ranks could not finish a multi-rank switch, so this rank rolled back too; catch it as either
    base."""


_SWITCH_CLASSES: tuple[tuple[type[HybridMemError], type[_SwitchFailedWith]], ...] = (
    (HostMemoryBudgetError, SwitchHostMemoryBudgetError),
    (WeightSyncError, SwitchWeightSyncError),
    (KVResumeError, SwitchKVResumeError),
    (CollectiveTimeoutError, SwitchCollectiveTimeoutError),
    (PeerAbortError, SwitchPeerAbortError),
    (EngineProcessError, SwitchEngineProcessError),
)


def switch_error(message: str, *, direction: str, step: str, phase_after: object,
                 cause: BaseException) -> SwitchError:
    """The :class:`SwitchError` to raise for a step that failed with ``cause``.

    Returns an instance of ``SwitchHostMemoryBudgetError`` / ``SwitchWeightSyncError`` /
    ``SwitchKVResumeError`` when ``cause`` is of the matching documented class, else a plain
    :class:`SwitchError`. Raise it ``from cause``.
    """
    for cause_cls, cls in _SWITCH_CLASSES:
        if isinstance(cause, cause_cls):
            return cls(message, direction=direction, step=step, phase_after=phase_after, cause=cause)
    return SwitchError(message, direction=direction, step=step, phase_after=phase_after)


def did_you_mean_path(path: str | os.PathLike[str], *, directories: bool = False) -> str:
    """``"did you mean 'NAME'?"`` for the entry beside ``path`` (a directory where ``directories``) whose
    name is closest to its name (``difflib``), or ``""``: the hint an error about a missing file or
    directory gives."""
    path = Path(path).expanduser()
    try:
        names = [p.name for p in path.parent.iterdir() if not directories or p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f"did you mean {str(path.with_name(close[0]))!r}?" if close else ""


def add_note(exc: BaseException, note: str) -> None:
    """Append ``note`` to ``exc``'s traceback text (PEP 678; a no-op before Python 3.11)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
