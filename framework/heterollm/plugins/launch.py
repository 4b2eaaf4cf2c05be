"""Launch-time selection shared by `serve`, `generate`, the offline API and worker processes:
resolve once, then let each selected backend register its kernels."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from heterollm.plugins.registry import get_registry, load_target
from heterollm.plugins.resolver import LaunchError, Selection, resolve

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig

logger = logging.getLogger("heterollm.launch")


def launch_selection(config: HeterollmConfig,
                     architectures: Callable[[], Sequence[str]] | None = None) -> Selection:
    """Resolve platform, components and, given a way to read the checkpoint's architectures, the
    model (raises LaunchError with every reason); call the selected backends' `register_ops(config)`
    and log the component table. Flags and platform are checked before the model is looked at, so
    a bad flag is reported first."""
    registry = get_registry()
    selection = resolve(config, registry)
    if architectures is not None:
        selection = resolve(config, registry, architectures())
    for name in selection.backends:
        info = registry.backend(name)
        hook = info.backend.register_ops if info is not None else None
        if hook is None:
            continue
        try:
            load_target(hook)(config)
        except Exception as exc:  # a vendor's kernels failing to register is a launch error, with its reason
            raise LaunchError([f"backend {name} ({info.origin}): register_ops failed: "
                               f"{type(exc).__name__}: {exc}"]) from exc
    logger.info("platform %s, component family %s; %s", selection.platform.name, selection.family,
                selection.describe())
    return selection
