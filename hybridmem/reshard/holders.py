"""Who holds which box of an HF tensor in a layout, learnt from groups of ranks rather than every rank.

A rank's share of a plan (:func:`~hybridmem.reshard.plan.build_plan` with ``rank=``) needs, for each HF
tensor it sends or receives, every box of it that the source layout holds and who holds it, and every
piece the destination layout wants and who wants it. Listing every rank's tensors costs as much as the
whole cluster's plan; a layout's :meth:`part_groups` instead groups ranks that hold the same tensors
of one part (see [Note: layout parts] in :mod:`hybridmem.reshard.layouts`), so one build per group
answers for all its ranks, and the expert groups are built only for the experts asked about.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hybridmem.reshard.layouts import PartGroups
from hybridmem.reshard.transforms import Box, LocalTensor, Piece, box_intersection

__all__ = ["Holding", "BoxHolders", "Holders", "holders_of", "sender_of", "served_by"]


class _Layout(Protocol):
    world_size: int

    def part_groups(self) -> tuple[PartGroups, ...]: ...


@dataclass(frozen=True, slots=True)
class Holding:
    """One piece of an HF tensor, held by every rank of a group under the same tensor name."""

    ranks: tuple[int, ...]
    """Ascending."""
    name: str
    piece: Piece


@dataclass(frozen=True, slots=True)
class BoxHolders:
    """Every holder of one box of an HF tensor."""

    ranks: tuple[int, ...]
    """The ranks holding the box, ascending, each once."""
    holdings: tuple[Holding, ...]
    """Where each holds it, in part order (a rank holding it twice uses the first)."""

    def __contains__(self, rank: int) -> bool:
        i = bisect.bisect_left(self.ranks, rank)
        return i < len(self.ranks) and self.ranks[i] == rank

    def held_by(self, rank: int) -> Holding:
        """The first holding of ``rank``.

        Raises:
            KeyError: ``rank`` does not hold the box.
        """
        for h in self.holdings:
            i = bisect.bisect_left(h.ranks, rank)
            if i < len(h.ranks) and h.ranks[i] == rank:
                return h
        raise KeyError(f"rank {rank} holds no {self.holdings[0].piece.hf_name} box "
                       f"{self.holdings[0].piece.src}")



def sender_of(holders: tuple[int, ...], consumers: tuple[int, ...], rank: int) -> int:
    """The holder that sends consumer ``rank`` its cells of a box: consumers (ascending) in equal
    contiguous runs per holder (ascending), so the load is even and neighbours pair up ([Note: plan
    cells] in :mod:`hybridmem.reshard.plan`)."""
    return holders[bisect.bisect_left(consumers, rank) * len(holders) // len(consumers)]


def served_by(holders: tuple[int, ...], consumers: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The consumers holder ``rank`` sends to: those :func:`sender_of` gives it."""
    j, m, n = bisect.bisect_left(holders, rank), len(holders), len(consumers)
    return consumers[-(-j * n // m):-(-(j + 1) * n // m)]


class Holders:
    """The holders of every HF tensor in ``layout``, computed per tensor on first use."""

    def __init__(self, layout: _Layout):
        self.layout = layout
        self._eager: dict[str, list[Holding]] = {}
        self._lazy: list[tuple[PartGroups, dict[Any, dict[str, list[tuple[str, Piece]]]]]] = []
        for part in layout.part_groups():
            if part.locate is None:
                for key, ranks in part.groups.items():
                    for name, local in part.build(key).items():
                        for p in local.pieces:
                            self._eager.setdefault(p.hf_name, []).append(Holding(ranks, name, p))
            else:
                self._lazy.append((part, {}))
        self._boxes: dict[str, dict[Box, BoxHolders]] = {}
        self._holdings: dict[str, list[Holding]] = {}
        self._wanting: dict[tuple, tuple[int, ...]] = {}

    def holdings(self, hf_name: str) -> list[Holding]:
        """Every piece of ``hf_name`` in the layout and the ranks holding it (cached)."""
        got = self._holdings.get(hf_name)
        if got is None:
            got = self._holdings[hf_name] = self._find(hf_name)
        return got

    def wanting(self, hf_name: str, box: Box, besides: tuple[int, ...]) -> tuple[int, ...]:
        """The ranks holding a piece of ``hf_name`` that meets ``box``, ascending, except ``besides``
        (ascending): in a destination layout, the consumers of a source box its holders lack."""
        groups = {id(h.ranks): h.ranks for h in self.holdings(hf_name)
                  if box_intersection(h.piece.src, box) is not None}
        key = (tuple(sorted(groups)), besides)
        got = self._wanting.get(key)
        if got is None:
            skip = set(besides)
            got = self._wanting[key] = tuple(r for r in _merge(list(groups.values())) if r not in skip)
        return got

    def _find(self, hf_name: str) -> list[Holding]:
        out = list(self._eager.get(hf_name, ()))
        for part, built in self._lazy:
            for key in part.locate(hf_name):
                index = built.get(key)
                if index is None:
                    index = built[key] = _by_hf(part.build(key))
                out.extend(Holding(part.groups[key], name, p) for name, p in index.get(hf_name, ()))
        return out

    def boxes(self, hf_name: str) -> Mapping[Box, BoxHolders]:
        """``{box: its holders}`` of ``hf_name``, boxes in the order of their first holding (cached)."""
        got = self._boxes.get(hf_name)
        if got is None:
            by_box: dict[Box, list[Holding]] = {}
            for h in self.holdings(hf_name):
                by_box.setdefault(h.piece.src, []).append(h)
            got = self._boxes[hf_name] = {box: BoxHolders(_merge([h.ranks for h in hs]), tuple(hs))
                                          for box, hs in by_box.items()}
        return got


def _by_hf(tensors: Mapping[str, LocalTensor]) -> dict[str, list[tuple[str, Piece]]]:
    out: dict[str, list[tuple[str, Piece]]] = {}
    for name, local in tensors.items():
        for p in local.pieces:
            out.setdefault(p.hf_name, []).append((name, p))
    return out


def _merge(groups: list[tuple[int, ...]]) -> tuple[int, ...]:
    if len(groups) == 1:
        return groups[0]
    return tuple(sorted(set().union(*groups)))


@functools.lru_cache(maxsize=8)
def holders_of(layout: _Layout) -> Holders:
    """The (cached) :class:`Holders` of ``layout``."""
    return Holders(layout)
