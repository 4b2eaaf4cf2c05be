"""The host's registry of heterollm memory reservations: what every engine process on this host
holds per memory (weights, activation peaks and KV cache), so that an instance starting next to
others sizes itself from what is left of the host budget (engine/memory_budget.py).

One JSON file per host under the cache dir (`$HETEROLLM_CACHE_DIR/kv_reservations/<host>.json`),
an object keyed by process id:

    {"4242": {"started": "123456", "memories": {"node1/cpu": 734003200}}}

A process's entry is the sum over the engines it runs (its --dp_size replicas); each engine
adds its part when it starts and takes it back at shutdown, and the entry goes when the process
exits. An entry whose process is gone (or whose pid now names another process: the start time
differs) is ignored and dropped at the next write, so a killed server leaves nothing behind that
counts. Reads and writes happen under an exclusive lock (fcntl), so two instances starting at
once see each other. Where the file cannot be written the registry is skipped with one warning.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from heterollm import envs

try:
    import fcntl
except ImportError:  # no advisory locks on this OS: the registry is best effort
    fcntl = None

logger = logging.getLogger("heterollm.engine")

_held: dict[Path, dict[str, dict[str, int]]] = {}
"""This process's reservations per registry file: engine key -> memory -> bytes."""
_lock = threading.Lock()
_warned: set[Path] = set()


def registry_path() -> Path:
    return envs.cache_dir() / "kv_reservations" / f"{socket.gethostname()}.json"


def process_started(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat), which tells a reused pid apart; None
    where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def alive(pid: int, started: str | None) -> bool:
    """Whether the process that wrote an entry still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    now = process_started(pid)
    return started is None or now is None or now == started


def _read(path: Path) -> dict[int, dict[str, int]]:
    """The live entries of the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for pid, entry in (data.items() if isinstance(data, dict) else ()):
        try:
            pid_n, memories = int(pid), {str(k): int(v) for k, v in entry["memories"].items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if alive(pid_n, entry.get("started")):
            out[pid_n] = memories
    return out


def _sum(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for memories in parts:
        for device, n in memories.items():
            total[device] = total.get(device, 0) + n
    return total


class HostView:
    """The registry while its lock is held (see `host_registry`)."""

    def __init__(self, path: Path, entries: dict[int, dict[str, int]], usable: bool) -> None:
        self.path, self.entries, self.usable = path, entries, usable

    def others(self) -> dict[str, int]:
        """Per memory, what the other live heterollm processes on this host reserved."""
        return _sum(m for pid, m in self.entries.items() if pid != os.getpid())

    def mine(self) -> dict[str, int]:
        """Per memory, what this process's engines reserved."""
        return _sum(_held.get(self.path, {}).values())

    def hold(self, key: str, memories: dict[str, int]) -> None:
        """Record engine `key`'s reservation as part of this process's entry."""
        _held.setdefault(self.path, {})[key] = dict(memories)
        self._write()

    def drop(self, key: str) -> None:
        _held.get(self.path, {}).pop(key, None)
        self._write()

    def _write(self) -> None:
        if not self.usable:
            return
        entries = {str(pid): {"started": process_started(pid), "memories": m}
                   for pid, m in self.entries.items() if pid != os.getpid()}
        if self.mine():
            entries[str(os.getpid())] = {"started": process_started(os.getpid()), "memories": self.mine()}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            _unusable(self.path, exc)


def _unusable(path: Path, exc: OSError) -> None:
    if path not in _warned:
        _warned.add(path)
        logger.warning("host memory registry %s unusable (%s): instances on this host do not see each other's "
                       "reservations", path, exc)


@contextlib.contextmanager
def host_registry(path: Path | None = None) -> Iterator[HostView]:
    """The registry, locked for one read-plan-write (this process's threads and other processes wait).
    Where the file cannot be used (an unwritable cache dir): a view of nothing that records nothing,
    after one warning."""
    path = path or registry_path()
    with _lock, contextlib.ExitStack() as stack:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(path.with_suffix(".lock"), "a"))
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            view = HostView(path, _read(path), usable=True)
        except OSError as exc:
            _unusable(path, exc)
            view = HostView(path, {}, usable=False)
        if path not in _held:
            _held[path] = {}
            atexit.register(release_all, path)
        yield view


def release(key: str, path: Path | None = None) -> None:
    """Take engine `key`'s reservation back (at shutdown; a second call does nothing)."""
    path = path or registry_path()
    if key in _held.get(path, {}):
        with host_registry(path) as view:
            view.drop(key)


def release_all(path: Path) -> None:
    """At exit: this process's entry in `path` goes."""
    if _held.get(path):
        with host_registry(path) as view:
            _held[path].clear()
            view._write()
