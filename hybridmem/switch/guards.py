"""Misuse guards: the training model and optimizer refuse work while their memory is offloaded.

[Note: misuse guards]
Outside TRAIN the training state's storages are 0 bytes (or half-moved, in FAILED). A forward, a
backward or an optimizer step there would read or write freed memory: a raw torch storage error at best,
a segfault at worst. On leaving TRAIN (INFER reached, or FAILED) the manager arms a
:class:`TrainingGuard`; on the return to TRAIN it disarms it, so TRAIN pays nothing. Armed, it holds:

- a forward pre-hook on every module of the training model (``register_forward_pre_hook``), ahead of the
  module's own (FSDP2's all-gather), so a refused forward starts no collective;
- for a ``torch.optim.Optimizer``, a step pre-hook (``register_step_pre_hook``); for other optimizers
  (Megatron's), a ``step`` shadowing the class's on the instance; and a ``zero_grad`` shadow on the
  instance for both (torch has no zero_grad hook);
- ``zero_grad`` (and Megatron DDP's ``zero_grad_buffer``) of the model shadowed on the instance;
- a hook on every parameter that requires grad (``Tensor.register_hook``), which fires before autograd
  accumulates into the freed ``.grad``;
- a check at the entry of ``torch.autograd.backward`` / ``torch.autograd.grad`` (``Tensor.backward``
  goes through the former): the graph is walked from its roots and refused if it reaches a guarded
  parameter. This catches a loss computed in TRAIN and backpropagated after the switch, whose graph
  would otherwise read the freed weights it saved before any parameter hook fires. The wrappers are
  installed while at least one guard is armed and removed with the last one.

Each raises :class:`~hybridmem.errors.PhaseError` naming the manager's phase and what to do.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridmem.errors import PhaseError

__all__ = ["TrainingGuard"]

_ARMED: weakref.WeakSet[TrainingGuard] = weakref.WeakSet()
"""Armed guards, held weakly: a manager dropped while out of TRAIN takes its guard (and its model) with it
instead of keeping them alive here."""
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _hint(phase: Any) -> str:
    name = getattr(phase, "name", str(phase))
    if name == "FAILED":
        return "the training state is not on the device; call manager.recover() first"
    return ("the training state is offloaded; leave `with manager.inference()` (or call manager.to_train()) "
            "first")


def _reaches(roots: Iterable[Any], guarded: dict[int, TrainingGuard]) -> TrainingGuard | None:
    """The guard owning a parameter the autograd graph of ``roots`` accumulates into, if any."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stack += [t for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is None and id(t) in guarded]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            return guarded[id(node)]
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None and id(variable) in guarded:
            return guarded[id(variable)]
        stack += [fn for fn, _ in node.next_functions if fn is not None]
    return None


def _guarded_params() -> dict[int, TrainingGuard]:
    return {id(p): g for g in _ARMED for p in g.params}


def _roots(tensors: Any) -> list[Any]:
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _check_backward(fn_name: str) -> Callable[..., Any]:
    original = _ORIGINAL[fn_name]

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not _ARMED:  # every armed guard was dropped with its manager: take the check away
            _remove_autograd_check()
            return original(*args, **kwargs)
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        owner = _reaches(_roots(roots), _guarded_params())
        if owner is not None:
            owner.refuse("run backward through the training model")
        return original(*args, **kwargs)

    return checked


def _install_autograd_check() -> None:
    for name in ("backward", "grad"):
        _ORIGINAL[name] = getattr(torch.autograd, name)
        setattr(torch.autograd, name, _check_backward(name))


def _remove_autograd_check() -> None:
    for name, fn in _ORIGINAL.items():
        setattr(torch.autograd, name, fn)
    _ORIGINAL.clear()


class TrainingGuard:
    """Refuses forward, backward, ``step`` and ``zero_grad`` on a training model while armed (see
    [Note: misuse guards]).

    Args:
        phase: Returns the manager's phase now (named in the error).
        modules: The training model's modules (chunks); every submodule gets a forward pre-hook.
        optimizers: The training optimizers.
        owner: The manager, held weakly; while the guard is armed it is held strongly, so a manager outside
            TRAIN, the holder of the only copy of the model's bytes, is never garbage (see
            [Note: one manager per model] in :mod:`hybridmem.switch.claims`).
    """

    def __init__(self, phase: Callable[[], Any], modules: Iterable[torch.nn.Module],
                 optimizers: Iterable[Any], owner: Any = None):
        self._phase = phase
        self._owner = weakref.ref(owner) if owner is not None else None
        self._kept: Any = None
        self.modules = list(modules)
        self.optimizers = [o for o in optimizers if o is not None]
        self.params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        self._handles: list[Any] = []
        self._shadows: list[tuple[Any, str, Any]] = []
        self.armed = False

    def refuse(self, operation: str) -> None:
        """Raise the :class:`PhaseError` for ``operation``."""
        phase = self._phase()
        raise PhaseError(operation, phase, _hint(phase))

    def _refuser(self, operation: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            self.refuse(operation)

        return refuse

    def _shadow(self, obj: Any, attr: str, operation: str) -> None:
        previous = obj.__dict__.get(attr, _MISSING)
        setattr(obj, attr, self._refuser(operation))
        self._shadows.append((obj, attr, previous))

    def arm(self) -> None:
        """Install the hooks (no-op when armed)."""
        if self.armed:
            return
        forward = self._refuser("run the training model's forward")
        for module in self.modules:
            for sub in module.modules():
                self._handles.append(sub.register_forward_pre_hook(forward, prepend=True))
            self._shadow(module, "zero_grad", "zero the training model's grads")
            if callable(getattr(module, "zero_grad_buffer", None)):  # Megatron's DDP
                self._shadow(module, "zero_grad_buffer", "zero the training model's grad buffers")
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Optimizer):
                self._handles.append(opt.register_step_pre_hook(self._refuser("step the training optimizer")))
            else:
                self._shadow(opt, "step", "step the training optimizer")
            self._shadow(opt, "zero_grad", "zero the training optimizer's grads")
        backward = self._refuser("accumulate a gradient into a training parameter")
        for p in self.params:
            self._handles.append(p.register_hook(backward))
        if not _ORIGINAL:  # not installed yet (or taken away once no guard was left)
            _install_autograd_check()
        _ARMED.add(self)
        self._kept = self._owner() if self._owner is not None else None
        self.armed = True

    def disarm(self) -> None:
        """Remove every hook (no-op when not armed)."""
        if not self.armed:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for obj, attr, previous in reversed(self._shadows):
            if previous is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, previous)
        self._shadows.clear()
        _ARMED.discard(self)
        if not _ARMED:
            _remove_autograd_check()
        self._kept = None
        self.armed = False


_MISSING = object()
