"""What hybridmem checks about a model it is given before vLLM starts (``VLLMEngine.create``, and for an
engine in its own process ``VLLMServerEngine.launch``, ``launch_server`` and ``start_async``).

[Note: vllm model source]
vLLM takes any string as a model: a directory, or else a Hugging Face hub id. A mistyped directory
(``"my-polciy"``) therefore goes to the hub, which offline means about a minute of retries and a long
``OSError`` about huggingface.co, and a checkpoint directory without tokenizer files fails deep inside
vLLM's tokenizer (or, for some families, gets an empty one). ``create`` (``launch``, ``start_async``) checks
first, in this process, without touching the network:

- an existing directory is the model; unless ``skip_tokenizer_init=True`` it (or the ``tokenizer=``
  directory) must hold tokenizer files (:data:`TOKENIZER_FILES`);
- an existing file is left to vLLM (a GGUF checkpoint);
- a name that is not on disk goes to the hub only when it is shaped like a hub id, ``owner/name``, and
  either ``HF_HUB_OFFLINE`` is not set or the hub cache already holds it; anything else (a single
  name, a path) is refused as a missing directory, naming the nearest directory beside it, and, when
  ``HF_HUB_OFFLINE`` is set, that the hub is ruled out. With ``VLLM_USE_MODELSCOPE`` set names go to
  ModelScope unchecked.

``launch`` checks no tokenizer (it passes ``--skip-tokenizer-init`` to a directory without one, see [Note:
vllm server process] in :mod:`hybridmem.adapters.vllm.server.process`). ``hybridmem plan`` names the
nearest file or directory too (:func:`hybridmem.errors.did_you_mean_path`, the one place that finds it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hybridmem.errors import did_you_mean_path

__all__ = ["TOKENIZER_FILES", "check_model_source", "hub_offline", "is_hub_id", "tokenizer_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json", "vocab.json",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
"""Files any of which makes a directory hold a tokenizer (transformers' fast, SentencePiece, BPE and
WordPiece files, Mistral's ``tekken.json``); ``tokenizer.model.*`` and ``*.tiktoken`` count too."""

_TOKENIZER_GLOBS = ("tokenizer.model.*", "*.tiktoken")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` keeps huggingface_hub (and so vLLM and transformers) off the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def is_hub_id(model: str) -> bool:
    """Whether ``model`` is shaped like a Hugging Face hub id, ``owner/name``."""
    return _HUB_ID.fullmatch(model) is not None and "--" not in model and ".." not in model


def tokenizer_files(directory: Path) -> list[str]:
    """The tokenizer files in ``directory`` (see :data:`TOKENIZER_FILES`)."""
    found = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    return found + sorted(p.name for pattern in _TOKENIZER_GLOBS for p in directory.glob(pattern))


def _in_hub_cache(repo_id: str, llm_kwargs: dict[str, Any]) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - a dependency of vLLM
    except ImportError:
        return False
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=llm_kwargs.get("download_dir"),
                                   revision=llm_kwargs.get("revision"))
    return isinstance(found, str)


def _check_tokenizer(directory: Path, shown: str) -> None:
    if not tokenizer_files(directory):
        raise ValueError(
            f"no tokenizer files in {shown!r} (none of {', '.join(TOKENIZER_FILES)}): pass "
            f"skip_tokenizer_init=True (VLLMEngine.generate takes token-id prompts) or save a tokenizer "
            f"there (tokenizer.save_pretrained({shown!r}))"
        )


def check_model_source(model: str, llm_kwargs: dict[str, Any]) -> None:
    """Refuse, before vLLM starts, a model vLLM would spend minutes failing to find or whose tokenizer it
    cannot build (see [Note: vllm model source]).

    Args:
        model: The model as given to ``create`` (a directory, a file, or a hub id).
        llm_kwargs: The ``vllm.LLM`` arguments (``skip_tokenizer_init``, ``tokenizer``, ``revision``,
            ``download_dir``).

    Raises:
        ValueError: A name that is no directory and will not be found on the hub, or a directory without
            tokenizer files; one line naming the value and the fix.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if llm_kwargs.get("skip_tokenizer_init"):
            return
        tokenizer = llm_kwargs.get("tokenizer")
        if tokenizer is None:
            _check_tokenizer(path, model)
        elif Path(str(tokenizer)).expanduser().is_dir():
            _check_tokenizer(Path(str(tokenizer)).expanduser(), str(tokenizer))
        return
    if path.exists() or os.environ.get("VLLM_USE_MODELSCOPE", "").strip().upper() in _TRUE:
        return
    hub_shaped = is_hub_id(model)
    offline = hub_offline()
    if hub_shaped and (not offline or _in_hub_cache(model, llm_kwargs)):
        return
    if "/" not in model and _HUB_ID.fullmatch(f"x/{model}") and _in_hub_cache(model, llm_kwargs):
        return  # a hub model without an owner (e.g. "gpt2") already downloaded
    notes = [str(path.absolute())] if str(path.absolute()) != model else []
    notes += [n for n in (did_you_mean_path(path, directories=True),) if n]
    where = f"{model!r}" + (f" ({'; '.join(notes)})" if notes else "")
    if offline:
        raise ValueError(
            f"no such directory {where}, and HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']} rules out the "
            f"Hugging Face hub" + (" (it is not in the hub cache)" if hub_shaped else "")
            + ": pass the directory the model was saved to, or unset HF_HUB_OFFLINE to download a hub model "
            "'owner/name'"
        )
    raise ValueError(
        f"no such directory {where}: pass the directory the model was saved to (save_pretrained), or a "
        f"Hugging Face hub model as 'owner/name'"
    )
