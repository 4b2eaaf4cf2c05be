"""`heterollm backends`: every discovered backend, platform, component and model implementation, its
origin, and whether it is usable here; `heterollm models`: the model architectures alone."""
from __future__ import annotations

from heterollm.plugins import COMPONENT_GROUPS, Entry, Registry, get_registry


def _platform_status(entry: Entry) -> str:
    if entry.error:
        return f"broken: {entry.error}"
    try:
        platform = entry.obj()
        if platform.is_available():
            return f"usable ({platform.device_count()} device(s), dist backend {platform.dist_backend}, " \
                   f"default family {platform.default_impl})"
        return f"not usable here: {platform.unavailable_reason()}"
    except Exception as exc:  # a vendor probe must not take the listing down
        return f"broken: probe raised {type(exc).__name__}: {exc}"


def _runs_on(entry: Entry, usable: set[str]) -> str:
    if entry.error:
        return f"broken: {entry.error}"
    if not entry.runs_on:
        return "usable on every platform"
    here = [p for p in entry.runs_on if p in usable]
    return f"usable on {', '.join(here)}" if here else f"not usable here: needs platform {', '.join(entry.runs_on)}"


def _print_backends(registry: Registry) -> None:
    print("backends:")
    for b in registry.backends:
        if b.error:
            print(f"  {b.name:<10} {b.origin:<36} {b.target}\n  {'':<10} broken: {b.error}")
            continue
        flags = [f"--{name}" for cls in b.flag_groups.values() for name in cls.model_fields]
        shown = ", ".join(flags[:6]) + (f" and {len(flags) - 6} more" if len(flags) > 6 else "")
        print(f"  {b.name:<10} {b.origin:<36} {b.target} (contract {b.backend.api_version})"
              + (f"\n  {'':<10} flags: {shown}" if flags else ""))


def _usable_platforms(registry: Registry) -> set[str]:
    return {e.name for e in registry.all("platforms") if _platform_status(e).startswith("usable")}


def print_models() -> int:
    """`heterollm models`: every registered architecture, one row per implementation: its family,
    origin distribution and class, and where it runs (the core's run on every platform)."""
    registry = get_registry()
    usable = _usable_platforms(registry)
    print("architectures (the --extension_impl family's implementation is used first, then the platform's, "
          "then core's):")
    print(f"  {'architecture':<36} {'family':<10} {'origin':<32} implementation")
    for arch in registry.names("models"):
        for e in (e for e in registry.all("models") if e.name == arch):
            where = "" if e.family == "core" and not e.error else f"\n  {'':<36} {_runs_on(e, usable)}"
            print(f"  {arch:<36} {e.family:<10} {e.origin:<32} {e.target}{where}")
    for message in registry.duplicates():
        print(f"warning: {message}")
    return 0


def print_backends() -> int:
    registry = get_registry()
    _print_backends(registry)
    usable = set()
    print("platforms:")
    entries = list(registry.all("platforms"))
    if not entries:
        print("  (none installed; `pip install -e backends/cpu` adds the CPU reference)")
    for e in entries:
        status = _platform_status(e)
        if status.startswith("usable"):
            usable.add(e.name)
        print(f"  {e.name:<10} {e.origin:<36} {e.target}\n  {'':<10} {status}")
    for group in COMPONENT_GROUPS:
        print(f"{group}:")
        rows = list(registry.all(group))
        if not rows:
            print("  (none)")
        for e in rows:
            print(f"  {e.name:<10} {e.origin:<36} {e.target}\n  {'':<10} {_runs_on(e, usable)}")
    print("models (architecture: family (origin) ...; the --extension_impl family's first, then the platform's, "
          "then core):")
    for arch in registry.names("models"):
        impls = [e for e in registry.all("models") if e.name == arch]
        shown = "; ".join(f"{e.family} ({e.origin}{', ' + _runs_on(e, usable) if e.family != 'core' else ''})"
                          for e in impls)
        print(f"  {arch}: {shown}")
    connectors = registry.names("kv_connectors")
    if connectors:
        print("kv connectors (name: family (origin) ...; chosen as models are):")
        for name in connectors:
            impls = [e for e in registry.all("kv_connectors") if e.name == name]
            shown = "; ".join(f"{e.family} ({e.origin}{', ' + _runs_on(e, usable) if e.family != 'core' else ''})"
                              for e in impls)
            print(f"  {name}: {shown}")
    plugins = list(registry.all("plugins"))
    if plugins:
        print("plugins:")
        for e in plugins:
            print(f"  {e.name:<24} {e.origin:<36} {'broken: ' + e.error if e.error else 'ok'}")
    for message in registry.duplicates():
        print(f"warning: {message}")
    return 0
