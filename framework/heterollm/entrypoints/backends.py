"""`heterollm backends`: every discovered platform and component, its origin, and whether it is usable."""
from __future__ import annotations

from heterollm.plugins import COMPONENT_GROUPS, get_registry


def _platform_status(entry) -> str:
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


def print_backends() -> int:
    registry = get_registry()
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
            if e.error:
                status = f"broken: {e.error}"
            else:
                plats = tuple(getattr(e.obj, "platforms", ()))
                here = [p for p in plats if p in usable]
                status = (f"usable on {', '.join(here)}" if here else
                          f"not usable here: needs platform {', '.join(plats) or '(none declared)'}")
            print(f"  {e.name:<10} {e.origin:<36} {e.target}\n  {'':<10} {status}")
    for group in ("models", "plugins"):
        rows = list(registry.all(group))
        if rows:
            print(f"{group}:")
            for e in rows:
                print(f"  {e.name:<24} {e.origin:<36} {'broken: ' + e.error if e.error else 'ok'}")
    for message in registry.duplicates():
        print(f"warning: {message}")
    return 0
