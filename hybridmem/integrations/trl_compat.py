"""What the TRL integration knows about TRL itself: the tested range, the hooks, the import-time check.

[Note: TRL hooks]
TRL offers no extension point for running its co-located vLLM generation inside someone else's switch, so
:mod:`hybridmem.integrations.trl` overrides, wraps, reads or replaces TRL internals, read from TRL
:data:`TRL_HOOKS_READ_FROM` (``trl/trainer/grpo_trainer.py``, ``trl/generation/vllm_generation.py``);
:data:`TRL_HOOKS` lists each with what the integration does with it. Private names move between TRL's minor
releases, so the integration accepts the tested range :data:`TESTED_TRL` only (patch releases of the
series the hooks were read from), and :func:`check_trl` refuses, at import, a TRL outside it or one that
lacks a hook, with one :class:`~hybridmem.errors.UnsupportedLibraryError` naming the installed version,
the range and every missing hook with where TRL was expected to have it. An instance attribute (TRL's
``self.llm``, ``self.vllm_generation``) does not exist before TRL builds it, so it is checked in the
code that sets or reads it (:attr:`HookKind.USED_BY`).

TRL 1.16.0 declares vLLM 0.22.0 to 0.31.0 and warns from every module that asks (five at import, one when
it builds its ``LLM``); hybridmem is tested with vLLM 0.32. :func:`vllm_range_warning_once` prints that
warning once per process and leaves every other warning, and the user's own filters, alone. (A ``"once"``
filter does not do it: under CPython 3.11's C ``warnings`` TRL's import still printed it four times.)
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from hybridmem.errors import UnsupportedLibraryError

__all__ = ["TRL_HOOKS_READ_FROM", "TESTED_TRL", "TRL_MODULES", "HookKind", "TRLHook", "TRL_HOOKS",
           "check_trl", "import_trl", "vllm_range_warning_once"]

TRL_HOOKS_READ_FROM = "1.16.0"
"""The TRL release whose source :data:`TRL_HOOKS` were read from (see [Note: TRL hooks])."""

TESTED_TRL = ">=1.16,<1.17"
"""The TRL versions the integration accepts (a PEP 440 specifier, compared on the release without
pre/dev/local parts): the series :data:`TRL_HOOKS_READ_FROM` belongs to."""

TRL_MODULES = ("trl", "trl.import_utils", "trl.trainer.grpo_config", "trl.trainer.grpo_trainer",
               "trl.generation.vllm_generation")
"""The TRL modules the hooks live in."""

VLLM_RANGE_WARNING = r"TRL currently supports vLLM versions from "
"""The start of TRL's warning about a vLLM outside its declared range (``trl/import_utils.py``)."""

_INSTALL_HINT = "pip install hybridmem[trl]"


class HookKind(Enum):
    """How a hook is checked."""

    ATTRIBUTE = auto()
    """``where`` has the attribute ``name`` (a method overridden, wrapped or replaced, a config field)."""
    PARAMETER = auto()
    """The function ``where`` takes a parameter ``name``."""
    USED_BY = auto()
    """The code of function ``where`` names ``name``: an attribute it sets or reads on ``self``, or a global
    it looks up when called."""


@dataclass(frozen=True, slots=True)
class TRLHook:
    """One TRL internal the integration relies on."""

    where: str
    """The dotted path of the TRL object that holds it, from its module (``trl.trainer.grpo_trainer...``)."""
    name: str
    kind: HookKind
    why: str
    """What the integration does with it."""

    def describe(self) -> str:
        """The hook and where TRL is expected to have it."""
        if self.kind is HookKind.PARAMETER:
            return f"parameter {self.name!r} of {self.where} ({self.why})"
        if self.kind is HookKind.USED_BY:
            return f"{self.name!r} set or read in {self.where} ({self.why})"
        return f"{self.where}.{self.name} ({self.why})"


_TRAINER = "trl.trainer.grpo_trainer.GRPOTrainer"
_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"

TRL_HOOKS: tuple[TRLHook, ...] = (
    TRLHook(f"{_TRAINER}.__init__", "model", HookKind.PARAMETER, "its dtype and LoRA rank shape vLLM's LLM"),
    TRLHook(f"{_TRAINER}.__init__", "args", HookKind.PARAMETER, "checked; sleep mode set"),
    TRLHook(f"{_TRAINER}.__init__", "peft_config", HookKind.PARAMETER, "its LoRA rank sizes vLLM's LoRA"),
    TRLHook(f"{_TRAINER}.__init__", "vllm_generation", HookKind.USED_BY, "the generation object wrapped"),
    TRLHook(f"{_TRAINER}.__init__", "ref_model", HookKind.USED_BY, "made a co-resident model"),
    TRLHook(f"{_TRAINER}.__init__", "_metrics", HookKind.USED_BY, "gets the hybridmem/ metrics"),
    TRLHook(_TRAINER, "create_optimizer", HookKind.ATTRIBUTE, "overridden: builds the manager"),
    TRLHook(f"{_TRAINER}._get_per_token_logps_and_entropies", "model", HookKind.PARAMETER,
            "overridden: onloads the reference model while it scores"),
    TRLHook(f"{_TRAINER}._generate_single_turn", "vllm_generation", HookKind.USED_BY,
            "generations go through it"),
    TRLHook(f"{_TRAINER}._generate_single_turn", "generate", HookKind.USED_BY, "wrapped in the switches"),
    TRLHook("trl.trainer.grpo_config.GRPOConfig", "use_vllm", HookKind.ATTRIBUTE, "must be True"),
    TRLHook("trl.trainer.grpo_config.GRPOConfig", "vllm_mode", HookKind.ATTRIBUTE, "must be 'colocate'"),
    TRLHook("trl.trainer.grpo_config.GRPOConfig", "vllm_enable_sleep_mode", HookKind.ATTRIBUTE,
            "set where vLLM has a sleep mode"),
    TRLHook(_GENERATION, "sync_weights", HookKind.ATTRIBUTE, "replaced: the switch syncs the weights"),
    TRLHook(_GENERATION, "generate", HookKind.ATTRIBUTE, "wrapped in the switches"),
    TRLHook(f"{_GENERATION}._init_vllm", "LLM", HookKind.USED_BY, "replaced while TRL builds its LLM"),
    TRLHook(f"{_GENERATION}._init_vllm", "llm", HookKind.USED_BY, "wrapped as a VLLMEngine"),
    TRLHook(f"{_GENERATION}.generate", "enable_sleep_mode", HookKind.USED_BY,
            "switched off: TRL must not sleep or wake vLLM"),
    TRLHook(f"{_GENERATION}.generate", "_llm_weights_sleeping", HookKind.USED_BY,
            "cleared: TRL must not resync the weights"),
    TRLHook("trl.import_utils", "is_vllm_available", HookKind.ATTRIBUTE, "its vLLM warning printed once"),
)
"""Every TRL internal :mod:`hybridmem.integrations.trl` relies on (read from :data:`TRL_HOOKS_READ_FROM`)."""


def vllm_range_warning_once(import_utils: types.ModuleType) -> None:
    """Print TRL's warning about a vLLM outside its declared range at most once in this process.

    TRL's own check (``import_utils.is_vllm_available``) runs once here, unless TRL's modules that warn are
    imported already; then a filter ignores that message. The filter is appended: the user's own filters
    (``-W``, ``-W error``) come first, and every other warning keeps its behaviour. Call before importing
    ``trl.generation``.
    """
    if "trl.generation" not in sys.modules:
        import_utils.is_vllm_available()
    warnings.filterwarnings("ignore", message=VLLM_RANGE_WARNING, category=UserWarning, append=True)


def import_trl() -> dict[str, types.ModuleType]:
    """The modules of :data:`TRL_MODULES`, once :func:`check_trl` accepted the installed TRL.

    Raises:
        ImportError: TRL is not installed.
        UnsupportedLibraryError: See :func:`check_trl`.
    """
    try:
        trl = importlib.import_module("trl")
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"hybridmem.integrations.trl needs Hugging Face TRL ({exc}); install it with "
                          f"`{_INSTALL_HINT}`") from exc
    version = str(getattr(trl, "__version__", "unknown"))
    check_trl(version, {})  # out of range: refused before importing modules that may have moved
    import_utils = importlib.import_module("trl.import_utils")
    check_trl(version, {"trl.import_utils": import_utils})
    vllm_range_warning_once(import_utils)
    modules = {name: importlib.import_module(name) for name in TRL_MODULES}
    check_trl(version, modules)
    return modules


def check_trl(version: str, modules: Mapping[str, Any], *, hooks: tuple[TRLHook, ...] = TRL_HOOKS,
              tested: str = TESTED_TRL) -> None:
    """Refuse a TRL outside ``tested`` or one missing a hook (see [Note: TRL hooks]).

    Args:
        version: TRL's version (``trl.__version__``).
        modules: TRL's modules by dotted name; a hook in a module not given is not checked.
        hooks: The hooks to check.
        tested: The accepted versions, a PEP 440 specifier.

    Raises:
        UnsupportedLibraryError: ``version`` outside ``tested``, or hooks missing; names them all.
    """
    in_range = _in_range(version, tested)
    missing = tuple(h.describe() for h in hooks if _module_of(h.where, modules) and not _present(h, modules))
    if not in_range or missing:
        raise UnsupportedLibraryError("trl", version, tested, read_from=TRL_HOOKS_READ_FROM,
                                      in_range=in_range, missing=missing)


def _in_range(version: str, tested: str) -> bool:
    from packaging.specifiers import SpecifierSet  # noqa: PLC0415 - TRL depends on packaging
    from packaging.version import InvalidVersion, Version  # noqa: PLC0415

    try:
        release = Version(version).base_version
    except InvalidVersion:
        return False
    return SpecifierSet(tested).contains(release)


def _module_of(where: str, modules: Mapping[str, Any]) -> str | None:
    """The longest name in ``modules`` that ``where`` starts with."""
    names = [m for m in modules if where == m or where.startswith(m + ".")]
    return max(names, key=len, default=None)


def _resolve(where: str, modules: Mapping[str, Any]) -> Any:
    module = _module_of(where, modules)
    obj = modules[module]
    for part in where[len(module):].split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _present(hook: TRLHook, modules: Mapping[str, Any]) -> bool:
    obj = _resolve(hook.where, modules)
    if obj is None:
        return False
    if hook.kind is HookKind.ATTRIBUTE:
        return hasattr(obj, hook.name)
    if hook.kind is HookKind.PARAMETER:
        try:
            return hook.name in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return False
    code = getattr(inspect.unwrap(obj), "__code__", None)
    return code is not None and hook.name in set(_names(code))


def _names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` uses, nested functions and comprehensions included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)
