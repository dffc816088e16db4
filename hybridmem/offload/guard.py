"""Offloaded tensors refuse to be read: an error naming them instead of a crash.

[Note: offloaded tensors refuse reads]
While an offloader's bytes are on the host ([Note: offload by storage] in :mod:`hybridmem.offload.base`),
the tensors the model, the optimizer and the user hold keep their shapes but their storages hold 0 bytes.
torch does not check a storage's size before reading it: ``p.norm()``, ``model.state_dict()`` then
``torch.save``, ``print(p)`` or ``p.copy_(x)`` on such a tensor read or write freed memory and the process
dies with SIGSEGV (measured with torch 2.13: ``p.untyped_storage().resize_(0); p.sum()`` exits 139). That
is what a user meets who logs a parameter norm inside ``with manager.inference()``, or saves a checkpoint
while a failed switch left the manager in FAILED.

So once an offload has freed its storages, :func:`guard` gives each tensor it was given a class of its
own, a subclass of the tensor's class made once per class (``Parameter`` -> ``OffloadedParameter``,
``Tensor`` -> ``OffloadedTensor``), whose ``__torch_function__`` lets through what reads no bytes (shape,
dtype, device, ``requires_grad``, ``grad``, ``size()``, ``stride()``, ``untyped_storage()``, ...) and
raises :class:`~hybridmem.errors.OffloadedTensorError` for everything else, naming the tensor's kind and
shape and how to get it back. ``isinstance(p, torch.nn.Parameter)`` stays true, and the object is the same
one, so the references the optimizer, the model and hooks hold stay valid (torch's own
``UninitializedParameter`` changes its ``__class__`` the same way). :func:`unguard` puts the class back;
:meth:`~hybridmem.offload.base.Offloader.onload` calls it before it touches any tensor, so every path
back to the device (a switch to TRAIN, a rollback, ``recover()``) lifts the guard. hybridmem's own code
reads offloaded tensors only through their storages (the offloader's slots), never through the tensors.

A wrapper tensor (FSDP2's ``DTensor``) has no storage: its offloader moves its local tensor, and the ops a
user calls on the wrapper reach the local tensor below ``__torch_function__``, where no guard sees them. So
such an offloader names the wrappers too (:meth:`~hybridmem.offload.base.Offloader.held_by_user`), and each
wrapper is guarded like its local tensor (``DTensor`` -> ``OffloadedDTensor``).

Not covered: a tensor whose class cannot be changed (its layout differs from a plain subclass's; it is
left as it was), and a wrapper whose offloader does not name it: those read freed memory as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridmem.errors import OffloadedTensorError

__all__ = ["guard", "is_guarded", "unguard"]

_T = torch.Tensor
_ALLOWED: frozenset[Any] = frozenset(
    {getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad",
                                       "grad_fn", "layout", "ndim", "is_cuda", "is_cpu", "is_meta",
                                       "itemsize", "nbytes", "_base")}
    | {_T.grad.__set__, _T.requires_grad.__set__}
    | {getattr(_T, n) for n in ("size", "dim", "numel", "stride", "storage_offset", "untyped_storage",
                                "element_size", "is_contiguous", "get_device", "data_ptr", "requires_grad_",
                                "nelement", "register_hook", "register_post_accumulate_grad_hook")}
)
"""What a guarded tensor still answers: its metadata, none of its bytes."""

_ATTR = "_hybridmem_offloaded"
"""The attribute a guarded tensor carries: ``(its own class, the kind of state it is)``."""

_GUARDS: dict[type, type] = {}


def _refuse(cls: type, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
    if func in _ALLOWED:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    tensor = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls))
    _, kind = tensor.__dict__.get(_ATTR, (None, "training state"))
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = tuple(tensor.shape), tensor.dtype
    name = getattr(func, "__name__", repr(func)).strip("_")
    raise OffloadedTensorError(name, kind=kind, shape=shape, dtype=dtype)


def _guard_class(cls: type) -> type:
    guard_cls = _GUARDS.get(cls)
    if guard_cls is None:
        name = "OffloadedParameter" if cls is torch.nn.Parameter else f"Offloaded{cls.__name__}"
        guard_cls = type(name, (cls,), {"__torch_function__": classmethod(_refuse), "__module__": __name__})
        _GUARDS[cls] = guard_cls
    return guard_cls


def is_guarded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` refuses reads now."""
    return _ATTR in tensor.__dict__


def guard(tensors: Iterable[torch.Tensor], kind: str) -> list[torch.Tensor]:
    """Make each of ``tensors`` refuse reads (see [Note: offloaded tensors refuse reads]).

    Args:
        tensors: Tensors whose storages an offload freed.
        kind: What they are, for the error (``"params"``, ``"grads"``, ``"optimizer"``).

    Returns:
        The tensors guarded by this call (one already guarded, or whose class cannot change, is not).
    """
    done = []
    for t in tensors:
        if is_guarded(t):
            continue
        cls = type(t)
        try:
            t.__class__ = _guard_class(cls)
        except TypeError:  # a layout a plain subclass cannot take
            continue
        t.__dict__[_ATTR] = (cls, kind)
        done.append(t)
    return done


def unguard(tensors: Iterable[torch.Tensor]) -> None:
    """Give each guarded tensor of ``tensors`` its class back (a no-op for the others)."""
    for t in tensors:
        saved = t.__dict__.pop(_ATTR, None)
        if saved is not None:
            t.__class__ = saved[0]
