"""Pick the platform and one implementation per component group, once, in the launcher.

`--device` names the platform (auto: the first available accelerator, CPU last; platforms whose
tensors live on the host, other than cpu, are used only when named). The family is
`--extension_impl`, or the platform's `default_impl` when that is empty. For each component
group the family's entry is used when it exists and lists the platform; other groups keep the
platform's default family. Every reason the selection cannot serve the config is collected into
one LaunchError.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from heterollm.config.checks import check_flag_combinations
from heterollm.config.support import check_support
from heterollm.plugins.registry import COMPONENT_GROUPS, Entry, Registry, get_registry

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
    """The effective component table: platform plus group -> entry. Passed to worker processes
    as `as_dict()` so they load exactly the same plugins."""

    platform: Platform
    platform_entry: Entry
    family: str
    components: dict[str, Entry]

    def component(self, group: str) -> Any:
        return self.components[group].obj

    def as_dict(self) -> dict[str, Any]:
        return {
            "platform": {"name": self.platform_entry.name, "target": self.platform_entry.target,
                         "origin": self.platform_entry.origin},
            "family": self.family,
            "components": {g: {"name": e.name, "target": e.target, "origin": e.origin}
                           for g, e in self.components.items()},
        }

    def describe(self) -> str:
        rows = [f"platform: {self.platform_entry.name} ({self.platform_entry.target}, {self.platform_entry.origin})"]
        rows += [f"{group}: {e.name} ({e.target}, {e.origin})" for group, e in self.components.items()]
        return "; ".join(rows)


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


def resolve(config: HeterollmConfig, registry: Registry | None = None) -> Selection:
    """Resolve platform and components for `config`, or raise LaunchError with every reason."""
    registry = registry or get_registry()
    platform_entry, platform = _platform(registry, config.device.device)
    requested = config.execution.extension_impl
    family = requested or platform.default_impl
    families = registry.families()
    if requested and requested not in families:
        raise LaunchError([f"--extension_impl={requested}: no component group registers family {requested!r} "
                           f"(families installed: {', '.join(families) or 'none'})"])

    reasons: list[str] = []
    components: dict[str, Entry] = {}
    used_requested = False
    for group in COMPONENT_GROUPS:
        chosen = None
        if requested:
            try:
                entry = registry.get(group, requested)
            except LookupError as exc:
                reasons.append(f"--extension_impl={requested}: {exc}")
                continue
            if entry is not None and platform.name in entry.obj.platforms:
                chosen, used_requested = entry, True
        if chosen is None:
            try:
                chosen = registry.get(group, platform.default_impl)
            except LookupError as exc:
                reasons.append(f"platform {platform.name}: default {exc}")
                continue
            if chosen is None or platform.name not in chosen.obj.platforms:
                reasons.append(f"platform {platform.name} ({platform_entry.origin}): no {group} implementation "
                               f"in its default family {platform.default_impl!r}")
                continue
        components[group] = chosen
    if requested and not used_requested and not reasons:
        offers = sorted(f"{g} for {', '.join(e.obj.platforms)}" for g in COMPONENT_GROUPS
                        for e in registry.candidates(g, requested) if e.ok)
        reasons.append(f"--extension_impl={requested}: family {requested!r} has no component for platform "
                       f"{platform.name} (it provides: {'; '.join(offers) or 'nothing usable'})")
    if reasons:
        raise LaunchError(reasons)

    reasons += platform.validate(config)
    for group, entry in components.items():
        reasons += [f"{group} {entry.name}: {r}" for r in entry.obj.validate(config)]
    reasons += check_support(config, platform.name)
    reasons += check_flag_combinations(config)
    if reasons:
        raise LaunchError(reasons)
    selection = Selection(platform, platform_entry, family, components)
    logger.info("components: %s", selection.describe())
    return selection
