"""Capabilities a part declares: a frozen dataclass of flags on its ``capabilities`` attribute, each flag
promising members of the part (see [Note: engine capabilities] in :mod:`hybridmem.contract.engine` and [Note:
training capabilities] in :mod:`hybridmem.contract.training`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["declared_capabilities"]

C = TypeVar("C")


def declared_capabilities(part: Any, cls: type[C], promises: Mapping[str, tuple[str, ...]], *, what: str,
                          has: Callable[[Any, str], bool],
                          attributes: frozenset[str] = frozenset()) -> C | None:
    """``part.capabilities`` when it is a ``cls`` whose every true flag's members (``promises``) the part
    has (``has(part, member)``), ``None`` when the part declares nothing.

    Raises:
        TypeError: ``capabilities`` is not a ``cls``, or a true flag's member is missing (naming the flag,
            the ``what`` and the member, an attribute when it is in ``attributes``, else a callable).
    """
    declared = getattr(part, "capabilities", None)
    if declared is None:
        return None
    name = type(part).__name__
    if not isinstance(declared, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{name}.capabilities must be {article} {cls.__name__}, "
                        f"got {type(declared).__name__}")
    for capability, members in promises.items():
        missing = [m for m in members if getattr(declared, capability) and not has(part, m)]
        if missing:
            kind = "attribute" if missing[0] in attributes else "callable"
            raise TypeError(f"{name}.capabilities declares {capability}=True but the {what} has no {kind} "
                            f"{missing}")
    return declared
