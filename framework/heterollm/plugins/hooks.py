"""pluggy hookspecs for general plugins (entry-point group `heterollm.plugins`).

A general plugin is any object (usually a module) with functions marked `@hookimpl`. It observes
or refuses requests without patching the core. Every hookspec here is called by the core: the
engine builds one plugin manager when it starts and calls the request hooks on every request it
admits and finishes, and the OpenAI server calls the parser hook once when it starts. (Model
architectures come from backend descriptors' `models`, one mechanism.)

    from heterollm.plugins import hookimpl

    @hookimpl
    def heterollm_on_request(request_id, prompt_token_ids, sampling):
        return "prompt too long" if len(prompt_token_ids) > 4096 else None
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pluggy

from heterollm.plugins.registry import Registry, get_registry

if TYPE_CHECKING:  # the engine's types, named only in signatures (the engine imports this module)
    from heterollm.engine.outputs import RequestOutput
    from heterollm.parsers import ParserRegistry
    from heterollm.sampling import SamplingParams

PROJECT = "heterollm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
logger = logging.getLogger("heterollm.plugins")


class HeterollmHookSpec:
    """The hooks the core calls. All are optional for a plugin."""

    @hookspec
    def heterollm_on_request(self, request_id: str, prompt_token_ids: list[int],
                             sampling: SamplingParams) -> str | None:
        """Called by `LLMEngine.add_request` once per request (not per choice of an `n > 1` one),
        after the engine's own checks passed and before any of it runs. Return None to let it
        run, or a reason string to refuse it: the engine then admits nothing and raises
        RequestRejected (a ValueError; HTTP 400 with the reason, the offline API raises it).
        A refused request gets no `heterollm_on_request_finished`. Do not modify the arguments."""

    @hookspec
    def heterollm_on_request_finished(self, request_id: str, output: RequestOutput) -> None:
        """Called by the engine exactly once for every request it admitted, when it ends for any
        reason: finished (`stop`, `length`) or aborted (client gone, failed step, no room in the
        KV cache). `output` is its final RequestOutput (every choice has its finish_reason). An
        exception raised here is logged and ignored."""

    @hookspec
    def heterollm_register_parsers(self, registry: ParserRegistry) -> None:
        """Called once by the OpenAI server when it starts (every plugin's, and the file
        `--tool_parser_plugin` names): add tool-call formats with
        `registry.register_tool_parser(name, cls)` (a `heterollm.parsers.ToolParser` subclass) and
        reasoning formats with `registry.register_reasoning_parser(name, cls)`; `--tool_call_parser`
        / `--reasoning_parser` then select them by name. A name already taken is a launch error
        naming both origins."""


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
