"""Platform: one per device kind (a backend descriptor's `platform`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig


class TraceProfiler(ABC):
    """An online timeline profiler (`--enable_online_profile`): `POST /start_profile` starts it on
    every rank, on the thread that runs the steps, and `/stop_profile` stops it there."""

    @abstractmethod
    def start(self, stem: Path) -> None:
        """Begin recording; what is recorded goes next to `stem` (a folder and a file name without
        suffix, unique to this rank and session)."""

    @abstractmethod
    def stop(self) -> list[Path]:
        """End recording and write it; return the files (or folders) written: none for a profiler
        that hands its capture to an outside tool."""


class Platform(ABC):
    """A device kind. Constructing one and calling `is_available()` must not initialize the device
    beyond what the vendor library allows (import checks and device counts only)."""

    name: ClassVar[str]
    """The name `--device` selects (cpu, cuda, npu, mlu, ...)."""
    device_type: ClassVar[str]
    """The torch device string for tensors on this platform."""
    dist_backend: ClassVar[str]
    """torch.distributed backend for collectives: gloo, nccl, hccl, cncl."""
    default_impl: ClassVar[str]
    """Component family used for every group when `--extension_impl` is empty or lacks the group."""
    idle_kv_budget_bytes: ClassVar[int | None] = None
    """Where an allocated but untouched KV cache costs no memory until first written (CPU: pages
    are committed on first touch), how much the prefix cache may keep in freed blocks beyond the
    working set before it evicts rather than touch a new block; None where the cache is resident
    anyway (every block is used). An explicit --max_cache_size or --num_gpu_blocks_override lifts it."""

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this platform can run here (library importable, at least one device)."""

    @abstractmethod
    def unavailable_reason(self) -> str:
        """Why `is_available()` is False, in one line (e.g. "torch_npu not importable"); "" when available."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    @abstractmethod
    def memory_info(self, device: int | None = None) -> tuple[int, int]:
        """(free, total) bytes of memory on device index `device`; None (the default): the calling
        process's current device, the one `set_device` bound, so each tensor-parallel rank sizes its
        KV cache from its own device. On CPU, of system memory."""

    @abstractmethod
    def set_device(self, local_rank: int) -> None:
        """Bind the calling process to its device: `local_rank` is the process's index among the
        ranks on this node (LOCAL_RANK under torchrun), not its global rank."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    @abstractmethod
    def seed(self, seed: int) -> None:
        """Seed the host's and the device's random generators (called in every process that samples:
        the engine's and each tensor-parallel rank's, with the same --random_seed)."""

    def configure_threads(self, num_workers: int, keep_for_server: int = 0) -> None:
        """Size this process's host thread pools, called once per process before the model loads:
        `num_workers` engine workers (tensor-parallel ranks, data-parallel replicas) share the host,
        and `keep_for_server` cores stay free for an HTTP server in this process. Optional: the
        default leaves them alone (a device backend's host threads only launch kernels)."""

    def supports_dtype(self, dtype: str) -> bool:
        """Whether `dtype` ("float32", "bfloat16", "float16") runs natively here; `--dtype auto`
        avoids the ones that do not. Optional: the default says yes to all."""
        return True

    profilers: ClassVar[Mapping[str, str]] = {
        "torch": "torch.profiler (Kineto): host operators, written as a Chrome / Perfetto trace"}
    """The `--profile_backend` values this platform offers, with what each records. Optional: the
    default is torch's profiler over `profiler_activities()`; a backend adds its own (a vendor
    capture tool) by extending this and `trace_profiler`."""

    def profiler_activities(self) -> list:
        """The torch.profiler activities the "torch" profiler records here (the default: the host's)."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU]

    def trace_profiler(self, backend: str) -> TraceProfiler:
        """A new profiler of kind `backend`, one of `profilers`."""
        if backend != "torch":
            raise ValueError(f"--profile_backend={backend}: the {self.name} platform offers "
                             f"{', '.join(self.profilers)}")
        from heterollm.profiling import TorchTraceProfiler

        return TorchTraceProfiler(self.profiler_activities())

    @abstractmethod
    def validate(self, config: HeterollmConfig) -> list[str]:
        """Reasons this platform cannot serve `config` (platform-owned flags are checked here)."""
