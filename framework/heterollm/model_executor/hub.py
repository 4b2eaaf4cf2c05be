"""`--model org/name`: a Hugging Face model id found in huggingface_hub's own cache (HF_HOME /
HF_HUB_CACHE), at `--revision` (a branch, tag or commit).

heterollm never downloads at run time (ARCHITECTURE.md, "Models and weights"): the cache is read
without any connection, whether HF_HUB_OFFLINE is set or not, and a model missing from it fails in
one line that says where heterollm looked and the `huggingface-cli download` command that fills it.
A cached branch is used as it is (download again to refresh it)."""
from __future__ import annotations

import logging
from pathlib import Path

from heterollm.config import ConfigError

logger = logging.getLogger("heterollm.hub")



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
    """The snapshot folder of `repo_id` at `revision` (None: the default branch) in the cache; else a
    ConfigError in one line saying where heterollm looked and how to fill the cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    at = f" at revision {revision!r}" if revision else ""
    fill = f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")
    offline = " (HF_HUB_OFFLINE is set)" if constants.is_offline_mode() else ""
    raise ConfigError(f"--model: {repo_id!r} is not a local path, and as a Hugging Face id{at} it is not in the "
                      f"Hugging Face cache {constants.HF_HUB_CACHE}{offline}; heterollm does not download at run "
                      f"time: fill the cache with `{fill}` or give a local folder")
