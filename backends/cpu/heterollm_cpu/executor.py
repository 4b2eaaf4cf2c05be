"""The CPU executor: one in-process worker running the core's ModelRunner with this backend's
attention and eager runner. Tensor parallelism (one process per rank over gloo) comes with the
parallelism issue."""
from __future__ import annotations

from heterollm.model_executor.executor import InProcessExecutor


class CpuExecutor(InProcessExecutor):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []
