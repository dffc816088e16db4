"""Model families: one file each says what a family is (see [Note: canonical names] in
:mod:`hybridmem.models.family`); the resharding engine and the adapters read them through
:func:`get_family` and never branch on a family's name."""

from __future__ import annotations

from hybridmem.models.family import Family, RouterBias, TextModelNames, getter
from hybridmem.models.registry import (
    ALIASES,
    ARCHITECTURES,
    FAMILIES,
    family_name,
    get_family,
    model_type_of,
    structural_model_type,
)

__all__ = ["Family", "RouterBias", "TextModelNames", "getter", "FAMILIES", "ALIASES", "ARCHITECTURES",
           "family_name", "get_family", "model_type_of", "structural_model_type"]
