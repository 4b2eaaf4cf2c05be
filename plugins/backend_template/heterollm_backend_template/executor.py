"""The executor: the core's in-process executor runs the model with this backend's components
(tensor parallelism wraps it in one process per rank)."""
from __future__ import annotations

from heterollm.model_executor.executor import InProcessExecutor


class TemplateExecutor(InProcessExecutor):
    platforms = ("template",)
