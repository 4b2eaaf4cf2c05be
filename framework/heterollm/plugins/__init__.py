"""Entry-point discovery (stevedore), extension_impl resolution, and pluggy hookspecs."""
from heterollm.plugins.hooks import hookimpl, hookspec, make_plugin_manager
from heterollm.plugins.launch import launch_selection
from heterollm.plugins.registry import COMPONENT_GROUPS, GROUPS, Entry, Registry, get_registry
from heterollm.plugins.resolver import LaunchError, Selection, resolve

__all__ = ["COMPONENT_GROUPS", "GROUPS", "Entry", "LaunchError", "Registry", "Selection", "get_registry",
           "hookimpl", "hookspec", "launch_selection", "make_plugin_manager", "resolve"]
