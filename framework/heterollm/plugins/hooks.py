"""pluggy hookspecs for general plugins (entry-point group `heterollm.plugins`).

A general plugin is any object (usually a module) with functions marked `@hookimpl`. It can add
model architectures, reasoning / tool-call parsers, and observe or refuse requests, without
patching the core:

    from heterollm.plugins import hookimpl

    @hookimpl
    def heterollm_register_models(register):
        register("MyForCausalLM", "my_pkg.model:MyForCausalLM")
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pluggy

from heterollm.plugins.registry import Registry, get_registry

PROJECT = "heterollm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
logger = logging.getLogger("heterollm.plugins")


class HeterollmHookSpec:
    """The hooks the core calls. All are optional for a plugin."""

    @hookspec
    def heterollm_register_models(self, register: Callable[[str, Any], None]) -> None:
        """Register model architectures: `register(architecture, cls_or_"module:attr")`."""

    @hookspec
    def heterollm_register_parsers(self, register_reasoning: Callable[[str, Any], None],
                                   register_tool: Callable[[str, Any], None]) -> None:
        """Register reasoning and tool-call parsers by the name `--reasoning_parser` /
        `--tool_call_parser` select."""

    @hookspec
    def heterollm_on_request(self, request_id: str, prompt_token_ids: list[int], sampling: Any) -> str | None:
        """Called when a request is admitted; return a reason string to reject it (HTTP 400)."""

    @hookspec
    def heterollm_on_request_finished(self, request_id: str, output: Any) -> None:
        """Called once a request has finished (any reason)."""


def make_plugin_manager(registry: Registry | None = None) -> pluggy.PluginManager:
    """A PluginManager with the hookspecs and every healthy `heterollm.plugins` entry registered.
    A plugin whose hookimpls do not match the specs is reported and skipped."""
    registry = registry or get_registry()
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HeterollmHookSpec)
    for entry in registry.all("plugins"):
        if not entry.ok:
            continue
        try:
            pm.register(entry.obj, name=f"{entry.name} ({entry.origin})")
        except (pluggy.PluginValidationError, ValueError) as exc:
            entry.error = f"rejected by the plugin manager: {exc}"
            logger.warning("skipping plugin %r from %s: %s", entry.name, entry.origin, exc)
    return pm
