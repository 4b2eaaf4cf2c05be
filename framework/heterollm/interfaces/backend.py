"""Backend: the one object a backend wheel registers (entry-point group `heterollm.backends`).

A vendor's `pyproject.toml` has one line,

    [project.entry-points."heterollm.backends"]
    mydev = "heterollm_mydev:BACKEND"

and the package's `__init__.py` (kept import-light: no torch, no vendor library) builds the
descriptor. Every class it names may be given as `"module:attr"`: the registry checks
`api_version` against the core's contract before it imports any of them.

    BACKEND = Backend(
        name="mydev", api_version=">=2.0,<3",
        platform="heterollm_mydev.platform:MyPlatform",
        components={"attention": "heterollm_mydev.attention:MyAttention", ...},
        models={"LlamaForCausalLM": "heterollm_mydev.llama:FusedLlama"},
        flags={"mydev": MyDevFlags}, unsupported={"enable_graph": "no graph API on mydev yet"},
        register_ops="heterollm_mydev.ops:register",
    )
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.config.base import FlagGroup
    from heterollm.interfaces.platform import Platform

Target = Union[str, type]
"""A class, or its `"module:attr"` path (imported only after the contract range is checked)."""

COMPONENT_GROUPS = ("attention", "graph_runners", "communicators", "executors")
"""The component groups a family may provide; a group it leaves out falls back to the platform's
default family, group by group (`--extension_impl`)."""


@dataclass(frozen=True)
class Backend:
    """What one backend distribution provides."""

    name: str
    """The family name `--extension_impl` selects; with a platform, also the name `--device` selects
    (the Platform class's `name` must equal it)."""
    api_version: str
    """The contract range it implements (a PEP 440 specifier, e.g. ">=2.0,<3"), checked against
    `heterollm.interfaces.API_VERSION` before anything else of the backend is imported."""
    platform: Target | None = None
    """Its Platform class; None for a component-only family (a vendor kernel for an existing device)."""
    platforms: tuple[str, ...] = ()
    """Platforms its components and models run on. Default: its own platform's name."""
    components: Mapping[str, Target] = field(default_factory=dict)
    """Group (one of COMPONENT_GROUPS) -> class, all under the family `name`."""
    models: Mapping[str, Target] = field(default_factory=dict)
    """Architecture (a config.json `architectures` name) -> model class, under the family `name`."""
    kv_connectors: Mapping[str, Target] = field(default_factory=dict)
    """Connector name ("host": the host KV tier's block copies) -> KVConnector class, under the family
    `name`; a launch takes the first of the --extension_impl family, the platform's default family and
    the core's that registers the name for its platform."""
    flags: Mapping[str, Union[type[FlagGroup], str]] = field(default_factory=dict)
    """Its own launch-flag groups: config attribute -> FlagGroup class (`config.<attribute>.<flag>`).
    They join the core's groups in every config, dump and `docs/flags.md`; when this backend is not
    part of the selection a non-default value is refused naming this distribution."""
    unsupported: Mapping[str, str] = field(default_factory=dict)
    """Flag (its own or the core's) -> why this backend cannot serve a non-default value yet. Checked
    at launch when the backend is selected."""
    register_ops: Union[Callable[[HeterollmConfig], None], str, None] = None
    """Called once per launch, after selection, with the effective config: puts its kernels into the
    op registry (`heterollm.model_executor.ops.register(name, family=<name>)`). Nothing registers
    at import."""

    @property
    def runs_on(self) -> tuple[str, ...]:
        """The platforms its components and models serve."""
        return self.platforms or ((self.name,) if self.platform is not None else ())


def platform_class_check(backend: Backend, cls: type[Platform]) -> str | None:
    """Why `cls` cannot be `backend`'s platform, or None."""
    if getattr(cls, "name", None) != backend.name:
        return f"its platform {cls.__qualname__} is named {getattr(cls, 'name', None)!r}, not {backend.name!r}"
    return None
