"""`--model org/name`: a Hugging Face model id found through huggingface_hub's own cache
(HF_HOME / HF_HUB_CACHE), at `--revision` (a branch, tag or commit), honouring HF_HUB_OFFLINE.

The cache is asked first, without any connection: a cached revision is used as it is (run
`huggingface-cli download` to refresh a branch). Only a model missing from the cache, with the hub
not switched off, is downloaded; a hub that cannot be reached gives up after a short timeout."""
from __future__ import annotations

import logging
from pathlib import Path

from heterollm.config import ConfigError

logger = logging.getLogger("heterollm.hub")

WEIGHT_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What a download fetches: config, safetensors weights, tokenizer and chat template files."""
CONNECT_TIMEOUT_S = 10.0


def is_repo_id(model: str) -> bool:
    """`org/name` (or `name`) as the hub spells ids, not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def locate(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (None: the default branch), from the cache or,
    when it is missing there and the hub is not switched off, downloaded into it. A ConfigError in
    one line says where heterollm looked and how to fill the cache."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    at = f" at revision {revision!r}" if revision else ""
    fill = f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    if constants.is_offline_mode():
        raise ConfigError(f"--model: {repo_id!r} is not a local path, and as a Hugging Face id{at} it is not in "
                          f"{where} (HF_HUB_OFFLINE is set); fill the cache with `{fill}` or give a local folder")
    logger.info("downloading %s%s into %s", repo_id, at, constants.HF_HUB_CACHE)
    try:
        # huggingface_hub's client has no timeout of its own: one call with a timeout first keeps an
        # unreachable hub from hanging the launch (the download then talks to a hub that answers; it
        # is given the revision by name so that the cache records the branch or tag)
        HfApi().repo_info(repo_id, revision=revision, timeout=CONNECT_TIMEOUT_S)
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=WEIGHT_FILES,
                                      etag_timeout=CONNECT_TIMEOUT_S))
    except Exception as exc:  # offline, unreachable, unknown repo or revision, gated: all one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"--model: {repo_id!r} is not a local path, and as a Hugging Face id{at} it is not in "
                          f"{where} and could not be downloaded ({type(exc).__name__}: {reason}); fill the cache "
                          f"with `{fill}` or give a local folder") from None
