"""The CPU executor: one in-process worker."""
from __future__ import annotations

from typing import Any

from heterollm.interfaces import Executor

_NOT_YET = "the engine is not built yet (the engine issue gives the CPU executor its body)"


class CpuExecutor(Executor):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def __init__(self, launch: Any) -> None:
        self.launch = launch

    def load_model(self) -> None:
        raise NotImplementedError(_NOT_YET)

    def determine_num_blocks(self) -> int:
        raise NotImplementedError(_NOT_YET)

    def initialize_cache(self, num_blocks: int) -> None:
        raise NotImplementedError(_NOT_YET)

    def execute(self, scheduler_output):
        raise NotImplementedError(_NOT_YET)

    def shutdown(self) -> None:
        pass
