"""Executor: owns the workers and runs steps (a backend's `components["executors"]`)."""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    from heterollm.interfaces.batch import RunnerOutput, SchedulerOutput
    from heterollm.model_executor.runner import LaunchContext


class ExecutorDead(RuntimeError):
    """The executor's workers are gone (a process died); the engine cannot run another step."""


class Executor(Component):
    """Loads the model on its workers, sizes and allocates the KV cache, and executes steps.

    Call order: `load_model` -> `determine_num_blocks` -> `initialize_cache` -> `execute`* -> `shutdown`.
    """

    @classmethod
    def create(cls, launch: LaunchContext) -> Executor:
        """How the engine builds the selected executor. The default constructs `cls`; a subclass may
        return another executor, e.g. the core's in-process executor returns one process per rank
        (distributed.MultiprocExecutor) for --tp_size > 1, each rank running `cls` itself."""
        return cls(launch)

    @abstractmethod
    def __init__(self, launch: LaunchContext) -> None:
        """`launch` carries the config, the selected Platform and the resolved component table."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model and load its weights on every worker."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV cache blocks fit (num_gpu_blocks_override, else max_cache_size, else memory)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV cache blocks on every worker."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one forward step and sample; returns tokens for requests whose `sample` is True."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop workers and release device memory. Safe to call twice."""
