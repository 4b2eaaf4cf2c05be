"""An in-process, single-worker Executor that backends can subclass (the CPU backend does)."""
from __future__ import annotations

from heterollm.config.checks import world_size
from heterollm.interfaces import Executor, RunnerOutput, SchedulerOutput
from heterollm.interfaces.executor import RankMemory
from heterollm.model_executor.runner import LaunchContext, ModelRunner
from heterollm.model_executor.weight_update import WeightUpdate


class InProcessExecutor(Executor):
    """One ModelRunner in this process. Subclasses may override `make_runner`."""

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    @classmethod
    def create(cls, launch: LaunchContext) -> Executor:
        """One process per rank (each running `cls`) when the engine has several (--tp_size, or attention
        data parallelism's --dp_size), else `cls`."""
        if world_size(launch.config) > 1:
            from heterollm.distributed.executor import MultiprocExecutor

            return MultiprocExecutor(launch)
        return cls(launch)

    def __init__(self, launch: LaunchContext) -> None:
        self.launch = launch
        self.runner: ModelRunner | None = None

    def make_runner(self) -> ModelRunner:
        return ModelRunner(self.launch)

    def load_model(self) -> None:
        self.runner = self.make_runner()
        self.runner.load_model()

    def memory_profile(self) -> list[RankMemory]:
        return [self.runner.memory_profile()]

    def initialize_cache(self, num_blocks: int, host_blocks: int = 0) -> None:
        self.runner.initialize_cache(num_blocks, host_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(scheduler_output)

    def update_weights(self, update: WeightUpdate) -> int:
        return self.runner.update_weights(update)

    def kv_connector_info(self) -> list[dict[str, dict[str, object]]]:
        return [self.runner.kv_connector_info()]

    def start_profile(self) -> None:
        self.runner.start_profile()

    def stop_profile(self) -> list[str]:
        return self.runner.stop_profile()

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
