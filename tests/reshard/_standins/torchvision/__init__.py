"""An import-only stand-in for torchvision, put on ``sys.path`` by the vLLM worker tasks where torchvision does
not import (the CPU machines: PyPI's torchvision builds are CUDA builds that fail to load beside the CPU torch).

vLLM's Qwen3.5 model module imports its Qwen3-VL module, which imports transformers' Qwen2-VL image processor,
which imports ``torchvision.transforms.v2`` at module level. The text models whose weights the tests load
never call any of it: every name resolves, and using one raises.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"


class _AbsentType(type):
    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _AbsentType(attr, (_Absent,), {})


class _Absent(metaclass=_AbsentType):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision stand-in: vision code is not available in this test environment")


def __getattr__(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _AbsentType(attr, (_Absent,), {})


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``torchvision.*`` submodule, as an empty module whose names are stand-ins."""

    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
