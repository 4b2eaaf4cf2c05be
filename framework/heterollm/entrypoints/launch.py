"""Launch-time resolution shared by `serve`, `generate` and the offline API."""
from __future__ import annotations

import logging

from heterollm.config import HeterollmConfig
from heterollm.plugins import Selection, resolve

logger = logging.getLogger("heterollm.launch")


def launch_selection(config: HeterollmConfig) -> Selection:
    """Resolve platform and components once (raises LaunchError with every reason) and log the table."""
    selection = resolve(config)
    logger.info("platform %s, component family %s", selection.platform.name, selection.family)
    return selection
