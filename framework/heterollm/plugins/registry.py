"""Entry-point discovery for every heterollm group, through stevedore.

Each entry is recorded with its origin (distribution and version). Before an entry point's own
module imports, the registry imports only the top-level package of the backend and checks its
declared contract range (`__heterollm_api__`) against the core's API_VERSION, so a backend built
for another contract is one clear line, not a crash deep inside a step. An entry that fails to
import, declares the wrong range, or does not implement its group's contract is kept with its
error: it is reported (and skipped unless selected), never fatal for the others.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from stevedore import ExtensionManager
from stevedore.extension import Extension

from heterollm.interfaces import (API_VERSION, AttentionBackend, Communicator, Executor, GraphRunner,
                                  Platform)

logger = logging.getLogger("heterollm.plugins")

NAMESPACE = "heterollm"
COMPONENT_GROUPS: dict[str, type] = {
    "attention": AttentionBackend,
    "graph_runners": GraphRunner,
    "communicators": Communicator,
    "executors": Executor,
}
GROUP_CONTRACTS: dict[str, type | None] = {
    "platforms": Platform,
    **COMPONENT_GROUPS,
    "models": None,  # a model class (nn.Module subclass) or a factory
    "plugins": None,  # a pluggy plugin: any object with hookimpls
}
GROUPS = tuple(GROUP_CONTRACTS)
_CORE_PACKAGE = "heterollm"


@dataclass
class Entry:
    """One registered (group, name) from one distribution."""

    group: str
    name: str
    target: str
    """The entry point's value, `module:attr`."""
    dist: str
    version: str
    obj: Any = None
    error: str | None = None

    @property
    def origin(self) -> str:
        return f"{self.dist} {self.version}"

    @property
    def ok(self) -> bool:
        return self.error is None


class _Manager(ExtensionManager):
    """stevedore's manager with two changes: entry points keep their distribution (stevedore's
    on-disk cache drops it, and origins are how users tell two wheels apart), and the contract
    range is checked before `ep.load()` imports the entry's module."""

    def __init__(self, group: str, failures: list[tuple[Any, str]]) -> None:
        self._failures = failures
        super().__init__(f"{NAMESPACE}.{group}", on_load_failure_callback=self._failed)

    def list_entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return list(importlib.metadata.entry_points(group=self.namespace))

    def _load_one_plugin(self, ep, invoke_on_load, invoke_args, invoke_kwds) -> Extension | None:
        check_api_version(ep.value)
        return super()._load_one_plugin(ep, invoke_on_load, invoke_args, invoke_kwds)

    def _failed(self, _manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        self._failures.append((ep, _describe_error(err)))


class APIVersionError(Exception):
    pass


def check_api_version(target: str) -> None:
    """Import the top-level package of `module:attr` and check its `__heterollm_api__` range."""
    package = target.split(":", 1)[0].split(".", 1)[0]
    if package == _CORE_PACKAGE:
        return
    top = importlib.import_module(package)
    declared = getattr(top, "__heterollm_api__", None)
    if declared is None:
        raise APIVersionError(f"package {package!r} does not declare __heterollm_api__ "
                              f"(the core implements contract {API_VERSION})")
    try:
        spec = SpecifierSet(str(declared))
    except InvalidSpecifier:
        raise APIVersionError(f"package {package!r} declares an invalid __heterollm_api__ {declared!r}") from None
    if API_VERSION not in spec:
        raise APIVersionError(f"package {package!r} implements contract {declared}, "
                              f"but this heterollm core implements {API_VERSION}")


def _describe_error(err: BaseException) -> str:
    if isinstance(err, APIVersionError):
        return f"contract version mismatch: {err}"
    return f"failed to import: {type(err).__name__}: {err}"


def _contract_error(group: str, obj: Any) -> str | None:
    contract = GROUP_CONTRACTS[group]
    if contract is None:
        if group == "models" and not callable(obj):
            return f"registers {obj!r}, which is not a model class or factory"
        return None
    if not (inspect.isclass(obj) and issubclass(obj, contract)):
        return f"registers {obj!r}, which does not subclass heterollm.interfaces.{contract.__name__}"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        return f"registers {obj.__qualname__}, which leaves {contract.__name__} methods unimplemented: {missing}"
    return None


def _origin(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"] or dist.name, dist.version


@dataclass
class Registry:
    """Every discovered entry, by group and name; duplicates and failures kept for reporting."""

    entries: dict[str, dict[str, list[Entry]]] = field(default_factory=dict)

    @classmethod
    def discover(cls) -> Registry:
        registry = cls({g: {} for g in GROUPS})
        for group in GROUPS:
            failures: list[tuple[Any, str]] = []
            manager = _Manager(group, failures)
            found: list[Entry] = []
            for ext in manager.extensions:
                dist, version = _origin(ext.entry_point)
                entry = Entry(group, ext.name, ext.entry_point.value, dist, version, obj=ext.plugin)
                entry.error = _contract_error(group, ext.plugin)
                found.append(entry)
            for ep, reason in failures:
                dist, version = _origin(ep)
                found.append(Entry(group, ep.name, ep.value, dist, version, error=reason))
            for entry in found:
                registry.entries[group].setdefault(entry.name, []).append(entry)
                if entry.error:
                    logger.warning("skipping %s entry %r from %s: %s", group, entry.name, entry.origin, entry.error)
        for message in registry.duplicates():
            logger.warning("%s", message)
        return registry

    def all(self, group: str) -> Iterator[Entry]:
        for candidates in self.entries.get(group, {}).values():
            yield from candidates

    def names(self, group: str) -> list[str]:
        return sorted(self.entries.get(group, {}))

    def candidates(self, group: str, name: str) -> list[Entry]:
        return self.entries.get(group, {}).get(name, [])

    def families(self) -> list[str]:
        """Names registered in any component group."""
        return sorted({name for group in COMPONENT_GROUPS for name in self.entries.get(group, {})})

    def duplicates(self) -> list[str]:
        out = []
        for group, by_name in self.entries.items():
            for name, candidates in by_name.items():
                if len(candidates) > 1:
                    origins = " and ".join(f"{c.target} from {c.origin}" for c in candidates)
                    out.append(f"duplicate {group} entry {name!r}: registered by {origins}")
        return out

    def failures(self) -> list[Entry]:
        return [e for group in GROUPS for e in self.all(group) if e.error]

    def get(self, group: str, name: str) -> Entry | None:
        """The single healthy entry for (group, name); None when not registered.

        Raises LookupError when the name is registered but cannot be used (broken, or registered
        by two distributions), since a selected entry must never fall back silently."""
        candidates = self.candidates(group, name)
        if not candidates:
            return None
        if len(candidates) > 1:
            origins = " and ".join(c.origin for c in candidates)
            raise LookupError(f"{group} entry {name!r} is registered by both {origins}; uninstall one")
        entry = candidates[0]
        if entry.error:
            raise LookupError(f"{group} entry {name!r} from {entry.origin} {entry.error}")
        return entry


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry (discovered once; `refresh` re-reads installed distributions)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry.discover()
    return _REGISTRY
