"""Every environment variable heterollm reads, in one place."""
from __future__ import annotations

import os
from pathlib import Path


def api_key() -> str | None:
    """HETEROLLM_API_KEY: the server's API key when --api_key is not given."""
    return os.environ.get("HETEROLLM_API_KEY") or None


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS, when the user fixed torch's intra-op thread count."""
    return os.environ.get("OMP_NUM_THREADS") or None


def cache_dir() -> Path:
    """HETEROLLM_CACHE_DIR (default $XDG_CACHE_HOME/heterollm, else ~/.cache/heterollm): where
    converted model metadata is kept between starts."""
    explicit = os.environ.get("HETEROLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "heterollm"


def local_rank() -> int | None:
    """LOCAL_RANK, set by launchers such as torchrun: this process's index among its node's ranks."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value else None


def api_server_nice() -> int:
    """HETEROLLM_API_SERVER_NICE (default 10; 0 turns it off): how far `heterollm serve`'s API server
    process lowers its own CPU priority (os.nice) once its engine cores are running."""
    value = os.environ.get("HETEROLLM_API_SERVER_NICE", "").strip()
    if not value:
        return 10
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"HETEROLLM_API_SERVER_NICE={value!r}: expected a whole number (0 turns it off)") from None
