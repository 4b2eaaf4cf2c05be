"""The model class a launch runs: chosen once by the resolver per (architecture, family) from the
backend descriptors' `models` (the core registers its own under the family "core", through its
descriptor `heterollm.model_executor.models:CORE_BACKEND`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from heterollm.config import ConfigError

if TYPE_CHECKING:
    from heterollm.plugins.resolver import Selection


def supported_architectures() -> list[str]:
    """Every architecture some installed family implements."""
    from heterollm.plugins import get_registry

    return get_registry().names("models")


def get_model_class(selection: Selection, architectures: Sequence[str], where: str) -> type:
    """The selected implementation of the checkpoint's architecture, or a ConfigError naming what
    is supported."""
    if selection.model is None or selection.model.name not in architectures:
        raise ConfigError(f"--model: {where} has architecture {list(architectures) or '(none)'}, which heterollm "
                          f"does not support (supported: {', '.join(supported_architectures())})")
    return selection.model.obj
