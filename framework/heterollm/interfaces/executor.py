"""Executor: owns the workers and runs steps (a backend's `components["executors"]`)."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    from heterollm.interfaces.batch import RunnerOutput, SchedulerOutput
    from heterollm.model_executor.runner import LaunchContext
    from heterollm.model_executor.weight_update import WeightUpdate


class ExecutorDead(RuntimeError):
    """The executor's workers are gone (a process died); the engine cannot run another step."""


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds after `load_model`, in bytes: the facts the launcher sizes the KV cache
    from (engine/memory_budget.py). Ranks report; they do not size the cache themselves."""

    device: str
    """The memory this rank draws on: the host's name, the platform's device type, and the rank's
    device index where the platform has several ("node1/npu:1"); ranks reporting the same string
    share that memory (on the CPU every rank of a host does: "node1/cpu")."""
    total: int
    """`Platform.memory_info()` total of that memory."""
    free: int
    """`Platform.memory_info()` free of that memory, read after the weights were loaded."""
    weights: int
    """This rank's weights (its shard under tensor parallelism)."""
    activation_peak: int
    """This rank's peak activation for a `--max_tokens_per_batch` step."""
    kv_bytes_per_block: int
    """Bytes one KV cache block takes on this rank (all layers, K and V)."""


class Executor(Component):
    """Loads the model on its workers, sizes and allocates the KV cache, and executes steps.

    Call order: `load_model` -> `memory_profile` -> `initialize_cache` -> `execute`* -> `shutdown`.
    The engine (the launcher) turns the ranks' profiles into one block count for all of them.
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
    def memory_profile(self) -> list[RankMemory]:
        """One RankMemory per rank this executor runs (every rank on this node, rank order)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, host_blocks: int = 0) -> None:
        """Allocate `num_blocks` KV cache blocks on every worker, and, when `host_blocks` > 0, the
        host tier's "host" KV connector (`LaunchContext.selection.component("kv_connectors.host")`)
        with that many slots over them; steps then carry `SchedulerOutput.kv_transfers`."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one forward step and sample; returns tokens for requests whose `sample` is True."""

    def update_weights(self, update: WeightUpdate) -> int:
        """Replace the model's parameters named by `update` on every worker, between steps, all or
        nothing (`--dynamic_load_weight`); returns the number of tensors read. An optional
        capability: the default refuses, and the core's executors implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot reload weights while running")

    def kv_connector_info(self) -> list[dict[str, dict[str, object]]]:
        """Per rank (rank order): connector name -> its `KVConnector.info()`, for the connectors built
        at `initialize_cache`. Optional like `update_weights`: the default has no ranks to ask."""
        raise NotImplementedError(f"{type(self).__name__} cannot describe its KV connectors")

    def start_profile(self) -> None:
        """Start the platform's online profiler (`Platform.trace_profiler`, --enable_online_profile) on
        every worker, on the thread that runs its steps, between steps. Optional, like
        `update_weights`: the default refuses, and the core's executors implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers")

    def stop_profile(self) -> list[str]:
        """Stop it on every worker; the trace files written, every rank's."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile its workers")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop workers and release device memory. Safe to call twice."""
