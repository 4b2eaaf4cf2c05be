"""Architecture name -> model class, from the `heterollm.models` entry points (the core registers
its own families there) and from plugins' `heterollm_register_models` hook."""
from __future__ import annotations

import importlib
from typing import Any

from heterollm.config import ConfigError


def _load_target(target: Any) -> Any:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


def model_architectures() -> dict[str, Any]:
    from heterollm.plugins import get_registry, make_plugin_manager

    registry = get_registry()
    found: dict[str, Any] = {}
    for entry in registry.all("models"):
        if entry.ok:
            found.setdefault(entry.name, entry.obj)
    extra: dict[str, Any] = {}
    make_plugin_manager(registry).hook.heterollm_register_models(register=lambda a, t: extra.__setitem__(a, t))
    found.update(extra)
    return found


def get_model_class(architectures: list[str], where: str) -> Any:
    known = model_architectures()
    for arch in architectures:
        if arch in known:
            return _load_target(known[arch])
    raise ConfigError(f"--model: {where} has architecture {architectures or '(none)'}, which heterollm does not "
                      f"support (supported: {', '.join(sorted(known))})")
