"""Models named by Hugging Face id (``--model ORG/NAME``), through ``huggingface_hub``.

A model already in the Hugging Face cache is used as it is, without asking the Hub; one that
is not is downloaded into the cache (the weights as safetensors, the config and the tokenizer
files only). ``huggingface_hub`` reads its own environment: ``HF_HUB_CACHE`` or ``HF_HOME``
(where the cache is), ``HF_HUB_OFFLINE=1`` (never ask the Hub: a model not in the cache is an
error) and ``HF_TOKEN`` (gated or private models).
"""

from __future__ import annotations

import logging
import os
import pathlib
import re

log = logging.getLogger("pagewire.worker")

# ORG/NAME as the Hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what the worker loads: config, safetensors weights, tokenizer and chat template
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]


def is_hub_id(model: str | os.PathLike | None) -> bool:
    """Whether ``model`` names a Hub repository: ORG/NAME, and no such path exists here."""
    if model is None or not _REPO_ID.match(str(model)) or str(model).endswith(".gguf"):
        return False
    return not pathlib.Path(model).expanduser().exists()


def snapshot_dir(repo_id: str) -> pathlib.Path:
    """The cached snapshot of ``repo_id``'s main revision, downloaded first if it is not cached
    (``FileNotFoundError`` saying why when it cannot be had)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
            f"download it first (hf download {repo_id}), point HF_HUB_CACHE at a cache that has it, or give a local "
            f"directory")
    log.info("downloading %s from the Hugging Face Hub into %s", repo_id, constants.HF_HUB_CACHE)
    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=MODEL_FILE_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError):
        raise FileNotFoundError(
            f"model {repo_id!r}: no such repository on the Hugging Face Hub, or it is gated or private "
            f"(set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be "
            f"reached") from None
