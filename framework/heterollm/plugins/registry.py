"""Entry-point discovery: backends (group `heterollm.backends`, one `Backend` descriptor per
distribution) and general pluggy plugins (group `heterollm.plugins`), through stevedore.

A backend's descriptor is loaded first (its package's `__init__`, import-light); its contract range
is checked against API_VERSION before any class it names is imported, so a backend built for another
contract is one clear line, not a crash deep inside a step. Then its platform, components and
models are expanded into per-group entries, each recorded with its origin (distribution and
version). An entry that fails to import or does not implement its group's contract is kept with its
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

from heterollm.interfaces import (API_VERSION, AttentionBackend, Backend, Communicator, Executor, GraphRunner,
                                  KVConnector, Platform)
from heterollm.interfaces.backend import platform_class_check

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
    "kv_connectors": KVConnector,  # by connector name and family, as models are
    "plugins": None,  # a pluggy plugin: any object with hookimpls
}
GROUPS = tuple(GROUP_CONTRACTS)
FAMILY_KEYED = ("models", "kv_connectors")
"""Groups whose entries are keyed by (name, family): several families implement the same name."""
DEFAULT_MODEL_FAMILY = "core"
"""The family the core's own model implementations are registered under."""


@dataclass
class Entry:
    """One registered (group, name) from one distribution. For models, `name` is the architecture
    and `family` the implementation family; for every other group `family == name`."""

    group: str
    name: str
    target: str
    """`module:attr` of the registered object."""
    dist: str
    version: str
    obj: Any = None
    error: str | None = None
    family: str = ""
    runs_on: tuple[str, ...] = ()
    """Platforms a component or model serves (its backend's `runs_on`)."""
    backend: str = ""
    """The descriptor (Backend.name) it came from; "" for pluggy plugins."""

    def __post_init__(self) -> None:
        self.family = self.family or self.name

    @property
    def origin(self) -> str:
        return f"{self.dist} {self.version}"

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class BackendEntry:
    """One `heterollm.backends` entry point: its descriptor, or why it could not be used."""

    name: str
    target: str
    dist: str
    version: str
    backend: Backend | None = None
    error: str | None = None
    flag_groups: dict[str, Any] = field(default_factory=dict)
    """Its flag groups, loaded: config attribute -> FlagGroup class."""

    @property
    def origin(self) -> str:
        return f"{self.dist} {self.version}"


class _Manager(ExtensionManager):
    """stevedore's manager with one change: entry points keep their distribution (stevedore's
    on-disk cache drops it, and origins are how users tell two wheels apart)."""

    def __init__(self, group: str, failures: list[tuple[Any, str]], check_package: bool = False) -> None:
        self._failures = failures
        self._check_package = check_package
        super().__init__(f"{NAMESPACE}.{group}", on_load_failure_callback=self._failed)

    def list_entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return list(importlib.metadata.entry_points(group=self.namespace))

    def _load_one_plugin(self, ep, invoke_on_load, invoke_args, invoke_kwds) -> Extension | None:
        if self._check_package:
            check_package_api(ep.value)
        return super()._load_one_plugin(ep, invoke_on_load, invoke_args, invoke_kwds)

    def _failed(self, _manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        self._failures.append((ep, _describe_error(err)))


class APIVersionError(Exception):
    pass


def check_api_range(declared: Any, who: str) -> None:
    """Raise APIVersionError unless `declared` (a PEP 440 specifier) admits the core's API_VERSION."""
    if not declared:
        raise APIVersionError(f"{who} declares no contract range (the core implements contract {API_VERSION})")
    try:
        spec = SpecifierSet(str(declared))
    except InvalidSpecifier:
        raise APIVersionError(f"{who} declares an invalid contract range {declared!r}") from None
    if API_VERSION not in spec:
        raise APIVersionError(f"{who} implements contract {declared}, but this heterollm core implements "
                              f"{API_VERSION}")


def check_package_api(target: str) -> None:
    """A pluggy plugin's package declares `__heterollm_api__`; checked before its module imports."""
    package = target.split(":", 1)[0].split(".", 1)[0]
    check_api_range(getattr(importlib.import_module(package), "__heterollm_api__", None),
                    f"package {package!r} (__heterollm_api__)")


def _describe_error(err: BaseException) -> str:
    if isinstance(err, APIVersionError):
        return f"contract version mismatch: {err}"
    return f"failed to import: {type(err).__name__}: {err}"


def load_target(target: Any) -> Any:
    """A class given directly, or imported from its `"module:attr"` path."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _target_name(target: Any) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


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


def _expand(info: BackendEntry) -> list[Entry]:
    """The per-group entries of one healthy descriptor, each imported and contract-checked."""
    backend = info.backend
    wanted: list[tuple[str, str, str, Any]] = []  # (group, name, family, target)
    if backend.platform is not None:
        wanted.append(("platforms", backend.name, backend.name, backend.platform))
    for group, target in backend.components.items():
        wanted.append((group, backend.name, backend.name, target))
    for arch, target in backend.models.items():
        wanted.append(("models", arch, backend.name, target))
    for name, target in backend.kv_connectors.items():
        wanted.append(("kv_connectors", name, backend.name, target))
    out = []
    for group, name, family, target in wanted:
        entry = Entry(group, name, _target_name(target), info.dist, info.version, family=family,
                      runs_on=backend.runs_on, backend=backend.name)
        if group not in GROUP_CONTRACTS or group == "plugins":
            entry.error = f"names an unknown component group {group!r} (groups: {', '.join(COMPONENT_GROUPS)})"
        else:
            try:
                entry.obj = load_target(target)
            except Exception as exc:  # a vendor SDK missing: report, keep the others
                entry.error = _describe_error(exc)
            else:
                entry.error = _contract_error(group, entry.obj)
                if entry.error is None and group == "platforms":
                    entry.error = platform_class_check(backend, entry.obj)
        out.append(entry)
    return out


def _load_flag_groups(info: BackendEntry) -> None:
    from heterollm.config.base import FlagGroup

    for attr, target in info.backend.flags.items():
        try:
            cls = load_target(target)
        except Exception as exc:
            info.error = f"flag group {attr!r}: {_describe_error(exc)}"
            return
        if not (inspect.isclass(cls) and issubclass(cls, FlagGroup)):
            info.error = f"flag group {attr!r} is {cls!r}, not a heterollm.config.base.FlagGroup"
            return
        info.flag_groups[attr] = cls


def _discover_backends(failures: list[tuple[Any, str]]) -> list[BackendEntry]:
    found = []
    for ext in _Manager("backends", failures).extensions:
        dist, version = _origin(ext.entry_point)
        info = BackendEntry(ext.name, ext.entry_point.value, dist, version)
        obj = ext.plugin
        if not isinstance(obj, Backend):
            info.error = f"registers {obj!r}, which is not a heterollm.interfaces.Backend descriptor"
        else:
            try:
                check_api_range(obj.api_version, f"backend {obj.name!r}")
            except APIVersionError as exc:
                info.error = _describe_error(exc)
            else:
                info.backend = obj
                info.name = obj.name
                _load_flag_groups(info)
        found.append(info)
    for ep, reason in failures:
        dist, version = _origin(ep)
        found.append(BackendEntry(ep.name, ep.value, dist, version, error=reason))
    failures.clear()
    return found


@dataclass
class Registry:
    """Every discovered backend, and every entry by group and name; duplicates and failures kept
    for reporting."""

    entries: dict[str, dict[str, list[Entry]]] = field(default_factory=dict)
    backends: list[BackendEntry] = field(default_factory=list)

    @classmethod
    def discover(cls) -> Registry:
        registry = cls({g: {} for g in GROUPS})
        failures: list[tuple[Any, str]] = []
        registry.backends = _discover_backends(failures)
        found: list[Entry] = []
        for info in registry.backends:
            if info.error:
                logger.warning("skipping backend %r from %s: %s", info.name, info.origin, info.error)
            else:
                found += _expand(info)
        for ext in _Manager("plugins", failures, check_package=True).extensions:
            dist, version = _origin(ext.entry_point)
            found.append(Entry("plugins", ext.name, ext.entry_point.value, dist, version, obj=ext.plugin))
        for ep, reason in failures:
            dist, version = _origin(ep)
            found.append(Entry("plugins", ep.name, ep.value, dist, version, error=reason))
        for entry in found:
            registry.add(entry)
        for message in registry.duplicates():
            logger.warning("%s", message)
        return registry

    def add(self, entry: Entry) -> None:
        key = entry.name if entry.group not in FAMILY_KEYED else f"{entry.name}@{entry.family}"
        self.entries.setdefault(entry.group, {}).setdefault(key, []).append(entry)
        if entry.error:
            logger.warning("skipping %s entry %r from %s: %s", entry.group, entry.name, entry.origin, entry.error)

    def all(self, group: str) -> Iterator[Entry]:
        for candidates in self.entries.get(group, {}).values():
            yield from candidates

    def names(self, group: str) -> list[str]:
        return sorted({e.name for e in self.all(group)})

    def candidates(self, group: str, name: str, family: str | None = None) -> list[Entry]:
        key = name if group not in FAMILY_KEYED else f"{name}@{family}"
        return self.entries.get(group, {}).get(key, [])

    def families(self) -> list[str]:
        """Names registered in any component group, or as the family of a model or a KV connector."""
        names = {e.name for group in COMPONENT_GROUPS for e in self.all(group)}
        return sorted(names | {e.family for g in FAMILY_KEYED for e in self.all(g)})

    def backend(self, name: str) -> BackendEntry | None:
        """The healthy descriptor named `name` (the first, when duplicated: duplicates are refused
        at selection through the entries)."""
        return next((b for b in self.backends if b.backend is not None and b.name == name), None)

    def duplicates(self) -> list[str]:
        out = []
        for group, by_name in self.entries.items():
            for candidates in by_name.values():
                if len(candidates) > 1:
                    origins = " and ".join(f"{c.target} from {c.origin}" for c in candidates)
                    what = (f"{candidates[0].name!r} of family {candidates[0].family!r}" if group in FAMILY_KEYED
                            else repr(candidates[0].name))
                    out.append(f"duplicate {group} entry {what}: registered by {origins}")
        return out

    def failures(self) -> list[Entry]:
        return [e for group in GROUPS for e in self.all(group) if e.error]

    def get(self, group: str, name: str, family: str | None = None) -> Entry | None:
        """The single healthy entry for (group, name[, family]); None when not registered.

        Raises LookupError when it is registered but cannot be used (broken, or registered by two
        distributions), since a selected entry must never fall back silently."""
        candidates = self.candidates(group, name, family)
        if not candidates:
            return None
        what = f"{group} entry {name!r}" + (f" of family {family!r}" if group in FAMILY_KEYED else "")
        if len(candidates) > 1:
            origins = " and ".join(c.origin for c in candidates)
            raise LookupError(f"{what} is registered by both {origins}; uninstall one")
        entry = candidates[0]
        if entry.error:
            raise LookupError(f"{what} from {entry.origin} {entry.error}")
        return entry


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry (discovered once; `refresh` re-reads installed distributions)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry.discover()
    return _REGISTRY
