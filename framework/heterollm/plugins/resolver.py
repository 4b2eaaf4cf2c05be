"""Pick the platform and one implementation per component group, once, in the launcher.

`--device` names the platform (auto: the first available accelerator, CPU last; platforms whose
tensors live on the host, other than cpu, are used only when named). The family is
`--extension_impl`, or the platform's `default_impl` when that is empty. For each component
group the family's entry is used when it exists and serves the platform; other groups keep the
platform's default family. A model architecture resolves the same way, with the core's own
implementation last. Every reason the selection cannot serve the config is collected into one
LaunchError: the platform's and components' `validate`, the selected backends' `unsupported`
flags, flags owned by backends the selection does not use, and the core's support table.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from heterollm.config.checks import check_flag_combinations
from heterollm.config.schema import current_schema
from heterollm.config.support import check_support, show_value
from heterollm.plugins.registry import COMPONENT_GROUPS, DEFAULT_MODEL_FAMILY, Entry, Registry, get_registry
from heterollm.profiling import check_profile_flags

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.interfaces import Platform

logger = logging.getLogger("heterollm.plugins")


class LaunchError(Exception):
    """The selected platform/components cannot serve the config. `reasons` has one line each."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__(reasons[0] if len(reasons) == 1 else
                         "cannot launch:\n" + "\n".join(f"  - {r}" for r in reasons))


@dataclass(frozen=True)
class Selection:
    """The effective component table: platform plus group -> entry, and the model class when the
    architecture was known at selection. Passed to worker processes as `as_dict()` so they load
    exactly the same plugins."""

    platform: Platform
    platform_entry: Entry
    family: str
    components: dict[str, Entry]
    backends: tuple[str, ...] = ()
    """Names of the backends the selection uses (the platform's, and the family's when it provides
    a component or the model): their flags are live, their `unsupported` rules apply."""
    model: Entry | None = None
    """The model implementation chosen for the checkpoint's architecture."""

    def component(self, group: str) -> Any:
        return self.components[group].obj

    def as_dict(self) -> dict[str, Any]:
        rows = {"platform": _row(self.platform_entry), "family": self.family,
                "components": {g: _row(e) for g, e in self.components.items()}}
        if self.model is not None:
            rows["model"] = {**_row(self.model), "architecture": self.model.name, "family": self.model.family}
        return rows

    def describe(self) -> str:
        rows = [f"platform: {self.platform_entry.name} ({self.platform_entry.target}, {self.platform_entry.origin})"]
        rows += [f"{group}: {e.name} ({e.target}, {e.origin})" for group, e in self.components.items()]
        if self.model is not None:
            rows.append(f"model {self.model.name}: {self.model.family} ({self.model.target}, {self.model.origin})")
        return "; ".join(rows)


def _row(entry: Entry) -> dict[str, str]:
    return {"name": entry.name, "target": entry.target, "origin": entry.origin}


def _installed_platforms(registry: Registry) -> str:
    names = [f"{e.name} ({e.origin})" for e in registry.all("platforms")]
    return ", ".join(names) if names else "none"


def _platform(registry: Registry, device: str) -> tuple[Entry, Platform]:
    if device != "auto":
        try:
            entry = registry.get("platforms", device)
        except LookupError as exc:
            raise LaunchError([f"--device={device}: {exc}"]) from None
        if entry is None:
            raise LaunchError([f"--device={device}: no platform {device!r} is installed "
                               f"(installed: {_installed_platforms(registry)})"])
        platform = entry.obj()
        if not platform.is_available():
            raise LaunchError([f"--device={device}: platform {device} ({entry.origin}) is not usable here: "
                               f"{platform.unavailable_reason()}"])
        return entry, platform
    # accelerators first (by name, for determinism), the CPU reference last; other platforms whose
    # tensors live on the host (a template, an emulator) are only used when named
    healthy = [e for e in registry.all("platforms") if e.ok and (e.name == "cpu" or e.obj.device_type != "cpu")]
    healthy.sort(key=lambda e: (e.name == "cpu", e.name))
    for entry in healthy:
        if len(registry.candidates("platforms", entry.name)) > 1:
            continue
        platform = entry.obj()
        if platform.is_available():
            return entry, platform
        logger.debug("platform %s not usable: %s", entry.name, platform.unavailable_reason())
    raise LaunchError([f"--device=auto: no usable platform (installed: {_installed_platforms(registry)})"])


def _components(registry: Registry, platform: Platform, platform_entry: Entry,
                requested: str) -> tuple[dict[str, Entry], list[str]]:
    reasons: list[str] = []
    components: dict[str, Entry] = {}
    for group in COMPONENT_GROUPS:
        chosen = None
        if requested:
            try:
                entry = registry.get(group, requested)
            except LookupError as exc:
                reasons.append(f"--extension_impl={requested}: {exc}")
                continue
            if entry is not None and platform.name in entry.runs_on:
                chosen = entry
        if chosen is None:
            try:
                chosen = registry.get(group, platform.default_impl)
            except LookupError as exc:
                reasons.append(f"platform {platform.name}: default {exc}")
                continue
            if chosen is None or platform.name not in chosen.runs_on:
                reasons.append(f"platform {platform.name} ({platform_entry.origin}): no {group} implementation "
                               f"in its default family {platform.default_impl!r}")
                continue
        components[group] = chosen
    return components, reasons


def resolve_model(registry: Registry, architectures: Sequence[str], families: Sequence[str],
                  platform: str) -> Entry | None:
    """The implementation of the first supported architecture: for each one, the first of `families`
    (the --extension_impl family, the platform's default family) that implements it for `platform`,
    else the core's. None when no architecture is implemented. Raises LookupError when the chosen
    (architecture, family) is registered twice or broken."""
    for arch in architectures:
        for family in (*families, DEFAULT_MODEL_FAMILY):
            entry = registry.get("models", arch, family)
            if entry is not None and (family == DEFAULT_MODEL_FAMILY or platform in entry.runs_on):
                return entry
    return None


KV_CONNECTOR_FLAGS = {"host": "--host_blocks_factor / --swap_space", "mooncake_store": "--enable_kvcache_store",
                      "mooncake_transfer": "--instance_role PREFILL / DECODE"}
"""Connector name -> the flags that ask for it."""


def kv_connectors_needed(config: HeterollmConfig) -> list[str]:
    """The KV connectors a launch uses: "host" for the host tier, "mooncake_store" for the KV store,
    "mooncake_transfer" for a PREFILL or DECODE instance."""
    out = []
    if config.kv_cache_store.host_blocks_factor > 0 or config.fastdeploy.swap_space:
        out.append("host")
    if config.kv_cache_store.enable_kvcache_store:
        out.append("mooncake_store")
    from heterollm.kv_cache.pd import is_disaggregated

    if is_disaggregated(config):
        out.append("mooncake_transfer")
    return out


def resolve_kv_connector(registry: Registry, name: str, families: Sequence[str], platform: str) -> Entry | None:
    """The KV connector registered as `name` by the first of `families` (the --extension_impl family,
    the platform's default family) for `platform`, else the core's; None when none registers it.
    Raises LookupError when the chosen one is registered twice or broken."""
    for family in (*families, DEFAULT_MODEL_FAMILY):
        entry = registry.get("kv_connectors", name, family)
        if entry is not None and (family == DEFAULT_MODEL_FAMILY or platform in entry.runs_on):
            return entry
    return None


def _owned_flag_problems(config: HeterollmConfig, backends: Sequence[str], platform: str) -> list[str]:
    """Flags of installed backends the selection does not use, set to a non-default value."""
    values = config.flat()
    problems = []
    for name, spec in current_schema().specs.items():
        if spec.backend and spec.backend not in backends and values[name] != spec.default:
            problems.append(f"--{name}={show_value(values[name])}: belongs to {spec.owner} (backend "
                            f"{spec.backend!r}), which this launch does not use (platform: {platform})")
    return problems


def unsupported_flags(config: HeterollmConfig, registry: Registry, backends: Sequence[str]) -> list[str]:
    """Flags set to a value one of `backends` (Backend.name) declares it cannot serve, one line each."""
    values = config.flat()
    specs = current_schema().specs
    problems = []
    for name in backends:
        info = registry.backend(name)
        for flag, reason in (info.backend.unsupported.items() if info else ()):
            if flag in values and values[flag] != specs[flag].default:
                problems.append(f"--{flag}={show_value(values[flag])}: {reason} ({info.dist}, selected)")
    return problems


def resolve(config: HeterollmConfig, registry: Registry | None = None,
            architectures: Sequence[str] = ()) -> Selection:
    """Resolve platform, components and (given the checkpoint's architectures) the model for
    `config`, or raise LaunchError with every reason."""
    registry = registry or get_registry()
    platform_entry, platform = _platform(registry, config.device.device)
    requested = config.execution.extension_impl
    family = requested or platform.default_impl
    families = registry.families()
    if requested and requested not in families:
        raise LaunchError([f"--extension_impl={requested}: no component group or model registers family "
                           f"{requested!r} (families installed: {', '.join(families) or 'none'})"])
    components, reasons = _components(registry, platform, platform_entry, requested)
    model = None
    if not reasons and architectures:
        try:
            model = resolve_model(registry, architectures, [f for f in (requested, platform.default_impl) if f],
                                  platform.name)
        except LookupError as exc:
            reasons.append(f"--model: {exc}")
    for name in kv_connectors_needed(config):
        try:
            entry = resolve_kv_connector(registry, name, [f for f in (requested, platform.default_impl) if f],
                                         platform.name)
        except LookupError as exc:
            reasons.append(f"KV connector {name!r}: {exc}")
            continue
        if entry is None:
            reasons.append(f"no family registers the KV connector {name!r} for platform {platform.name} "
                           f"({KV_CONNECTOR_FLAGS[name]} needs it)")
        else:
            components[f"kv_connectors.{name}"] = entry
    used_requested = bool(requested) and (any(e.family == requested for e in components.values())
                                          or (model is not None and model.family == requested))
    if requested and not used_requested and not reasons:
        offers = sorted({f"{e.group} for {', '.join(e.runs_on)}" for g in (*COMPONENT_GROUPS, "models")
                         for e in registry.all(g) if e.family == requested and e.ok})
        reasons.append(f"--extension_impl={requested}: family {requested!r} has no component for platform "
                       f"{platform.name} (it provides: {'; '.join(offers) or 'nothing usable'})")
    if reasons:
        raise LaunchError(reasons)

    backends = tuple(dict.fromkeys([platform_entry.backend, *(e.backend for e in components.values()),
                                    *([model.backend] if model is not None and model.backend else [])]))
    reasons += platform.validate(config)
    reasons += check_profile_flags(config, platform)
    for group, entry in components.items():
        reasons += [f"{group} {entry.name}: {r}" for r in entry.obj.validate(config)]
    reasons += unsupported_flags(config, registry, backends)
    reasons += _owned_flag_problems(config, backends, platform.name)
    reasons += check_support(config)
    reasons += check_flag_combinations(config)
    if reasons:
        raise LaunchError(reasons)
    return Selection(platform, platform_entry, family, components, backends, model)
